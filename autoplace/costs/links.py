"""Link speed between devices: timed copies between every ordered pair, fitted as
``t = alpha + bytes / bandwidth`` (:func:`measure_links`, :func:`fit_alpha_beta`, which
:mod:`autoplace.executor.collectives` also fits collectives with)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autoplace.costs.timing import _time_call

__all__ = ["fit_alpha_beta", "measure_links"]


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
    (:func:`autoplace.costs.timing._time_call`). Default sizes reach 64 MiB on GPUs, where an 8 MiB copy over
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
            a, bw = fit_alpha_beta(xs, ts)
            alpha[i][j], bandwidth[i][j] = a, bw
    return alpha, bandwidth


def fit_alpha_beta(xs: list[int], ts: list[float]) -> tuple[float, float]:
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
