"""Pipeline stages: one fx program per stage of a contiguous split, for torch.distributed.pipelining.

:func:`build_stage` cuts the captured graph into the plan's stages and returns the
stage ``s`` program. Its inputs are the values live across the cut before it and
its outputs the values live across the cut after it, so values that skip a stage
pass through it and the stages form a chain (``PipelineStage`` needs one).
Parameters are not activations: each ``get_attr`` op is copied into the stage
that uses it. Only tensors cross stages: ints from ``.size()``, ``torch.Size``
and the like are specialised to the constants the microbatch shapes give, and a
tuple that holds tensors (an LSTM's ``(out, (h, c))``) crosses as its tensor
leaves and is rebuilt on the other side.

:func:`make_schedule` wraps a stage program in ``PipelineStage`` and a
``ScheduleGPipe`` / ``Schedule1F1B``. Rank 0 calls ``step(*inputs)``, middle ranks
``step()``, the last ``step(target=y, losses=losses)``; gradients are divided by
the microbatch count (``scale_grads``) so they match the full-batch mean loss.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autoplace.capture import (
    InterpreterRunner,
    body_on_device,
    devices_as,
    fetch_attr,
    node_on_device,
    program_inputs,
)
from autoplace.errors import PlanError
from autoplace.executor.pieces import CompiledPiece, Piece
from autoplace.lowering import stage_of_ops
from autoplace.plan import Plan

__all__ = ["build_stage", "example_values", "make_schedule"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous (p2p buffers must be contiguous)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, with the gradient sent back to the previous stage made contiguous."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return _ContiguousGrad.apply(x)
    return x


class _GradFor(torch.autograd.Function):
    """Identity on ``out`` that gives each of ``inputs`` a zero gradient in backward.

    torch 2.11's ``PipelineStage`` expects a gradient for every tensor a stage received,
    to send back; an input the stage's outputs do not depend on differentiably (an index or
    mask, a float64-encoded integer) would have none ("has gradients None and is expecting
    to send gradients to stage 0"). Tying it to an output this way costs a zero tensor.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(x.shape, x.dtype, x.device) for x in inputs]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=dv) for s, d, dv in ctx.specs))


def grad_for(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    return _GradFor.apply(out, *inputs)


def example_values(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device | None = None,
                   autocast_dtype: str | None = None) -> dict[str, Any]:
    """The value of every node of ``gm`` on ``inputs``, computed with fake tensors.

    Tensors come back as fake tensors (shape and dtype only); ints, sizes and other
    Python values come back exactly. With ``device`` (a CUDA device) and ``autocast_dtype``
    the run is on fakes of that device under the workload's autocast, so the dtypes are
    the ones the stages will really pass (bf16 activations), and the devices the graph
    names are that device.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    values: dict[str, Any] = {}
    cuda = device is not None and device.type == "cuda"

    class _Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

        def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
            args_kwargs = super().fetch_args_kwargs_from_env(n)
            return devices_as(args_kwargs, device) if cuda else args_kwargs

        def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
            value = super().get_attr(target, args, kwargs)
            return body_on_device(value, device) if cuda else value

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = program_inputs(gm, inputs)
    if not cuda:
        with mode, torch.no_grad():
            fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat]
            _Rec(gm).run(*fake)
        return values

    def on(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                       device=device)

    tensors = {f"gm.{n}": on(t) for n, t in (*gm.named_parameters(), *gm.named_buffers())}
    fake = [on(x) if isinstance(x, torch.Tensor) else x for x in flat]
    runner = InterpreterRunner(gm, _Rec(gm))
    cast = (torch.autocast("cuda", dtype=getattr(torch, autocast_dtype)) if autocast_dtype
            else contextlib.nullcontext())
    with mode, torch.no_grad(), cast:
        torch.func.functional_call(runner, tensors, tuple(fake), strict=False, tie_weights=True)
    return values


def _leaves(value: Any, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Paths of the tensors inside ``value`` (tuples and lists are walked)."""
    if isinstance(value, torch.Tensor):
        return [path]
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return []


def _constant(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, torch.device):
        return device
    return value


def _rebuild(value: Any, path: tuple[int, ...], leaf: Callable[[tuple[int, ...]], Any],
             device: torch.device) -> Any:
    """``value``'s structure with each tensor replaced by ``leaf(path)``."""
    if isinstance(value, torch.Tensor):
        return leaf(path)
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        items = [_rebuild(v, (*path, i), leaf, device) for i, v in enumerate(value)]
        return type(value)(items) if isinstance(value, list) else tuple(items)
    return _constant(value, device)


def build_stage(
    gm: fx.GraphModule,
    plan: Plan,
    stage: int,
    example_inputs: Sequence[torch.Tensor],
    device: torch.device,
    values: dict[str, Any] | None = None,
) -> fx.GraphModule:
    """The program of pipeline stage ``stage``; shares parameters with ``gm``.

    Args:
        gm: the captured model.
        plan: a plan with ``parallel.pipeline > 1`` (stage ``s`` = local device ``s``).
        stage: which stage to build.
        example_inputs: one microbatch of model inputs (to specialise sizes).
        device: the stage's device (for ``device`` constants).
        values: :func:`example_values` of ``gm`` on ``example_inputs`` (computed if None).

    The stage carries its input and output shapes and dtypes from the fake run
    (``stage_io``, see :func:`make_schedule`).
    """
    n_stages = plan.parallel.pipeline
    values = values if values is not None else example_values(gm, example_inputs)
    st = stage_of_ops(gm, plan)
    nodes = list(gm.graph.nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    last_use: dict[str, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op != "get_attr":
                last_use[a.name] = max(last_use.get(a.name, -1), st[n.name])
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for p in placeholders:
        last_use[p.name] = max(last_use.get(p.name, 0), 0)

    def crossing(after: int) -> list[tuple[str, tuple[int, ...]]]:
        """Tensor leaves produced at stage <= after and used at a stage > after."""
        out = []
        for n in nodes:
            if n.op in ("get_attr", "output") or st[n.name] > after:
                continue
            if last_use.get(n.name, -1) > after:
                out.extend((n.name, p) for p in _leaves(values[n.name]))
        return sorted(out, key=lambda v: (pos[v[0]], v[1]))

    g = fx.Graph()
    env: dict[str, Any] = {}
    leaf_in: dict[tuple[str, tuple[int, ...]], fx.Node] = {}
    if stage == 0:  # tensor inputs; any other input (None, a flag) is a constant
        for p in placeholders:
            v = values[p.name]
            env[p.name] = g.placeholder(p.name) if isinstance(v, torch.Tensor) \
                else _constant(v, device)
    received: list[fx.Node] = []
    value_of: dict[fx.Node, Any] = {}  # stage node -> its fake value (for _untied)
    if stage > 0:
        for name, path in crossing(stage - 1):
            ph = g.placeholder(f"{name}_{'_'.join(map(str, path)) or 'x'}")
            v = _leaf_of(values, name, path)
            leaf_in[(name, path)] = g.call_function(contiguous_grad, (ph,)) \
                if v.is_floating_point() else g.call_method("to", (ph, v.dtype))
            received.append(ph)
            value_of[ph] = value_of[leaf_in[(name, path)]] = v

    attrs: dict[str, Any] = {}

    def ref(a: fx.Node) -> Any:
        if a.name in env:
            return env[a.name]
        if a.op == "get_attr":  # parameters and constants are copied where they are used
            attrs[a.target] = body_on_device(fetch_attr(gm, a.target), device)
            env[a.name] = g.node_copy(a)
            return env[a.name]
        # a value from an earlier stage: tensors are inputs, the rest constants
        return _rebuild(values[a.name], (), lambda p: leaf_in[(a.name, p)], device)

    for n in nodes:
        if n.op in ("placeholder", "output", "get_attr") or st[n.name] != stage:
            continue
        if n.op == "call_module":
            attrs[n.target] = fetch_attr(gm, n.target)
        new = g.node_copy(n, ref)
        if n.op in ("call_function", "call_method"):
            node_on_device(new, device)
        env[n.name] = new
        value_of[new] = values.get(n.name)

    def leaf_value(name: str, path: tuple[int, ...]) -> Any:
        v = env[name] if name in env else None
        if v is None:
            return leaf_in[(name, path)]
        for i in path:
            v = g.call_function(operator.getitem, (v, i))
        return v

    def leaf_of(name: str, path: tuple[int, ...]) -> Any:
        return _leaf_of(values, name, path)

    def sent(x: fx.Node, v: torch.Tensor) -> fx.Node:
        return x if v.is_floating_point() else g.call_method("to", (x, WIRE_DTYPE))

    if stage == 0:
        ins = [values[p.name] for p in placeholders if isinstance(values[p.name], torch.Tensor)]
    else:
        ins = [_on_wire(leaf_of(name, path)) for name, path in crossing(stage - 1)]
    def tie(outs: list[Any], outs_v: list[Any]) -> list[Any]:
        """The first floating output, made to give the received inputs no path of floating
        values reaches a gradient (_GradFor)."""
        loose = _untied(g, received, value_of)
        i = next((i for i, v in enumerate(outs_v)
                  if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
        if loose and i is not None and isinstance(outs[i], fx.Node):
            outs = list(outs)
            outs[i] = g.call_function(grad_for, (outs[i], *loose))
        return outs

    if stage == n_stages - 1:
        output = next(n for n in nodes if n.op == "output")
        out_args = fx.map_arg(output.args[0], ref)
        leaves, spec = pytree.tree_flatten(out_args)
        leaf_vals = pytree.tree_leaves(fx.map_arg(output.args[0], lambda a: values[a.name]))
        if len(leaf_vals) == len(leaves):
            out_args = pytree.tree_unflatten(tie(leaves, leaf_vals), spec)
        g.output(out_args)
        outs_v = [v for v in leaf_vals if isinstance(v, torch.Tensor)]
    else:
        # send buffers must be contiguous (gloo and NCCL p2p reject strided tensors)
        crossed = crossing(stage)
        outs = [sent(g.call_method("contiguous", (leaf_value(name, path),)), leaf_of(name, path))
                for name, path in crossed]
        if not outs:
            raise PlanError(f"pipeline stage {stage} passes nothing to stage {stage + 1}")
        outs_v = [_on_wire(leaf_of(name, path)) for name, path in crossed]
        outs = tie(outs, outs_v)
        g.output(tuple(outs) if len(outs) > 1 else outs[0])
    gm_stage = fx.GraphModule(attrs, g)
    gm_stage.stage_io = (tuple(_meta_like(v, grad=stage > 0) for v in ins),
                         tuple(_meta_like(v, grad=True) for v in outs_v))
    return gm_stage


#: integer and bool tensors cross between stages as float64 (exact up to 2**53) and are
#: cast back on arrival: PipelineStage marks the buffers it receives as requiring grad, which
#: a tensor that is not floating point cannot (torch 2.11: "only Tensors of floating point
#: dtype can require gradients"; GPT-2's and BERT's position and mask indices)
WIRE_DTYPE = torch.float64


def _floating(v: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               for t in pytree.tree_leaves(v))


def _untied(g: fx.Graph, received: list[fx.Node], value_of: dict[fx.Node, Any]) -> list[fx.Node]:
    """The received inputs from which no chain of floating-point values reaches the stage's
    output (so no gradient would reach them): integers, masks, indices."""
    out = []
    for ph in received:
        seen, todo, reaches = {ph}, [ph], False
        while todo and not reaches:
            n = todo.pop()
            for u in n.users:
                if u.op == "output":
                    reaches = True
                    break
                v = value_of.get(u)
                if u not in seen and (v is None or _floating(v)):
                    seen.add(u)
                    todo.append(u)
        if not reaches:
            out.append(ph)
    return out


def _leaf_of(values: dict[str, Any], name: str, path: tuple[int, ...]) -> Any:
    v = values[name]
    for i in path:
        v = v[i]
    return v


def _on_wire(v: torch.Tensor) -> torch.Tensor:
    """``v`` as it crosses a cut (:data:`WIRE_DTYPE` unless floating point)."""
    return v if v.is_floating_point() else v.to(WIRE_DTYPE)


def _meta_like(v: torch.Tensor, grad: bool) -> torch.Tensor:
    """A ``meta`` tensor of ``v``'s shape and dtype (requiring grad if floating and ``grad``)."""
    t = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
    return t.requires_grad_(grad and t.is_floating_point())


def _unwrapped(module: nn.Module) -> nn.Module:
    """The stage program inside its wrappers: data parallel (DDP's ``.module``; FSDP2 wraps
    in place), then compiled and recomputed pieces (``CompiledPiece.piece``,
    ``Piece.inner``)."""
    module = getattr(module, "module", module)
    if isinstance(module, CompiledPiece):
        module = module.piece
    if isinstance(module, Piece):
        module = module.inner
    return module


def make_schedule(
    module: nn.Module,
    stage: int,
    n_stages: int,
    device: torch.device,
    microbatches: int,
    schedule: str,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    group: Any = None,
) -> Any:
    """``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` for one stage on this rank."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    # the stage's input and output shapes and dtypes from the fake run (build_stage,
    # example_values under the workload's autocast), found through its wrappers. Without
    # them PipelineStage infers them by running the stage on uninitialised inputs, which
    # an op that indexes by an input tensor cannot survive (BERT's attention mask, torch
    # 2.13: "index ... is out of bounds"), nor a stage compiled whole on 2x H200 (GNMT-4,
    # torch 2.11: the last stage's logits inferred as the hidden state before them, and
    # its first real step refused with PipeliningShapeError)
    io = getattr(_unwrapped(module), "stage_io", None)
    kw: dict[str, Any] = {"input_args": io[0], "output_args": io[1]} if io else {}
    pstage = PipelineStage(module, stage, n_stages, device, group=group, **kw)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return cls(pstage, n_microbatches=microbatches, loss_fn=loss_fn)
