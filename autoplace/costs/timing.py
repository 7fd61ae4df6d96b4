"""Timing one call and one op: looped samples with CUDA events on GPUs, and an
``fx.Interpreter`` that times every node's forward and backward on detached inputs
(:func:`autoplace.costs.profile.profile` describes the method and its accuracy)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoplace.errors import AutoplaceError

#: each timed sample loops until it lasts this long (CPU, GPU), at most _MAX_INNER calls
_SAMPLE_S = 2e-4
_SAMPLE_S_GPU = 1e-3
_MAX_INNER = 100


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_call(fn: Callable[[], Any], dev: torch.device, repeats: int,
               host: list[float] | None = None) -> float:
    """Seconds per call of ``fn``: the median of ``repeats`` looped samples on a CPU, the
    fastest on a GPU (interference from other processes there only adds time).

    With a list ``host``, also appends the median host seconds per call: on a GPU the
    time the loop took to *issue* its calls (CUDA launches are asynchronous), which is
    what the calling thread spends per call whatever the device does; on a CPU the
    whole time.
    """
    fn()
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    once = time.perf_counter() - t0
    sample_s = _SAMPLE_S_GPU if dev.type == "cuda" else _SAMPLE_S
    inner = max(1, min(_MAX_INNER, int(sample_s / max(once, 1e-7))))
    samples, issue = [], []
    for _ in range(repeats):
        if dev.type == "cuda":
            # record on dev's stream, not the current device's: a copy between two other
            # devices never reaches the current device's stream, and events there timed
            # nothing (13-23 TB/s "measured" between GPUs 1-3 of a 4x H200 machine)
            stream = torch.cuda.current_stream(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sync(dev)
            start.record(stream)
            h0 = time.perf_counter()
            for _ in range(inner):
                fn()
            issue.append((time.perf_counter() - h0) / inner)
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
            issue.append(samples[-1])  # a CPU op runs on the thread that calls it
    if host is not None and issue:
        host.append(statistics.median(issue))
    return min(samples) if dev.type == "cuda" else statistics.median(samples)


def _grad_overhead(dev: torch.device, repeats: int, host: list[float] | None = None
                   ) -> float:
    leaf = torch.ones(1, device=dev, requires_grad=True)
    out = leaf * 2.0
    go = torch.ones_like(out)
    return _time_call(lambda: torch.autograd.grad(out, leaf, go, retain_graph=True), dev,
                      repeats, host)


def _grad_outputs(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` that autograd can differentiate (they have a grad_fn)."""
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]


class _Timer(fx.Interpreter):
    """Runs each node on detached inputs and times its forward and backward."""

    def __init__(self, gm: fx.GraphModule, dev: torch.device, repeats: int,
                 subtract: bool) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.dev, self.repeats, self.subtract = dev, repeats, subtract
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        # host seconds to issue each op (a placeholder's are 0)
        self.fwd_host: dict[str, float] = {}
        self.bwd_host: dict[str, float] = {}
        grad_host: list[float] = []
        self.grad_overhead = _grad_overhead(dev, repeats, grad_host)
        # one backward call's own setup; a real backward pays it once per step
        self.grad_overhead_host = grad_host[0] if grad_host else 0.0

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):
            self.fwd[n.name] = self.bwd[n.name] = 0.0
            self.fwd_host[n.name] = self.bwd_host[n.name] = 0.0
            return super().run_node(n)
        try:
            return self._run_timed(n)
        except AutoplaceError:
            raise
        except Exception as e:
            raise AutoplaceError(
                f"profiling op {n.name!r} ({n.op} {n.target}) failed: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            ) from e

    def _run_timed(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inplace = _is_inplace(n, self.module)
        leaves: list[torch.Tensor] = []

        def detach(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            # a leaf requiring grad where the step's value does: a parameter, or what a
            # differentiable op made of one (Mixtral's expert histogram, from histc, does
            # not, and its int32 cumsum refuses an input that requires grad)
            if not (t.is_floating_point() or t.is_complex()) or not t.requires_grad:
                return t.detach()
            leaf = t.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone() if inplace else leaf

        args, kwargs = pytree.tree_map(detach, (args, kwargs))
        fn = self._callable(n)
        host: list[float] = []
        if inplace:  # the timed loop works on its own clones, the real call on the values
            # (integer ones too: T5's bucket indices, added to in place, went out of range
            # after the loop had added to them a hundred times)
            loop_args, loop_kwargs = pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
            self.fwd[n.name] = _time_call(lambda: fn(*loop_args, **loop_kwargs), self.dev,
                                          self.repeats, host)
        else:
            self.fwd[n.name] = _time_call(lambda: fn(*args, **kwargs), self.dev, self.repeats,
                                          host)
        if host:
            self.fwd_host[n.name] = host[0]
            self.bwd_host[n.name] = 0.0
        out = fn(*args, **kwargs)
        params = list(self.module.get_submodule(n.target).parameters()) \
            if n.op == "call_module" else []
        wrt = leaves + [p for p in params if p.requires_grad]
        outs = _grad_outputs(out)
        self.bwd[n.name] = 0.0
        if outs and wrt:
            gos = [torch.ones_like(t) for t in outs]

            def backward() -> Any:
                return torch.autograd.grad(outs, wrt, gos, retain_graph=True, allow_unused=True)

            host = []
            t = _time_call(backward, self.dev, self.repeats, host)
            self.bwd[n.name] = max(t - self.grad_overhead, 0.0) if self.subtract else t
            if host:
                self.bwd_host[n.name] = max(host[0] - self.grad_overhead_host, 0.0)
        return out

    def _callable(self, n: fx.Node) -> Callable[..., Any]:
        if n.op == "call_module":
            return self.module.get_submodule(n.target)
        if n.op == "call_method":
            return lambda obj, *a, **k: getattr(obj, n.target)(*a, **k)
        return n.target


def _is_inplace(n: fx.Node, gm: fx.GraphModule) -> bool:
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(n.target), "inplace", False))
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if isinstance(n.target, torch._ops.OpOverload):
        name = n.target._opname
    if name in ("iadd", "isub", "imul", "itruediv"):
        return True
    return (name.endswith("_") and not name.startswith("_")) or n.kwargs.get("inplace") is True
