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
import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from autoplace.capture import body_on_device, capture_workload, fetch_attr, program_inputs
from autoplace.cluster import _gpu_kind
from autoplace.costs.fixed_parts import _cut_batch as _cut_batch
from autoplace.costs.fixed_parts import _fit_fixed as _fit_fixed
from autoplace.costs.fixed_parts import _small_batch_pass
from autoplace.costs.links import fit_alpha_beta as _fit_alpha_beta  # noqa: F401 (old name)
from autoplace.costs.links import measure_links
from autoplace.costs.passes import _timed_pass, _warm_up, optimizer_host
from autoplace.costs.profile_cache import PROFILE_FORMAT, _apply, _load, _save, apply_cached
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph

__all__ = ["profile", "measure_links", "device_kind", "apply_cached"]

_NO_WORK = ("input", "param", "output")


def device_kind(device: str | torch.device) -> str:
    """Cost key of a torch device: ``"cpu"`` or the GPU kind (``"h100"``)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
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
    if isinstance(workload_or_graph, OpGraph):
        graph = workload_or_graph
    else:
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


def _measure(graph: OpGraph, inputs: tuple, dev: torch.device, repeats: int,
             calibrate: bool, autocast_dtype: str | None) -> dict[str, Any]:
    gm = graph.module
    first = next(iter(gm.parameters()), None)
    if first is not None and first.device != dev:
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
        # the optimizer's host work per step, on GPUs (a CPU's is in its measured time)
        **({"optimizer": optimizer_host(sum(1 for p in gm.parameters() if p.requires_grad),
                                        dev, repeats)} if dev.type == "cuda" else {}),
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
