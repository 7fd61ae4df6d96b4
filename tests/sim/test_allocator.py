"""Allocator retries over a cap: reserved memory is the peak plus FSDP2's side pools."""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.executor.runner import capture_graph
from autoplace.planners.pipeline_dp import fsdp, zero2
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.allocator import RETRIES_PER_STEP, RETRY_S_PER_BYTE, side_pool_bytes
from autoplace.sim.model import graph_arrays


@pytest.fixture(scope="module")
def graph():
    return capture_graph(workloads.get("gpt-tiny"))


def test_side_pools_are_the_largest_gather_and_the_gradient_shards(graph):
    ga = graph_arrays(graph)
    cl = preset("h200x2")
    plan = fsdp(graph, cl)
    params = float(ga.param_bytes.sum())
    pools = side_pool_bytes(ga, plan)
    assert params / 2 < pools < params / 2 + 1.5 * params  # shards + (1 + 1/2) x a unit
    assert side_pool_bytes(ga, plan.with_parallel(shard="none")) == 0  # DDP: none


def test_a_plan_whose_pools_pass_the_cap_pays_for_retries(graph):
    ga = graph_arrays(graph)
    base = preset("h200x2")
    plan = zero2(graph, base)
    free = simulate(graph, plan, base)
    peak = max(free.peak_memory_bytes)
    pools = side_pool_bytes(ga, plan)
    cap = int(peak + pools / 2)  # the peak fits, peak + pools does not
    capped = base.with_memory_cap(cap)
    r = simulate(graph, plan, capped)
    assert not r.oom
    assert r.step_time_s == pytest.approx(
        free.step_time_s + RETRIES_PER_STEP * RETRY_S_PER_BYTE * cap, rel=1e-6)
    roomy = simulate(graph, plan, base.with_memory_cap(int(peak + 2 * pools)))
    assert roomy.step_time_s == pytest.approx(free.step_time_s, rel=1e-9)
    b = simulate_batch(graph, [plan, fsdp(graph, capped)], capped)  # the batch agrees
    assert b.step_time_s[0] == pytest.approx(r.step_time_s, rel=1e-9)
    assert b.step_time_s[1] == pytest.approx(simulate(graph, fsdp(graph, capped),
                                                      capped).step_time_s, rel=1e-9)
    cpu = preset("cpu-x2").with_memory_cap(cap)  # no caching allocator on CPUs
    assert simulate(graph, plan, cpu).step_time_s == pytest.approx(
        simulate(graph, plan, preset("cpu-x2")).step_time_s, rel=1e-9)
