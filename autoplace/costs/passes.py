"""Whole-model passes around the per-op timing: warm-up, the per-op timed pass, and
its calibration against a whole forward and a whole forward+backward (device time, and
on GPUs the host's time to issue them)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from autoplace.costs.timing import _grad_outputs, _sync, _time_call, _Timer
from autoplace.errors import AutoplaceError

#: GPUs run whole steps this long before timing (clocks ramp up from idle)
_WARMUP_S = 0.3


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


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


def optimizer_host(tensors: int, dev: torch.device, repeats: int) -> dict[str, list[float]]:
    """Host seconds of the executor's optimizer step (fused AdamW) and of
    ``zero_grad(set_to_none=True)`` over ``tensors`` parameter tensors and over an eighth of
    them, on ``dev`` (:mod:`autoplace.sim.optimizer_host`). The tensors are one-element
    dummies: the host's work is per tensor, and the model's state is not allocated twice.
    Each figure is the median of ``repeats`` timed steps after two untimed ones, the device
    idle at each start."""
    counts = sorted({max(1, tensors // 8), max(1, tensors)})
    step_s, zero_s = [], []
    for n in counts:
        params = [torch.zeros(1, device=dev, requires_grad=True) for _ in range(n)]
        opt = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if dev.type == "cuda"
                                                    else {}))
        ts, zs = [], []
        for i in range(repeats + 2):
            for p in params:
                p.grad = torch.ones_like(p)
            _sync(dev)
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            _sync(dev)
            if i >= 2:
                ts.append(t1 - t0)
                zs.append(t2 - t1)
        step_s.append(statistics.median(ts))
        zero_s.append(statistics.median(zs))
        del opt, params
    if len(counts) == 1:
        counts, step_s, zero_s = counts * 2, step_s * 2, zero_s * 2
    return {"tensors": counts, "step_host_s": step_s, "zero_grad_host_s": zero_s}

