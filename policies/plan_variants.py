"""Execution-level variants of a policy's best plans, chosen on the simulator after it.

A policy samples placements and hybrid splits; how those plans *run* -- the microbatch
count, compilation, and for a pipeline its stage count and where its stages are cut -- is
cheap to vary around them. A policy that rarely samples a valid plan of some stage count
(a 4-stage split needs groups placed on all four devices, in order) never shows such a
plan at all, however good it would be. :func:`execution_variants` therefore takes the
best plans a zero-shot search already has and scores, until a deadline:

1. each of them with every other microbatch count the env offers, eager and (where
   :func:`~autoplace.envs.levers.compile_pays`) compiled;
2. for every pipeline degree ``p`` and data degree ``d`` with ``d * p`` devices at most:
   the stage cuts of those plans refitted to ``p`` stages (the heaviest stage split at its
   compute midpoint, or the lightest adjacent pair merged, until there are ``p``) and the
   ``p`` stages of equal compute, each with every microbatch count ``>= p``, eager and
   compiled;

   the seeds' own variants (1) and each stage count's (2) taken in turn, one at a time, so
   a deadline leaves every family some variants scored;
3. a hill climb of the best pipeline's stage cuts (each moved a few ops either way).

Stages are contiguous runs of :func:`~autoplace.grouping.placement_order`, so every
variant is a chain the pipeline executor runs. Variants that do not fit in memory or that
:meth:`~autoplace.plan.Plan.validate` refuses are dropped.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph
from autoplace.grouping import placement_order
from autoplace.plan import Plan
from autoplace.sim import simulate

from .shard_variant import CHOSEN_AFTER

__all__ = ["CUT_MOVES", "SEED_TOP", "Split", "execution_variants", "outcome_variants", "refit_cuts",
           "stage_cuts"]

#: best plans of a zero-shot search whose variants are scored
SEED_TOP = 4
#: op positions a stage cut moves by in the hill climb
CUT_MOVES = (-4, -2, -1, 1, 2, 4)


@dataclass(frozen=True)
class Split:
    """The options of the env the variants stay inside (``PlacementEnv``'s)."""

    data: tuple[int, ...]
    pipeline: tuple[int, ...]
    microbatches: tuple[int, ...]
    num_devices: int


def stage_cuts(plan: Plan, order: Sequence[str]) -> list[int] | None:
    """The positions in ``order`` where each of a pipeline plan's stages after the first
    starts (``[]`` for a plan without a pipeline); None when its stages are not
    contiguous runs of ``order``."""
    if plan.parallel.pipeline <= 1:
        return []
    stage = [plan.device_of(op) for op in order]
    if any(b < a for a, b in zip(stage, stage[1:])):
        return None
    cuts = []
    for s in range(1, plan.parallel.pipeline):
        at = next((i for i, x in enumerate(stage) if x >= s), len(order))
        cuts.append(at)
    return cuts


def refit_cuts(cuts: Sequence[int], stages: int, weight: np.ndarray) -> list[int] | None:
    """``cuts`` (stage starts in an op order with per-op compute ``weight``) changed to
    ``stages`` non-empty stages: the heaviest stage split where its compute halves, or the
    two adjacent stages of least compute merged, until there are ``stages``; None when the
    order has fewer ops than ``stages``."""
    n = len(weight)
    if stages > n:
        return None
    cum = np.concatenate([[0.0], np.cumsum(weight)])
    out = sorted({c for c in cuts if 0 < c < n})

    def bounds() -> list[tuple[int, int]]:
        edges = [0, *out, n]
        return list(zip(edges, edges[1:]))

    while len(out) + 1 > stages:  # merge the lightest adjacent pair
        parts = bounds()
        i = min(range(len(parts) - 1),
                key=lambda j: cum[parts[j + 1][1]] - cum[parts[j][0]])
        out.remove(parts[i][1])
    while len(out) + 1 < stages:  # split the heaviest stage that has two ops or more
        parts = [(a, b) for a, b in bounds() if b - a >= 2]
        a, b = max(parts, key=lambda ab: (cum[ab[1]] - cum[ab[0]], ab[1] - ab[0]))
        half = (cum[a] + cum[b]) / 2
        at = a + 1 + int(np.argmin(np.abs(cum[a + 1:b] - half)))
        out = sorted({*out, at})
    return out


def _balanced(stages: int, weight: np.ndarray) -> list[int] | None:
    """Cuts of ``stages`` stages of equal compute (each non-empty)."""
    return refit_cuts([], stages, weight)


class _Scorer:
    """Simulates variants once each, until a deadline; keeps every outcome."""

    def __init__(self, graph: OpGraph, cluster: Cluster, deadline: float) -> None:
        self.graph, self.cluster, self.deadline = graph, cluster, deadline
        self.seen: set = set()
        self.outcomes: list[tuple[float, Plan]] = []

    def expired(self) -> bool:
        return time.perf_counter() > self.deadline

    def score(self, key: tuple, plan: Plan) -> float:
        if key in self.seen:
            return math.inf
        self.seen.add(key)
        try:  # simulate validates the plan first (lowering.validate)
            res = simulate(self.graph, plan, self.cluster)
        except AutoplaceError:  # a split or microbatch count this graph does not take
            return math.inf
        if res.oom or not math.isfinite(res.step_time_s):
            return math.inf
        step = float(res.step_time_s)
        self.outcomes.append((step, plan))
        return step


def execution_variants(graph: OpGraph, cluster: Cluster, seeds: Sequence[Plan], split: Split,
                       *, compile: bool, deadline: float) -> list[tuple[float, Plan]]:
    """``(step_time_s, plan)`` of every variant of ``seeds`` (the best plans first) that fits
    and was scored before ``deadline`` (a :func:`time.perf_counter` time): see the module
    docstring. A variant's ``planner`` says which of ``microbatches``, ``stages`` and
    ``compile`` were chosen here.

    Args:
        graph: the graph the plans place.
        cluster: the cluster they run on.
        seeds: plans to vary, best first (from the env: no recompute or priority levers).
        split: the data, pipeline and microbatch options the variants choose among.
        compile: also try every variant compiled.
        deadline: stop scoring at this :func:`time.perf_counter` time.
    """
    order = placement_order(graph)
    kind = next((k for k in cluster.device_kinds if graph.has_costs(k)), None)
    if kind is not None:
        per_op = graph.fwd_times(kind) + graph.bwd_times(kind)
        weight = np.array([per_op[graph.index[op]] for op in order], dtype=np.float64)
    else:
        weight = np.ones(len(order))
    scorer = _Scorer(graph, cluster, deadline)
    compiles = (False, True) if compile else (False,)
    base = seeds[0] if seeds else None
    if base is None:
        return []

    def own() -> Iterator[tuple[tuple, Plan]]:
        """1. the seeds' own microbatch counts and compilation"""
        for plan in seeds:
            cuts = stage_cuts(plan, order)
            for m in split.microbatches:
                if plan.parallel.pipeline > 1 and (m < plan.parallel.pipeline or cuts is None):
                    continue
                for c in compiles:
                    yield _variant(plan, order, cuts, plan.parallel.data,
                                   plan.parallel.pipeline, m, c, restaged=False)

    cut_sets = [stage_cuts(p, order) for p in seeds]

    def staged(p: int) -> Iterator[tuple[tuple, Plan]]:
        """2. ``p`` stages: the seeds' cuts refitted, and stages of equal compute"""
        fitted = [_balanced(p, weight)]
        fitted += [refit_cuts(c, p, weight) for c in cut_sets if c is not None]
        for cuts in dict.fromkeys(tuple(c) for c in fitted if c is not None):
            for d in split.data:
                if d * p > split.num_devices:
                    continue
                for m in split.microbatches:
                    if m < p:
                        continue
                    for c in compiles:
                        yield _variant(base, order, list(cuts), d, p, m, c, restaged=True)

    # breadth first, so that a deadline cuts every family short rather than the last ones
    # whole: one variant of each in turn
    families = [own()] + [staged(p) for p in split.pipeline if p > 1]
    variants = (v for vs in itertools.zip_longest(*families) for v in vs if v is not None)

    for key, plan in variants:
        if scorer.expired():
            return scorer.outcomes
        scorer.score(key, plan)
    _climb(scorer, order, base)
    return scorer.outcomes


def outcome_variants(env: Any, outcomes: Sequence[tuple], *, compile: bool,
                     deadline: float) -> list[tuple]:
    """:func:`execution_variants` of the :data:`SEED_TOP` best distinct plans that fit among
    ``outcomes`` (``_outcome`` tuples of a :class:`~autoplace.envs.PlacementEnv`'s steps),
    inside the env's split options, as ``_outcome`` tuples (``plan`` a :class:`Plan`)."""
    e = env.unwrapped
    seeds: list[Plan] = []
    seen: set = set()
    for rank, _, plan, _ in sorted(outcomes, key=lambda o: o[0]):
        if len(seeds) >= SEED_TOP or rank[0]:
            break
        if plan is None:
            continue
        p = plan if isinstance(plan, Plan) else Plan.from_json(plan)
        key = (p.placement, p.parallel, tuple(sorted(p.groups.items())))
        if key not in seen:
            seen.add(key)
            seeds.append(p)
    split = Split(data=tuple(e.data_options), pipeline=tuple(e.pipeline_options),
                  microbatches=tuple(e.microbatch_options), num_devices=e.num_devices)
    found = execution_variants(e.graph, e.cluster, seeds, split, compile=compile,
                               deadline=deadline)
    return [((False, step, 0.0), step, plan, False) for step, plan in found]


def _climb(scorer: _Scorer, order: Sequence[str], base: Plan) -> None:
    """Hill-climb the stage cuts of the best pipeline variant scored (first improvement,
    each cut moved by :data:`CUT_MOVES` ops), until no move helps or the deadline."""
    piped = [(s, p) for s, p in scorer.outcomes if p.parallel.pipeline > 1]
    if not piped:
        return
    step, plan = min(piped, key=lambda sp: sp[0])
    cuts = stage_cuts(plan, order)
    if cuts is None:
        return
    par, n = plan.parallel, len(order)
    improved = True
    while improved:
        improved = False
        for i in range(len(cuts)):
            for move in CUT_MOVES:
                if scorer.expired():
                    return
                trial = sorted({*cuts[:i], cuts[i] + move, *cuts[i + 1:]})
                if len(trial) != len(cuts) or trial[0] <= 0 or trial[-1] >= n:
                    continue
                key, variant = _variant(base, order, trial, par.data, par.pipeline,
                                        par.microbatches, par.compile, restaged=True)
                s = scorer.score(key, variant)
                if s < step:
                    step, cuts, improved = s, trial, True


def _variant(plan: Plan, order: Sequence[str], cuts: list[int] | None, data: int,
             pipeline: int, microbatches: int, compile: bool, *, restaged: bool
             ) -> tuple[tuple, Plan]:
    """``(key, plan)``: ``plan`` with this split; for a pipeline, its stages cut at
    ``cuts`` (one group per stage, no recompute or priorities). ``restaged``: the stages
    are not ``plan``'s own (its ``planner`` then says ``stages`` were chosen here)."""
    par = replace(plan.parallel, data=data, pipeline=pipeline, microbatches=microbatches,
                  compile=compile, shard="none")
    chosen = {k: CHOSEN_AFTER for k, changed in (
        ("microbatches", microbatches != plan.parallel.microbatches),
        ("compile", compile != plan.parallel.compile), ("stages", restaged)) if changed}
    planner = {**plan.planner, **chosen}
    if pipeline <= 1:
        return ("placement", id(plan), data, microbatches, compile), \
            replace(plan, parallel=par, planner=planner)
    stage = np.zeros(len(order), dtype=np.int64)
    for c in cuts or ():
        stage[c:] += 1
    groups = {op: int(s) for op, s in zip(order, stage)}
    key = ("stages", tuple(cuts or ()), data, pipeline, microbatches, compile)
    return key, replace(plan, groups=groups, placement=tuple(range(pipeline)), parallel=par,
                        recompute=frozenset(), selective=frozenset(), priority=(),
                        planner=planner)
