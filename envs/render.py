"""Rendering of :class:`~autoplace.envs.PlacementEnv`: a placement table and a Gantt chart."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["placement_table", "gantt_rgb"]


def placement_table(
    group_ops: list[list[str]],
    placement: np.ndarray,
    fwd_time_s: np.ndarray,
    param_bytes: np.ndarray,
    device_names: list[str],
    last: dict[str, Any] | None,
) -> str:
    """The current placement as a text table, one row per group, plus the last result."""
    lines = [f"{'group':>5}  {'ops':>5}  {'first op':<24} {'last op':<24} {'fwd ms':>8} "
             f"{'param MiB':>9}  device"]
    for g, ops in enumerate(group_ops):
        d = int(placement[g])
        lines.append(
            f"{g:>5}  {len(ops):>5}  {ops[0][:24]:<24} {ops[-1][:24]:<24} "
            f"{fwd_time_s[g] * 1e3:>8.3f} {param_bytes[g] / 2**20:>9.2f}  {d} ({device_names[d]})"
        )
    if last is not None:
        status = last["error"] or "ok"
        lines.append(
            f"last step: {last['step_time_s'] * 1e3:.3f} ms ({last['backend']}), "
            f"reward {last['reward']:.4f}, {status}"
        )
    return "\n".join(lines) + "\n"


def gantt_rgb(timeline: Any, title: str) -> np.ndarray:
    """A Gantt chart of a simulated step's timeline as an ``[H, W, 3]`` uint8 array."""
    import tempfile
    from pathlib import Path

    from matplotlib.image import imread

    from autoplace.viz import gantt

    with tempfile.TemporaryDirectory(prefix="autoplace-render-") as tmp:
        rgba = imread(gantt(timeline, Path(tmp) / "gantt.png", title=title))
    rgb = rgba[..., :3]
    if rgb.dtype != np.uint8:  # PNGs read as floats in [0, 1]
        rgb = np.round(rgb * 255).astype(np.uint8)
    return np.ascontiguousarray(rgb)
