"""Tensor parallelism: a plan's Linear pairs split over a tensor group through DTensor.

The lowering names the pairs (:class:`autoplace.tensor_shards.TensorShards`); this module
applies them to the captured program, as torchtitan's ``parallelize`` does to a model:

* :func:`rewrite_views`: the ops between a pair's Linears run on each rank's shard, but
  the captured program names global sizes in its views (``unflatten(-1, (3, 2, 32))``,
  ``view(B, T, H, Dh)``); the size of the split dimension becomes ``-1`` (or the global
  size divided by the degree where the view has a ``-1`` already);
* :func:`regroup_columns`: a fused column (qkv) whose split factor is not its outermost
  has its rows reordered so that each rank's contiguous shard holds its heads of q, k
  and v (the function reorders weight and bias in place: the model computes the same);
* :func:`apply_tensor_parallel`: ``parallelize_module`` with ``ColwiseParallel`` on the
  columns and ``RowwiseParallel`` on the rows, on the ``tp`` dimension of the mesh
  (:func:`device_mesh`): the forward all-reduces each row's partial output, the backward
  each column's input gradient (Megatron's f and g). Every other op runs whole on every
  rank of the group, on the same values.

Ranks: with ``parallel.tensor = t`` each local device of the plan is ``t`` ranks, the
tensor index fastest: rank ``((replica * p) + stage) * t + j`` (``p`` pipeline stages,
1 without a pipeline), on cluster device ``(replica * k + stage) * t + j``
(:meth:`autoplace.plan.Plan.replica_devices`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autoplace.plan import Plan
from autoplace.sequence_shards import SEQUENCE_DIM, SequenceShards
from autoplace.tensor_shards import TensorShards

__all__ = ["apply_sequence_parallel", "apply_tensor_parallel", "data_mesh", "device_mesh", "prepare_program",
           "process_count", "rank_cluster_device", "rank_layout", "regroup_columns",
           "rewrite_views"]


def process_count(plan: Plan) -> int:
    """Processes a plan runs in: replicas x pipeline stages x tensor ranks."""
    par = plan.parallel
    return par.data * par.pipeline * par.tensor


def rank_layout(plan: Plan, rank: int) -> tuple[int, int, int]:
    """``(replica, stage, tensor index)`` of process ``rank`` (stage 0 without a pipeline)."""
    par = plan.parallel
    rest, j = divmod(rank, par.tensor)
    replica, stage = divmod(rest, par.pipeline)
    return replica, stage, j


def rank_cluster_device(plan: Plan, rank: int) -> int:
    """The cluster device index of process ``rank``: its replica's first local device (a
    one-process replica), or its stage's, within its tensor group."""
    replica, stage, j = rank_layout(plan, rank)
    return (replica * plan.devices_per_replica + stage) * plan.parallel.tensor + j


