"""``mesh``: a device-mesh search for transformer-scale models on one node or many.

Searches data parallel x sharding (DDP, ZeRO-2, FSDP, HSDP with ``replicate`` groups) x
tensor parallel (within a node) x pipeline stages (contiguous runs of blocks, balanced by
compute) x microbatches x schedule x activation checkpointing per block (none, selective,
full, or full on the first part of each stage's blocks and selective on the rest), with
the closed-form model of :mod:`autoplace.sim.mesh` (a fraction of a millisecond per
configuration). The fastest configuration that fits every GPU's memory becomes a
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

import numpy as np

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError
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

__all__ = ["mesh", "mesh_candidates", "balanced_stages"]

#: checkpoint recipes per pipeline stage: a mode for every block, or ``full`` on the
#: first share of each stage's blocks and ``selective`` on the rest
AC_RECIPES = ("none", "selective", "full", 0.25, 0.5, 0.75)
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


def _ac_of_block(recipe: str | float, stage_of_block: tuple[int, ...]) -> tuple[str, ...]:
    if isinstance(recipe, str):
        return (recipe,) * len(stage_of_block)
    out = []
    for s in sorted(set(stage_of_block)):
        n = stage_of_block.count(s)
        k = int(round(recipe * n))
        out += ["full"] * k + ["selective"] * (n - k)
    return tuple(out)


def _tensor_degrees(graph: OpGraph, table: BlockTable, gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees (powers of two within a node) that split every Linear's
    output features of every block evenly."""
    regions = block_regions(graph)
    widths = {op.output_shapes[0][-1] for op, r in zip(graph.ops, regions)
              if r and op.kind in ("Linear", "linear") and op.output_shapes}
    return [t for t in _powers_of_two(gpus_per_node) if all(w % t == 0 for w in widths)]


def mesh_candidates(graph: OpGraph, cluster: Cluster, *, batch_size: int = 0,
                    fit: MeshFit | None = None) -> list[tuple[MeshConfig, MeshResult]]:
    """Every searched configuration with its predicted step, fastest feasible first."""
    table = block_table(graph, cluster)
    n = cluster.num_devices
    gpn = int(getattr(cluster, "gpus_per_node", None) or n)
    batch = batch_size or table.batch_size
    per_block = (table.var["fwd_lin"] + table.var["fwd_mm"] + table.var["fwd_other"]
                 + table.var["bwd_lin"] + table.var["bwd_mm"] + table.var["bwd_other"])
    out: list[tuple[MeshConfig, MeshResult]] = []
    for tp in _tensor_degrees(graph, table, gpn):
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
            for m, (shard, rep), sched, recipe in itertools.product(mbs, shards, scheds,
                                                                    AC_RECIPES):
                cfg = MeshConfig(data=dp, tensor=tp, pipeline=pp, microbatches=m,
                                 schedule=sched, shard=shard, replicate=rep,
                                 stage_of_block=stages or (0,) * table.num_blocks,
                                 ac_of_block=_ac_of_block(recipe, stages or
                                                          (0,) * table.num_blocks),
                                 batch_size=batch)
                out.append((cfg, estimate_config(table, cfg, cluster, fit=fit)))
    out.sort(key=lambda cr: (cr[1].oom, cr[1].step_time_s if not cr[1].oom
                             else cr[1].peak_memory_bytes))
    return out


def _plan_of(graph: OpGraph, cfg: MeshConfig, cluster: Cluster, res: MeshResult,
             **info) -> Plan:
    """The plan of ``cfg``: one group per block run (:func:`block_groups`)."""
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
                              shard=cfg.shard, tensor=cfg.tensor, replicate=cfg.replicate)
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
    cands = mesh_candidates(graph, cluster, batch_size=batch_size)
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
    return _plan_of(graph, cfg, cluster, res, searched=len(cands),
                    search_time_s=time.perf_counter() - t0)
