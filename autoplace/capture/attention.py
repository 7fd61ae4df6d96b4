"""Attention as the model ran it eagerly: masks an exported graph builds from shapes alone
given back to the kernel as ``is_causal``, and keys and values repeated per head given
back as grouped-query attention.

A model run eagerly often skips its causal mask: Hugging Face's mask helpers return no
mask where the batch is unpadded and causal, and ``scaled_dot_product_attention`` runs
with ``is_causal=True``, which lets it pick FlashAttention. Traced by ``torch.export``,
the same helpers cannot take that data-dependent shortcut, and the graph builds the
``[B, 1, S, S]`` mask from ``arange`` s and the inputs' sizes and passes it to the kernel:
the mask rules FlashAttention out, so the graph trains with a slower kernel than the model
it came from (a 12-layer Llama at sequence 1024 on one H200: 125.5 against 117.2 ms a
step by hand, docs/executor.md).

:func:`causal_from_shapes` finds each ``scaled_dot_product_attention`` whose mask depends
on no tensor's values (only on ``arange`` s, constants and inputs' sizes), computes it on
the CPU at two batch sizes (a sequence up to 16,384: a longer one's mask stays rather than
be computed), and where it is the causal mask (query and key lengths equal) or masks
nothing, replaces it with ``is_causal=True`` or no mask; the mask's ops that nothing else
uses leave the graph. A mask that depends on data (a padding mask input) or is anything
else is left as it is.

The same helpers pick grouped-query attention by whether a mask is given: with no mask
the kernel gets the key and value heads as they are and ``enable_gqa=True``; with one
(the exported graph's) they are first repeated to the query's heads (``repeat_kv``:
unsqueeze, expand, reshape), and attention saves for backward keys and values as many
times larger (a 12-layer Llama with 16 query and 4 key/value heads: 0.5 GiB more at seq
1024, batch 8). :func:`causal_from_shapes` also finds each attention whose key and value
are such repeats of the same count, checks it by computing the views on random tensors of
the source's shape at two batch sizes against ``repeat_interleave``, and passes the
sources with ``enable_gqa=True``, where the call is left without a mask (grouped with a
mask, attention has no fused kernel and runs as the math one). A tiling (heads repeated
as a block) is not grouped-query attention and stays.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

__all__ = ["causal_from_shapes"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: batch sizes the mask is computed at (a dynamic batch dimension takes each)
_BATCHES = (1, 2)
#: the most elements a mask (or a repeated key) is computed with, at the larger batch:
#: 2^29, a mask's sequence of 16,384; a larger one is left in the graph
_MAX_MASK = 2**29
#: plain functions a shape computation may call besides aten ops
_SCALAR_FUNCTIONS = (operator.add, operator.sub, operator.mul, operator.floordiv,
                     operator.getitem, operator.neg)


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _mask_nodes(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes computing ``mask``, in graph order, where they read no tensor's values:
    every leaf is a constant or an input's size (``aten.sym_size``); None otherwise."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            return None  # a tensor input read for its values
        if node.op != "call_function":
            return None  # parameters, buffers, submodules: values the mask may depend on
        if node.target is torch.ops.aten.sym_size.int:
            if node.args[0].op != "placeholder":
                return None
            continue  # an input's size: its values are not read
        if not (isinstance(node.target, torch._ops.OpOverload)
                or node.target in _SCALAR_FUNCTIONS):
            return None
        if isinstance(node.target, torch._ops.OpOverload) and (
                node.target._schema.is_mutable
                or torch.Tag.nondeterministic_seeded in node.target.tags):
            return None  # in-place or random: not a function of shapes
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _size(node: fx.Node, batch: int) -> int:
    """``aten.sym_size.int(input, dim)`` with a dynamic dimension taken as ``batch``."""
    val = node.args[0].meta.get("val")
    if val is None:
        raise ValueError("an input without its example value")
    s = val.shape[node.args[1]]
    return int(s) if isinstance(s, int) else batch


def _compute(nodes: list[fx.Node], batch: int, env: dict[fx.Node, Any] | None = None) -> Any:
    """The last of ``nodes`` computed on the CPU, dynamic sizes taken as ``batch``, from
    the values ``env`` gives (an input's size is read where an argument needs it)."""
    env = dict(env or {})
    cpu = torch.device("cpu")

    def value(n: fx.Node) -> Any:
        if n not in env and n.target is torch.ops.aten.sym_size.int:
            env[n] = _size(n, batch)
        return env[n]

    for node in nodes:
        if node.target is torch.ops.aten.sym_size.int:
            env[node] = _size(node, batch)
            continue
        args = fx.node.map_arg(node.args, value)
        kwargs = dict(fx.node.map_arg(node.kwargs, value))
        if "device" in kwargs:
            kwargs["device"] = cpu
        env[node] = node.target(*args, **kwargs)
    return env[nodes[-1]]


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """Where ``mask`` lets attention through (bool), or None for a float mask with other
    values than 0 and the lowest its dtype holds (an additive bias)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    lowest = torch.finfo(mask.dtype).min
    if not bool(((mask == 0) | (mask <= lowest)).all()):
        return None
    return mask == 0


def _kind(mask: Any, q_len: int, k_len: int) -> str | None:
    """``"none"`` where ``mask`` masks nothing, ``"causal"`` where it is
    ``scaled_dot_product_attention``'s causal mask for every batch row and head, None
    otherwise."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 \
            or tuple(mask.shape[-2:]) not in ((q_len, k_len), (1, k_len), (q_len, 1), (1, 1)):
        return None
    allowed = _allowed(mask)
    if allowed is None:
        return None
    allowed = allowed.expand(*allowed.shape[:-2], q_len, k_len)
    if bool(allowed.all()):
        return "none"
    if q_len == k_len:
        causal = torch.ones(q_len, k_len, dtype=torch.bool).tril()
        if bool((allowed == causal).all()):
            return "causal"
    return None


def _lengths(node: fx.Node) -> tuple[int, int] | None:
    q, k = (getattr(a, "meta", {}).get("val") for a in node.args[:2])
    if q is None or k is None:
        return None
    sq, sk = q.shape[-2], k.shape[-2]
    if not (isinstance(sq, int) and isinstance(sk, int)):
        return None
    return sq, sk


def _rewrite(node: fx.Node, kind: str) -> None:
    args = list(node.args)
    kwargs = dict(node.kwargs)
    for index, name, value in ((3, "attn_mask", None), (5, "is_causal", kind == "causal")):
        if len(args) > index:
            args[index] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


#: ops that move or view a tensor's elements without computing new ones: a head repeat
#: (``repeat_kv``: unsqueeze, expand, reshape) is made of these
_VIEWS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.slice.Tensor,
          torch.ops.aten.clone.default, torch.ops.aten.contiguous.default)


