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

``autocast_dtype`` (``"bfloat16"``): the fake run happens under
``torch.autocast("cpu", dtype)``, so every op's output dtype, and hence every
output / edge / activation byte count, is what autocast produces: matmul, linear,
conv, attention and RNN outputs in the low dtype, elementwise ops following their
inputs, reductions and normalisations as autocast's fp32 list says. The inputs a
matmul-like op keeps for backward are counted at the low dtype too (autocast
keeps the cast copy). CPU and CUDA autocast lists differ in a few ops.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import operator
import os
import re
import traceback
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplace.capture import op_rules as rules
from autoplace.errors import AutoplaceError, CaptureError
from autoplace.graph import OpGraph, OpNode

__all__ = ["InterpreterRunner", "capture", "capture_workload", "devices_as", "is_exported",
           "model_output", "program_inputs", "random_ops"]

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


def is_exported(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` came from torch.export (flattened inputs and outputs), not torch.fx."""
    return isinstance(gm.graph._codegen, _PyTreeCodeGen)


def devices_as(value: Any, device: torch.device) -> Any:
    """``value`` (a node's arguments) with every ``torch.device`` in it made ``device``: an
    exported graph keeps the device it was traced on as constants (``to(device=meta)``,
    ``aten.to.device(mask, cpu)``), where the model meant its input's device."""
    return pytree.tree_map_only(torch.device, lambda _: device, value)


def node_on_device(node: fx.Node, device: torch.device) -> None:
    """Every device ``node`` names (``device=`` or positional, as in an exported graph's
    ``aten.to.device(x, cpu)``) made ``device``, the one its op runs on, and an autocast
    region's device type (``wrap_with_autocast("cpu", ...)``) made ``device``'s: a capture
    keeps the device it traced on as a constant, where the model meant its input's."""
    if any(isinstance(a, torch.device) for a in pytree.tree_leaves((node.args, node.kwargs))):
        node.args, node.kwargs = devices_as((node.args, node.kwargs), device)
    if (node.target is getattr(torch.ops.higher_order, "wrap_with_autocast", None)
            and node.args and isinstance(node.args[0], str) and node.args[0] != device.type):
        node.args = (device.type, *node.args[1:])


def body_on_device(body: Any, device: torch.device) -> Any:
    """A copy of ``body``, a higher-order op's submodule (torch.export keeps a model's
    ``no_grad`` and autocast regions as ``wrap_with_set_grad_enabled(False, body, ...)``),
    whose ops and nested bodies name ``device`` (:func:`node_on_device`); anything else
    as it is. The copy shares the body's tensors."""
    if not isinstance(body, fx.GraphModule):
        return body
    out = fx.GraphModule(body, copy.deepcopy(body.graph))
    for n in out.graph.nodes:
        if n.op in ("call_function", "call_method"):
            node_on_device(n, device)
        elif n.op == "get_attr":
            owner_path, _, attr = n.target.rpartition(".")
            owner = out.get_submodule(owner_path) if owner_path else out
            inner = getattr(owner, attr)
            if isinstance(inner, fx.GraphModule):
                setattr(owner, attr, body_on_device(inner, device))
    out.recompile()
    return out


def program_inputs(gm: fx.GraphModule, inputs: Sequence[Any]) -> list[Any]:
    """The values of ``gm``'s placeholders for a workload's ``inputs`` tuple.

    A torch.fx trace takes the model's positional inputs as they are; an exported graph
    takes their pytree leaves (``None`` is one: an optional input left out keeps its
    placeholder, and nested tuples, lists and dicts are flattened), as its own
    ``forward`` does before it runs the nodes.
    """
    if is_exported(gm):
        return list(pytree.tree_leaves(tuple(inputs)))
    return list(inputs)


def model_output(gm: fx.GraphModule, value: Any) -> Any:
    """What the model returns, from the value of ``gm``'s output node (a program built
    from ``gm``'s nodes computes that value): an exported graph's outputs are the leaves
    of the model's output, which it puts back together (a Hugging Face ``ModelOutput``,
    a dict) in its own ``forward``; a torch.fx trace's output node is the output."""
    if is_exported(gm):
        return gm.graph._codegen.process_outputs(
            list(value) if isinstance(value, (tuple, list)) else value)
    return value


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                      "feature_alpha_dropout", "native_dropout", "feature_dropout"}


def random_ops(gm: fx.GraphModule) -> list[str]:
    """Names of the ops of ``gm`` that draw random numbers in training: dropout with a
    nonzero probability (a module, ``F.dropout`` or ``aten.dropout`` / ``native_dropout``
    as an exported graph records it). A plan runs them on other shares of the batch and in
    another order than the unpartitioned model, so its losses then match the reference's
    only statistically."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            if isinstance(mod, _DROPOUT_MODULES) and mod.p > 0:
                out.append(n.name)
        elif n.op == "call_function":
            name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
            if name in _DROPOUT_FUNCTIONS:
                p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
                train = n.kwargs.get("training", n.kwargs.get(
                    "train", n.args[2] if len(n.args) > 2 else True))
                if (not isinstance(p, (int, float)) or p > 0) and train is not False:
                    out.append(n.name)
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


# ------------------------------------------------------------------ tracing
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
    if _on_meta(model, args):
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model, args = _fake_cpu(model, args, mode)
        with mode:
            return _export_here(model, args, autocast_dtype)
    return _export_here(model, args, autocast_dtype)


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
            if not fr.filename.startswith(torch_dir) and fr.filename != __file__:
                where = f' at File "{fr.filename}", line {fr.lineno}, in {fr.name}: {fr.line}'
                break
    return f"{type(e).__name__}: {first[:300]}{where}"


# -------------------------------------------------------- fake propagation
class _PropagationError(Exception):
    pass


_CPU = torch.device("cpu")


class _Prop(fx.Interpreter):
    """Runs every node on fake tensors, recording FLOPs per node from a FlopCounterMode."""

    def __init__(self, gm: fx.GraphModule, counter: Any) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.counter = counter
        self.flops: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        try:
            out = super().run_node(n)
        except Exception as e:
            where = ""
            if n.stack_trace:
                lines = [ln.strip() for ln in n.stack_trace.strip().splitlines() if ln.strip()]
                where = " at " + " ".join(lines[-2:])
            raise _PropagationError(
                f"op {n.name!r} ({n.op} {_target_name(n)}){where}: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            ) from e
        self.flops[n.name] = float(self.counter.get_total_flops() - before)
        return out

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        """The node's arguments with every device made ``cpu``, where the fakes live."""
        return devices_as(super().fetch_args_kwargs_from_env(n), _CPU)


class InterpreterRunner(nn.Module):
    """Lets ``torch.func.functional_call`` swap ``gm``'s tensors (as ``gm.<name>``) for
    fakes while ``interp``, an interpreter of ``gm``, runs it."""

    def __init__(self, gm: fx.GraphModule, interp: fx.Interpreter) -> None:
        super().__init__()
        self.gm = gm
        self._interp = [interp]

    def forward(self, *args: Any) -> Any:
        return self._interp[0].run(*args)


def _propagate(gm: fx.GraphModule, args: tuple, autocast_dtype: str | None):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
        with mode:  # every tensor becomes a storage-less CPU fake of the same layout
            f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                    device="cpu")
        return f.requires_grad_(requires_grad) if t.is_floating_point() else f

    tensors = {n: fake(p, p.requires_grad) for n, p in gm.named_parameters()}
    tensors.update({n: fake(b) for n, b in gm.named_buffers()})
    flat_args = [fake(a) if isinstance(a, torch.Tensor) else a for a in pytree.tree_leaves(args)]
    counter = FlopCounterMode(display=False)
    prop = _Prop(gm, counter)
    runner = InterpreterRunner(gm, prop)
    cast = (torch.autocast("cpu", dtype=getattr(torch, autocast_dtype)) if autocast_dtype
            else contextlib.nullcontext())
    try:
        with _quiet(), mode, counter, cast:
            torch.func.functional_call(runner, {f"gm.{k}": v for k, v in tensors.items()},
                                       tuple(flat_args), strict=False, tie_weights=True)
    except _PropagationError:
        raise
    except Exception as e:
        raise _PropagationError(_describe(e)) from e
    return prop.env, prop.flops


# ---------------------------------------------------------------- building
def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    try:
        return fx.node._get_qualified_name(t)
    except Exception:
        return getattr(t, "__name__", repr(t))


def _kind(n: fx.Node, gm: fx.GraphModule) -> str:
    if n.op == "placeholder":
        return "input"
    if n.op == "get_attr":
        return "param"
    if n.op == "output":
        return "output"
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    if n.op == "call_method":
        return str(n.target)
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", str(t)).lstrip("_") or str(t)


def _module_path(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    if n.op == "get_attr":
        return str(n.target).rpartition(".")[0]
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", str(path))  # strict-export spelling
    return re.sub(r"\[(\d+)\]", r".\1", path).strip(".")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _build(gm: fx.GraphModule, args: tuple, name: str, autocast_dtype: str | None,
           method: str) -> OpGraph:
    env, counted = _propagate(gm, args, autocast_dtype)
    low_itemsize = torch.empty((), dtype=getattr(torch, autocast_dtype)).element_size() \
        if autocast_dtype else None
    canonical = {id(p): n for n, p in gm.named_parameters()}
    owned: set[int] = set()
    ops: list[OpNode] = []
    edges: list[tuple[str, str, int]] = []
    info: dict[str, OpNode] = {}
    for n in gm.graph.nodes:
        kind = _kind(n, gm)
        outs = [] if n.op == "output" else _tensors(env.get(n))
        params: list[nn.Parameter] = []
        submod = None
        if n.op == "call_module":
            submod = gm.get_submodule(n.target)
            params = list(submod.parameters())
        elif n.op == "get_attr" and isinstance(fetch_attr(gm, n.target), nn.Parameter):
            params = [fetch_attr(gm, n.target)]
        pbytes = 0
        pnames = []
        for p in params:
            pnames.append(canonical.get(id(p), ""))
            if id(p) not in owned:  # tied weights: bytes counted once, at the first user
                owned.add(id(p))
                pbytes += _nbytes(p)
        in_nodes = list(dict.fromkeys(n.all_input_nodes))
        for src in in_nodes:
            edges.append((src.name, n.name, info[src.name].output_bytes))
        ctx = rules.OpContext(
            kind=kind,
            node=n,
            submod=submod,
            args=_materialize(n.args, env),
            kwargs=_materialize(n.kwargs, env),
            outputs=outs,
            act_inputs=[
                t for src in in_nodes if info[src.name].kind != "param"
                for t in _tensors(env.get(src))
            ],
            low_itemsize=low_itemsize,
        )
        flops = counted.get(n.name, 0.0)
        if flops == 0.0 and n.op not in ("placeholder", "get_attr", "output"):
            flops = rules.fallback_flops(ctx)
        op = OpNode(
            name=n.name,
            kind=kind,
            target=_target_name(n),
            module_path=_module_path(n),
            output_shapes=tuple(tuple(int(s) for s in t.shape) for t in outs),
            output_dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in outs),
            output_bytes=sum(_nbytes(t) for t in outs),
            param_bytes=pbytes,
            param_names=tuple(x for x in pnames if x),
            activation_bytes=0 if n.op in ("placeholder", "get_attr", "output")
            else int(rules.activation_bytes(ctx)),
            flops=float(flops),
        )
        info[n.name] = op
        ops.append(op)
    graph = OpGraph(name, ops, edges, module=gm)
    graph.capture_method = method
    graph.autocast_dtype = autocast_dtype
    return graph


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` / ``call_module`` target names (``"h.0.attn.weight"``)."""
    return operator.attrgetter(target)(root)


def _materialize(a: Any, env: dict) -> Any:
    return fx.node.map_arg(a, lambda x: env.get(x))
