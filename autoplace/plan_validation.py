"""Whether a plan fits a graph and a cluster: :meth:`autoplace.plan.Plan.validate`.

The plan file's own shape (types, keys, group ids in range) is checked when it is read
(:meth:`autoplace.plan.Plan.from_json`) and the hybrid split's fields when it is built
(:class:`autoplace.parallel_config.ParallelConfig`); what is left needs the graph and the
cluster: the ops named, the devices used, how the split fits the placement, and a
pipeline's stages forming a chain.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autoplace.errors import PlanError

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.graph import OpGraph
    from autoplace.plan import Plan

__all__ = ["validate_plan"]


def validate_plan(plan: Plan, graph: OpGraph, cluster: Cluster | None = None) -> None:
    """Raise :class:`PlanError` naming the first way ``plan`` does not fit ``graph`` (and
    ``cluster``, when given)."""
    fp = plan.model.get("fingerprint")
    if fp is not None and fp != graph.fingerprint:
        raise PlanError(
            f"plan was made for another graph: plan fingerprint {fp}, this model's "
            f"{graph.fingerprint} (model {plan.model.get('spec', '?')!r}, "
            f"{plan.model.get('num_ops', '?')} ops in the plan vs {len(graph)} here)"
        )
    unknown = [op for op in plan.groups if op not in graph]
    if unknown:
        raise PlanError(f"plan names {len(unknown)} ops not in the graph, e.g. {unknown[:3]}")
    missing = [op.name for op in graph if op.name not in plan.groups]
    if missing:
        raise PlanError(f"plan does not place {len(missing)} ops, e.g. {missing[:3]}")
    g = plan.num_groups
    bad = {op: gid for op, gid in plan.groups.items() if not (0 <= gid < g)}
    if bad:
        op, gid = next(iter(bad.items()))
        raise PlanError(f"op {op!r} is in group {gid}, but groups are 0..{g - 1}")
    for key, ids in (("recompute", plan.recompute), ("selective", plan.selective)):
        bad_ids = sorted(x for x in ids if not (0 <= x < g))
        if bad_ids:
            raise PlanError(f"{key} names group {bad_ids[0]}, but groups are 0..{g - 1}")
    if plan.priority and len(plan.priority) != g:
        raise PlanError(f"priority has {len(plan.priority)} entries, but the plan has {g} "
                        "groups: give one integer per group, or none")
    both = sorted(plan.recompute & plan.selective)
    if both:
        raise PlanError(f"group {both[0]} is in both recompute and selective; a group is "
                        "recomputed whole or selectively, not both")
    if (plan.recompute or plan.selective) and plan.parallel.graphs:
        raise PlanError("parallel.graphs cannot be combined with recompute: a recomputed "
                        "group runs under activation checkpointing, outside any CUDA graph")
    if any(d < 0 for d in plan.placement):
        raise PlanError(f"device index {min(plan.placement)} is negative")
    if cluster is not None:
        need = plan.num_devices
        if need > cluster.num_devices:
            tp = (f" x {plan.parallel.tensor} tensor-parallel"
                  if plan.parallel.tensor > 1 else "")
            raise PlanError(
                f"plan needs {need} devices ({plan.parallel.data} replicas x "
                f"{plan.devices_per_replica} devices{tp}), but cluster {cluster.name!r} has "
                f"{cluster.num_devices}: device index {max(plan.placement)} is out of range"
                if plan.parallel.data == 1 and not tp
                else f"plan needs {need} devices ({plan.parallel.data} replicas x "
                f"{plan.devices_per_replica} devices{tp}), but cluster {cluster.name!r} has "
                f"{cluster.num_devices}"
            )
    par = plan.parallel
    if par.shard != "none" and par.data == 1 and not par.offload:
        raise PlanError(f"parallel.shard={par.shard!r} needs parallel.data > 1 (or, with "
                        "shard='fsdp', parallel.offload: one rank streaming its parameters "
                        "from the host)")
    if par.shard != "none" and par.pipeline == 1 and plan.devices_per_replica > 1:
        raise PlanError(
            f"parallel.shard={par.shard!r} with a replica spread over "
            f"{plan.devices_per_replica} devices in one process is not supported (FSDP2 "
            "keeps one device per rank); use shard='none' (DDP) or a pipeline"
        )
    if par.shard_optimizer and plan.devices_per_replica > 1:
        raise PlanError(
            f"parallel.shard_optimizer with a replica spread over {plan.devices_per_replica} "
            "devices in one process is not supported (ZeRO-1 shards AdamW over DDP "
            "replicas of one device each); place every group on local device 0")
    if par.tensor > 1 and par.pipeline == 1 and plan.devices_per_replica > 1:
        raise PlanError(
            f"parallel.tensor={par.tensor} with a replica spread over "
            f"{plan.devices_per_replica} devices in one process is not supported (a "
            "tensor-parallel rank is one process on one device); use a pipeline")
    if par.pipeline > 1:
        _check_chain(plan, graph)
    elif par.microbatches > 1:
        _check_divisible(par.microbatches, "microbatches")

def _check_chain(plan: Plan, graph: OpGraph) -> None:
    """A pipelined plan's stages form a chain: local devices ``0 .. p-1``, each one
    contiguous run of ops in topological order, no edge going back a stage."""
    p = plan.parallel.pipeline
    used = sorted(set(plan.placement))
    if used != list(range(p)):
        raise PlanError(
            f"a {p}-stage pipeline must place ops on local devices 0..{p - 1}, "
            f"one stage each; the plan uses devices {used}"
        )
    # model inputs and parameter fetches have no producers: wherever they sit in
    # program order, the stage that holds them receives them, so they are skipped here
    last = -1
    for node in graph:
        if node.kind in ("input", "param"):
            continue
        op, s = node.name, plan.device_of(node.name)
        if s < last:
            raise PlanError(
                f"pipeline stages do not form a chain: op {op!r} is on stage {s} after an op "
                f"of stage {last} (each stage must be one contiguous run of ops in "
                f"topological order, stage 0 first)"
            )
        last = s
    for u, v, _ in graph.edges:
        su, sv = plan.device_of(u), plan.device_of(v)
        if sv < su:
            raise PlanError(
                f"pipeline stages do not form a chain: {u!r} (stage {su}) feeds "
                f"{v!r} (stage {sv}), a backward edge"
            )


def _check_divisible(n: int, what: str) -> None:
    if n < 1 or not math.isfinite(n):
        raise PlanError(f"{what} must be >= 1")