def device_mesh(plan: Plan, device_type: str) -> Any:
    """The ``DeviceMesh`` of a multi-process plan: dimensions ``dp`` (or ``dp_replicate``,
    ``dp_shard`` under HSDP), ``pp`` and ``tp``, each where its degree is above 1, in that
    order (ranks laid out as :func:`rank_layout`); None for a one-process plan."""
    from torch.distributed.device_mesh import init_device_mesh

    par = plan.parallel
    dims: list[tuple[str, int]] = []
    if par.data > 1:
        if par.replicate > 1:
            dims += [("dp_replicate", par.replicate), ("dp_shard", par.data // par.replicate)]
        else:
            dims.append(("dp", par.data))
    for name, size in (("pp", par.pipeline), ("tp", par.tensor)):
        if size > 1:
            dims.append((name, size))
    if not dims:
        return None
    names, shape = zip(*dims)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def data_mesh(mesh: Any, plan: Plan) -> Any:
    """The mesh FSDP2 shards over: ``dp`` or, under HSDP, 2-D ``(dp_replicate, dp_shard)``."""
    if plan.parallel.replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp"]


def rewrite_views(gm: fx.GraphModule, graph: Any, shards: TensorShards) -> int:
    """Give the views inside each pair the split dimension's local size; returns how many
    size arguments changed. Run it once per program (a second run would divide again)."""
    t = shards.degree
    nodes = {n.name: n for n in gm.graph.nodes}
    changed = 0
    for pair in shards.pairs:
        for name, dim in pair.reshapes:
            n = nodes[name]
            op = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            if op in ("view", "reshape"):
                sizes = list(n.args[1]) if len(n.args) == 2 and isinstance(
                    n.args[1], (tuple, list)) else list(n.args[1:])
                new = _local_sizes(gm, n, sizes, dim, t)
                n.args = (n.args[0], tuple(new))
            elif op == "unflatten":
                x, at, sizes = n.args[0], n.args[1], list(n.args[2])
                pos = dim - at % len(graph[x.name].output_shapes[0])
                if not 0 <= pos < len(sizes):  # it splits another dimension
                    continue
                n.args = (x, at, tuple(_local_sizes(gm, n, sizes, pos, t)))
            elif op == "expand":  # -1 keeps the local size
                sizes = list(n.args[1]) if len(n.args) == 2 and isinstance(
                    n.args[1], (tuple, list)) else list(n.args[1:])
                sizes[dim] = -1
                n.args = (n.args[0], tuple(sizes))
            else:  # flatten and the like name no sizes
                continue
            changed += 1
    gm.graph.lint()
    gm.recompile()
    return changed


def _local_sizes(gm: fx.GraphModule, n: fx.Node, sizes: list[Any], pos: int, t: int) -> list[Any]:
    """``sizes`` with the entry at ``pos`` made local: ``-1`` where no other entry is, else
    the global size divided by ``t`` (a node for a size computed at run time)."""
    if sizes[pos] == -1:
        return sizes
    if not any(s == -1 for s in sizes if not isinstance(s, fx.Node)):
        sizes[pos] = -1
    elif isinstance(sizes[pos], fx.Node):
        with gm.graph.inserting_before(n):
            sizes[pos] = gm.graph.call_function(operator.floordiv, (sizes[pos], t))
    else:
        sizes[pos] = int(sizes[pos]) // t
    return sizes


@torch.no_grad()
def regroup_columns(gm: fx.GraphModule, graph: Any, shards: TensorShards) -> None:
    """Reorder the output features of each column the pairs regroup (a fused qkv) to
    ``[rank, outer, mid / t, inner]``, so rank ``j``'s contiguous shard is its slice of the
    ``mid`` factor (its heads) for every ``outer`` (q, k, v). Weights and bias in place."""
    t = shards.degree
    for pair in shards.pairs:
        for op, outer, mid, inner in pair.regroup:
            mod = gm.get_submodule(graph[op].target)
            n = outer * mid * inner
            perm = torch.arange(n).view(outer, t, mid // t, inner).permute(1, 0, 2, 3).reshape(-1)
            for p in (mod.weight, mod.bias):
                if p is not None:
                    p.data = p.data.index_select(0, perm.to(p.device)).contiguous()
            mod.autoplace_regroup = (t, outer, mid, inner)  # checkpoints record the layout


def apply_tensor_parallel(gm: fx.GraphModule, graph: Any, shards: TensorShards, tp_mesh: Any,
                          ops: set[str] | None = None) -> list[str]:
    """Split the pairs' Linears of ``gm`` over ``tp_mesh`` (``ColwiseParallel`` /
    ``RowwiseParallel``, local tensors in and out); ``ops``: only the pairs whose ops are
    all among them (a pipeline stage's). With ``shards.sequence`` the rows reduce-scatter
    along the sequence instead (``output_layouts=Shard(1)``) and the stream's modules run
    under ``SequenceParallel`` (:func:`apply_sequence_parallel`). Returns the module paths
    split (and those run on sequence shards)."""
    seq = shards.sequence
    styles: dict[str, Any] = {}
    for pair in shards.pairs:
        if ops is not None and not set(pair.columns) <= ops:
            continue
        for c in pair.columns:
            styles[graph[c].target] = ColwiseParallel()
        for r in pair.rows:
            styles[graph[r].target] = RowwiseParallel(
                output_layouts=Shard(SEQUENCE_DIM) if seq is not None else None)
    if seq is not None:
        for name in seq.modules:  # parameters replicated, their gradients summed
            styles[graph[name].target] = SequenceParallel(
                sequence_dim=SEQUENCE_DIM, use_local_output=name not in seq.gathers)
    if styles:
        parallelize_module(gm, tp_mesh, styles)
    if seq is not None:
        apply_sequence_parallel(gm, seq, tp_mesh)
    return sorted(styles)


def apply_sequence_parallel(gm: fx.GraphModule, seq: SequenceShards, tp_mesh: Any) -> None:
    """The stream's boundaries on ``gm`` (after ``parallelize_module``): the gathering
    norms' outputs all-gathered to replicated DTensors for their columns, the entries'
    outputs scattered along the sequence, the exits' gathered. A call_function or
    call_method entry or exit becomes a call of a :class:`_Then` module (same node name)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in seq.gathers:
        gm.get_submodule(nodes[name].target).register_forward_hook(_replicate_hook)
    for i, name in enumerate((*seq.entries, *seq.exits)):
        n = nodes[name]
        then = _scatter if name in seq.entries else _gather
        if n.op == "call_module":
            gm.get_submodule(n.target).register_forward_hook(
                lambda m, args, out, then=then: then(out, tp_mesh))
            continue
        target = f"_sequence_boundary{i}"
        gm.add_submodule(target, _Then(n.op, n.target, then, tp_mesh))
        n.op, n.target = "call_module", target
    gm.recompile()


class _Then(nn.Module):
    """An fx op (a call_function's function or a call_method's name) followed by a
    sequence scatter or gather of its output."""

    def __init__(self, op: str, target: Any, then: Any, mesh: Any) -> None:
        super().__init__()
        self.op, self.target, self.then, self.mesh = op, target, then, mesh

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.op == "call_method":
            out = getattr(args[0], self.target)(*args[1:], **kwargs)
        else:
            out = self.target(*args, **kwargs)
        return self.then(out, self.mesh)

    def extra_repr(self) -> str:
        return f"{getattr(self.target, '__name__', self.target)} then {self.then.__name__}"


def _scatter(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's sequence shard of ``x`` (the same on every rank); backward all-gathers."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(SEQUENCE_DIM)]).to_local()


def _gather(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """The whole sequence from each rank's shard ``x``; backward keeps this rank's shard
    of the gradient (every rank computes the same one from the whole sequence)."""
    return DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()


def _replicate_hook(module: nn.Module, args: Any, out: Any) -> Any:
    """A norm's sequence-sharded output gathered once for all its columns; backward
    reduce-scatters the columns' summed input gradients."""
    return out.redistribute(placements=[Replicate()])


def prepare_program(gm: fx.GraphModule, graph: Any, shards: TensorShards, tp_mesh: Any,
                    ops: set[str] | None = None) -> list[str]:
    """:func:`rewrite_views`, :func:`regroup_columns` and :func:`apply_tensor_parallel` on
    ``gm``, in that order (the split needs the regrouped weights)."""
    rewrite_views(gm, graph, shards)
    regroup_columns(gm, graph, shards)
    return apply_tensor_parallel(gm, graph, shards, tp_mesh, ops)
