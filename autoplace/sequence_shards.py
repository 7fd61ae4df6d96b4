"""Sequence parallelism: the residual stream between a tensor plan's Linear pairs, split
along the sequence over the tensor group (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", arXiv:2205.05198; torchtitan's
``SequenceParallel``).

Without it every rank of a tensor group runs the ops between the pair units whole: the
norms, residual adds and dropouts on the full ``[batch, sequence, features]`` activations.
With it those ops run on ``1 / t`` of the sequence: a unit's columns all-gather their
input (once per unit, after its norm) and its rows reduce-scatter their output instead of
all-reducing it, so the traffic is the same and the stream's activations are divided by
``t``.

The *stream* is found from the captured graph alone: starting at the rows' consumers and
at the norms feeding the columns, every op inside the units' blocks (module paths) that
is not itself split and that exchanges values with the stream joins it. It must consist
of ops that act on each token alone (norms, Linears that are not split, dropout and
activation modules, elementwise arithmetic), each output ``[batch, sequence, ...]``; the
stream reaches a unit only through a module (a norm) feeding the unit's columns alone.
Values entering it (the embeddings) are scattered after the op that makes them; values
leaving it (into the final norm) are gathered after the stream's op that makes them.
Anything else is refused with the op and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from autoplace.errors import PlanError
from autoplace.graph import OpGraph
from autoplace.tensor_dims import block_of, dim_arg, op_name

__all__ = ["SEQUENCE_DIM", "SequenceShards", "find_sequence_shards"]

#: the dimension the stream is split along: ``[batch, sequence, features]``
SEQUENCE_DIM = 1

#: call_function / call_method ops that act on each element alone
_ELEMENTWISE = {"add", "sub", "mul", "truediv", "div", "neg", "iadd", "imul", "dropout",
                "gelu", "relu", "silu", "tanh", "sigmoid", "contiguous", "to", "float",
                "half", "bfloat16", "type_as", "clone", "pow", "rsqrt", "sqrt", "exp"}
#: reductions that are token-wise over a feature dimension (a norm written out)
_REDUCTIONS = {"mean", "sum", "amax", "var"}
#: modules that act on each token alone
_TOKENWISE = (nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.Identity, nn.Linear, nn.GELU,
              nn.ReLU, nn.SiLU, nn.Tanh)


@dataclass(frozen=True)
class SequenceShards:
    """Where a tensor plan's residual stream runs on sequence shards.

    Attributes:
        seq_len: the sequence length (dimension 1 of the stream), divisible by the degree.
        stream: ops that run on each rank's sequence shard.
        entries: ops outside the stream whose outputs are scattered along the sequence
            (every consumer is in the stream).
        exits: stream ops whose outputs are gathered (every consumer is outside it).
        modules: stream ops calling a module with parameters (``SequenceParallel``: their
            parameters' gradients summed over the group).
        gathers: those among ``modules`` whose outputs feed a unit's columns alone: their
            outputs are all-gathered once for the unit, and the columns' input gradients
            reduce-scattered back.
    """

    seq_len: int
    stream: tuple[str, ...]
    entries: tuple[str, ...]
    exits: tuple[str, ...]
    modules: tuple[str, ...]
    gathers: tuple[str, ...]


def find_sequence_shards(graph: OpGraph, gm: fx.GraphModule, columns: set[str],
                         rows: set[str], split: set[str], blocks: set[str],
                         degree: int) -> SequenceShards:
    """The stream of the pair units (``columns``, ``rows``, every ``split`` op, in
    ``blocks``) at tensor degree ``degree`` (see the module docstring).

    Raises:
        PlanError: the stream holds an op that is not token-wise, reaches a unit other
            than through a norm feeding its columns, or the sequence does not divide.
    """
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}

    def refuse(why: str) -> PlanError:
        return PlanError(f"parallel.sequence_parallel: {why}; run without sequence "
                         "parallelism (parallel.sequence_parallel=false)")

    def in_blocks(n: fx.Node) -> bool:
        return (n.op.startswith("call_") and n.name in graph and n.name not in split
                and block_of(graph[n.name].module_path) in blocks)

    seeds = [u for r in rows for u in by_name[r].users if u.name not in split]
    seeds += [n for c in columns for n in by_name[c].all_input_nodes if in_blocks(n)]
    stream: set[fx.Node] = set()
    todo = [n for n in seeds if in_blocks(n)]
    while todo:
        x = todo.pop()
        if x in stream:
            continue
        stream.add(x)
        todo.extend(y for y in (*x.users, *x.all_input_nodes) if in_blocks(y) and y not in stream)
    first_row = by_name[min(rows, key=lambda r: nodes.index(by_name[r]))]
    seq = graph[first_row.name].output_shapes[0][SEQUENCE_DIM]
    if seq % degree:
        raise refuse(f"the sequence ({seq} tokens, dimension {SEQUENCE_DIM} of "
                     f"{first_row.name}'s output) does not split into {degree} equal shards")
    entries: set[fx.Node] = set()
    exits: set[fx.Node] = set()
    modules: list[str] = []
    gathers: list[str] = []
    for x in sorted(stream, key=nodes.index):
        shapes = graph[x.name].output_shapes
        if len(shapes) != 1 or len(shapes[0]) < 2 or shapes[0][SEQUENCE_DIM] != seq:
            raise refuse(f"{x.name} on the residual stream has output shapes {list(shapes)}, "
                         f"not one [batch, {seq}, ...]")
        _check_tokenwise(graph, gm, x, refuse)
        if x.op == "call_module" and any(True for _ in gm.get_submodule(x.target).parameters()):
            modules.append(x.name)
        to_cols = [u for u in x.users if u.name in columns]
        if to_cols:
            if x.op != "call_module" or len(to_cols) != len(x.users):
                raise refuse(f"{x.name} feeds the columns {[u.name for u in to_cols]} but is "
                             "not a module whose output only they read")
            gathers.append(x.name)
            continue
        inside = [u for u in x.users if u.name in split]
        if inside:
            raise refuse(f"{x.name} on the residual stream feeds {inside[0].name} inside a "
                         "tensor-parallel unit other than through its columns")
        out = [u for u in x.users if u not in stream]
        if out:
            if len(out) != len(x.users):
                raise refuse(f"{x.name} feeds both the stream and {out[0].name} outside it")
            exits.add(x)
        for a in x.all_input_nodes:
            if a in stream or a.name in rows:
                continue
            if not a.op.startswith("call_") or a.name not in graph:
                raise refuse(f"{x.name} on the residual stream reads {a.name} ({a.op}), "
                             "which is not an op's output the executor can scatter")
            if any(u not in stream for u in a.users):
                raise refuse(f"{a.name} feeds the residual stream ({x.name}) and ops outside it")
            ashape = graph[a.name].output_shapes
            if len(ashape) != 1 or len(ashape[0]) < 2 or ashape[0][SEQUENCE_DIM] != seq:
                raise refuse(f"{a.name} enters the residual stream with shapes {list(ashape)}, "
                             f"not [batch, {seq}, ...]")
            entries.add(a)
    for r in rows:
        bad = [u.name for u in by_name[r].users if u not in stream]
        if bad:
            raise refuse(f"the row {r}'s output reaches {bad[0]} outside the residual stream")
    for name in (*modules, *(e.name for e in entries if e.op == "call_module")):
        target = by_name[name].target
        if sum(1 for n in nodes if n.op == "call_module" and n.target == target) > 1:
            raise refuse(f"module {target!r} is called more than once")
    order = nodes.index
    return SequenceShards(
        seq_len=int(seq), stream=tuple(n.name for n in sorted(stream, key=order)),
        entries=tuple(n.name for n in sorted(entries, key=order)),
        exits=tuple(n.name for n in sorted(exits, key=order)),
        modules=tuple(modules), gathers=tuple(gathers))


def _check_tokenwise(graph: OpGraph, gm: fx.GraphModule, x: fx.Node, refuse) -> None:
    if x.op == "call_module":
        mod = gm.get_submodule(x.target)
        if not isinstance(mod, _TOKENWISE):
            raise refuse(f"{x.name} ({type(mod).__name__}) on the residual stream is not a "
                         "module known to act on each token alone")
        return
    name = op_name(x)
    if name in _REDUCTIONS and x.args and isinstance(x.args[0], fx.Node) \
            and x.args[0].name in graph:
        dim, ndim = dim_arg(x, 1), len(graph[x.args[0].name].output_shapes[0])
        if dim is not None and dim % ndim > SEQUENCE_DIM:
            return
    if name not in _ELEMENTWISE:
        raise refuse(f"{x.name} ({name}) on the residual stream is not an elementwise op")
