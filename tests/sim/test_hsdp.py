"""HSDP in the simulator: state sharded over the shard group only, gathers inside it, the
gradients reduce-scattered inside it then all-reduced across the replica groups."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.costs.collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from autoplace.sim import simulate
from autoplace.sim.model import affine_collective, collective_time, grad_reduction, replica_group
from tests.helpers.plans import single

NODES = preset("h100x8-n2")  # 2 nodes x 8 H100
FSDP = {"data": 16, "shard": "fsdp"}
HSDP = {"data": 16, "shard": "fsdp", "replicate": 2}  # a shard group per node


@pytest.fixture(scope="module")
def wide():
    """A GPT whose parameters outweigh its compute (d=4096, 2 blocks, 128 tokens)."""
    wl = workloads.get("gpt-small", d_model=4096, n_heads=32, n_layers=2, seq_len=128,
                       vocab_size=1024, batch_size=16, device="meta")
    return capture_workload(wl)


def collective_seconds(result, kind: str) -> float:
    return sum(e.end_s - e.start_s for e in result.timeline if e.kind == kind)


def test_groups_and_gradient_reduction_cost(wide):
    fsdp, hsdp = single(wide, **FSDP), single(wide, **HSDP)
    assert replica_group(fsdp, 0) == list(range(16))
    assert replica_group(hsdp, 0) == list(range(8))  # replica 0's node
    n = float(2**30)  # one of the points the affine form is read through: exact there
    expected = reduce_scatter_s(NODES, n, list(range(8))) + all_reduce_s(NODES, n / 8, [0, 8])
    assert collective_time(grad_reduction(NODES, hsdp, 0), n) == pytest.approx(expected)
    assert grad_reduction(NODES, fsdp, 0) == affine_collective(NODES, "reducescatter",
                                                               list(range(16)))


def test_memory_sharded_over_the_shard_group_only(wide):
    fsdp = simulate(wide, single(wide, **FSDP), NODES)
    hsdp = simulate(wide, single(wide, **HSDP), NODES)
    f, h = fsdp.memory_breakdown[0], hsdp.memory_breakdown[0]
    assert h["optimizer"] == pytest.approx(2 * f["optimizer"], rel=1e-6)  # 1/8, not 1/16
    assert h["grads"] > f["grads"] and h["params"] >= f["params"]  # the gathered units cap both
    assert h["activations"] == f["activations"]
    assert hsdp.peak_memory_bytes[0] > fsdp.peak_memory_bytes[0]


def test_time_gathers_inside_a_node_and_pays_the_cross_node_all_reduce(wide):
    fsdp = simulate(wide, single(wide, **FSDP), NODES, timeline=True)
    hsdp = simulate(wide, single(wide, **HSDP), NODES, timeline=True)
    nbytes = 2.0**27
    assert all_gather_s(NODES, nbytes, list(range(8))) < all_gather_s(NODES, nbytes,
                                                                       list(range(16)))
    assert collective_seconds(hsdp, "allgather") < collective_seconds(fsdp, "allgather")
    # each unit's gradients: reduce-scatter in the node, then an all-reduce across nodes
    assert collective_seconds(hsdp, "reducescatter") > collective_seconds(fsdp, "reducescatter")
    # on a slow network the gathers across nodes dominate FSDP: HSDP is faster
    slow = replace(NODES, network_bandwidth=NODES.network_bandwidth / 10)
    t_fsdp = simulate(wide, single(wide, **FSDP), slow).step_time_s
    t_hsdp = simulate(wide, single(wide, **HSDP), slow).step_time_s
    assert t_hsdp < 0.8 * t_fsdp


def test_zero2_hsdp_reduces_in_buckets_over_both_levels(wide):
    flat = simulate(wide, single(wide, data=16, shard="zero2"), NODES)
    hsdp = simulate(wide, single(wide, data=16, shard="zero2", replicate=2), NODES)
    assert hsdp.memory_breakdown[0]["optimizer"] == pytest.approx(
        2 * flat.memory_breakdown[0]["optimizer"], rel=1e-6)
    assert hsdp.step_time_s != flat.step_time_s
