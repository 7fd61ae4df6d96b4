"""Following one dimension of a tensor through the ops of a captured fx program.

Tensor parallelism (:mod:`autoplace.tensor_shards`) splits a Linear's output features over
a group of ranks and must know, for each op the split values flow through, which output
dimension carries the split, or that the op cannot run on a shard. These helpers answer
that for one op kind each, from the op's arguments and the shapes capture recorded; each
raises :class:`Unsplittable` (with the op and the reason) where the dimension does not
survive.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

__all__ = ["ATTENTION", "DIM_OPS", "INSERT_DIM", "SAME", "VIEWS", "Unsplittable", "as_int",
           "block_of", "dim_arg", "expand_dim", "index_dim", "inserted_dim", "op_name",
           "permute_dim", "view_group"]

#: views: size arguments that split or merge dimensions
VIEWS = {"view", "reshape", "unflatten", "flatten", "view_as", "reshape_as"}
#: ops whose output is their input's values as they are (dtype, layout, dropout)
SAME = {"contiguous", "to", "float", "half", "bfloat16", "type_as", "clone", "dropout"}
#: ops that reduce or normalise over a ``dim`` argument
DIM_OPS = {"softmax", "log_softmax"}
#: attention: batched matrix products whose leading dimensions are batch dimensions
ATTENTION = {"scaled_dot_product_attention", "matmul", "bmm"}
#: ops that insert one dimension at a ``dim`` argument
INSERT_DIM = {"unsqueeze", "stack"}


class Unsplittable(Exception):
    """An op the split dimension does not pass through unchanged (the message says why)."""


def block_of(module_path: str) -> str:
    """A module path up to its first integer index (``"blocks.3.attn.qkv"`` -> ``"blocks.3"``),
    ``""`` outside any block."""
    parts = module_path.split(".") if module_path else []
    cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[:cut + 1]) if cut is not None else ""


def op_name(n: fx.Node) -> str:
    """The op's name: a method's, or a function's ``__name__``."""
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    return n.op


def as_int(v: Any) -> int | None:
    """``v`` if it is a Python int (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def dim_arg(n: fx.Node, pos: int, default: int | None = None) -> int | None:
    """The op's ``dim`` argument (keyword, or positional at ``pos``)."""
    v = n.kwargs.get("dim", n.args[pos] if len(n.args) > pos else default)
    return as_int(v)


def view_group(sin: tuple[int, ...], sout: tuple[int, ...], d: int) -> tuple[int, int, int, int]:
    """Input dims ``a..b`` and output dims ``c..e`` of a view that hold the same elements as
    input dim ``d`` does with its neighbours (equal products, smallest such runs)."""
    i = j = 0
    while i < len(sin) or j < len(sout):
        a, c = i, j
        pi = sin[i] if i < len(sin) else 1
        pj = sout[j] if j < len(sout) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= sin[i]
                i += 1
            else:
                pj *= sout[j]
                j += 1
        if a <= d < i:
            # size-1 output dims ahead of the group's first real factor belong to it
            while c < j - 1 and sout[c] == 1:
                c += 1
            return a, i - 1, c, j - 1
    raise Unsplittable(f"dimension {d} is not in the view's input")


def index_dim(n: fx.Node, d: int, ndim: int) -> int:
    """The split dimension after indexing (``x[0]``, ``x[:, None]``, ``x[..., 1]``)."""
    idx = n.args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(it is Ellipsis for it in items):
        k = items.index(Ellipsis)
        fill = ndim - sum(1 for it in items if it is not None and it is not Ellipsis)
        items = items[:k] + (slice(None),) * fill + items[k + 1:]
    out, src = 0, 0
    for it in items:
        if it is None:
            if src <= d:
                out += 1
            continue
        if src == d:
            if not (isinstance(it, slice) and it == slice(None)):
                raise Unsplittable(f"{n.name} indexes the split dimension")
            return out
        if isinstance(it, slice):
            out += 1
        elif as_int(it) is None:
            raise Unsplittable(f"{n.name}: indexing by {type(it).__name__}")
        src += 1
    return out + (d - src)


def permute_dim(n: fx.Node, d: int, ndim: int) -> int:
    """The split dimension after ``permute`` / ``transpose``."""
    args = list(n.args[1:])
    if op_name(n) == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        return [int(x) % ndim for x in dims].index(d)
    d0 = int(args[0] if args else n.kwargs["dim0"]) % ndim
    d1 = int(args[1] if len(args) > 1 else n.kwargs["dim1"]) % ndim
    return d1 if d == d0 else d0 if d == d1 else d


def inserted_dim(n: fx.Node, d: int, ndim: int) -> int:
    """The split dimension after ``unsqueeze(dim)`` or ``stack(tensors, dim)``: one past
    ``d`` when the new dimension comes at or before it."""
    k = dim_arg(n, 1, 0)
    if k is None:
        raise Unsplittable(f"{n.name}: {op_name(n)} with a dimension computed at run time")
    k %= ndim + 1
    return d + 1 if k <= d else d


def expand_dim(n: fx.Node, d: int, sin: tuple[int, ...], sout: tuple[int, ...]) -> bool:
    """Whether ``expand`` names the split dimension's size explicitly (then the executor
    rewrites it to ``-1``); raises :class:`Unsplittable` where it grows that dimension or
    adds leading ones."""
    if len(sout) != len(sin) or sout[d] != sin[d]:
        raise Unsplittable(f"{n.name} expands the split dimension")
    sizes = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) \
        else n.args[1:]
    return as_int(sizes[d]) != -1 if d < len(sizes) else False
