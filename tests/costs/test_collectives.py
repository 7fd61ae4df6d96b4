"""Collective costs over nodes (ring, tree, hierarchical), measured collective and copy
speeds, and the cluster that simulates with them."""

from __future__ import annotations

import time

import pytest

from autoplace.cluster import Cluster, preset
from autoplace.costs.collectives import (
    all_gather_s,
    all_reduce_s,
    reduce_scatter_s,
    send_recv_s,
)
from autoplace.costs.profile import measure_links
from autoplace.errors import AutoplaceError
from autoplace.executor.collectives import bus_factor, measure_collectives, with_measured_links


def test_measured_collectives_on_two_cpu_ranks_fit_the_cluster_formulas():
    sizes = (2**12, 2**16, 2**20)
    r = measure_collectives(["cpu", "cpu"], sizes=sizes, repeats=3)
    assert r["backend"] == "gloo"
    for kind in ("allreduce", "allgather", "reducescatter"):
        pts = r[kind]["points"]
        assert [n for n, _ in pts] == list(sizes) and all(t > 0 for _, t in pts)
        assert r[kind]["bus_bandwidth"] > 0 and r[kind]["alpha_s"] >= 0
    base = preset("cpu-x2")
    links = measure_links(["cpu", "cpu"], sizes=(2**12, 2**18, 2**21), repeats=3)
    c = with_measured_links(base, links, r)
    assert c.bandwidth[0][1] == links[1][0][1] and c.alpha_s[1][0] == links[0][1][0]
    assert c.collective_bandwidth != base.collective_bandwidth
    # the simulator's all-reduce of 1 MiB now follows the measured speed: alpha steps
    # plus the bus bytes at the measured bus bandwidth
    n = 2**20
    want = 2 * max(c.collective_alpha_s, c.alpha_s[0][1], c.alpha_s[1][0]) \
        + bus_factor("allreduce", 2) * n / c.collective_bandwidth
    assert all_reduce_s(c, n, [0, 1]) == pytest.approx(want)


def test_collectives_need_two_devices_and_links_must_match_the_cluster():
    with pytest.raises(AutoplaceError, match="at least two devices"):
        measure_collectives(["cpu"])
    with pytest.raises(AutoplaceError, match="3 devices"):
        with_measured_links(preset("cpu-x2"), ([[0.0] * 3] * 3, [[1.0] * 3] * 3), None)


# ----------------------------------------------------------- the cost model over nodes
def _nodes(nodes: int, per_node: int, *, network: float = 50e9) -> Cluster:
    return Cluster.multi_node("t", preset("h100x1").devices[0], per_node, nodes, alpha_s=2e-6,
                              bandwidth=300e9, collective_bandwidth=200e9,
                              network_alpha_s=4e-6, network_bandwidth=network,
                              gamma_s_per_byte=1e-13)


def test_one_node_ring_by_hand():
    c = Cluster.uniform("t", preset("cpu-x1").devices[0], 4, alpha_s=1e-5, bandwidth=1e9,
                        gamma_s_per_byte=1e-10)
    n, a, b, g = 1e8, 1e-5, 1e-9, 1e-10  # collective_alpha_s (10 us) = the link's 10 us
    assert all_reduce_s(c, n, [0, 1, 2, 3]) == pytest.approx(6 * a + 1.5 * n * b + 0.75 * n * g)
    assert all_gather_s(c, n, [0, 1, 2, 3]) == pytest.approx(3 * a + 0.75 * n * b)
    assert reduce_scatter_s(c, n, [0, 1, 2, 3]) == pytest.approx(3 * a + 0.75 * n * (b + g))
    # every algorithm is the ring inside one node; one rank or no bytes costs nothing
    assert all_reduce_s(c, n, [0, 1, 2, 3], "tree") == all_reduce_s(c, n, [0, 1, 2, 3])
    assert all_reduce_s(c, n, [2]) == 0.0 and all_gather_s(c, 0, [0, 1]) == 0.0
    assert send_recv_s(c, n, 0, 3) == pytest.approx(a + n * b)
    with pytest.raises(AutoplaceError, match="valid: auto, ring, tree, hierarchical"):
        all_reduce_s(c, n, [0, 1], "butterfly")
    with pytest.raises(AutoplaceError, match=r"rank 4 is not a device .*\(valid: 0..3\)"):
        all_gather_s(c, n, [0, 4])