def _example(val: Any, batch: int) -> torch.Tensor | None:
    """A random CPU tensor of ``val`` 's shape and dtype, a dynamic size taken as ``batch``."""
    shape = [int(s) if isinstance(s, int) else batch for s in val.shape]
    if not val.is_floating_point():
        return None
    return torch.randn(shape, dtype=torch.float32).to(val.dtype)


def _repeated_heads(node: Any) -> tuple[fx.Node, list[fx.Node], int] | None:
    """``(source, chain, n)`` where ``node`` is ``source`` [B, H, S, D] with its heads
    repeated ``n`` times each (``repeat_interleave(n, dim=1)``, what
    ``scaled_dot_product_attention(enable_gqa=True)`` does itself) through the view-like
    ops ``chain``; checked by computing the chain at two batch sizes. None otherwise."""
    if not isinstance(node, fx.Node):
        return None
    out = node.meta.get("val")
    if out is None or out.dim() != 4 or not all(isinstance(s, int) for s in out.shape[1:]) \
            or max(_BATCHES) * out.shape[1] * out.shape[2] * out.shape[3] > _MAX_MASK:
        return None  # too large to check on the CPU: the repeat stays
    chain: list[fx.Node] = []
    x = node
    while x.op == "call_function" and x.target in _VIEWS and isinstance(x.args[0], fx.Node):
        chain.append(x)
        x = x.args[0]
        val = x.meta.get("val")
        if val is None or val.dim() != 4 or not isinstance(val.shape[1], int) \
                or val.shape[1] >= out.shape[1] or out.shape[1] % val.shape[1]:
            continue
        n = out.shape[1] // val.shape[1]
        try:
            same = True
            for b in _BATCHES:
                src = _example(val, b)
                if src is None:
                    return None
                got = _compute(list(reversed(chain)), b, {x: src})
                same &= tuple(got.shape) == (src.shape[0], out.shape[1], *src.shape[2:]) \
                    and bool((got == src.repeat_interleave(n, dim=1)).all())
        except Exception:  # a view this cannot run: not a repeat it can tell
            return None
        if same:
            return x, chain, n
    return None


