"""The two tracers: ``torch.fx`` symbolic tracing, and ``torch.export`` (on CPU fakes for
a model on ``meta``) when fx fails; see :mod:`autoplace.capture`."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import re
import traceback
import warnings
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autoplace.capture.attention import causal_from_shapes

#: frames of this package are left out of a tracer error's "where"
_PACKAGE_DIR = os.path.dirname(__file__)


def _fx_trace(model: nn.Module) -> fx.GraphModule:
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    g = tracer.trace(model)
    return fx.GraphModule(tracer.root, g, type(model).__name__)


@contextlib.contextmanager
def _quiet():
    """Silence export's warnings and its graph dumps in the log (errors still raise)."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch.fx.experimental.symbolic_shapes",
                                              "torch._export", "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def _on_meta(model: nn.Module, args: tuple) -> bool:
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))]
    return any(t.is_meta for t in tensors)


def _fake_cpu(model: nn.Module, args: tuple, mode: Any) -> tuple[nn.Module, tuple]:
    """A copy of a ``meta`` model, and its inputs, as CPU fake tensors of ``mode``.

    An exported graph depends on the device it was traced on: ``Tensor.contiguous()``
    records a node only where the tensor is not contiguous already, and meta kernels lay
    some outputs out differently from CPU ones (T5's attention output: three more nodes on
    meta), so a plan made on a meta capture would name ops the executor's capture of the
    real (CPU) model does not have. Tracing on CPU fakes gives the CPU graph without
    memory. Parameters shared by several modules (tied embeddings) stay shared.
    """
    clone = copy.deepcopy(model)
    slots = [(mod, name, id(p)) for mod in model.modules()
             for name, p in mod._parameters.items() if p is not None]
    with mode:
        clone = clone.to_empty(device="cpu")
        fargs = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty_strided(tuple(t.shape), tuple(t.stride()),
                                                        dtype=t.dtype, device="cpu"), args)
    first: dict[int, nn.Parameter] = {}
    for (_, name, pid), mod in zip(slots, (m for m in clone.modules()
                                           for n, q in m._parameters.items() if q is not None)):
        p = mod._parameters[name]
        if pid in first and first[pid] is not p:
            mod._parameters[name] = first[pid]
        first.setdefault(pid, p)
    return clone, fargs


def _export(model: nn.Module, args: tuple, autocast_dtype: str | None = None) -> fx.GraphModule:
    """``model`` exported, its causal masks built from shapes given back to attention as
    ``is_causal`` (:func:`autoplace.capture.attention.causal_from_shapes`, outside any
    fake mode: the masks are computed)."""
    if _on_meta(model, args):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model, args = _fake_cpu(model, args, mode)
        with mode:
            gm = _export_here(model, args, autocast_dtype)
    else:
        gm = _export_here(model, args, autocast_dtype)
    causal_from_shapes(gm)
    return gm


def _export_here(model: nn.Module, args: tuple, autocast_dtype: str | None = None
                 ) -> fx.GraphModule:
    """``model`` exported on ``args`` (CPU tensors or CPU fakes).

    With ``autocast_dtype`` the export runs under CPU autocast, as the model will run:
    a region the model runs with autocast off (Llama's rotary embedding in transformers
    5.17 calls ``torch.autocast(enabled=False)`` only where autocast is on) is kept as a
    ``wrap_with_autocast`` call; exported without autocast it vanished and its matmul
    ran in bf16 under the executor's autocast. The graph's ops are recorded before
    autocast applies, so the rest of the graph is the same either way."""
    cast = (torch.autocast("cpu", dtype=getattr(torch, autocast_dtype)) if autocast_dtype
            else contextlib.nullcontext())
    with _quiet(), contextlib.redirect_stderr(io.StringIO()), cast:  # export prints graphs
        try:  # batch dimension symbolic, so microbatches of any size run the module
            ep = torch.export.export(model, args, dynamic_shapes=_batch_dynamic(args),
                                     strict=False)
        except Exception:
            ep = torch.export.export(model, args, strict=False)
        try:
            gm = ep.module(check_guards=False)
        except TypeError:  # torch without check_guards
            gm = ep.module()
    # ep.module() forbids train()/eval() because the graph is fixed in the mode it was
    # exported in (training); restore nn.Module's, which only set the flags
    for attr in ("train", "eval"):
        gm.__dict__.pop(attr, None)
    # input guards and metadata asserts check nothing the planner needs: drop them (in the
    # bodies of no_grad / autocast regions too, whose asserts name the capture's device)
    for mod in (m for m in gm.modules() if isinstance(m, fx.GraphModule)):
        for node in list(mod.graph.nodes):
            is_guard = node.op == "call_module" and node.target == "_guards_fn"
            is_assert = node.op == "call_function" and str(node.target).startswith("aten._assert")
            if (is_guard or is_assert) and not node.users:
                mod.graph.erase_node(node)
        mod.recompile()
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    return gm


def _batch_dynamic(args: tuple) -> tuple:
    auto = torch.export.Dim.AUTO
    return tuple(
        pytree.tree_map(lambda t: {0: auto} if isinstance(t, torch.Tensor) and t.dim() else None, a)
        if isinstance(a, (torch.Tensor, tuple, list, dict)) else None
        for a in args
    )


def _describe(e: BaseException) -> str:
    """A short message from a tracer exception: its first line plus the user source line."""
    text = str(e).strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(
        ("def ", "    "))), "")
    m = re.search(r"The following call raised this error:\s*\n\s*(File [^\n]+)\n\s*([^\n]+)", text)
    if m:
        where = f" at {m.group(1).strip()}: {m.group(2).strip()}"
    else:
        where = ""
        torch_dir = os.path.dirname(torch.__file__)
        for fr in reversed(traceback.extract_tb(e.__traceback__)):
            if not fr.filename.startswith((torch_dir, _PACKAGE_DIR)):
                where = f' at File "{fr.filename}", line {fr.lineno}, in {fr.name}: {fr.line}'
                break
    return f"{type(e).__name__}: {first[:300]}{where}"
