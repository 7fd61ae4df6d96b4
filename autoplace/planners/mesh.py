"""``mesh``: a device-mesh search for transformer-scale models on one node or many.

Searches data parallel x sharding (DDP, ZeRO-2, FSDP, HSDP with ``replicate`` groups) x
tensor parallel (within a node, with and without sequence parallelism) x pipeline stages
(contiguous runs of blocks, balanced by compute) x microbatches x schedule x activation
checkpointing per block, with the closed-form model of :mod:`autoplace.sim.mesh` (a
fraction of a millisecond per configuration).

Sequence parallelism is priced and emitted only where the plan can run it: no pipeline,
and a residual stream :func:`autoplace.tensor_shards.with_sequence` accepts (checked once
per tensor degree; a refusal is recorded as ``planner["sequence_parallel_refused"]``).

Checkpointing is a count per mode on each pipeline stage: ``full`` on the stage's first
blocks, ``selective`` on the next, none on the rest. The counts grow in the cheapest-first
order (the mode that frees an activation byte for the least recomputation first: blocks
turn selective one by one, then full one by one, when selective is the cheaper per byte;
otherwise full directly), and each stage takes the first count that fits its GPU's
memory, found by bisection on all stages at once (the stages' memories are independent). The fastest configuration that fits every GPU's memory becomes a
:class:`~autoplace.plan.Plan` whose groups are the graph's blocks
(:func:`autoplace.lowering.block_groups`): placement is each group's pipeline stage,
``recompute`` / ``selective`` name the checkpointed blocks, ``parallel`` holds the mesh.

The plan records the model's prediction (``predicted``, with ``"simulator": "mesh"``) and
the searched configurations' count; on a machine without the cluster's devices it is a
plan to run elsewhere, made from simulation only.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError, PlanError
from autoplace.graph import OpGraph
from autoplace.lowering import block_groups, block_regions
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim.mesh import (
    BlockTable,
    MeshConfig,
    MeshFit,
    MeshResult,
    block_table,
    estimate_config,
)
from autoplace.tensor_shards import find_tensor_shards, with_sequence

__all__ = ["ac_counts", "balanced_stages", "mesh", "mesh_candidates", "plan_of", "selective_first",
           "sequence_refusal"]

#: microbatches per pipeline stage tried (m = factor x stages), and without a pipeline
PIPELINE_MB_FACTORS = (1, 2, 4, 8)
FLAT_MICROBATCHES = (1, 2, 4)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def balanced_stages(costs: np.ndarray, stages: int) -> tuple[int, ...]:
    """Stage of each block: ``stages`` contiguous runs whose summed ``costs`` are as even as
    the cuts at multiples of the mean allow (``costs[0]`` and ``costs[-1]``, the work
    before and after the blocks, weigh on the first and the last stage)."""
    nb = len(costs) - 2
    if stages > nb:
        raise AutoplaceError(f"{stages} pipeline stages for {nb} blocks: each stage needs a "
                             "block at least")
    work = np.asarray(costs[1:nb + 1], dtype=float).copy()
    work[0] += costs[0]
    work[-1] += costs[-1]
    cum = np.cumsum(work)
    starts = [0]  # first block of each stage
    for s in range(1, stages):
        cut = int(np.searchsorted(cum, cum[-1] * s / stages)) + 1
        starts.append(min(max(cut, starts[-1] + 1), nb - (stages - s)))
    out = np.zeros(nb, dtype=np.int64)
    for s, first in enumerate(starts):
        out[first:] = s
    return tuple(int(x) for x in out)


def selective_first(table: BlockTable) -> bool:
    """Whether ``selective`` frees an activation byte for less recomputation than ``full``
    does beyond it (the cheapest-first order of the checkpoint counts), on the blocks'
    sums."""
    blocks = slice(1, table.num_blocks + 1)

    def again(mode: str) -> float:
        return float(sum(table.recompute_var[f"{mode}_{c}"][blocks].sum()
                         for c in ("lin", "mm", "other")) + table.recompute_fixed[mode][blocks].sum())

    freed_sel = float((table.kept["none"] - table.kept["selective"])[blocks].sum())
    freed_full = float((table.kept["selective"] - table.kept["full"])[blocks].sum())
    if freed_sel <= 0:
        return False
    if freed_full <= 0:
        return True
    return again("selective") / freed_sel <= (again("full") - again("selective")) / freed_full


def ac_counts(step: int, blocks: int, sel_first: bool) -> tuple[int, int]:
    """(``full``, ``selective``) blocks of a stage of ``blocks`` at ``step`` of the
    cheapest-first order (0: none checkpointed; the last step, ``2 * blocks`` or
    ``blocks``: all full)."""
    if not sel_first:
        return step, 0
    return (0, step) if step <= blocks else (step - blocks, 2 * blocks - step)


def _ac_of_block(steps: list[int], stage_of_block: tuple[int, ...],
                 sel_first: bool) -> tuple[str, ...]:
    out: list[str] = []
    for s, k in enumerate(steps):
        n = stage_of_block.count(s)
        full, sel = ac_counts(k, n, sel_first)
        out += ["full"] * full + ["selective"] * sel + ["none"] * (n - full - sel)
    return tuple(out)


def _fitting(table: BlockTable, base: MeshConfig, cluster: Cluster, fit: MeshFit | None,
             sel_first: bool, evaluated: list[int]) -> tuple[MeshConfig, MeshResult]:
    """``base`` with each stage's first checkpoint count that fits (bisection on every
    stage at once), or all blocks full when a stage fits with none."""
    stage_of = base.stage_of_block
    stages = base.pipeline
    sizes = [stage_of.count(s) for s in range(stages)]
    top = [2 * n if sel_first else n for n in sizes]
    usable = cluster.devices[0].usable_memory_bytes

    def run(steps: list[int]) -> tuple[MeshConfig, MeshResult]:
        cfg = replace(base, ac_of_block=_ac_of_block(steps, stage_of, sel_first))
        evaluated[0] += 1
        return cfg, estimate_config(table, cfg, cluster, fit=fit)

    first = run([0] * stages)
    if not first[1].oom:
        return first
    last = run(top)
    if last[1].oom:
        return last
    fits0 = [p <= usable for p in first[1].stage_peak_bytes]
    lo = [0 if f else 1 for f in fits0]
    hi = [0 if f else t for f, t in zip(fits0, top)]
    while any(a < b for a, b in zip(lo, hi)):
        mid = [(a + b) // 2 for a, b in zip(lo, hi)]
        cfg, res = run(mid)
        for s, peak in enumerate(res.stage_peak_bytes):
            if lo[s] < hi[s]:
                if peak <= usable:
                    hi[s] = mid[s]
                else:
                    lo[s] = mid[s] + 1
    best = run(hi)
    return best if not best[1].oom else last


def sequence_refusal(graph: OpGraph, tensor: int) -> str | None:
    """Why ``graph``'s residual stream cannot run on sequence shards at degree ``tensor``
    (None when it can)."""
    shards = find_tensor_shards(graph, tensor)  # found by _tensor_degrees
    try:
        with_sequence(graph, shards)
    except PlanError as e:
        return str(e)
    return None


def _tensor_degrees(graph: OpGraph, table: BlockTable, gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees (powers of two within a node) that split every Linear's
    output features of every block evenly and whose Linear pairs the executor can split
    (:func:`autoplace.tensor_shards.find_tensor_shards` finds them at that degree)."""
    regions = block_regions(graph)
    widths = {op.output_shapes[0][-1] for op, r in zip(graph.ops, regions)
              if r and op.kind in ("Linear", "linear") and op.output_shapes}
    return [t for t in _powers_of_two(gpus_per_node) if all(w % t == 0 for w in widths)
            and (t == 1 or _splits(graph, t))]


