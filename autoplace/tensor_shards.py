"""Tensor-parallel shards: which Linears a plan's ``parallel.tensor`` splits, Megatron-style.

:func:`find_tensor_shards` reads the captured graph's structure and module paths alone (no
model-specific code): the pair units of :mod:`autoplace.tensor_pairs` (column Linears whose
outputs reach only row Linears inside one block, the split dimension followed through the
ops between by :mod:`autoplace.tensor_dims`), and the norms whose outputs feed a unit's
columns (:attr:`TensorShards.norms`). With ``parallel.sequence_parallel``
:func:`plan_tensor_shards` adds the residual stream between the units that runs on
sequence shards (:mod:`autoplace.sequence_shards`).

The executor (:mod:`autoplace.executor.tensor_parallel`) applies the result with
``torch.distributed.tensor.parallel``; the simulator (:mod:`autoplace.sim.tensor`) prices it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoplace.errors import PlanError
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.sequence_shards import SequenceShards, find_sequence_shards
from autoplace.tensor_dims import block_of
from autoplace.tensor_pairs import PairFinder, TensorPair

__all__ = ["TensorPair", "TensorShards", "block_of", "find_tensor_shards", "plan_tensor_shards",
           "with_sequence"]


@dataclass(frozen=True)
class TensorShards:
    """The tensor-parallel split of a graph at one degree.

    Attributes:
        degree: ranks per tensor group.
        pairs: the pair units (:class:`TensorPair`), in graph order.
        norms: norm ops whose outputs feed a unit's columns (sequence parallel's norms).
        sequence: where the residual stream runs on sequence shards
            (:class:`autoplace.sequence_shards.SequenceShards`); None without sequence
            parallelism.
    """

    degree: int
    pairs: tuple[TensorPair, ...]
    norms: tuple[str, ...] = ()
    sequence: SequenceShards | None = None

    @property
    def columns(self) -> set[str]:
        return {c for p in self.pairs for c in p.columns}

    @property
    def rows(self) -> set[str]:
        return {r for p in self.pairs for r in p.rows}

    @property
    def split_ops(self) -> set[str]:
        """Every op that runs on a shard: columns, rows and the ops between."""
        return {o for p in self.pairs for o in (*p.columns, *p.inner, *p.rows)}

    def describe(self) -> str:
        return ", ".join(f"{p.block}: {'+'.join(p.columns)} -> {'+'.join(p.rows)}"
                         for p in self.pairs)


def find_tensor_shards(graph: OpGraph, degree: int) -> TensorShards:
    """The pair units of ``graph`` at tensor-parallel ``degree`` (see the module docstring).

    Raises:
        PlanError: the graph has no fx program to read, no pair unit, or a split size the
            degree does not divide.
    """
    cache = graph.__dict__.setdefault("_tensor_shards", {})
    if degree in cache:
        return cache[degree]
    gm = graph.module
    if gm is None:
        raise PlanError("parallel.tensor needs the captured fx program to find the Linear "
                        f"pairs to split; graph {graph.name!r} has none (loaded from a file?)")
    if getattr(graph, "capture_method", "fx") == "export":
        raise PlanError(
            f"parallel.tensor={degree}: graph {graph.name!r} was captured by torch.export, "
            "whose program calls no modules (its Linears are aten ops on flattened "
            "parameters): tensor parallelism splits nn.Linear modules of a torch.fx trace; "
            "use parallel.tensor=1 for this model")
    found = PairFinder(graph, gm, degree)
    pairs = found.pairs()
    if not pairs:
        why = found.why or "no Linear module calls"
        raise PlanError(
            f"parallel.tensor={degree}: graph {graph.name!r} has no Linear pair to split "
            "(a Linear whose output reaches another Linear through non-Linear ops inside one "
            f"block: {why}); use parallel.tensor=1")
    norms = tuple(n.name for n in gm.graph.nodes
                  if n.op == "call_module" and "norm" in type(gm.get_submodule(n.target)).__name__.lower()
                  and any(u.name in {c for p in pairs for c in p.columns} for u in n.users))
    out = TensorShards(degree=degree, pairs=tuple(pairs), norms=norms)
    cache[degree] = out
    return out


def plan_tensor_shards(graph: OpGraph, plan: Plan) -> TensorShards | None:
    """The tensor-parallel split of ``plan`` on ``graph`` (None when ``parallel.tensor`` is 1).

    Raises:
        PlanError: as :func:`find_tensor_shards`, or a unit's ops on several pipeline stages
            or in several op groups recomputed differently (a unit runs whole on one stage).
    """
    t = plan.parallel.tensor
    if t == 1:
        return None
    shards = find_tensor_shards(graph, t)
    for p in shards.pairs:
        ops = (*p.columns, *p.inner, *p.rows)
        devices = {plan.device_of(o) for o in ops}
        if len(devices) > 1:
            raise PlanError(
                f"the tensor-parallel unit of block {p.block!r} ({p.columns[0]} -> {p.rows[-1]}) "
                f"has ops on local devices {sorted(devices)}; its Linears and the ops between "
                "them run on one device (stage): move the cut outside that unit")
    if plan.parallel.sequence_parallel:
        return with_sequence(graph, shards)
    return shards


def with_sequence(graph: OpGraph, shards: TensorShards) -> TensorShards:
    """``shards`` with its residual stream on sequence shards (``sequence`` set: see
    :func:`autoplace.sequence_shards.find_sequence_shards`), cached on ``graph``.

    Raises:
        PlanError: the stream cannot run on sequence shards (the error names the op).
    """
    cache = graph.__dict__.setdefault("_sequence_shards", {})
    if shards.degree not in cache:
        seq = find_sequence_shards(graph, graph.module, shards.columns, shards.rows,
                                   shards.split_ops, {p.block for p in shards.pairs},
                                   shards.degree)
        cache[shards.degree] = replace(shards, sequence=seq)
    return cache[shards.degree]
