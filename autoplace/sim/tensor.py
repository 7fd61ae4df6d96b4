"""Tensor parallelism in the simulator: a plan's replica as one rank of a tensor group sees it.

A plan with ``parallel.tensor = t`` runs each local device as ``t`` ranks that split the
lowering's Linear pairs (:class:`autoplace.tensor_shards.TensorShards`). Every rank of a
group does the same work at the same time, so the step is simulated on one of them: a
*view* of the graph in which

* every split op (the pairs' columns, rows and the ops between) takes ``1 / t`` of its
  forward and backward time, FLOPs, parameter bytes, activation bytes kept for backward,
  output bytes and the bytes of the edges between split ops (the rows' outputs are whole);
* each row's forward ends with an all-reduce of its output over the tensor group, and each
  unit's first column's backward with an all-reduce of the unit's input gradient (the
  columns of one unit read one input: Megatron's g and f), priced with the cluster's
  collective model on the group's devices, added to the op's time;
* with sequence parallelism (``parallel.sequence_parallel``) the ops of the residual
  stream (:class:`autoplace.sequence_shards.SequenceShards`: norms, residual adds) take
  ``1 / t`` of their time, activations and outputs too (their parameters are whole on
  every rank), a row's all-reduce becomes a reduce-scatter in forward and an all-gather
  of its output's gradient in backward, a unit's first column all-gathers its input in
  forward and reduce-scatters its gradient in backward, and each exit from the stream
  all-gathers its output;
* every other op runs whole, as it does on every rank;

on a cluster of the groups' first devices (data-parallel and pipeline traffic between
groups runs on those links). The view's result is every rank's: each device of a group
reports its first device's busy time and memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import Plan
from autoplace.sim.model import affine_collective, collective_time
from autoplace.tensor_shards import plan_tensor_shards

__all__ = ["simulate_tensor", "tensor_collective_s", "tensor_view"]


def tensor_collective_s(cluster: Cluster, plan: Plan, nbytes: float,
                        kind: str = "allreduce") -> float:
    """Seconds of one ``kind`` collective (``allreduce``, ``allgather``, ``reducescatter``)
    of ``nbytes`` (the whole tensor) over replica 0's first tensor group (the simulator's
    collective model: :func:`autoplace.sim.model.affine_collective`)."""
    t = plan.parallel.tensor
    if t <= 1 or nbytes <= 0:
        return 0.0
    return collective_time(affine_collective(cluster, kind, list(range(t))), nbytes)


def tensor_view(graph: OpGraph, plan: Plan, cluster: Cluster) -> tuple[OpGraph, Plan, Cluster]:
    """``(graph, plan, cluster)`` as one rank of every tensor group runs them (see the module
    docstring): the plan with ``tensor = 1``, the cluster of the groups' first devices."""
    shards = plan_tensor_shards(graph, plan)
    t = plan.parallel.tensor
    if shards is None:
        return graph, plan, cluster
    seq = shards.sequence
    stream = set(seq.stream) if seq is not None else set()
    split = shards.split_ops
    first_cols = {p.columns[0]: p for p in shards.pairs}

    def coll(nbytes: float, kind: str) -> float:
        return tensor_collective_s(cluster, plan, nbytes, kind)

    ops: list[OpNode] = []
    for op in graph.ops:
        new = copy.copy(op)
        if op.name in split or op.name in stream:
            _divide(new, op, t, params=op.name not in stream)
        if op.name in shards.rows:  # forward: the partial outputs summed over the group
            if seq is None:
                fwd, bwd = coll(op.output_bytes, "allreduce"), 0.0
                new.output_bytes = op.output_bytes
            else:  # summed and scattered along the sequence; backward gathers the gradient
                fwd, bwd = coll(op.output_bytes, "reducescatter"), coll(op.output_bytes,
                                                                        "allgather")
            _add(new, fwd, bwd)
        if op.name in first_cols:  # the unit's input: its gradient summed over the group
            nbytes = max((b for u, v, b in graph.edges if v == op.name), default=0)
            if seq is None:
                _add(new, 0.0, coll(nbytes, "allreduce"))
            else:  # gathered from sequence shards once; the gradient reduce-scattered back
                _add(new, coll(nbytes, "allgather"), coll(nbytes, "reducescatter"))
        if seq is not None and op.name in seq.exits:  # the whole sequence again
            _add(new, coll(op.output_bytes, "allgather"), 0.0)
            new.output_bytes = op.output_bytes
        ops.append(new)
    sharded = split | stream
    edges = [(u, v, b // t if u in sharded and v in sharded else b) for u, v, b in graph.edges]
    view = OpGraph(graph.name, ops, edges, module=None)
    view.autocast_dtype, view.capture_method = graph.autocast_dtype, graph.capture_method
    return view, *_view_plan_cluster(plan, cluster)


def _divide(new: OpNode, op: OpNode, t: int, params: bool) -> None:
    """``new``: ``op``'s work, activations and output on ``1 / t`` of its values (its
    parameters too where ``params``: a split Linear's, not a replicated norm's)."""
    new.fwd_time_s = {k: v / t for k, v in op.fwd_time_s.items()}
    new.bwd_time_s = {k: v / t for k, v in op.bwd_time_s.items()}
    new.fwd_fixed_s = {k: v / t for k, v in op.fwd_fixed_s.items()}
    new.bwd_fixed_s = {k: v / t for k, v in op.bwd_fixed_s.items()}
    new.flops = op.flops / t
    if params:
        new.param_bytes = op.param_bytes // t
    new.activation_bytes = op.activation_bytes // t
    new.workspace_bytes = op.workspace_bytes // t
    new.output_bytes = op.output_bytes // t


def _add(new: OpNode, fwd_s: float, bwd_s: float) -> None:
    """A collective's seconds on ``new``'s forward and backward."""
    if fwd_s:
        new.fwd_time_s = {k: v + fwd_s for k, v in new.fwd_time_s.items()}
    if bwd_s:
        new.bwd_time_s = {k: v + bwd_s for k, v in new.bwd_time_s.items()}


def _view_plan_cluster(plan: Plan, cluster: Cluster) -> tuple[Plan, Cluster]:
    t = plan.parallel.tensor
    model = {k: v for k, v in plan.model.items() if k != "fingerprint"}
    vplan = replace(plan, parallel=replace(plan.parallel, tensor=1, sequence_parallel=False),
                    model=model)
    leaders = [i * t for i in range(plan.parallel.data * plan.devices_per_replica)]
    return vplan, cluster.subset(leaders)


def _view_of(graph: OpGraph, plan: Plan, cluster: Cluster) -> tuple[OpGraph, Plan, Cluster]:
    """:func:`tensor_view`, the view graph kept on ``graph`` per (degree, cluster links,
    placement): the simulator's caches (graph arrays, lower bound) then live on one object
    across calls."""
    key = (plan.parallel.tensor, plan.parallel.sequence_parallel, cluster.devices, cluster.alpha_s, cluster.bandwidth,
           tuple(plan.placement), tuple(sorted(plan.groups.items())))
    cache = graph.__dict__.setdefault("_tensor_views", {})
    if key not in cache:
        cache.clear()
        cache[key] = tensor_view(graph, plan, cluster)[0]
    return cache[key], *_view_plan_cluster(plan, cluster)


def simulate_tensor(graph: OpGraph, plan: Plan, cluster: Cluster,
                    simulate: Callable[..., Any], **kw: Any) -> Any:
    """``simulate`` (:func:`autoplace.sim.simulate`) of ``plan``'s view, its per-device
    figures spread back over every rank of each tensor group."""
    t = plan.parallel.tensor
    view, vplan, vcluster = _view_of(graph, plan, cluster)
    res = simulate(view, vplan, vcluster, **kw)
    n = cluster.num_devices

    def spread(values: list[Any], empty: Any) -> list[Any]:
        return [values[i // t] if i // t < len(values) else empty for i in range(n)]

    usable = [d.usable_memory_bytes for d in cluster.devices]
    peak = spread(res.peak_memory_bytes, 0)
    oom = [i for i, b in enumerate(peak) if b > usable[i]]
    return replace(res, busy_time_s=spread(res.busy_time_s, 0.0), peak_memory_bytes=peak,
                   memory_breakdown=spread(res.memory_breakdown, None), oom=bool(oom),
                   oom_devices=oom)