def _grouped_query(node: fx.Node) -> int:
    """Give ``node`` (an attention call) its key and value before their heads were
    repeated, with ``enable_gqa=True``, where both are repeats of the same count and the
    call does not group already; returns 1 where it did, else 0."""
    if node.kwargs.get("enable_gqa", False):
        return 0
    found = [_repeated_heads(a) for a in node.args[1:3]]
    if None in found or found[0][2] != found[1][2]:
        return 0
    node.args = (node.args[0], found[0][0], found[1][0], *node.args[3:])
    node.kwargs = {**node.kwargs, "enable_gqa": True}
    for _, chain, _ in found:
        _drop_unused(list(reversed(chain)))
    return 1


def _drop_unused(nodes: list[fx.Node]) -> None:
    graph = nodes[-1].graph
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)


def _unmask(node: fx.Node, found: dict[tuple, set]) -> bool:
    """Drop ``node`` 's mask where it is causal or masks nothing (see the module docstring);
    ``found`` keeps each mask's verdict for the calls sharing it. Whether it did."""
    mask = _arg(node, 3, "attn_mask")
    if not isinstance(mask, fx.Node) or _arg(node, 5, "is_causal", False):
        return False
    lengths = _lengths(node)
    if lengths is None or lengths[0] * lengths[1] * max(_BATCHES) > _MAX_MASK:
        return False
    nodes = _mask_nodes(mask)
    if nodes is None:
        return False
    if (mask, lengths) not in found:
        try:
            with torch.no_grad():
                found[mask, lengths] = {_kind(_compute(nodes, b), *lengths) for b in _BATCHES}
        except Exception:  # an op this cannot run on the CPU: leave the mask
            found[mask, lengths] = {None}
    kinds = found[mask, lengths]
    if len(kinds) != 1 or None in kinds:
        return False
    _rewrite(node, next(iter(kinds)))
    _drop_unused(nodes)
    return True


def causal_from_shapes(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (and the graph modules inside it) as the module docstring says;
    returns how many attention calls lost their mask (a call given grouped-query attention
    is not counted). Keys and values are grouped only for a call left without a mask:
    with one, grouped-query attention has no fused kernel and runs as the math one."""
    done = 0
    found: dict[tuple, set] = {}
    for mod in (m for m in gm.modules() if isinstance(m, fx.GraphModule)):
        changed = False
        for node in list(mod.graph.nodes):
            if node.op != "call_function" or node.target is not _SDPA:
                continue
            if _unmask(node, found):
                changed = True
                done += 1
            if _arg(node, 3, "attn_mask") is None and _grouped_query(node):
                changed = True
        if changed:
            mod.graph.lint()
            mod.recompile()
    return done
