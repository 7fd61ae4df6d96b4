"""The host's time for the optimizer's update and ``zero_grad``, after the backward.

A training step ends with ``opt.step()`` and ``opt.zero_grad(set_to_none=True)`` on every
process's parameters. Their device time is AdamW's traffic (:func:`autoplace.sim.model.
update_time`); their host time is Python and dispatch work per parameter tensor (fused
AdamW gathers each tensor's gradient and state, groups them by device and dtype, then
launches its kernels; ``zero_grad`` drops each gradient), which the profile's whole
forward + backward does not hold. The update cannot start on a device before the host
has issued the backward and then the update; the step ends no earlier than the host
finishes both. On a launch-bound model that is several percent of the step.

Per device kind, ``(fixed, per tensor)`` seconds of ``opt.step()`` and per tensor of
``zero_grad``: measured by the profile on the machine
(``profile_info[kind]["optimizer"]``, :func:`autoplace.costs.passes.optimizer_host`: the
workload's optimizer on dummy one-element tensors, so its figures hold the host's speed and
not the model's memory), else :data:`OPT_STEP_HOST_S`, :data:`OPT_STEP_TENSOR_HOST_S` and
:data:`ZERO_GRAD_TENSOR_HOST_S` on a GPU kind and nothing on a CPU (whose op times,
measured, are the step's).
"""

from __future__ import annotations

import numpy as np

from autoplace.graph import OpGraph

__all__ = ["OPT_STEP_HOST_S", "OPT_STEP_TENSOR_HOST_S", "ZERO_GRAD_TENSOR_HOST_S",
           "optimizer_host_s", "optimizer_host_table"]

#: host seconds of fused AdamW's ``step`` beyond its per-tensor work, and per parameter
#: tensor, on a GPU kind without a profiled figure: fitted on one H200 (torch 2.11) to a
#: U-Net's 50 tensors (0.366 ms) and branchy-mlp's 28 (0.262 ms); held out, a residual
#: MLP's 1,206 tensors: 5.46 ms measured, 5.80 predicted (+6%) (docs/simulator.md, constants)
OPT_STEP_HOST_S = 0.13e-3
OPT_STEP_TENSOR_HOST_S = 4.7e-6
#: host seconds of ``zero_grad(set_to_none=True)`` per parameter tensor, the same run: 2.1
#: us on the U-Net and branchy-mlp; held out, the residual MLP: 1.94 ms measured, 2.53
#: predicted (+31%)
ZERO_GRAD_TENSOR_HOST_S = 2.1e-6


def optimizer_host_table(graph: OpGraph, kinds: list[str]) -> np.ndarray:
    """``[len(kinds), 3]``: per kind, ``opt.step()``'s fixed and per-tensor host seconds
    and ``zero_grad``'s per tensor (see the module docstring)."""
    info = getattr(graph, "profile_info", None) or {}
    out = np.zeros((len(kinds), 3))
    for i, kind in enumerate(kinds):
        measured = (info.get(kind) or {}).get("optimizer")
        if measured:
            out[i] = fitted(measured)
        elif kind != "cpu":
            out[i] = (OPT_STEP_HOST_S, OPT_STEP_TENSOR_HOST_S, ZERO_GRAD_TENSOR_HOST_S)
    return out


def fitted(measured: dict) -> tuple[float, float, float]:
    """``(fixed, per tensor, zero_grad per tensor)`` from a profile's record: ``tensors``
    (two counts) and the host seconds of ``step`` and ``zero_grad`` at each."""
    (n0, n1), (s0, s1), (_, z1) = (measured["tensors"], measured["step_host_s"],
                                   measured["zero_grad_host_s"])
    slope = max(0.0, (s1 - s0) / (n1 - n0)) if n1 != n0 else s1 / max(n1, 1)
    fixed = max(0.0, s1 - slope * n1)
    return fixed, slope, max(0.0, z1 / max(n1, 1))


def optimizer_host_s(table: np.ndarray, kind: int, tensors: float,
                     updated: float = 1.0) -> tuple[float, float]:
    """``(step, zero_grad)`` host seconds of one process holding ``tensors`` parameter
    tensors on a device of kind index ``kind`` (none without parameters), of which it
    updates the share ``updated`` (ZeRO-1's rank: :func:`~autoplace.sim.model.
    optimizer_shares`; ``zero_grad`` still drops every gradient)."""
    if tensors <= 0:
        return 0.0, 0.0
    fixed, per, zero = table[kind]
    return float(fixed + per * tensors * updated), float(zero * tensors)
