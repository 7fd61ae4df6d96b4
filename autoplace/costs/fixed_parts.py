"""How op times scale with the batch: a second profile at a smaller batch, and each
op's batch-independent (fixed) part fitted through the two points (the method and its
limits are in :mod:`autoplace.costs.profile`'s docstring)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoplace.capture import program_inputs
from autoplace.costs.passes import _first_line, _timed_pass, _warm_up
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph


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
