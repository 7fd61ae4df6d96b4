"""A policy's plan with the shard mode (and compilation) its actions lack, chosen after it on
the simulator: the demo's policy and the pre-trained GNN's plans share it."""

from __future__ import annotations

import math

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.plan import Plan
from autoplace.policies import best_shard_variant
from autoplace.policies.shard_variant import CHOSEN_AFTER
from autoplace.sim import simulate


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get("gpt-small", device="meta"))


def test_a_data_parallel_plan_gets_the_shard_mode_the_simulator_finds_fastest(graph):
    cluster = resolve("cpu-x2")
    ddp = Plan.single(graph, cluster=cluster).with_parallel(data=2)
    chosen, step = best_shard_variant(graph, ddp, cluster)
    times = {shard: simulate(graph, ddp.with_parallel(shard=shard), cluster).step_time_s
             for shard in ("none", "zero2", "fsdp")}
    assert step == simulate(graph, chosen, cluster).step_time_s == min(times.values())
    assert min(times, key=times.get) != "none"  # gpt-small on two CPUs: sharding pays
    assert chosen.parallel.shard == min(times, key=times.get)
    assert chosen.planner["shard"] == CHOSEN_AFTER and "compile" not in chosen.planner
    # a variant must beat beat_s: none does when the bar is below all of them
    assert best_shard_variant(graph, ddp, cluster, beat_s=0.0) == (ddp, 0.0)


def test_a_plan_without_data_parallelism_is_kept(graph):
    cluster = resolve("cpu-x2")
    single = Plan.single(graph, cluster=cluster)
    kept, step = best_shard_variant(graph, single, cluster)
    assert kept is single and step == simulate(graph, single, cluster).step_time_s
    kept, step = best_shard_variant(graph, single, cluster, beat_s=math.inf)
    assert kept is single and step == math.inf  # nothing to try, even against no bar


def test_with_compile_the_variants_are_also_tried_compiled(graph):
    cluster = resolve("h100x2")
    single = Plan.single(graph, cluster=cluster)
    eager = simulate(graph, single, cluster).step_time_s
    compiled = simulate(graph, single.with_parallel(compile=True), cluster).step_time_s
    assert compiled < eager  # the simulator's compile saves time on GPUs
    chosen, step = best_shard_variant(graph, single, cluster, compile=True)
    assert chosen.parallel.compile and step == compiled
    assert chosen.planner["compile"] == CHOSEN_AFTER and "shard" not in chosen.planner
    assert best_shard_variant(graph, single, cluster)[0] is single  # compile not asked
