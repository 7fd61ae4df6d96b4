"""Zero-shot's execution-level variants (``autoplace.policies.plan_variants``): stage counts
and cuts, microbatch counts and compilation of the best plans, scored on the simulator."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.costs import estimate_costs
from autoplace.grouping import placement_order
from autoplace.plan import ParallelConfig, Plan
from autoplace.policies import pretrained, zero_shot
from autoplace.policies.plan_variants import (
    Split,
    execution_variants,
    refit_cuts,
    stage_cuts,
)
from autoplace.policies.shard_variant import CHOSEN_AFTER
from autoplace.sim import simulate

#: GNMT-4 at the size of the RL placement papers (the learned-placement benchmark's row)
GNMT4 = {"hidden": 1024, "vocab_size": 32000, "src_len": 50, "tgt_len": 50, "batch_size": 128}


@pytest.fixture(scope="module")
def gnmt4():
    cluster = resolve("h100x4")
    graph = capture_workload(workloads.get("gnmt-4", device="meta", **GNMT4))
    estimate_costs(graph, cluster)
    return graph, cluster


def _pipeline(order: list[str], cuts: list[int], **parallel) -> Plan:
    stage = np.zeros(len(order), dtype=int)
    for c in cuts:
        stage[c:] += 1
    return Plan(groups={op: int(s) for op, s in zip(order, stage)},
                placement=tuple(range(len(cuts) + 1)),
                parallel=ParallelConfig(pipeline=len(cuts) + 1, **parallel))


def test_refit_cuts_splits_the_heaviest_stage_and_merges_the_lightest_pair():
    w = np.array([1.0, 1.0, 1.0, 1.0, 4.0, 4.0])
    assert refit_cuts([], 2, w) == [4]  # 4 | 8 and 8 | 4 are as even: the first
    assert refit_cuts([4], 3, w) == [4, 5]  # the heavier second stage is split
    assert refit_cuts([1, 2, 4], 2, w) == [4]  # the light stages merge first
    assert refit_cuts([], 4, np.zeros(6)) == [1, 2, 3]  # no compute: still non-empty stages
    assert refit_cuts([], 7, w) is None
    for stages in range(1, 7):
        cuts = refit_cuts([2], stages, w)
        assert len(cuts) == stages - 1 and cuts == sorted(set(cuts)) and all(0 < c < 6 for c in cuts)


def test_variants_reach_other_stage_counts_as_valid_chains(gnmt4):
    """From one 2-stage plan: 4-stage pipelines, other microbatch counts and compiled
    plans, each a valid chain that fits and says what was chosen after the policy."""
    graph, cluster = gnmt4
    order = placement_order(graph)
    seed = _pipeline(order, [len(order) // 2], microbatches=2)
    assert stage_cuts(seed, order) == [len(order) // 2]
    split = Split(data=(1, 2, 4), pipeline=(1, 2, 4), microbatches=(1, 2, 4, 8), num_devices=4)
    found = execution_variants(graph, cluster, [seed], split, compile=True,
                               deadline=time.perf_counter() + 30)
    shapes = {(p.parallel.data, p.parallel.pipeline, p.parallel.microbatches, p.parallel.compile)
              for _, p in found}
    assert {(1, 4, 4, True), (1, 4, 8, False), (2, 2, 2, True), (1, 2, 8, False)} <= shapes
    assert not any(p.parallel.microbatches < p.parallel.pipeline for _, p in found)
    for step, plan in found:
        plan.validate(graph, cluster)
        assert step == pytest.approx(simulate(graph, plan, cluster).step_time_s)
        if plan.parallel.pipeline == 4:
            assert plan.planner["stages"] == CHOSEN_AFTER
            assert sorted(set(plan.groups.values())) == [0, 1, 2, 3]
    assert min(s for s, _ in found) < simulate(graph, seed, cluster).step_time_s
    late = execution_variants(graph, cluster, [seed], split, compile=True,
                              deadline=time.perf_counter() - 1)
    assert late == []


def test_zero_shot_finds_a_pipeline_its_samples_never_reach(gnmt4, monkeypatch):
    """GNMT-4 on four H100s: the policy's samples never give a valid 4-stage pipeline
    (no sampled plan places groups on all four devices in order). Zero-shot now scores the
    4-stage variants of its best plans too, and beats a 4-stage pipeline of equal stage
    compute built here, which the samples alone lose to by > 10%."""
    graph, cluster = gnmt4
    seen: list[tuple] = []
    real = zero_shot.outcome_variants

    def spy(env, outcomes, **kw):
        seen.extend(outcomes)
        return real(env, outcomes, **kw)

    monkeypatch.setattr(zero_shot, "outcome_variants", spy)
    plan = pretrained.place_pretrained(graph, cluster, seed=0)
    sampled = [o for o in seen if not o[0][0]]
    assert sampled and not any(o[2]["parallel"]["pipeline"] == 4 for o in sampled)
    order = placement_order(graph)
    kind = cluster.devices[0].kind
    w = graph.fwd_times(kind) + graph.bwd_times(kind)
    weight = np.array([w[graph.index[op]] for op in order])
    balanced = _pipeline(order, refit_cuts([], 4, weight), microbatches=4)
    reference = min(simulate(graph, replace(balanced, parallel=replace(
        balanced.parallel, compile=c)), cluster).step_time_s for c in (False, True))
    assert min(o[1] for o in sampled) > 1.1 * reference
    assert plan.parallel.pipeline == 4 and plan.predicted["step_time_s"] <= reference
    assert plan.planner["search_time_s"] < 1.0
