"""Memory of a workload's loss, which the captured graph does not hold."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplace.capture.program import model_output
from autoplace.graph import OpGraph

__all__ = ["loss_workspace_bytes"]


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors alive at once among those created under the mode."""

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.live = self.peak = start

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place op: no new memory
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                n = t.numel() * t.element_size()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out


def loss_workspace_bytes(workload: Any, graph: OpGraph, batch_size: int) -> int:
    """Peak memory of the workload's loss, forward and backward, on the model's output.

    The loss is not part of the captured graph, but it is often the largest transient
    of a step: a cross-entropy over a large vocabulary keeps a float32 log-softmax as
    large as the logits and makes a gradient as large again (gpt-1b: 1.5 GiB of
    logits in bf16 and 3.8 GiB at the loss's peak). Runs the loss on ``meta`` tensors
    shaped like the output (floating ones in float32: autocast runs losses in float32)
    under a dispatch mode that counts the bytes alive at once, starting from the
    output's own bytes as the model made it. 0 when the loss cannot run on ``meta``.
    """
    gm = graph.module
    node = next(n for n in gm.graph.nodes if n.op == "output")
    ops = {op.name: op for op in graph}
    leaves: list[torch.Tensor] = []
    held: list[int] = []

    def fake(a: fx.Node) -> Any:
        op = ops.get(a.name)
        if op is None or not op.output_shapes:
            raise ValueError(f"no shape for {a.name}")
        ts = []
        for shape, dt in zip(op.output_shapes, op.output_dtypes):
            dtype = getattr(torch, dt)
            if dtype.is_floating_point:
                t = torch.empty(shape, dtype=torch.float32, device="meta", requires_grad=True)
                leaves.append(t)
                held.append(t.numel() * dtype.itemsize)  # the output as the model made it
            else:
                t = torch.empty(shape, dtype=dtype, device="meta")
            ts.append(t)
        return ts[0] if len(ts) == 1 else tuple(ts)

    try:
        output = model_output(gm, fx.map_arg(node.args[0], fake))
        with torch.random.fork_rng(devices=[]):
            _, target = workload.make_batch(batch_size, "cpu")
        target = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), target)
        mode = _LiveBytes(sum(held))
        with mode:
            loss = workload.loss_fn(output, target)
            if leaves and loss.requires_grad:
                loss.backward()
        return int(mode.peak)
    except Exception:  # a loss that cannot run on meta: its memory stays unmodelled
        return 0
