"""Measure per-op forward / backward time and link speed on real devices.

How op times are measured (:func:`profile`). ``graph.module`` runs node by node in
a ``torch.fx.Interpreter``. Each op is run on *detached copies* of its inputs that
require grad, so it builds its own small autograd graph; then

* forward: the op's call (module ``__call__``, function or method, with autograd
  recording on) is repeated in a timed loop: ``perf_counter`` on CPU, CUDA events
  on GPUs (a loop of N calls / N, so launch overhead and GPU time both count);
* backward: ``torch.autograd.grad`` of the op's float outputs with respect to its
  float inputs and its own parameters, repeated with ``retain_graph=True``.

Each is the median of ``repeats`` samples on CPU, the fastest of them on GPUs (work of
other processes on the same GPU only ever adds time: on a 2x H200 machine the benchmark's
pool jobs, starting NCCL on the GPUs while it profiled, once inflated gpt-1b's
small-batch backward 1.8x and with it every op's fixed part); each sample loops until it lasts
~0.2 ms on CPU, ~1 ms on GPU (at most 100 calls), which hides the timer's
resolution. Whole training steps run first until the device is warm (GPU clocks
ramp up from idle). The interpreter's own per-node overhead (~15-20 µs on CPU) is
outside the timed loop. In-place ops run on a clone of their input, so the repeated
loop leaves the real input alone.

Accuracy, and the calibration. Ops run in isolation with warm caches. Each
``autograd.grad`` call pays a fixed setup cost (tens of µs) that a real backward
pays once per step; but when a step is launch-bound (small batches on a GPU) a real
backward pays a comparable engine cost per op. So with ``calibrate=True`` (the
default) raw times are kept and then scaled so that their sums equal a measured
whole forward and a whole forward+backward of ``graph.module`` (factors clamped to
[0.25, 4] and recorded with the raw sums in ``graph.profile_info``): the measured
step total is exact and is shared out in proportion to the per-op measurements.
With ``calibrate=False`` the setup cost of one ``autograd.grad`` on a one-element op
is subtracted from every backward time instead. Measured on an H200 with torch
2.11 (gpt-small, gpt-medium in bf16, resnet50, gnmt-4), raw forward sums came within
25% of a whole forward and raw backward sums were 1.0x to 2.1x a whole backward.

How op times scale with the batch (the fixed parts). A plan runs an op on a share of
the batch (a microbatch, a data-parallel replica's part), and not every op's time
shrinks in proportion: a cuDNN LSTM steps through its timesteps one after another
whatever the batch, a small matmul on a GPU is latency-bound. So after the
measurement above at the full batch ``B``, the whole measurement (warm-up, per-op
timing with the same ``repeats``, and its own calibration against a whole forward and
forward+backward at that batch) runs again at ``b = max(1, B // 8)``, on the inputs cut
to their first ``b`` rows along dim 0 (every tensor input of one or more dimensions;
other inputs unchanged). Per op, forward and backward separately, the affine model
``t(s) = fixed + (t_full - fixed) * s`` through the points ``s = 1`` and
``s = b / B`` gives ``fixed = (t_small - (b / B) t_full) / (1 - b / B)``, clipped to
``[0, t_full]``. It is recorded as ``fwd_fixed_s`` / ``bwd_fixed_s`` and set on the
graph's ops, where the simulator uses it (:mod:`autoplace.sim.model`). Limits: two
points of noisy timings (an op of a few µs gets a rough fixed part; the clip keeps it
in range); a time that is not affine in the batch (cache effects, a change of kernel
between the two batch sizes) is read as if it were; shares below ``b / B`` (more
than 8 microbatches x replicas) are extrapolated. It is skipped, and the record's
``"fixed_parts"`` says why (the simulator then falls back to its launch-overhead
rule), when the inputs have no common dim 0, dim 0 is not the graph's
``batch_size``, ``B < 2``, or the model fails at batch ``b`` or returns an output of
unchanged shape (a batch size baked into the model). The second pass takes about as
many timed calls as the first, each on a smaller batch.

Host time per op (GPUs). Each timed loop also reads the clock when its calls have been
*issued* (CUDA launches return before the device works): that time per call is the
op's host time, what the thread that issues it spends whatever the device does (the
backward's less one ``autograd.grad`` call's own). A one-process placement's forward is
issued by one thread for every device, so these times, not the devices, can bound it.
They are scaled down (never up) where their sum exceeds the time to issue a whole
forward or backward, which may also hold waits for the device; the second pass fits
their batch-independent parts like the device times'. Recorded as ``fwd_host_s`` /
``bwd_host_s`` / ``fwd_host_fixed_s`` / ``bwd_host_fixed_s``; measured on 2x H200
machines, 26-33 us per op on average, a cuDNN LSTM's far more.

Results are cached as JSON per (graph fingerprint, device kind) in ``cache_dir``;
records written before the fixed parts existed still load, without them.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoplace.capture import body_on_device, fetch_attr, program_inputs
from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic
from autoplace.graph import OpGraph

__all__ = ["profile", "measure_links", "device_kind"]

PROFILE_FORMAT = "autoplace.profile/1"
_SAMPLE_S = 2e-4
_SAMPLE_S_GPU = 1e-3
_MAX_INNER = 100
_WARMUP_S = 0.3
_NO_WORK = ("input", "param", "output")


def device_kind(device: str | torch.device) -> str:
    """Cost key of a torch device: ``"cpu"`` or the GPU kind (``"h100"``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    from autoplace.cluster import _gpu_kind

    return _gpu_kind(torch.cuda.get_device_name(dev))


def profile(
    workload_or_graph: Any,
    devices: Sequence[str] | str | Any = ("cpu",),
    *,
    repeats: int = 5,
    cache_dir: str | Path | None = None,
    inputs: tuple | None = None,
    batch_size: int | None = None,
    calibrate: bool = True,
    autocast_dtype: str | None = None,
) -> OpGraph:
    """Measure every op's forward and backward time on each device kind of ``devices``.

    Args:
        workload_or_graph: a :class:`~autoplace.workloads.Workload` (captured here)
            or an :class:`OpGraph` with ``graph.module`` (real, not meta, parameters).
        devices: torch device strings, one device string, or a
            :class:`~autoplace.cluster.Cluster`; one device per distinct kind is used.
        repeats: timed samples per op (the median is kept).
        cache_dir: folder of ``<fingerprint>-<kind>.json`` results, read and written.
        inputs: example inputs for a graph (default: the workload's batch, or
            zeros / randn of the graph's input shapes).
        batch_size: batch size when a workload is captured here.
        calibrate: scale op times to match a whole-graph measurement.
        autocast_dtype: run under ``torch.autocast`` with this dtype on CUDA devices
            (default: the workload's; CPUs always run in the model's own dtypes).

    Returns:
        The graph, with ``fwd_time_s[kind]`` / ``bwd_time_s[kind]`` set on every op,
        and ``fwd_fixed_s[kind]`` / ``bwd_fixed_s[kind]`` (the batch-independent parts)
        where the second, smaller-batch run worked (see the module docstring;
        ``graph.profile_info[kind]["fixed_parts"]`` says whether it did).
    """
    from autoplace.graph import OpGraph as _OpGraph

    if isinstance(workload_or_graph, _OpGraph):
        graph = workload_or_graph
    else:
        from autoplace.capture import capture_workload

        wl = workload_or_graph
        graph = capture_workload(wl, batch_size)
        autocast_dtype = autocast_dtype or wl.autocast_dtype
        if inputs is None:
            inputs = wl.example_inputs(graph.batch_size, "cpu")
    if graph.module is None:
        raise AutoplaceError(
            f"graph {graph.name!r} has no module to run (a graph loaded from JSON); "
            "profile a workload or a freshly captured graph"
        )
    from torch._subclasses.fake_tensor import FakeTensor

    if any(p.is_meta or isinstance(p, FakeTensor) for p in graph.module.parameters()):
        raise AutoplaceError(
            f"graph {graph.name!r} has parameters on the meta device; build the model on a "
            "real device to profile it (or use autoplace.costs.estimate_costs)"
        )
    if hasattr(devices, "devices"):  # a Cluster
        devices = [d.name for d in devices.devices]
    elif isinstance(devices, (str, torch.device)):
        devices = [devices]
    by_kind: dict[str, torch.device] = {}
    for d in devices:
        by_kind.setdefault(device_kind(d), torch.device(d))
    if inputs is None:
        inputs = _synth_inputs(graph)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    for kind, dev in by_kind.items():
        cached = _load(cache_dir, graph, kind)
        if cached is None:
            cached = _measure(graph, inputs, dev, repeats, calibrate,
                              autocast_dtype if dev.type == "cuda" else None)
            cached["device_kind"] = kind
            _save(cache_dir, graph, kind, cached)
        _apply(graph, kind, cached)
    return graph


# -------------------------------------------------------------------- timing
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


def _measure(graph: OpGraph, inputs: tuple, dev: torch.device, repeats: int,
             calibrate: bool, autocast_dtype: str | None) -> dict[str, Any]:
    gm = graph.module
    first = next(iter(gm.parameters()), None)
    if first is not None and first.device != dev:
        import copy

        gm = copy.deepcopy(gm).to(dev)  # leave the user's model where it is
    gm = _devices_to(gm, dev)
    inputs = pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, inputs)
    flat = tuple(program_inputs(graph.module, inputs))
    # no autocast cache: each timed call casts its weights, as one training forward does
    cast = (torch.autocast(dev.type, dtype=getattr(torch, autocast_dtype), cache_enabled=False)
            if autocast_dtype else contextlib.nullcontext())
    with torch.enable_grad(), cast:
        try:
            _warm_up(gm, flat, dev)
        except Exception as e:
            raise AutoplaceError(
                f"a whole training step of {graph.name!r} failed before profiling: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            ) from e
        host: dict[str, dict[str, float]] | None = {} if dev.type == "cuda" else None
        fwd, bwd, calib = _timed_pass(gm, flat, dev, repeats, calibrate,
                                      f"the profile of {graph.name!r}", host)
        scale_f, scale_b = calib["fwd_scale"], calib["bwd_scale"]
        fwd = {k: v * scale_f for k, v in fwd.items()}
        bwd = {k: v * scale_b for k, v in bwd.items()}
        scaling = _small_batch_pass(graph, gm, inputs, flat, dev, repeats, calibrate, fwd, bwd,
                                    host)
    return {
        "format": PROFILE_FORMAT,
        "fingerprint": graph.fingerprint,
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "torch_version": torch.__version__,
        "repeats": repeats,
        "autocast_dtype": autocast_dtype,
        "calibration": calib,
        "fwd_time_s": fwd,
        "bwd_time_s": bwd,
        **({"fwd_host_s": host["fwd"], "bwd_host_s": host["bwd"]} if host else {}),
        **scaling,
    }


def _devices_to(gm: fx.GraphModule, dev: torch.device) -> fx.GraphModule:
    """``gm``, or a GraphModule sharing its modules whose ops name ``dev`` wherever they name
    a device: an exported graph keeps the device it was captured on (CPU) as constants
    (T5's positions: "index is on cpu, different from other tensors on cuda:0"), which the
    executor remaps too (``capture.node_on_device``)."""
    named = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and any(
        isinstance(a, torch.device) and a != dev for a in pytree.tree_leaves((n.args, n.kwargs)))]
    bodies = [n for n in gm.graph.nodes if n.op == "get_attr"
              and isinstance(fetch_attr(gm, n.target), fx.GraphModule)]
    if not named and not bodies:
        return gm
    return body_on_device(gm, dev)  # the top graph and its no_grad / autocast regions' bodies


