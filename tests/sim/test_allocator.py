"""Allocator retries over a cap: reserved memory is the peak plus FSDP2's side pools; a
one-process placement whose highest peak nears the cap retries once a step on each GPU."""

from __future__ import annotations

import pytest

from autoplace import planners, workloads
from autoplace.cluster import preset
from autoplace.executor.runner import capture_graph
from autoplace.planners.pipeline_dp import fsdp, zero2
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.allocator import (
    PLACEMENT_RETRY_S_PER_BYTE,
    RETRIES_PER_STEP,
    RETRY_S_PER_BYTE,
    allocator_retry_s,
    is_one_process_placement,
    side_pool_bytes,
)
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


def _near_cap(peaks: list[int], fraction: float) -> int:
    """A cap that puts the largest of ``peaks`` at ``fraction`` of it."""
    return int(max(peaks) / fraction)


def test_a_placement_near_the_cap_pays_one_retry_on_each_gpu(graph):
    base = preset("h200x2")
    plan = planners.get("expert")(graph, base, per_layer=False).with_parallel(microbatches=1)
    assert is_one_process_placement(plan) and plan.num_devices == 2
    free = simulate(graph, plan, base)
    cap = _near_cap(free.peak_memory_bytes, 0.97)
    capped = base.with_memory_cap(cap)
    r = simulate(graph, plan, capped)
    assert not r.oom and r.peak_memory_bytes == free.peak_memory_bytes  # a time charge only
    assert r.step_time_s - free.step_time_s == pytest.approx(
        2 * PLACEMENT_RETRY_S_PER_BYTE * cap, rel=1e-6)  # both GPUs, one retry each
    assert r.step_time_s - free.step_time_s < 0.1 * free.step_time_s  # ms, not a cliff
    b = simulate_batch(graph, [plan], capped)  # the batch agrees
    assert b.step_time_s[0] == pytest.approx(r.step_time_s, rel=1e-9)


def test_a_placement_far_below_the_cap_or_uncapped_pays_nothing(graph):
    base = preset("h200x2")
    plan = planners.get("expert")(graph, base, per_layer=False).with_parallel(microbatches=1)
    free = simulate(graph, plan, base)
    below = base.with_memory_cap(_near_cap(free.peak_memory_bytes, 0.90))
    assert simulate(graph, plan, below).step_time_s == pytest.approx(free.step_time_s,
                                                                     rel=1e-12)
    assert allocator_retry_s(graph_arrays(graph), plan, base,
                             [0.99 * d.memory_bytes for d in base.devices]) == 0.0  # no cap


def test_pipelines_microbatches_and_ddp_near_the_cap_pay_nothing(graph):
    base = preset("h200x2")
    ga = graph_arrays(graph)
    plan = planners.get("expert")(graph, base, per_layer=False).with_parallel(microbatches=1)
    cap = 10 * 2**30
    capped = base.with_memory_cap(cap)
    near = [0.72 * cap, 0.97 * cap]  # gpt-1b's expert placement: both GPUs retry
    assert allocator_retry_s(ga, plan, capped, near) == pytest.approx(
        2 * PLACEMENT_RETRY_S_PER_BYTE * cap)
    assert allocator_retry_s(ga, plan, capped, [0.75 * cap, 0.93 * cap]) == 0.0  # two halves
    for other in (plan.with_parallel(microbatches=2),
                  planners.get("pipeline")(graph, base, microbatches=4),
                  planners.get("ddp")(graph, base)):
        assert not is_one_process_placement(other)
        assert allocator_retry_s(ga, other, capped, near) == 0.0
    assert allocator_retry_s(ga, plan, capped, [1.01 * cap] * 2) == 0.0  # over: out of memory
