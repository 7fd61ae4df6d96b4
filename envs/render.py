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


def gantt_rgb(result: Any, title: str, *, width_px: int = 960, height_px: int = 480) -> np.ndarray:
    """A Gantt chart of a simulated step (``SimResult`` with a timeline) as ``[H, W, 3]`` uint8.

    Uses :func:`autoplace.viz.gantt` when it is available, else draws with matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = None
    try:
        from autoplace import viz

        fig = viz.gantt(result.timeline, title=title)
    except Exception:  # viz missing or with another signature: draw it here
        fig = None
    if not isinstance(fig, Figure):
        fig = Figure(figsize=(width_px / 100, height_px / 100), dpi=100)
        ax = fig.add_subplot()
        events = list(result.timeline or [])
        resources = sorted({e.resource for e in events}, key=_resource_key)
        row = {r: i for i, r in enumerate(resources)}
        colors = {"fwd": "tab:blue", "bwd": "tab:orange", "copy": "tab:green",
                  "transfer": "tab:green", "allreduce": "tab:red", "optim": "tab:purple"}
        for e in events:
            ax.barh(row[e.resource], (e.end_s - e.start_s) * 1e3, left=e.start_s * 1e3,
                    color=colors.get(str(e.kind), "tab:gray"), edgecolor="none")
        ax.set_yticks(range(len(resources)), resources)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(title)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _resource_key(r: str) -> tuple[int, str]:
    return (0 if r.startswith("dev") else 1 if r.startswith("link") else 2, r)
