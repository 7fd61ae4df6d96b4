"""Attention masks an exported graph builds from shapes alone, given back to the kernel as
``is_causal``.

A model run eagerly often skips its causal mask: Hugging Face's mask helpers return no
mask where the batch is unpadded and causal, and ``scaled_dot_product_attention`` runs
with ``is_causal=True``, which lets it pick FlashAttention. Traced by ``torch.export``,
the same helpers cannot take that data-dependent shortcut, and the graph builds the
``[B, 1, S, S]`` mask from ``arange`` s and the inputs' sizes and passes it to the kernel:
the mask rules FlashAttention out, so the graph trains with a slower kernel than the model
it came from (a 12-layer Llama at sequence 1024 on one H200: 125.5 against 117.2 ms a
step by hand, docs/executor.md).

:func:`causal_from_shapes` finds each ``scaled_dot_product_attention`` whose mask depends
on no tensor's values (only on ``arange`` s, constants and inputs' sizes), computes it at
two batch sizes, and where it is the causal mask (query and key lengths equal) or masks
nothing, replaces it with ``is_causal=True`` or no mask; the mask's ops that nothing else
uses leave the graph. A mask that depends on data (a padding mask input) or is anything
else is left as it is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

__all__ = ["causal_from_shapes"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: batch sizes the mask is computed at (a dynamic batch dimension takes each)
_BATCHES = (2, 3)
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


def _compute(nodes: list[fx.Node], batch: int) -> Any:
    """The last of ``nodes`` computed on the CPU, dynamic sizes taken as ``batch``."""
    env: dict[fx.Node, Any] = {}
    cpu = torch.device("cpu")
    for node in nodes:
        if node.target is torch.ops.aten.sym_size.int:
            env[node] = _size(node, batch)
            continue
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = dict(fx.node.map_arg(node.kwargs, env.__getitem__))
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


def _drop_unused(nodes: list[fx.Node]) -> None:
    graph = nodes[-1].graph
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)


def causal_from_shapes(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (and the graph modules inside it) as the module docstring says;
    returns how many attention calls lost their mask."""
    done = 0
    found: dict[tuple, set] = {}  # a mask's kinds, for the calls sharing it
    for mod in (m for m in gm.modules() if isinstance(m, fx.GraphModule)):
        changed = False
        for node in list(mod.graph.nodes):
            if node.op != "call_function" or node.target is not _SDPA:
                continue
            mask = _arg(node, 3, "attn_mask")
            if not isinstance(mask, fx.Node) or _arg(node, 5, "is_causal", False):
                continue
            lengths = _lengths(node)
            nodes = _mask_nodes(mask) if lengths else None
            if nodes is None:
                continue
            if (mask, lengths) not in found:
                try:
                    with torch.no_grad():
                        found[mask, lengths] = {_kind(_compute(nodes, b), *lengths)
                                                for b in _BATCHES}
                except Exception:  # an op this cannot run on the CPU: leave the mask
                    found[mask, lengths] = {None}
            kinds = found[mask, lengths]
            if len(kinds) != 1 or None in kinds:
                continue
            _rewrite(node, next(iter(kinds)))
            _drop_unused(nodes)
            changed = True
            done += 1
        if changed:
            mod.graph.lint()
            mod.recompile()
    return done
