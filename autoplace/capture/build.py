"""From a traced ``GraphModule`` to an :class:`~autoplace.graph.OpGraph`: the graph runs
once on fake tensors under a FLOP counter, and each node becomes an op with its shapes,
bytes and FLOPs (per-kind rules in :mod:`autoplace.capture.op_rules`)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autoplace.capture import op_rules as rules
from autoplace.capture.gpu_autocast import GpuAutocastPolicy
from autoplace.capture.program import devices_as, fetch_attr
from autoplace.capture.tracing import _describe, _quiet
from autoplace.graph import OpGraph, OpNode

__all__ = ["InterpreterRunner"]


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
    low = getattr(torch, autocast_dtype) if autocast_dtype else None
    cast = torch.autocast("cpu", dtype=low) if low else contextlib.nullcontext()
    policy = GpuAutocastPolicy(low) if low else contextlib.nullcontext()
    try:
        with _quiet(), mode, counter, cast, policy:
            torch.func.functional_call(runner, {f"gm.{k}": v for k, v in tensors.items()},
                                       tuple(flat_args), strict=False, tie_weights=True)
    except _PropagationError:
        raise
    except Exception as e:
        raise _PropagationError(_describe(e)) from e
    return prop.env, prop.flops


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
    saved = rules.SavedTensors()
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
        act, shared = (0, ()) if n.op in ("placeholder", "get_attr", "output") \
            else saved.record(ctx)
        if flops == 0.0 and n.op not in ("placeholder", "get_attr", "output"):
            flops = rules.fallback_flops(ctx)
        flops *= rules.work_fraction(ctx)
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
            activation_bytes=int(act),
            shared_saves=shared,
            flops=float(flops),
        )
        info[n.name] = op
        ops.append(op)
    graph = OpGraph(name, ops, edges, module=gm)
    graph.capture_method = method
    graph.autocast_dtype = autocast_dtype
    return graph


def _materialize(a: Any, env: dict) -> Any:
    return fx.node.map_arg(a, lambda x: env.get(x))
