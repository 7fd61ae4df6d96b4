"""Moving values and parameters between the devices of a one-process placement: edges'
copies (plain, or on side streams that skip PyTorch's two-way barrier), module calls on
moved parameters, and each parameter's home device."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autoplace.capture import fetch_attr

__all__ = ["COPY_STREAMS_ENV", "copy_streams_from_env", "move_to", "move_to_streamed",
           "place_parameters", "reflatten_rnns"]


_META_METHODS = {"size", "dim", "numel", "ndimension", "get_device", "element_size"}

_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}


def _is_meta_op(node: fx.Node) -> bool:
    """Ops that read only tensor metadata: they run where their input is, nothing moves."""
    if node.op == "call_method" and node.target in _META_METHODS:
        return True
    return (node.op == "call_function" and node.target is getattr and len(node.args) > 1
            and node.args[1] in _META_ATTRS)


def move_to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device`` (non-tensors unchanged)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


#: ``AUTOPLACE_COPY_STREAMS=1``: cross-GPU edges use :func:`move_to_streamed` (experimental,
#: not yet measured on GPUs; read by :func:`build_local` when ``copy_streams`` is None)
COPY_STREAMS_ENV = "AUTOPLACE_COPY_STREAMS"

_side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _copy_streamed(x: torch.Tensor, dst: torch.device) -> torch.Tensor:
    """``x.to(dst)`` without PyTorch's two-way barrier between the devices' streams.

    A cross-device ``copy_`` runs on the source device's current stream after making it
    wait for everything queued on the destination's current stream (ATen's
    ``copy_device_to_device``), so in a one-process placement every edge makes the
    sending GPU wait for the receiving GPU's whole queue. Here the destination's current
    stream is, during the copy, a side stream of its own per (source, destination)
    pair, which holds only copies: the source waits for nothing but earlier copies on
    that pair; the destination's compute stream then waits for the side stream, and the
    new tensor is marked as used by it so the allocator does not reuse its memory early.
    """
    src = x.device
    if src.type != "cuda" or dst.type != "cuda" or src == dst:
        return x.to(dst, non_blocking=True)
    key = (src.index, dst.index)
    side = _side_streams.get(key)
    if side is None:
        side = _side_streams[key] = torch.cuda.Stream(device=dst)
    main = torch.cuda.current_stream(dst)
    with torch.cuda.stream(side):
        y = x.to(dst, non_blocking=True)
    main.wait_stream(side)
    y.record_stream(main)
    return y


class _CopyTo(torch.autograd.Function):
    """A differentiable :func:`_copy_streamed`: the gradient goes back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dst: torch.device) -> torch.Tensor:
        ctx.src = x.device
        y = _copy_streamed(x, dst)
        return x.view_as(x) if y is x else y  # a Function returns a new tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _copy_streamed(grad, ctx.src), None


def copy_streams_from_env() -> bool:
    """Whether the environment asks for streamed copies (``AUTOPLACE_COPY_STREAMS=1``)."""
    return os.environ.get(COPY_STREAMS_ENV, "0") == "1"


def move_to_streamed(value: Any, device: torch.device) -> Any:
    """:func:`move_to` whose GPU-to-GPU copies skip the two-way stream barrier
    (:func:`_copy_streamed`), forward and backward."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t if t.device == device else _CopyTo.apply(t, device), value)


def _call_module_on(module: nn.Module, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` with its parameters and buffers moved to ``device`` (grads flow back)."""
    moved = {n: t.to(device) for n, t in module.named_parameters()}
    moved.update({n: t.to(device) for n, t in module.named_buffers()})
    return torch.func.functional_call(module, moved, args, kwargs)


def _param_homes(gm: fx.GraphModule, dev_of: dict[str, int]) -> dict[int, int]:
    """id(parameter or buffer) -> local device of the first op that uses it."""
    homes: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        obj = fetch_attr(gm, node.target)
        tensors = ([*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module)
                   else [obj] if isinstance(obj, torch.Tensor) else [])
        for t in tensors:
            homes.setdefault(id(t), dev_of[node.name])
    return homes


def place_parameters(gm: fx.GraphModule, homes: dict[int, int],
                     devices: list[torch.device]) -> None:
    """Move every parameter and buffer of ``gm`` to its home device (unused: device 0).

    Parameters move one at a time (``p.data``, so optimizers and hooks keep the same
    objects); a recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) that moved is
    re-flattened afterwards (:func:`reflatten_rnns`), as ``Module.to`` does."""
    moved: set[int] = set()
    for mod in gm.modules():
        for p in list(mod._parameters.values()):
            if p is not None:
                dev = devices[homes.get(id(p), 0)]
                if p.device != dev:
                    p.data = p.data.to(dev)
                    moved.add(id(mod))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                dev = devices[homes.get(id(b), 0)]
                if b.device != dev:
                    new = b.to(dev)
                    homes[id(new)] = homes.get(id(b), 0)
                    mod._buffers[name] = new
    for node in gm.graph.nodes:  # plain tensor attributes (fx constants)
        if node.op == "get_attr":
            obj = fetch_attr(gm, node.target)
            if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
                dev = devices[homes.get(id(obj), 0)]
                if obj.device != dev:
                    *path, last = node.target.split(".")
                    owner = fetch_attr(gm, ".".join(path)) if path else gm
                    new = obj.to(dev)
                    homes[id(new)] = homes.get(id(obj), 0)
                    setattr(owner, last, new)
    reflatten_rnns(m for m in gm.modules() if id(m) in moved)


def reflatten_rnns(modules: Iterable[nn.Module]) -> int:
    """Re-pack the weights of each recurrent module among ``modules`` whose weights all
    sit on one CUDA device into cuDNN's single flat buffer (``flatten_parameters()``);
    returns how many were packed.

    Moved one parameter at a time, an LSTM's weights no longer share that buffer: cuDNN
    then warns that they "need to be compacted at every call" and copies them at every
    forward, in time and in memory kept for backward. ``Module.to`` re-flattens
    (``RNNBase._apply``); moving ``p.data`` does not. Off CUDA a no-op."""
    n = 0
    for mod in modules:
        if not isinstance(mod, nn.RNNBase):
            continue
        # the list the module packs may be stale: tracing leaves the fake tensors it ran
        # on there until the next forward; Module.to refreshes it the same way
        mod._init_flat_weights()
        ws = [w for w in mod._flat_weights if isinstance(w, torch.Tensor)]
        if not ws or ws[0].device.type != "cuda" or any(w.device != ws[0].device for w in ws):
            continue
        mod.flatten_parameters()
        n += 1
    return n