def test_one_node_presets_keep_the_stored_collective_costs():
    """The formulas the simulator used before nodes existed, on the presets it ran."""
    for name in ("h200x2", "h100x4", "h200x8", "a100-pcie-x4", "cpu-x2"):
        c = preset(name)
        p, bw = c.num_devices, c.collective_bandwidth or c.bandwidth[0][1]
        alpha = max(c.collective_alpha_s, c.alpha_s[0][1])
        for n in (4e3, 2**20, 3e9):
            ranks = list(range(p))
            assert all_reduce_s(c, n, ranks) == pytest.approx(
                2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw, rel=1e-12)
            assert all_gather_s(c, n, ranks) == pytest.approx(
                (p - 1) * alpha + (p - 1) / p * n / bw, rel=1e-12)


def test_across_nodes_by_hand():
    c = _nodes(2, 4)  # 8 ranks: alpha_in 10 us (collective), alpha_out 14 us, B_in 200 GB/s
    ranks, n, g = list(range(8)), 1e9, 1e-13
    a_in, a_out, b_in, b_out = 10e-6, 14e-6, 200e9, 50e9
    bus = min(b_in, 4 * b_out)  # four NICs a node carry the rings
    ring = 12 * a_in + 2 * a_out + 2 * 7 / 8 * n / bus + 7 / 8 * n * g
    tree = 2 * (3 * a_in + 1 * a_out) + 2 * n / (0.92 * bus) + 7 / 8 * n * g
    shard = n / 4
    hier = (2 * (3 * a_in + 3 / 4 * n / b_in) + 3 / 4 * n * g
            + min(2 * a_out + shard / b_out + shard / 2 * g,
                  2 * a_out + 2 * shard / (0.92 * b_out) + shard / 2 * g))
    assert all_reduce_s(c, n, ranks, "ring") == pytest.approx(ring)
    assert all_reduce_s(c, n, ranks, "tree") == pytest.approx(tree)
    assert all_reduce_s(c, n, ranks, "hierarchical") == pytest.approx(hier)
    assert all_reduce_s(c, n, ranks) == pytest.approx(min(ring, tree, hier))
    assert all_gather_s(c, n, ranks) == pytest.approx(6 * a_in + a_out + 7 / 8 * n / bus)
    assert send_recv_s(c, n, 0, 4) == pytest.approx(4e-6 + n / b_out)
    assert send_recv_s(c, n, 0, 1) == pytest.approx(2e-6 + n / 300e9)


def test_across_nodes_costs_more_than_one_node():
    c = preset("h100x8-n8")
    for n in (2**16, 25 * 2**20, 2**30):
        one_node = all_reduce_s(c, n, list(range(8)))
        assert all_reduce_s(c, n, list(range(16))) > one_node  # two whole nodes
        assert all_gather_s(c, n, list(range(16))) > all_gather_s(c, n, list(range(8)))
    for n in (25 * 2**20, 2**30):
        # the same 8 ranks, one on each node: each GPU's NIC instead of NVLink (below a
        # few MiB the tree's 3 levels between nodes take less latency than the node's
        # 14 ring steps)
        assert all_reduce_s(c, n, list(range(0, 64, 8))) > 2 * all_reduce_s(c, n, list(range(8)))
        assert all_gather_s(c, n, list(range(0, 64, 8))) > all_gather_s(c, n, list(range(8)))


def test_nccl_picks_tree_for_small_messages_and_ring_for_large():
    c = preset("h200x8-n16")
    ranks = list(range(c.num_devices))
    small, large = 2**16, 2**34
    assert all_reduce_s(c, small, ranks, "tree") < all_reduce_s(c, small, ranks, "ring")
    assert all_reduce_s(c, large, list(range(16)), "ring") < all_reduce_s(
        c, large, list(range(16)), "tree")


def test_hierarchical_beats_the_flat_ring_across_nodes():
    ranks = list(range(64))
    # many nodes, medium messages: the flat ring's 2(p-1) latency steps dominate
    c = preset("h100x8-n8")
    n = 25 * 2**20
    assert all_reduce_s(c, n, ranks, "hierarchical") < 0.5 * all_reduce_s(c, n, ranks, "ring")
    # large messages over a network narrow against NVLink (100 Gb/s a GPU): the flat ring's
    # bytes are held to the NICs, the hierarchical one moves 1/8 of them across nodes
    narrow = _nodes(2, 8, network=12.5e9)
    n = 2**31
    ranks = list(range(16))
    assert all_reduce_s(narrow, n, ranks, "hierarchical") < all_reduce_s(narrow, n, ranks, "ring")
    assert all_reduce_s(narrow, n, ranks) == all_reduce_s(narrow, n, ranks, "hierarchical")


def test_512_ranks_price_fast():
    c = preset("h100x8-n64")
    ranks = list(range(512))
    t0 = time.perf_counter()
    for n in (2**20, 2**26, 2**30):
        for fn in (all_reduce_s, all_gather_s, reduce_scatter_s):
            assert fn(c, n, ranks) > 0
    assert time.perf_counter() - t0 < 0.5
