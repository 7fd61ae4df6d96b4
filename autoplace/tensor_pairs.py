"""The pair rule: which Linears of a captured graph tensor parallelism splits together.

One rule, from the captured graph's structure and module paths alone (no model-specific
code). A *pair unit* is a set of column Linears (their output features split over the
tensor group: q / k / v or a fused qkv, an MLP's up and gate) whose outputs flow, through
ops that are not Linears, only into a set of row Linears (their input features split: an
attention's output projection, an MLP's down projection), every op of the flow inside one
block (a module path with an integer index: a transformer block). The ops in between run
on each rank's shard unchanged, so the rule follows the split dimension through them and
accepts only ops that keep it whole:

* elementwise ops (activations, products of two sharded values, broadcasts whose other
  operand has size 1 or nothing along the split dimension);
* views that split or merge the dimension (``unflatten(-1, (3, H, Dh))``,
  ``view(B, T, H, Dh)``, ``flatten(2)``): the shard follows the first factor the degree
  divides, which must be the outermost unless it is read straight off a column's output
  (then that column's rows are regrouped, rank by rank, so each rank's contiguous shard
  holds its heads of q, k and v: :attr:`TensorPair.regroup`);
* grouped-query attention's key / value heads repeated for the query heads
  (``unsqueeze`` + ``expand`` + ``flatten``, ``repeat_interleave``): the kv heads split by
  the degree (which must divide them), each rank's q heads reading its own kv heads;
  ``stack`` of split values (a rotary embedding's pairs);
* permutes, transposes, indexing on other dimensions, attention
  (``scaled_dot_product_attention``, ``matmul``) with the dimension among its batch
  dimensions, softmax / dropout over other dimensions, parameter-free modules, and
  modules with parameters (a per-head norm) that act on the last dimension only when
  it is not the split one.

Anything else ends the unit's search without a split: the Linears stay whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch.fx as fx
from torch import nn

from autoplace.errors import PlanError
from autoplace.graph import OpGraph
from autoplace.tensor_dims import (
    ATTENTION,
    DIM_OPS,
    INSERT_DIM,
    SAME,
    VIEWS,
    Unsplittable,
    as_int,
    block_of,
    dim_arg,
    expand_dim,
    index_dim,
    inserted_dim,
    op_name,
    permute_dim,
    view_group,
)

__all__ = ["PairFinder", "TensorPair"]


@dataclass(frozen=True)
class TensorPair:
    """One unit of column Linears, the ops they feed, and the row Linears that end it.

    Attributes:
        block: the block (module path up to its integer index) that holds the unit.
        columns: op names of the Linears split by output feature (``ColwiseParallel``).
        rows: op names of the Linears split by input feature (``RowwiseParallel``).
        inner: the ops between, run on each rank's shard.
        reshapes: ``(op, dim)``: a view among ``inner`` whose output dimension ``dim`` is the
            split one (its size argument there is the global size: the executor rewrites it).
        regroup: ``(column op, outer, mid, inner)``: the column's output features, read as
            ``[outer, mid, inner]``, are split along ``mid`` (a fused qkv: ``[3, H, Dh]``):
            the executor reorders its rows to ``[rank, outer, mid / degree, inner]``.
        split_sizes: the sizes the degree must divide (features, heads).
    """

    block: str
    columns: tuple[str, ...]
    rows: tuple[str, ...]
    inner: tuple[str, ...]
    reshapes: tuple[tuple[str, int], ...] = ()
    regroup: tuple[tuple[str, int, int, int], ...] = ()
    split_sizes: tuple[int, ...] = ()




def _module(gm: fx.GraphModule, target: str) -> nn.Module:
    return gm.get_submodule(target)


class PairFinder:
    """Grows pair units from each Linear of a block (one walk per candidate)."""

    def __init__(self, graph: OpGraph, gm: fx.GraphModule, degree: int) -> None:
        self.graph, self.gm, self.t = graph, gm, degree
        self.nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        uses: dict[str, int] = {}
        for op in graph.ops:
            for p in op.param_names:
                uses[p] = uses.get(p, 0) + 1
        self.linear = {
            n for n in self.nodes if n.op == "call_module"
            and isinstance(_module(gm, n.target), nn.Linear) and n.name in graph
            and block_of(graph[n.name].module_path)
            and all(uses[p] == 1 for p in graph[n.name].param_names)}
        self.why = ""

    def shape(self, n: fx.Node) -> tuple[int, ...] | None:
        if n.name not in self.graph:
            return None
        shapes = self.graph[n.name].output_shapes
        return tuple(shapes[0]) if len(shapes) == 1 else None

    def pairs(self) -> list[TensorPair]:
        out: list[TensorPair] = []
        taken: set[fx.Node] = set()
        for c in self.nodes:
            if c not in self.linear or c in taken:
                continue
            try:
                pair = self._grow({c})
            except Unsplittable as e:
                self.why = self.why or f"{c.name}: {e}"
                continue
            if pair is None:
                continue
            taken.update(n for n in self.nodes if n.name in (*pair.columns, *pair.rows))
            out.append(pair)
        return out

    def _grow(self, seeds: set[fx.Node]) -> TensorPair | None:
        """Walk from ``seeds``, adding sibling columns, and backtracking over which factor
        of a view carries the split (the first that works: heads, not the head size)."""
        choices: dict[str, int] = {}
        while True:
            made: list[tuple[str, int]] = []  # (view, number of candidates), in walk order
            try:
                res = self._walk(seeds, choices, made)
            except Unsplittable:
                while made and choices.get(made[-1][0], 0) + 1 >= made[-1][1]:
                    choices.pop(made.pop()[0], None)
                if not made:
                    raise
                choices[made[-1][0]] = choices.get(made[-1][0], 0) + 1
                continue
            if isinstance(res, set):  # sibling columns found: walk again with them
                seeds = seeds | res
                choices = {}
                continue
            return res

    def _walk(self, seeds: set[fx.Node], choices: dict[str, int], made: list[tuple[str, int]]
              ) -> TensorPair | set[fx.Node] | None:
        block = block_of(self.graph[next(iter(seeds)).name].module_path)
        state: dict[fx.Node, int] = {}   # node -> split dimension of its output
        raw: set[fx.Node] = set()        # nodes whose value is a column's output as it is
        rows: list[fx.Node] = []
        inner: list[fx.Node] = []
        reshapes: list[tuple[str, int]] = []
        regroup: dict[str, tuple[int, int, int]] = {}
        sizes: list[int] = []
        origin: dict[fx.Node, fx.Node] = {}  # raw node -> its column
        for c in seeds:
            shp = self.shape(c)
            if shp is None or block_of(self.graph[c.name].module_path) != block:
                raise Unsplittable("not a single tensor output in the block")
            state[c] = len(shp) - 1
            raw.add(c)
            origin[c] = c
            sizes.append(shp[-1])
        first = min(self.pos[c] for c in seeds)
        for n in self.nodes[first:]:
            if n in seeds or not any(a in state for a in n.all_input_nodes):
                continue
            if n.op == "output" or n.name not in self.graph \
                    or block_of(self.graph[n.name].module_path) != block:
                raise Unsplittable(f"the split values reach {n.name}, outside block {block!r}")
            if n in self.linear:
                (arg,) = n.all_input_nodes
                if state.get(arg) != len(self.shape(arg) or ()) - 1:
                    raise Unsplittable(f"{n.name} reads the split values on another dimension")
                rows.append(n)
                sizes.append(_module(self.gm, n.target).in_features)
                continue
            if n.op == "call_module" and isinstance(_module(self.gm, n.target), nn.Linear):
                raise Unsplittable(f"{n.name} (a Linear with shared parameters or outside "
                                    "a block) reads the split values")
            siblings = self._outside_full(n, state)
            if siblings:
                return siblings
            self.choices, self.made = choices, made
            d, reshape = self._through(n, state, raw, origin, regroup, sizes)
            state[n] = d
            inner.append(n)
            if reshape:
                reshapes.append((n.name, d))
        if not rows:
            return None
        if any(s % self.t for s in sizes):
            raise PlanError(
                f"parallel.tensor={self.t} does not divide the split sizes {sorted(set(sizes))} "
                f"of block {block!r} ({', '.join(sorted(c.name for c in seeds))} -> "
                f"{', '.join(r.name for r in rows)}): use a degree that divides the heads and "
                "the hidden sizes")
        order = sorted(seeds, key=self.pos.__getitem__)
        return TensorPair(block=block, columns=tuple(c.name for c in order),
                          rows=tuple(r.name for r in rows), inner=tuple(n.name for n in inner),
                          reshapes=tuple(reshapes),
                          regroup=tuple((c, *g) for c, g in regroup.items()),
                          split_sizes=tuple(sorted(set(sizes))))

    def _outside_full(self, n: fx.Node, state: dict[fx.Node, int]) -> set[fx.Node]:
        """Linears of the block outside the unit whose outputs meet it at full size along
        the split dimension here (q meeting k): they are columns too."""
        out = set()
        inside = [a for a in n.all_input_nodes if a in state]
        ref = inside[0]
        shp = self.shape(ref)
        for a in n.all_input_nodes:
            if a in state:
                continue
            other = self.shape(a)
            if other is not None and shp is not None and len(other) == len(shp) \
                    and other[state[ref]] == shp[state[ref]] and other[state[ref]] > 1:
                src = self._source_linear(a)
                if src is not None:
                    out.add(src)
        return out

    def _source_linear(self, a: fx.Node) -> fx.Node | None:
        """The one Linear of the block ``a`` is computed from, through ops that are not
        Linears (``k`` of ``q @ k.transpose(-2, -1)``, a rotary-embedded ``k``), or None
        where no Linear or several are."""
        block = block_of(self.graph[a.name].module_path) if a.name in self.graph else ""
        found: set[fx.Node] = set()
        seen: set[fx.Node] = set()
        todo = [a]
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in self.linear:
                found.add(x)
                continue
            if x.name not in self.graph or block_of(self.graph[x.name].module_path) != block:
                continue  # constants and tables from outside the block: no source
            if x.op == "call_module" and any(True for _ in _module(self.gm, x.target).parameters()):
                return None
            todo.extend(x.all_input_nodes)
        return next(iter(found)) if len(found) == 1 else None

    def _through(self, n: fx.Node, state: dict[fx.Node, int], raw: set[fx.Node],
                 origin: dict[fx.Node, fx.Node], regroup: dict[str, tuple[int, int, int]],
                 sizes: list[int]) -> tuple[int, bool]:
        """The split dimension of ``n``'s output, and whether ``n`` is a view whose size
        arguments name it; raises :class:`Unsplittable` for an op that does not keep it."""
        name = op_name(n)
        ins = [a for a in n.all_input_nodes if a in state]
        x = ins[0]
        d = state[x]
        sin, sout = self.shape(x), self.shape(n)
        if sin is None or sout is None:
            raise Unsplittable(f"{n.name} has no single tensor output")
        if any(state[a] != d or self.shape(a) != sin for a in ins[1:]) and name not in ATTENTION:
            raise Unsplittable(f"{n.name} combines split values of different layouts")
        if name in VIEWS:
            return self._view(n, x, d, sin, sout, raw, origin, regroup, sizes), True
        if name in INSERT_DIM:  # unsqueeze; stack of split values (a rotary's pairs)
            if name == "stack" and not all(a in state for a in n.all_input_nodes):
                raise Unsplittable(f"{n.name} stacks split values with whole ones")
            return inserted_dim(n, d, len(sin)), False
        if name == "expand":  # grouped-query attention: kv heads repeated for the q heads
            return d, expand_dim(n, d, sin, sout)
        if name == "repeat_interleave":
            if dim_arg(n, 2) is None or as_int(n.args[1] if len(n.args) > 1 else None) is None:
                raise Unsplittable(f"{n.name}: repeat_interleave without an integer count "
                                   "and dimension")
            return d, False  # each shard's heads repeated in place: the q heads' order
        if name == "getitem":
            return index_dim(n, d, len(sin)), False
        if name in ("permute", "transpose", "swapaxes"):
            return permute_dim(n, d, len(sin)), False
        if name in ATTENTION:
            if any(state.get(a) != d for a in n.args[:2] if isinstance(a, fx.Node)) \
                    or d >= len(sout) - 2 or sout[d] != sin[d]:
                raise Unsplittable(f"{n.name}: attention split on a non-batch dimension")
            self._broadcast_ok(n, state, d, sout)
            if name == "scaled_dot_product_attention":
                for a in n.args[:3]:
                    if not (isinstance(a, fx.Node) and a in state):
                        raise Unsplittable(f"{n.name}: q, k and v are not all split")
            return d, False
        if name in DIM_OPS:
            dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
            if dim is None or int(dim) % len(sin) == d:
                raise Unsplittable(f"{n.name} reduces over the split dimension")
        if n.op == "call_module":
            mod = _module(self.gm, n.target)
            if any(True for _ in mod.parameters()) and d == len(sin) - 1:
                raise Unsplittable(f"{n.name} (a module with parameters) acts on the split "
                                    "dimension")
        if sout != sin:
            raise Unsplittable(f"{n.name} ({name}) changes the shape of the split values")
        self._broadcast_ok(n, state, d, sout)
        if x in raw and name in SAME:
            raw.add(n)
            origin[n] = origin[x]
        return d, False

    def _broadcast_ok(self, n: fx.Node, state: dict[fx.Node, int], d: int,
                      sout: tuple[int, ...]) -> None:
        for a in n.all_input_nodes:
            if a in state:
                continue
            shp = self.shape(a)
            if shp is None:
                continue
            k = len(shp) - (len(sout) - d)  # a's dimension aligned with the split one
            if 0 <= k < len(shp) and shp[k] != 1:
                raise Unsplittable(f"{n.name} reads {a.name}, whole along the split dimension")

    def _view(self, n: fx.Node, x: fx.Node, d: int, sin: tuple[int, ...], sout: tuple[int, ...],
              raw: set[fx.Node], origin: dict[fx.Node, fx.Node],
              regroup: dict[str, tuple[int, int, int]], sizes: list[int]) -> int:
        a, b, c, e = view_group(sin, sout, d)
        if d != a:
            raise Unsplittable(f"{n.name} merges the split dimension under an outer one")
        cands = [i for i in range(c, e + 1) if sout[i] > 1]
        if not cands:
            raise Unsplittable(f"{n.name} leaves the split dimension no factor")
        self.made.append((n.name, len(cands)))
        i = cands[min(self.choices.get(n.name, 0), len(cands) - 1)]
        if i > c:
            if x not in raw or a != b:
                raise Unsplittable(f"{n.name} splits the dimension inside an outer factor, "
                                    "past another op")
            col = origin[x]
            regroup[col.name] = (prod(sout[c:i]), sout[i], prod(sout[i + 1:e + 1]))
        sizes.append(sout[i])
        return i