def _splits(graph: OpGraph, tensor: int) -> bool:
    try:
        find_tensor_shards(graph, tensor)
    except PlanError:
        return False
    return True


def mesh_candidates(graph: OpGraph, cluster: Cluster, *, batch_size: int = 0,
                    fit: MeshFit | None = None,
                    info: dict | None = None) -> list[tuple[MeshConfig, MeshResult]]:
    """Every searched configuration (each with its checkpoint counts that fit) with its
    predicted step, fastest feasible first; ``info`` receives ``evaluated`` (the
    configurations priced, checkpoint counts included) and ``refused`` (per tensor degree,
    why sequence parallelism was not searched)."""
    table = block_table(graph, cluster)
    sel_first = selective_first(table)
    info = {} if info is None else info
    refused: dict[int, str] = info.setdefault("refused", {})
    evaluated = [0]
    n = cluster.num_devices
    gpn = int(getattr(cluster, "gpus_per_node", None) or n)
    batch = batch_size or table.batch_size
    per_block = (table.var["fwd_lin"] + table.var["fwd_mm"] + table.var["fwd_other"]
                 + table.var["bwd_lin"] + table.var["bwd_mm"] + table.var["bwd_other"])
    out: list[tuple[MeshConfig, MeshResult]] = []
    for tp in _tensor_degrees(graph, table, gpn):
        why = sequence_refusal(graph, tp) if tp > 1 else "tensor=1"
        if tp > 1 and why:
            refused[tp] = why
        for pp in (p for p in range(1, n // tp + 1) if (n // tp) % p == 0):
            if pp > table.num_blocks:
                break
            dp = n // (tp * pp)
            if batch % dp:
                continue
            local = batch // dp
            mbs = ([pp * f for f in PIPELINE_MB_FACTORS] if pp > 1 else list(FLAT_MICROBATCHES))
            mbs = [m for m in mbs if local % m == 0]
            stages = balanced_stages(per_block, pp) if pp > 1 else ()
            shards = [("none", 1)] if dp == 1 else [("none", 1), ("zero2", 1), ("fsdp", 1)] + [
                (s, dp // g) for s in ("zero2", "fsdp") for g in _powers_of_two(dp // 2)
                if g >= 2 and dp % g == 0]
            scheds = ("1f1b", "gpipe") if pp > 1 else ("gpipe",)
            sps = (False, True) if pp == 1 and not why else (False,)
            for m, (shard, rep), sched, sp in itertools.product(mbs, shards, scheds, sps):
                base = MeshConfig(data=dp, tensor=tp, pipeline=pp, microbatches=m,
                                  schedule=sched, shard=shard, replicate=rep,
                                  stage_of_block=stages or (0,) * table.num_blocks,
                                  batch_size=batch, sequence_parallel=sp)
                out.append(_fitting(table, base, cluster, fit, sel_first, evaluated))
    info["evaluated"] = evaluated[0]
    out.sort(key=lambda cr: (cr[1].oom, cr[1].step_time_s if not cr[1].oom
                             else cr[1].peak_memory_bytes))
    return out


def plan_of(graph: OpGraph, cfg: MeshConfig, cluster: Cluster, res: MeshResult,
            **info) -> Plan:
    """The plan of ``cfg`` priced ``res``: one group per block run (:func:`block_groups`)."""
    groups = block_groups(graph)
    regions = dict(zip(graph.order, block_regions(graph)))
    names = list(dict.fromkeys(r for r in regions.values() if r))
    unit_of_group: dict[int, int] = {}
    for op in graph.ops:  # a group's unit: that of its first op doing work
        g = groups[op.name]
        if g not in unit_of_group and op.kind not in ("input", "param"):
            r = regions[op.name]
            unit_of_group[g] = names.index(r) + 1 if r else (
                0 if not unit_of_group else len(names) + 1)
    count = max(groups.values()) + 1
    placement, recompute, selective = [], set(), set()
    for g in range(count):
        u = unit_of_group.get(g, 0)
        if u == 0:
            placement.append(0)
        elif u > len(names):
            placement.append(cfg.pipeline - 1)
        else:
            placement.append(cfg.stage_of_block[u - 1] if cfg.pipeline > 1 else 0)
            mode = cfg.ac_of_block[u - 1]
            (recompute if mode == "full" else selective if mode == "selective" else set()).add(g)
    parallel = ParallelConfig(data=cfg.data, pipeline=cfg.pipeline,
                              microbatches=cfg.microbatches, schedule=cfg.schedule,
                              shard=cfg.shard, tensor=cfg.tensor, replicate=cfg.replicate,
                              sequence_parallel=cfg.sequence_parallel)
    plan = Plan.from_groups(graph, groups, placement, parallel=parallel, recompute=recompute,
                            selective=selective, planner="mesh", cluster=cluster, **info)
    plan.validate(graph, cluster)
    return plan.with_predicted({
        "simulator": "mesh", "step_time_s": res.step_time_s,
        "tokens_per_s_per_gpu": res.tokens_per_s_per_gpu,
        "peak_memory_bytes": [res.peak_memory_bytes] * res.num_gpus, "oom": res.oom,
        "breakdown_s": {k: float(v) for k, v in res.breakdown_s.items()}})


def mesh(graph: OpGraph, cluster: Cluster, *, batch_size: int = 0) -> Plan:
    """The fastest mesh plan that fits in memory (see the module docstring).

    Args:
        graph: a captured graph with blocks (a transformer's layers).
        cluster: one node or many; tensor groups stay within a node.
        batch_size: global batch in samples (0: the graph's own).

    Raises:
        AutoplaceError: no configuration splits the batch, or none fits in memory (the
            message names the smallest peak found and the usable memory).
    """
    t0 = time.perf_counter()
    found: dict = {}
    cands = mesh_candidates(graph, cluster, batch_size=batch_size, info=found)
    refused = found["refused"]
    if not cands:
        raise AutoplaceError(
            f"mesh planner: no dp x tp x pp split of {cluster.num_devices} devices divides "
            f"the global batch of {batch_size or getattr(graph, 'batch_size', '?')}; use a "
            "batch size divisible by the data-parallel degree")
    cfg, res = cands[0]
    if res.oom:
        usable = cluster.devices[0].usable_memory_bytes
        raise AutoplaceError(
            f"mesh planner: nothing fits {graph.name!r} on {cluster.name}: the smallest peak "
            f"found is {res.peak_memory_bytes / 2**30:.1f} GiB per GPU, usable "
            f"{usable / 2**30:.1f} GiB")
    info = {"sequence_parallel_refused": refused[cfg.tensor]} if cfg.tensor in refused else {}
    return plan_of(graph, cfg, cluster, res, searched=found["evaluated"],
                   search_time_s=time.perf_counter() - t0, **info)
