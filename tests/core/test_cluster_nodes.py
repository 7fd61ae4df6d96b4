"""Clusters of several nodes: node structure, link matrices, presets, compact JSON."""

from __future__ import annotations

import json
import math
import time

import pytest

from autoplace.cluster import PRESETS, Cluster, preset, resolve
from autoplace.errors import AutoplaceError
from autoplace.topology import NETWORK_ALPHA_S, NETWORK_BANDWIDTH
from tests.helpers.cli_process import run_cli


def _two_by_four() -> Cluster:
    return Cluster.multi_node("t", preset("cpu-x1").devices[0], 4, 2, alpha_s=1e-5,
                              bandwidth=1e10, network_alpha_s=3e-6, network_bandwidth=2e9)


def test_node_structure_and_link_matrices():
    c = _two_by_four()
    assert (c.num_devices, c.num_nodes, c.gpus_per_node) == (8, 2, 4)
    assert [c.node_of(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(c.node_devices(1)) == [4, 5, 6, 7]
    for i in range(8):
        for j in range(8):
            if i == j:
                assert c.alpha_s[i][j] == 0.0 and math.isinf(c.bandwidth[i][j])
            elif c.node_of(i) == c.node_of(j):
                assert (c.alpha_s[i][j], c.bandwidth[i][j]) == (1e-5, 1e10)
            else:
                assert (c.alpha_s[i][j], c.bandwidth[i][j]) == (3e-6, 2e9)
    # a copy between nodes goes over the network, inside a node over the link
    assert c.transfer_time(0, 5, 2e9) == pytest.approx(3e-6 + 1.0)
    assert c.transfer_time(0, 3, 1e10) == pytest.approx(1e-5 + 1.0)
    with pytest.raises(AutoplaceError, match=r"device 8 is not in cluster .t. \(valid: 0..7\)"):
        c.node_of(8)


def test_one_node_by_default_and_bad_node_sizes_refused():
    c = preset("h200x8")
    assert (c.num_nodes, c.gpus_per_node, c.node_of(7)) == (1, 8, 0)
    assert c.network_bandwidth == NETWORK_BANDWIDTH and c.network_alpha_s == NETWORK_ALPHA_S
    with pytest.raises(AutoplaceError, match=r"6 devices do not split into nodes of 4.*1, 2, 3, 6"):
        Cluster(name="x", devices=preset("cpu-x1").devices * 6,
                alpha_s=preset("cpu-x4").alpha_s, bandwidth=preset("cpu-x4").bandwidth,
                gpus_per_node=4)
    with pytest.raises(AutoplaceError, match="gpus_per_node must be a positive integer"):
        Cluster.multi_node("x", preset("cpu-x1").devices[0], 0, 2, alpha_s=1e-5, bandwidth=1e9)
    with pytest.raises(AutoplaceError, match="network_bandwidth must be a positive"):
        Cluster.multi_node("x", preset("cpu-x1").devices[0], 2, 2, alpha_s=1e-5,
                           bandwidth=1e9, network_bandwidth=0.0)


def test_presets_of_several_nodes():
    for kind, mem_gib in (("h100", 80), ("h100-96", 96), ("h200", 141)):
        for nodes in (1, 2, 4, 8, 16, 32, 64):
            name = f"{kind}x8-n{nodes}"
            assert name in PRESETS
        c = preset(f"{kind}x8-n4")
        assert (c.num_nodes, c.gpus_per_node, c.num_devices) == (4, 8, 32)
        assert c.devices[0].memory_bytes == mem_gib * 2**30 and c.devices[0].kind == kind
        # device names are what each node's processes call their GPUs
        assert [d.name for d in c.devices[8:16]] == [f"cuda:{i}" for i in range(8)]
        assert c.bandwidth[0][8] == 50e9 and c.bandwidth[0][1] == 300e9
    assert preset("h100x8-n1").alpha_s == preset("h100x8").alpha_s
    with pytest.raises(AutoplaceError, match=r"valid: .*h100x8-n8.*h200x8-n64"):
        resolve("h100x8-n3")


def test_512_devices_build_fast_and_save_compact(tmp_path):
    t0 = time.perf_counter()
    c = Cluster.multi_node("big", preset("h100x1").devices[0], 8, 64, alpha_s=11e-6,
                           bandwidth=299e9, collective_bandwidth=250e9)
    capped = c.with_memory_cap(40 * 2**30)
    built_s = time.perf_counter() - t0
    assert built_s < 0.5, built_s
    path = tmp_path / "big.json"
    capped.save(path)
    assert path.stat().st_size < 20_000  # one node and a count, not 512 x 512 matrices
    data = json.loads(path.read_text())
    assert data["nodes"] == 64 and len(data["node"]["devices"]) == 8
    t0 = time.perf_counter()
    again = Cluster.load(path)
    assert time.perf_counter() - t0 < 0.5
    assert again == capped and again.num_nodes == 64


def test_json_keeps_measured_links_in_full_and_reads_old_files(tmp_path):
    c = _two_by_four()
    rows = [list(r) for r in c.bandwidth]
    rows[0][5] = 1.5e9  # a measured link that differs from the node structure
    measured = Cluster(name="m", devices=c.devices, alpha_s=c.alpha_s,
                       bandwidth=tuple(tuple(r) for r in rows), gpus_per_node=4,
                       network_alpha_s=3e-6, network_bandwidth=2e9)
    data = measured.to_json()
    assert "nodes" not in data and data["gpus_per_node"] == 4
    assert Cluster.from_json(json.loads(json.dumps(data, allow_nan=False))) == measured
    # a file written before clusters had nodes: one node, default network
    old = preset("cpu-x2").to_json()
    for key in ("gpus_per_node", "network_alpha_s", "network_bandwidth"):
        del old[key]
    assert Cluster.from_json(old) == preset("cpu-x2")


def test_compact_json_errors_name_the_problem():
    data = _two_by_four().to_json()
    assert data["nodes"] == 2
    bad = dict(data, nodes=0)
    with pytest.raises(AutoplaceError, match="\"nodes\" must be a positive integer, got 0"):
        Cluster.from_json(bad)
    bad = dict(data, node={"devices": data["node"]["devices"]})
    with pytest.raises(AutoplaceError, match="missing key 'link_alpha_s'"):
        Cluster.from_json(bad)


def test_subset_keeps_whole_nodes_and_refuses_ragged_ones():
    c = _two_by_four()
    s = c.subset([0, 1, 4, 5])
    assert (s.num_nodes, s.gpus_per_node) == (2, 2) and s.bandwidth[0][2] == 2e9
    assert c.subset([4, 5, 6]).num_nodes == 1
    with pytest.raises(AutoplaceError, match=r"lie on nodes \[0, 0, 1\]"):
        c.subset([0, 1, 4])


def test_cluster_command_shows_nodes():
    p = run_cli("cluster", "h100-96x8-n16", timeout=60)
    assert p.returncode == 0, p.stderr
    assert "16 nodes x 8 h100-96 = 128 devices" in p.stdout
    assert "50 GB/s per device (400 Gb/s)" in p.stdout and "96.00 GiB" in p.stdout


def test_a_file_cannot_expand_to_a_huge_cluster():
    data = json.loads(json.dumps(_two_by_four().to_json()))
    data["nodes"] = 10**9
    with pytest.raises(AutoplaceError, match="more than the 2048 devices"):
        Cluster.from_json(data)
