"""Capture: ``nn.Module`` + example inputs -> :class:`~autoplace.graph.OpGraph`.

Two tracers, tried in order:

1. ``torch.fx`` symbolic tracing with the default tracer: ``torch.nn`` modules
   (``Linear``, ``LSTM``, ``Conv2d``...) stay whole as one ``call_module`` op; user
   modules are traced through. ``graph.module`` is the traced ``GraphModule``; it
   shares every parameter object with the model.
2. ``torch.export.export(strict=False)`` (training IR) when fx fails (control flow,
   shape-dependent Python, Hugging Face models) or its graph does not run. Ops are
   aten ops (``linear``, ``layer_norm``, ``scaled_dot_product_attention``...), each
   with the ``module_path`` of the ``nn.Module`` it came from (``nn_module_stack``),
   so grouping can merge them back by module. ``graph.module`` is ``ep.module()``
   minus its input-guard call: a runnable ``GraphModule`` whose parameters *are*
   the model's parameter objects (export keeps references), so it trains with
   autograd and updates the model. ``graph.capture_method`` says which tracer won.

Shapes, dtypes, bytes and FLOPs come from running the graph once on fake tensors
(``FakeTensorMode``: no memory, no compute, so a model built on the ``meta``
device captures in seconds) under ``torch.utils.flop_counter.FlopCounterMode``.
Per-kind rules (activation bytes kept for backward, FLOPs the counter misses)
live in :mod:`autoplace.capture.op_rules`.

``autocast_dtype`` (``"bfloat16"``): the fake run happens under the GPUs' autocast
policy (``torch.autocast("cpu", dtype)`` with
:class:`~autoplace.capture.gpu_autocast.GpuAutocastPolicy` below it, which runs the ops
CUDA autocast keeps in float32, ``pow``, ``exp``, norms, ``softmax``, ``sum``, on
float32 inputs), so every op's output dtype, and hence every output / edge / activation
byte count, is what autocast produces on a GPU: matmul, linear, conv, attention and RNN
outputs in the low dtype, the float32 list in float32, elementwise ops following their
inputs by type promotion. The inputs a matmul-like op keeps for backward are counted at
the low dtype too (autocast keeps the cast copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoplace.capture.build import InterpreterRunner, _build, _PropagationError
from autoplace.capture.loss import loss_workspace_bytes
from autoplace.capture.program import (
    body_on_device,
    devices_as,
    fetch_attr,
    is_exported,
    model_output,
    node_on_device,
    program_inputs,
    random_ops,
)
from autoplace.capture.tracing import _describe, _export, _fx_trace
from autoplace.errors import AutoplaceError, CaptureError
from autoplace.graph import OpGraph

__all__ = ["InterpreterRunner", "body_on_device", "capture", "capture_workload", "devices_as",
           "fetch_attr", "is_exported", "loss_workspace_bytes", "model_output",
           "node_on_device", "program_inputs", "random_ops"]


_AUTOCAST_DTYPES = ("bfloat16", "float16")

def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Any = None,
    *,
    name: str = "model",
    autocast_dtype: str | None = None,
) -> OpGraph:
    """Capture ``model``'s forward on ``example_inputs`` as an :class:`OpGraph`.

    Args:
        model: any ``nn.Module``; its parameters may live on ``meta``.
        example_inputs: a tuple of positional inputs (a single tensor is wrapped);
            tensors may be real or ``meta``; only their shapes and dtypes matter.
        loss_fn: accepted for symmetry with workloads; the loss is not part of the
            graph (the executor applies it to the graph's output).
        name: graph name (the workload name).
        autocast_dtype: ``"bfloat16"`` / ``"float16"`` to count bytes as autocast
            produces them, or None for the model's own dtypes.

    Returns:
        The graph, with ``graph.module`` (a ``torch.fx.GraphModule``; node names are
        op names) and ``graph.capture_method`` (``"fx"`` or ``"export"``).

    Raises:
        CaptureError: neither tracer could capture the model; the message names the
            offending op or source line.
    """
    del loss_fn
    if autocast_dtype is not None and autocast_dtype not in _AUTOCAST_DTYPES:
        raise AutoplaceError(
            f"autocast_dtype {autocast_dtype!r} is not valid; valid: {', '.join(_AUTOCAST_DTYPES)} "
            "or None"
        )
    args = example_inputs if isinstance(example_inputs, tuple) else (
        tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    )
    fx_error = None
    try:
        gm = _fx_trace(model)
    except Exception as e:  # any tracer failure means: try export
        fx_error = _describe(e)
    else:
        try:
            graph = _build(gm, args, name, autocast_dtype, "fx")
        except _PropagationError as e:
            fx_error = str(e)
        else:
            return graph
    try:
        gm = _export(model, args, autocast_dtype)
    except Exception as e:
        raise CaptureError(
            f"cannot capture {name!r} ({type(model).__name__}): torch.fx failed: {fx_error}; "
            f"torch.export failed: {_describe(e)}"
        ) from None
    try:
        return _build(gm, args, name, autocast_dtype, "export")
    except _PropagationError as e:
        raise CaptureError(
            f"cannot capture {name!r} ({type(model).__name__}): torch.fx failed: {fx_error}; "
            f"the exported graph does not run on fake tensors: {e}"
        ) from None


def capture_workload(workload: Any, batch_size: int | None = None) -> OpGraph:
    """Capture a :class:`~autoplace.workloads.Workload` at ``batch_size`` (default: its own).

    Example inputs are made on the device of the model's parameters (``meta`` for a
    model built there). Sets ``graph.spec`` (a copy of ``workload.spec``) and
    ``graph.batch_size``; counts bytes at ``workload.autocast_dtype``.
    """
    bs = int(batch_size or workload.batch_size)
    first = next(iter(workload.model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    inputs = workload.example_inputs(bs, device)
    graph = capture(workload.model, inputs, workload.loss_fn, name=workload.name,
                    autocast_dtype=workload.autocast_dtype)
    graph.spec = dict(workload.spec)
    graph.batch_size = bs
    out = next((op for op in graph if op.kind == "output"), None)
    if out is not None and graph.module is not None:
        out.workspace_bytes = loss_workspace_bytes(workload, graph, bs)
    return graph
