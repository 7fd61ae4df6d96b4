"""Data-parallel and pipeline plans, and the hybrid search over both (``hybrid-dp``).

Plain plans (what a practitioner writes): ``ddp`` / ``zero1`` / ``zero2`` / ``fsdp`` put every op
on local device 0 and replicate over all devices; ``pipeline`` cuts the ops into one
compute-balanced contiguous stage per device (torch.distributed.pipelining).

``hybrid-dp`` is an inter-op dynamic program in the style of PipeDream
(https://arxiv.org/abs/1806.03377) and Alpa (https://arxiv.org/abs/2201.12023). The
ops are coarsened into ``granularity`` contiguous groups (intervals of placement order
for one-process replicas, of program order for pipelines, whose stages must form a
chain there; see :mod:`autoplace.planners.stage_split`). For every configuration —
data-parallel degree ``d``, stages ``k`` (run as a torch pipeline, or inside one
process with microbatches flowing through the placement), microbatches ``m``, shard
mode and pipeline schedule — :func:`best_split` chooses the stage boundaries that
minimise the slowest stage's time per microbatch, each stage fitting its device's
memory (recomputing a stage's activations when that is what makes it fit). The
configurations with the best estimated step time, the best of every family and the
plain ``ddp`` / ``zero2`` / ``fsdp`` / ``pipeline`` plans are then simulated
(:func:`autoplace.sim.simulate_batch`) and the fastest one that does not run out of
memory wins (the one overflowing least when all do).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError, PlanError
from autoplace.graph import OpGraph
from autoplace.grouping import coarsen
from autoplace.plan import ParallelConfig, Plan
from autoplace.planners._common import ensure_costs, make_plan
from autoplace.planners._evaluate import evaluate, overflow
from autoplace.planners.stage_split import (
    SplitConfig,
    SplitCosts,
    best_split,
    chain_groups,
    estimate_step_s,
    op_weights,
    split_costs,
    split_objective,
)
from autoplace.sim import simulate
from autoplace.sim.model import graph_arrays, recompute_boundary_bytes

__all__ = ["ddp", "zero1", "zero2", "fsdp", "pipeline", "hybrid_dp", "hybrid_candidates",
           "dp_recompute", "hybrid_family", "SplitCosts", "SplitConfig",
           "split_costs", "best_split", "split_objective", "chain_groups"]


# ------------------------------------------------------------------ plain plans
def _data_parallel(graph: OpGraph, cluster: Cluster, name: str, shard: str,
                   microbatches: int, shard_optimizer: bool = False) -> Plan:
    t0 = time.perf_counter()
    n = cluster.num_devices
    par = ParallelConfig(data=n, microbatches=microbatches, shard=shard if n > 1 else "none",
                         shard_optimizer=shard_optimizer and n > 1)
    return make_plan(graph, cluster, name, t0, {op: 0 for op in graph.order}, [0], parallel=par)


def ddp(graph: OpGraph, cluster: Cluster, *, microbatches: int = 1) -> Plan:
    """DistributedDataParallel over every device (whole model per device)."""
    return _data_parallel(graph, cluster, "ddp", "none", microbatches)


def zero1(graph: OpGraph, cluster: Cluster, *, microbatches: int = 1) -> Plan:
    """DDP over every device with the optimizer state sharded (ZeRO-1:
    ``ZeroRedundancyOptimizer``)."""
    return _data_parallel(graph, cluster, "zero1", "none", microbatches, shard_optimizer=True)


def zero2(graph: OpGraph, cluster: Cluster, *, microbatches: int = 1) -> Plan:
    """Data parallel with gradients and optimizer state sharded (ZeRO-2)."""
    return _data_parallel(graph, cluster, "zero2", "zero2", microbatches)


def fsdp(graph: OpGraph, cluster: Cluster, *, microbatches: int = 1) -> Plan:
    """Fully sharded data parallel over every device."""
    return _data_parallel(graph, cluster, "fsdp", "fsdp", microbatches)


def pipeline(
    graph: OpGraph,
    cluster: Cluster,
    *,
    stages: int | None = None,
    microbatches: int | None = None,
    schedule: str = "gpipe",
) -> Plan:
    """An even (compute-balanced) contiguous split into one pipeline stage per device.

    Args:
        stages: pipeline stages (default: every device).
        microbatches: microbatches per step (default ``2 x stages``, lowered to a divisor
            of the graph's batch size when it is known).
        schedule: ``gpipe`` or ``1f1b``.
    """
    t0 = time.perf_counter()
    ensure_costs(graph, cluster)
    k = stages or cluster.num_devices
    if not 1 <= k <= cluster.num_devices:
        raise AutoplaceError(f"pipeline: stages must be in 1..{cluster.num_devices}, got {k}")
    groups = chain_groups(graph, k, op_weights(graph, cluster))
    k = max(groups.values()) + 1
    m = microbatches or _default_microbatches(graph, k)
    par = ParallelConfig(pipeline=k, microbatches=m, schedule=schedule) if k > 1 else \
        ParallelConfig(microbatches=m)
    return make_plan(graph, cluster, "pipeline", t0, groups, list(range(k)), parallel=par)


def _default_microbatches(graph: OpGraph, k: int) -> int:
    batch = getattr(graph, "batch_size", None)
    if not batch:
        return 2 * k
    divisors = [m for m in range(k, 2 * k + 1) if batch % m == 0]
    return max(divisors) if divisors else max(k, 2 * k)


# ------------------------------------------------------------------ hybrid search
def _microbatch_options(graph: OpGraph, d: int, max_microbatches: int) -> list[int]:
    batch = getattr(graph, "batch_size", None)
    out = []
    m = 1
    while m <= max_microbatches:
        if not batch or (batch % (d * m) == 0):
            out.append(m)
        m *= 2
    return out


def _configs(graph: OpGraph, n_dev: int, max_microbatches: int, margin: float,
             modes: tuple[str, ...]) -> list[SplitConfig]:
    out = []
    for d in range(1, n_dev + 1):
        batch = getattr(graph, "batch_size", None)
        if batch and batch % d:
            continue
        shards = ("none", "zero2", "fsdp") if d > 1 else ("none",)
        for k in range(1, n_dev // d + 1):
            for m in _microbatch_options(graph, d, max_microbatches):
                for shard in shards:
                    if k == 1:
                        out.append(SplitConfig(1, d, m, "data", "gpipe", shard, margin))
                        continue
                    if "local" in modes and shard == "none":  # FSDP2: one device per rank
                        out.append(SplitConfig(k, d, m, "local", "gpipe", shard, margin))
                    if "pipeline" in modes and m >= k:
                        for sched in ("gpipe", "1f1b"):
                            out.append(SplitConfig(k, d, m, "pipeline", sched, shard, margin))
    return out


def _plan_for(graph: OpGraph, cluster: Cluster, groups: dict[str, int], cfg: SplitConfig,
              bounds: list[int], recompute: list[bool], t0: float, **info) -> Plan:
    stage_of_group = np.zeros(bounds[-1], dtype=np.int64)
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        stage_of_group[a:b] = s
    stage_groups = {op: int(stage_of_group[g]) for op, g in groups.items()}
    par = ParallelConfig(
        data=cfg.data, pipeline=cfg.stages if cfg.mode == "pipeline" else 1,
        microbatches=cfg.microbatches, schedule=cfg.schedule,
        shard=cfg.shard if cfg.data > 1 else "none",
    )
    rc = {s for s, flag in enumerate(recompute) if flag}
    return make_plan(graph, cluster, "hybrid-dp", t0, stage_groups, list(range(cfg.stages)),
                     parallel=par, recompute=rc, mode=cfg.mode, **info)


def dp_recompute(graph: OpGraph, cluster: Cluster, *, granularity: int = 48,
                 margin: float = 0.05, shard_optimizer: bool = False) -> list[Plan]:
    """DDP over every device with just enough activation checkpointing to fit memory
    (with ``shard_optimizer``, ZeRO-1's DDP: AdamW's state sharded too).

    What a practitioner does when DDP runs out of memory. When plain DDP's simulated peak
    is over a device's usable memory, the ops are cut into ``granularity`` contiguous
    groups and groups are marked for recomputation (``torch.utils.checkpoint`` in the
    executor) in order of activation bytes freed (less the inputs a recomputed group
    keeps) per second of forward recomputed: the shortest prefix of that order whose
    simulated peak is within ``1 - margin`` of the usable memory (binary search: the peak
    falls as the prefix grows, up to the recomputed group held during its backward).
    Returns ``[]`` when plain DDP fits or nothing makes it fit.
    """
    t0 = time.perf_counter()
    d = cluster.num_devices
    batch = getattr(graph, "batch_size", None)
    if d < 2 or (batch and batch % d):
        return []
    usable = min(x.usable_memory_bytes for x in cluster.devices)
    par = ParallelConfig(data=d, shard_optimizer=shard_optimizer)
    plain = zero1(graph, cluster) if shard_optimizer else ddp(graph, cluster)
    if not simulate(graph, plain, cluster).oom:
        return []
    groups = coarsen(graph, granularity, weights=op_weights(graph, cluster))
    n_groups = max(groups.values()) + 1
    gid = np.array([groups[name] for name in graph.order])
    # bytes a group's recomputation frees: its activations less the inputs it keeps
    keep = recompute_boundary_bytes(graph_arrays(graph), gid.tolist(),
                                    frozenset(range(n_groups)))
    act = np.bincount(gid, weights=[op.activation_bytes for op in graph], minlength=n_groups)
    saved = act - np.array([keep.get(g, 0.0) for g in range(n_groups)])
    fwd = np.bincount(gid, weights=graph.fwd_times(cluster.devices[0].kind),
                      minlength=n_groups)
    order = [int(g) for g in np.argsort(-saved / (fwd + 1e-9), kind="stable") if saved[g] > 0]

    def plan_for(count: int) -> tuple[Plan, bool]:
        p = make_plan(graph, cluster, "hybrid-dp", t0, groups, [0] * n_groups, parallel=par,
                      recompute=set(order[:count]), mode="data")
        r = simulate(graph, p, cluster)
        return p, not r.oom and max(r.peak_memory_bytes) <= (1 - margin) * usable

    lo, hi = 0, len(order)  # hi: the smallest count known to fit
    best, fits = plan_for(hi)
    if not fits:
        return []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p, ok = plan_for(mid)
        if ok:
            hi, best = mid, p
        else:
            lo = mid
    return [best]


def hybrid_family(plan: Plan) -> str:
    """A hybrid plan's family: data degree, replica kind, stages, shard and schedule.

    ``"dp=2 x pp=2 gpipe"``, ``"local x2 mb>1"``, ``"dp=2/zero2"``, ``"single"``: plans of one
    family differ only in stage boundaries, microbatch counts or recomputation.
    """
    par = plan.parallel
    k = plan.devices_per_replica
    parts = []
    if par.data > 1:
        parts.append(f"dp={par.data}" + (f"/{par.shard}" if par.shard != "none" else "")
                     + ("/zero1" if par.shard_optimizer else ""))
    if par.pipeline > 1:
        parts.append(f"pp={par.pipeline} {par.schedule}")
    elif k > 1:
        parts.append(f"local x{k}" + (" mb>1" if par.microbatches > 1 else ""))
    return " x ".join(parts) or "single"


def hybrid_candidates(
    graph: OpGraph,
    cluster: Cluster,
    *,
    granularity: int = 48,
    max_microbatches: int = 32,
    verify: int = 24,
    memory_margin: float = 0.05,
    modes: tuple[str, ...] = ("local", "pipeline"),
) -> list[tuple[Plan, float, bool]]:
    """Every plan ``hybrid-dp`` simulated: ``(plan, simulated step s, out of memory)``.

    Sorted fastest feasible first (then the out-of-memory ones, least overflowing
    first). The same options as :func:`hybrid_dp`.
    """
    t0 = time.perf_counter()
    ensure_costs(graph, cluster)
    weights = op_weights(graph, cluster)
    # local / data replicas: intervals of placement order; pipelines: of program order
    grouping = {"local": coarsen(graph, granularity, weights=weights),
                "pipeline": chain_groups(graph, granularity, weights)}
    costs = {mode: split_costs(graph, cluster, groups) for mode, groups in grouping.items()}

    def score(margin: float) -> list:
        out = []
        for cfg in _configs(graph, cluster.num_devices, max_microbatches, margin, modes):
            key = "pipeline" if cfg.mode == "pipeline" else "local"
            obj, bounds, rc = best_split(costs[key], cfg)
            if np.isfinite(obj):
                est = estimate_step_s(costs[key], cfg, cluster, obj, bounds)
                out.append((est, cfg, bounds, rc))
        return out

    scored = score(memory_margin)
    if not scored:  # nothing fits by the estimate: keep the most memory-frugal plans
        scored = score(-10.0)
    scored.sort(key=lambda x: x[0])
    chosen, seen_family = scored[:verify], set()
    for item in scored[verify:]:  # plus the best of every family not yet in
        fam = (item[1].mode, item[1].shard, item[1].data, item[1].stages)
        if fam not in seen_family and len(chosen) < 2 * verify:
            chosen.append(item)
        seen_family.add(fam)
    plans, kept = [], []
    for est, cfg, bounds, rc in chosen:
        try:
            groups = grouping["pipeline" if cfg.mode == "pipeline" else "local"]
            p = _plan_for(graph, cluster, groups, cfg, bounds, rc, t0, estimated_step_s=est)
            p.validate(graph, cluster)
        except PlanError:  # e.g. a split that is not a chain in program order
            continue
        plans.append(p)
        kept.append(cfg)
    if cluster.num_devices > 1:  # DDP (and ZeRO-1) checkpointing just enough groups to fit
        for flag in (False, True):
            for p in dp_recompute(graph, cluster, granularity=granularity,
                                  margin=memory_margin, shard_optimizer=flag):
                plans.append(p)
                kept.append(SplitConfig(1, p.parallel.data, 1, "data", "gpipe", "none"))
    if cluster.num_devices > 1:  # the plain options are always candidates
        for planner in (ddp, zero1, zero2, fsdp, pipeline):
            try:
                p = planner(graph, cluster)
                p.validate(graph, cluster)
            except AutoplaceError:
                continue
            plans.append(p)
            kept.append(SplitConfig(p.num_groups, p.parallel.data, p.parallel.microbatches,
                                    "pipeline" if p.parallel.pipeline > 1 else "data",
                                    p.parallel.schedule, p.parallel.shard))
    if not plans:
        raise AutoplaceError(f"hybrid-dp found no valid plan for graph {graph.name!r}")
    step_s, peak, oom = evaluate(graph, plans, cluster)
    over = overflow(peak, cluster)
    order = sorted(range(len(plans)), key=lambda i: (bool(oom[i]),
                                                     float(over[i]) if oom[i] else 0.0,
                                                     float(step_s[i])))
    search_s = time.perf_counter() - t0
    out = []
    for i in order:
        info = dict(plans[i].planner)
        info.update(name="hybrid-dp", mode=kept[i].mode, configs_searched=len(scored),
                    configs_simulated=len(plans), simulated_step_s=float(step_s[i]),
                    oom=bool(oom[i]), search_time_s=search_s)
        out.append((replace(plans[i], planner=info), float(step_s[i]), bool(oom[i])))
    return out


def hybrid_dp(
    graph: OpGraph,
    cluster: Cluster,
    *,
    granularity: int = 48,
    max_microbatches: int = 32,
    verify: int = 24,
    memory_margin: float = 0.05,
    modes: tuple[str, ...] = ("local", "pipeline"),
) -> Plan:
    """The fastest feasible hybrid plan: DP over stage boundaries, then simulation.

    Args:
        granularity: contiguous groups the stage boundaries are chosen among.
        max_microbatches: largest microbatch count tried (powers of two).
        verify: how many configurations (best estimates first) are simulated.
        memory_margin: fraction of each device's memory the estimate keeps free.
        modes: multi-device replica kinds tried: ``local`` (one process) and ``pipeline``.
    """
    best = hybrid_candidates(graph, cluster, granularity=granularity,
                             max_microbatches=max_microbatches, verify=verify,
                             memory_margin=memory_margin, modes=modes)[0][0]
    return best