def _timed_pass(gm: fx.GraphModule, flat: tuple, dev: torch.device, repeats: int,
                calibrate: bool, what: str, host: dict[str, dict[str, float]] | None = None
                ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Raw per-op forward / backward seconds on ``flat`` and the calibration factors.

    With a dict ``host`` (GPUs): also each op's host seconds to issue its forward and its
    backward, under ``host["fwd"]`` / ``host["bwd"]``, scaled down where their sums
    exceed the host time of issuing a whole forward or a whole backward (the factors and
    the whole times are recorded in the calibration).
    """
    timer = _Timer(gm, dev, repeats, subtract=not calibrate)
    timer.run(*flat)
    fwd, bwd = timer.fwd, timer.bwd
    calib: dict[str, float] = {"fwd_scale": 1.0, "bwd_scale": 1.0}
    if calibrate:
        try:
            calib = _calibrate(gm, flat, dev, repeats, fwd, bwd)
        except Exception as e:
            raise AutoplaceError(
                f"calibrating {what} failed: {type(e).__name__}: {_first_line(e)}"
            ) from e
    if host is not None and timer.fwd_host and len(timer.fwd_host) == len(fwd):
        try:
            whole_f, whole_b = _whole_host(gm, flat, dev, repeats)
        except Exception as e:
            raise AutoplaceError(
                f"timing the host side of {what} failed: {type(e).__name__}: {_first_line(e)}"
            ) from e
        # scaled down only: a whole pass's issue time bounds the host's work from above,
        # but may also hold waits for the device (a queue of launches full, a copy from
        # pageable memory), which scaling up would count as host work (gpt-1b's whole
        # forward took 7.5 ms to issue on one 2x H200 machine, 15.7 ms on another, whose
        # per-op issue times summed to 9.3 ms)
        sum_f, sum_b = sum(timer.fwd_host.values()), sum(timer.bwd_host.values())
        sf = min(1.0, _clamp(whole_f / sum_f)) if sum_f > 0 else 1.0
        sb = min(1.0, _clamp(whole_b / sum_b)) if sum_b > 0 else 1.0
        host["fwd"] = {k: v * sf for k, v in timer.fwd_host.items()}
        host["bwd"] = {k: v * sb for k, v in timer.bwd_host.items()}
        calib.update(whole_fwd_host_s=whole_f, whole_bwd_host_s=whole_b, sum_fwd_host_s=sum_f,
                     sum_bwd_host_s=sum_b, fwd_host_scale=sf, bwd_host_scale=sb)
    return fwd, bwd, calib


def _clamp(x: float) -> float:
    return min(4.0, max(0.25, x)) if math.isfinite(x) else 1.0


def _whole_host(gm: nn.Module, flat: tuple, dev: torch.device, repeats: int
                ) -> tuple[float, float]:
    """Median host seconds to issue a whole forward and a whole backward of ``gm``, each
    started on an idle device (the launches return before the device works)."""
    fs, bs = [], []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        outs = _grad_outputs(gm(*flat))
        fs.append(time.perf_counter() - t0)
        if not outs:
            bs.append(0.0)
            continue
        grads = [torch.ones_like(t) for t in outs]
        _sync(dev)
        t0 = time.perf_counter()
        torch.autograd.backward(outs, grads)
        bs.append(time.perf_counter() - t0)
        _sync(dev)
    gm.zero_grad(set_to_none=True)
    return statistics.median(fs), statistics.median(bs)


# ------------------------------------------------------- batch-size scaling
def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _cut_batch(graph: OpGraph, inputs: tuple) -> tuple[tuple, int, int] | str:
    """``(inputs cut to their first b rows, B, b)``, or why the batch cannot be cut."""
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    batched = [t for t in leaves if t.dim() >= 1]
    if not batched:
        return "no tensor input has a batch dimension"
    sizes = sorted({int(t.shape[0]) for t in batched})
    if len(sizes) > 1:
        return f"tensor inputs disagree on the size of dim 0 ({sizes})"
    big = sizes[0]
    known = getattr(graph, "batch_size", None)
    if known is not None and int(known) != big:
        return f"dim 0 of the inputs ({big}) is not the batch size ({known})"
    if big < 2:
        return f"batch size {big} < 2"
    small = max(1, big // 8)
    cut = pytree.tree_map(
        lambda t: t[:small].clone() if isinstance(t, torch.Tensor) and t.dim() >= 1 else t,
        inputs)
    return cut, big, small


def _check_outputs_follow_batch(gm: nn.Module, flat: tuple, small: tuple, big: int,
                                b: int) -> None:
    """Raise when the model's outputs do not shrink with the batch (a batch size baked
    into the model, which broadcasting can hide): an output with a dimension of the full
    batch size must change shape at the small batch."""
    with torch.no_grad():
        full = [t.shape for t in pytree.tree_leaves(gm(*flat)) if isinstance(t, torch.Tensor)]
        cut = [t.shape for t in pytree.tree_leaves(gm(*small)) if isinstance(t, torch.Tensor)]
    if len(full) != len(cut):
        raise AutoplaceError(f"the model returns {len(cut)} tensors at batch {b}, "
                             f"{len(full)} at batch {big}")
    for a, c in zip(full, cut):
        if big in a and tuple(a) == tuple(c):
            raise AutoplaceError(f"an output keeps its shape {tuple(a)} at batch {b} "
                                 "(a batch size baked into the model?)")


def _fit_fixed(full: dict[str, float], small: dict[str, float], share: float
               ) -> dict[str, float]:
    """Per op, the fixed part of ``t(s) = fixed + (t_full - fixed) s`` through the points
    ``(1, t_full)`` and ``(share, t_small)``, clipped to ``[0, t_full]``."""
    out = {}
    for name, t in full.items():
        ts = small.get(name, math.nan)
        fixed = (ts - share * t) / (1.0 - share)
        out[name] = min(max(fixed, 0.0), t) if math.isfinite(fixed) else math.nan
    return out


def _small_batch_pass(graph: OpGraph, gm: fx.GraphModule, inputs: tuple, flat: tuple,
                      dev: torch.device, repeats: int, calibrate: bool,
                      fwd: dict[str, float], bwd: dict[str, float],
                      host: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Profile again at batch ``b = max(1, B // 8)`` and fit each op's fixed part.

    Returns the record's batch-scaling keys; ``"fixed_parts"`` says whether they were
    measured or why not (then there are no ``fwd_fixed_s`` / ``bwd_fixed_s``). With the
    full batch's host times ``host``, the host times' fixed parts too
    (``fwd_host_fixed_s`` / ``bwd_host_fixed_s``).
    """
    cut = _cut_batch(graph, inputs)
    if isinstance(cut, str):
        return {"fixed_parts": f"skipped: {cut}"}
    small_inputs, big, b = cut
    small = tuple(program_inputs(gm, small_inputs))
    out: dict[str, Any] = {"batch_size": big, "small_batch": b, "share": b / big}
    try:
        _check_outputs_follow_batch(gm, flat, small, big, b)
        _warm_up(gm, small, dev)
        small_host: dict[str, dict[str, float]] | None = {} if host else None
        fwd_s, bwd_s, calib = _timed_pass(gm, small, dev, repeats, calibrate,
                                          f"the profile at batch {b}", small_host)
    except Exception as e:
        gm.zero_grad(set_to_none=True)
        out["fixed_parts"] = (f"skipped: running at batch {b} failed: "
                              f"{type(e).__name__}: {_first_line(e)}")
        return out
    fwd_s = {k: v * calib["fwd_scale"] for k, v in fwd_s.items()}
    bwd_s = {k: v * calib["bwd_scale"] for k, v in bwd_s.items()}
    share = b / big
    ff, bf = _fit_fixed(fwd, fwd_s, share), _fit_fixed(bwd, bwd_s, share)
    if any(math.isnan(v) for v in (*ff.values(), *bf.values())):
        out["fixed_parts"] = f"skipped: the run at batch {b} did not time every op"
        return out
    out.update({
        "fixed_parts": "measured",
        "small_calibration": calib,
        "fwd_small_s": fwd_s,
        "bwd_small_s": bwd_s,
        "fwd_fixed_s": ff,
        "bwd_fixed_s": bf,
    })
    if host and small_host:
        hff = _fit_fixed(host["fwd"], small_host["fwd"], share)
        hbf = _fit_fixed(host["bwd"], small_host["bwd"], share)
        if not any(math.isnan(v) for v in (*hff.values(), *hbf.values())):
            out.update({"fwd_host_small_s": small_host["fwd"],
                        "bwd_host_small_s": small_host["bwd"],
                        "fwd_host_fixed_s": hff, "bwd_host_fixed_s": hbf})
    return out


def _grad_outputs(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` that autograd can differentiate (they have a grad_fn)."""
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _step_fns(gm: nn.Module, flat: tuple) -> tuple[Callable[[], Any], Callable[[], None]]:
    """A whole forward, and a whole forward + backward (ones as output gradients)."""

    def forward() -> Any:
        return gm(*flat)

    def step() -> None:
        outs = _grad_outputs(gm(*flat))
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    return forward, step


def _warm_up(gm: nn.Module, flat: tuple, dev: torch.device) -> None:
    """Whole steps until the device is warm (GPU clocks ramp up from idle over ~0.1 s)."""
    _, step = _step_fns(gm, flat)
    budget = _WARMUP_S if dev.type == "cuda" else 0.0
    t0 = time.perf_counter()
    for i in range(200):
        step()
        _sync(dev)
        if i >= 1 and time.perf_counter() - t0 >= budget:
            break
    gm.zero_grad(set_to_none=True)


def _calibrate(gm: nn.Module, flat: tuple, dev: torch.device, repeats: int,
               fwd: dict[str, float], bwd: dict[str, float]) -> dict[str, float]:
    """Scale factors making per-op sums match a whole forward and forward+backward."""
    forward, step = _step_fns(gm, flat)
    whole_fwd = _time_call(forward, dev, repeats)
    whole_step = _time_call(step, dev, repeats)
    gm.zero_grad(set_to_none=True)
    sum_f, sum_b = sum(fwd.values()), sum(bwd.values())
    return {
        "fwd_scale": _clamp(whole_fwd / sum_f) if sum_f > 0 else 1.0,
        "bwd_scale": _clamp(max(whole_step - whole_fwd, 0.0) / sum_b) if sum_b > 0 else 1.0,
        "whole_fwd_s": whole_fwd,
        "whole_step_s": whole_step,
        "sum_fwd_s": sum_f,
        "sum_bwd_s": sum_b,
    }


def _synth_inputs(graph: OpGraph) -> tuple:
    out = []
    for op in graph:
        if op.kind != "input":
            continue
        if not op.output_shapes:
            raise AutoplaceError(
                f"cannot make an example for non-tensor input {op.name!r}; pass inputs="
            )
        shape, dtype = op.output_shapes[0], getattr(torch, op.output_dtypes[0])
        out.append(torch.randn(shape, dtype=dtype) if dtype.is_floating_point
                   else torch.zeros(shape, dtype=dtype))
    return tuple(out)


# --------------------------------------------------------------------- cache
def _apply(graph: OpGraph, kind: str, cached: dict[str, Any]) -> None:
    """Set every op's ``kind`` times from a profile record and note where they came from."""
    ff, bf = cached.get("fwd_fixed_s") or {}, cached.get("bwd_fixed_s") or {}
    hf, hb = cached.get("fwd_host_s") or {}, cached.get("bwd_host_s") or {}
    hff, hbf = cached.get("fwd_host_fixed_s") or {}, cached.get("bwd_host_fixed_s") or {}
    for op in graph:
        op.fwd_time_s[kind] = float(cached["fwd_time_s"][op.name])
        op.bwd_time_s[kind] = float(cached["bwd_time_s"][op.name])
        # fixed parts where the record has them (older records have none: the simulator
        # then uses the launch overhead); never keep those of an earlier profile
        if op.name in ff and op.name in bf:
            op.fwd_fixed_s[kind] = min(float(ff[op.name]), op.fwd_time_s[kind])
            op.bwd_fixed_s[kind] = min(float(bf[op.name]), op.bwd_time_s[kind])
        else:
            op.fwd_fixed_s.pop(kind, None)
            op.bwd_fixed_s.pop(kind, None)
        for full, fixed, whole, part in ((hf, hff, op.fwd_host_s, op.fwd_host_fixed_s),
                                         (hb, hbf, op.bwd_host_s, op.bwd_host_fixed_s)):
            # host times: GPU records of this format on (older ones: host_dispatch_s)
            if op.name in hf and op.name in hb:
                whole[kind] = float(full[op.name])
            else:
                whole.pop(kind, None)
            if kind in whole and op.name in fixed:
                part[kind] = min(float(fixed[op.name]), whole[kind])
            else:
                part.pop(kind, None)
    info = dict(getattr(graph, "profile_info", None) or {})
    info[kind] = {k: cached[k] for k in ("calibration", "device", "torch_version",
                                         "fixed_parts", "batch_size", "small_batch", "share",
                                         "small_calibration")
                  if k in cached}
    info[kind].setdefault("fixed_parts", "absent: the profile record predates them")
    graph.profile_info = info


def apply_cached(graph: OpGraph, cache_dir: str | Path, kinds: Sequence[str]) -> list[str]:
    """Fill ``graph``'s op times from profiles cached in ``cache_dir``; return the kinds found.

    Needs no parameters (a meta-device graph works): the cache is keyed by the graph's
    fingerprint and the device kind.
    """
    found = []
    for kind in dict.fromkeys(kinds):
        cached = _load(cache_dir, graph, kind)
        if cached is None:
            continue
        _apply(graph, kind, cached)
        found.append(kind)
    return found


def _cache_path(cache_dir: str | Path, graph: OpGraph, kind: str) -> Path:
    return Path(cache_dir) / f"{graph.fingerprint}-{kind}.json"


def _load(cache_dir: str | Path | None, graph: OpGraph, kind: str) -> dict[str, Any] | None:
    if cache_dir is None:
        return None
    path = _cache_path(cache_dir, graph, kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (data.get("format") == PROFILE_FORMAT and data.get("fingerprint") == graph.fingerprint
          and set(graph.order) <= set(data.get("fwd_time_s", {}))
          and set(graph.order) <= set(data.get("bwd_time_s", {})))
    return data if ok else None


def _save(cache_dir: str | Path | None, graph: OpGraph, kind: str, data: dict) -> None:
    if cache_dir is None:
        return
    path = _cache_path(cache_dir, graph, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


# --------------------------------------------------------------------- links
def measure_links(
    devices: Sequence[str],
    *,
    sizes: Sequence[int] | None = None,
    repeats: int = 5,
) -> tuple[list[list[float]], list[list[float]]]:
    """Latency and bandwidth of a copy between every ordered pair of ``devices``.

    Each pair copies float32 buffers of ``sizes`` bytes into a preallocated tensor on
    the destination (``copy_``, so a CPU-to-CPU pair really copies), timed on the
    destination's stream (which waits for the copy), and fits
    ``t = alpha + bytes / bandwidth`` by least squares over the timings
    (:func:`_time_call`). Default sizes reach 64 MiB on GPUs, where an 8 MiB copy over
    NVLink (about 20 us) is too close to its launch latency for the slope to mean
    anything.

    Returns:
        ``(alpha_s, bandwidth)``: n x n lists (diagonal 0 and inf) for
        :class:`~autoplace.cluster.Cluster`.
    """
    devs = [torch.device(d) for d in devices]
    if sizes is None:
        gpu = all(d.type == "cuda" for d in devs)
        sizes = (2**10, 2**20, 2**23, 2**26) if gpu else (2**10, 2**16, 2**20, 2**23)
    n = len(devs)
    alpha = [[0.0] * n for _ in range(n)]
    bandwidth = [[math.inf] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            xs, ts = [], []
            for nbytes in sizes:
                src = torch.ones(max(1, nbytes // 4), device=devs[i])
                dst = torch.empty_like(src, device=devs[j])
                timing_dev = devs[j] if devs[j].type == "cuda" else devs[i]
                ts.append(_time_call(lambda s=src, d=dst: d.copy_(s), timing_dev, repeats))
                xs.append(src.numel() * 4)
            a, bw = _fit_alpha_beta(xs, ts)
            alpha[i][j], bandwidth[i][j] = a, bw
    return alpha, bandwidth


def _fit_alpha_beta(xs: list[int], ts: list[float]) -> tuple[float, float]:
    """``t = alpha + x * beta``: beta by least squares, alpha from the smallest copy.

    The intercept of a least-squares fit is dominated by the large copies' noise, so
    alpha is the smallest copy's time minus its bytes' share (clamped at 0).
    """
    m = len(xs)
    mx, mt = sum(xs) / m, sum(ts) / m
    var = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
    if beta <= 0:  # no size dependence measurable: bandwidth from the largest copy
        beta = ts[-1] / xs[-1]
    i = min(range(m), key=xs.__getitem__)
    return max(ts[i] - xs[i] * beta, 0.0), 1.0 / beta
