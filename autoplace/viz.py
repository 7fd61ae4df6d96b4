"""Pictures: Gantt chart of a simulated step, placement strip, training curves, bar charts.

Every function draws with matplotlib's Agg backend (no display needed), writes one
image file (the format follows the suffix: ``.png``, ``.svg``, ``.pdf``) and returns
its path.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import networkx as nx

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from autoplace.errors import AutoplaceError  # noqa: E402
from autoplace.files import PICTURE_FORMATS, write_atomic  # noqa: E402

if TYPE_CHECKING:
    from autoplace.graph import OpGraph
    from autoplace.plan import Plan
    from autoplace.sim.model import Event

__all__ = ["FORMATS", "KIND_COLORS", "bar_chart", "gantt", "mesh_picture", "placement_picture",
           "suite_figure",
           "training_curve"]

#: colour of each event kind in :func:`gantt`
KIND_COLORS: dict[str, str] = {
    "fwd": "#4C72B0",
    "bwd": "#DD8452",
    "comm": "#55A868",
    "allreduce": "#C44E52",
    "reducescatter": "#C44E52",
    "allgather": "#8172B3",
    "update": "#937860",
}
_DEVICE_COLORS = plt.get_cmap("tab10").colors


def _resource_key(name: str) -> tuple[int, int, str]:
    """Devices first, then links, then collective streams; numbers in order."""
    nums = [int(x) for x in re.findall(r"\d+", name)] or [0]
    rank = 0 if name.startswith("dev") else 1 if name.startswith("link") else 2
    return rank, nums[0] * 1000 + (nums[1] if len(nums) > 1 else 0), name


#: picture formats the functions here write (the file's suffix picks one)
FORMATS = PICTURE_FORMATS


def _save(fig: Any, path: str | Path) -> Path:
    """Render ``fig`` in the format of ``path``'s suffix and write it atomically."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        plt.close(fig)
        raise AutoplaceError(f"{path}: unknown picture format {path.suffix or '(none)'!r}; "
                             f"valid: {', '.join('.' + f for f in FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=fmt, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    write_atomic(path, buf.getvalue())
    return path


def gantt(timeline: Sequence[Event], path: str | Path, *, title: str = "",
          max_events: int = 20000) -> Path:
    """Gantt chart: one row per device, link and collective stream, coloured by kind.

    Args:
        timeline: events from ``simulate(..., timeline=True).timeline``.
        path: image file to write.
        title: figure title.
        max_events: draw at most this many (the longest) events, to keep files small.
    """
    events = list(timeline)
    if len(events) > max_events:
        events = sorted(events, key=lambda e: e.end_s - e.start_s, reverse=True)[:max_events]
    resources = sorted({e.resource for e in events}, key=_resource_key)
    row = {r: i for i, r in enumerate(resources)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(resources) + 1.5))
    by_kind: dict[str, dict[str, list]] = {}
    for e in events:
        spans = by_kind.setdefault(e.kind, {})
        spans.setdefault(e.resource, []).append((e.start_s * 1e3, (e.end_s - e.start_s) * 1e3))
    for kind, per_res in by_kind.items():
        color = KIND_COLORS.get(kind, "#999999")
        for res, spans in per_res.items():
            ax.broken_barh(spans, (row[res] - 0.4, 0.8), facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(resources)), resources)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    end = max((e.end_s for e in events), default=0.0) * 1e3
    ax.set_xlim(0, end * 1.01 if end > 0 else 1)
    ax.legend(handles=[Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in by_kind],
              loc="upper right", fontsize=8, ncols=min(len(by_kind), 6))
    ax.set_title(title or f"simulated step: {end:.3f} ms")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def placement_picture(graph: OpGraph, plan: Plan, path: str | Path, *, title: str = "",
                      max_drawn_nodes: int = 60) -> Path:
    """Ops in topological order coloured by device.

    A layered drawing of the graph for small graphs (at most ``max_drawn_nodes`` ops),
    else a strip: one column per op, bar height = forward time, so long runs on one
    device and the cost of each stage are visible.
    """
    dev = plan.device_map()
    devices = sorted(set(dev.values()))
    colors = {d: _DEVICE_COLORS[d % len(_DEVICE_COLORS)] for d in devices}
    handles = [Patch(color=colors[d], label=f"device {d}") for d in devices]
    if len(graph) <= max_drawn_nodes:
        depth: dict[str, int] = {}
        for op in graph.order:
            depth[op] = 1 + max((depth[u] for u in graph.preds(op)), default=-1)
        g = graph.nx.copy()
        for op in g.nodes:
            g.nodes[op]["layer"] = depth[op]
        pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal")
        pos = {k: (x, -y) for k, (y, x) in pos.items()}
        fig, ax = plt.subplots(figsize=(max(6, len(set(depth.values())) * 0.35 + 3), 6))
        nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.4, arrowsize=6, node_size=120)
        nx.draw_networkx_nodes(g, pos, ax=ax, node_size=120,
                               node_color=[colors[dev[n]] for n in g.nodes])
        if len(graph) <= 30:
            nx.draw_networkx_labels(g, pos, ax=ax, font_size=6)
        ax.axis("off")
    else:
        kind = next(iter(graph.ops[0].fwd_time_s), None) if len(graph) else None
        heights = [max(op.fwd_time_s.get(kind, 0.0), 0.0) * 1e3 if kind else 1.0 for op in graph]
        if not any(heights):
            heights = [1.0] * len(graph)
        fig, ax = plt.subplots(figsize=(12, 3))
        ax.bar(range(len(graph)), heights, width=1.0,
               color=[colors[dev[n]] for n in graph.order])
        ax.set_xlabel("op (topological order)")
        ax.set_ylabel(f"forward ms ({kind})" if kind else "op")
        ax.set_xlim(-0.5, len(graph) - 0.5)
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    ax.set_title(title or f"{graph.name}: {plan.describe()}")
    return _save(fig, path)


def mesh_picture(plan: Plan, gpus_per_node: int, path: str | Path, *, title: str = "") -> Path:
    """Where a plan's ranks sit: one row per node, one cell per GPU, coloured by the
    local device (the pipeline stage) it runs, labelled with its data-parallel replica
    and tensor-parallel rank (``r3 t1``); HSDP's replica groups as thick borders.

    Device ``(replica * k + local) * tensor + j`` (:class:`autoplace.plan.Plan`'s numbering)."""
    par = plan.parallel
    k, t = plan.devices_per_replica, par.tensor
    n = plan.num_devices
    per_node = max(1, min(gpus_per_node, n))
    nodes = -(-n // per_node)
    fig, ax = plt.subplots(figsize=(min(14, 1.1 * per_node + 2), min(12, 0.5 * nodes + 1.5)))
    group_size = par.data // par.replicate if par.replicate > 1 else 0
    for i in range(n):
        replica, rest = divmod(i // t, k)
        local, j = rest, i % t
        node, slot = divmod(i, per_node)
        edge = "black" if not group_size or (replica // group_size) % 2 == 0 else "0.45"
        ax.add_patch(plt.Rectangle((slot, nodes - 1 - node), 0.94, 0.9,
                                   color=_DEVICE_COLORS[local % len(_DEVICE_COLORS)],
                                   ec=edge, lw=2.5 if group_size else 0.5))
        if n <= 128:
            ax.text(slot + 0.47, nodes - 1 - node + 0.45,
                    f"r{replica}" + (f" t{j}" if t > 1 else ""), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_xlim(0, per_node)
    ax.set_ylim(0, nodes)
    ax.set_xticks([x + 0.47 for x in range(per_node)], [str(x) for x in range(per_node)])
    ax.set_yticks([nodes - 1 - y + 0.45 for y in range(nodes)],
                  [f"node {y}" for y in range(nodes)])
    ax.set_xlabel("GPU in node")
    handles = [Patch(color=_DEVICE_COLORS[d % len(_DEVICE_COLORS)],
                     label=f"stage {d}" if par.pipeline > 1 else f"local device {d}")
               for d in range(k)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"{plan.describe()}: {n} GPUs")
    return _save(fig, path)


def training_curve(values: Sequence[float] | Mapping[str, Sequence[float]], path: str | Path,
                   *, title: str = "", xlabel: str = "iteration", ylabel: str = "step time (s)",
                   smooth: int = 1, hlines: Mapping[str, float] | None = None) -> Path:
    """Line plot of one or several series (e.g. best step time per RL iteration).

    Args:
        values: a series, or ``{label: series}``.
        smooth: moving-average window drawn over the raw values (1: none).
        hlines: reference levels drawn as dashed lines, ``{label: y}`` (baselines,
            the lower bound).
    """
    series = {"": list(values)} if not isinstance(values, Mapping) else dict(values)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, ys in series.items():
        ys = [float(y) for y in ys]
        line = ax.plot(range(len(ys)), ys, alpha=0.35 if smooth > 1 else 1.0,
                       label=None if smooth > 1 else (label or None))[0]
        if smooth > 1 and len(ys) >= smooth:
            avg = [sum(ys[i - smooth + 1:i + 1]) / smooth for i in range(smooth - 1, len(ys))]
            ax.plot(range(smooth - 1, len(ys)), avg, color=line.get_color(), label=label or None)
    for i, (label, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, linestyle="--", color=f"C{(i + len(series)) % 10}", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, path)


def bar_chart(rows: Sequence[Mapping[str, Any]] | Mapping[str, float], path: str | Path, *,
              label: str = "planner", value: str = "step_time_s", error: str | None = None,
              title: str = "", ylabel: str | None = None, scale: float = 1.0) -> Path:
    """Bars comparing planners (a compare table): one bar per row.

    Args:
        rows: dicts like ``{"planner": "expert", "step_time_s": 0.08}``, or a plain
            ``{label: value}`` mapping. Rows whose value is missing or None (an OOM
            plan) are drawn as an empty slot marked "n/a".
        label, value: keys of the bar label and height.
        error: key of a symmetric error (spread), optional.
        scale: multiply values by this (1e3 for milliseconds).
    """
    if isinstance(rows, Mapping):
        rows = [{label: k, value: v} for k, v in rows.items()]
    if rows and not any(value in r for r in rows):  # a chart of empty slots says nothing
        raise AutoplaceError(f"bar_chart: no row has the value {value!r}; the rows hold "
                             f"{sorted(set().union(*(r.keys() for r in rows)))}")
    names = [str(r.get(label, i)) for i, r in enumerate(rows)]
    vals = [r.get(value) for r in rows]
    heights = [float(v) * scale if v is not None else 0.0 for v in vals]
    errs = None
    if error is not None:
        errs = [float(r.get(error) or 0.0) * scale for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(rows) + 2), 4))
    bars = ax.bar(range(len(rows)), heights, yerr=errs, capsize=3,
                  color=[_DEVICE_COLORS[i % len(_DEVICE_COLORS)] for i in range(len(rows))])
    for b, v, h in zip(bars, vals, heights):
        ax.annotate("n/a" if v is None else f"{h:.3g}", (b.get_x() + b.get_width() / 2, h),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right")
    ax.set_ylabel(ylabel or value)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def suite_figure(result: Mapping[str, Any], path: str | Path) -> Path:
    """A benchmark suite (``scripts/bench/bench_plans.py``'s JSON) in pictures: per scenario, the
    measured step time of every distinct plan with its spread (hand-written options in
    grey, auto's choice in red, plans that ran out of memory marked, the best hand-written
    option as a dashed line), and the simulated against the measured step times (the
    diagonal is a perfect simulator)."""
    scenarios = [sc for sc in result.get("scenarios", []) if sc.get("plans")]
    if not scenarios:
        raise ValueError("the suite has no scenario with plans to draw")
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(14, 4.4 * len(scenarios)),
                             gridspec_kw={"width_ratios": [3, 1]}, squeeze=False,
                             layout="constrained")
    for (bars_ax, sim_ax), sc in zip(axes, scenarios):
        rows, labels, seen = [], [], set()
        for r in sorted(sc["plans"], key=lambda r: (r.get("measured_step_time_s") is None,
                                                    r.get("measured_step_time_s") or 0.0)):
            names = sorted([r["planner"], *r.get("same_plan_as", [])],
                           key=lambda n: (n != "auto", n))  # auto first
            if tuple(names) in seen or not r.get("executed"):
                continue
            seen.add(tuple(names))
            rows.append(r)
            labels.append(names[0] + (f" (= {names[1]}{', ...' if len(names) > 2 else ''})"
                                      if len(names) > 1 else ""))
        ms = [1e3 * (r.get("measured_step_time_s") or 0.0) for r in rows]
        lo = [m - 1e3 * r["spread_s"][0] if r.get("spread_s") else 0.0
              for m, r in zip(ms, rows)]
        hi = [1e3 * r["spread_s"][1] - m if r.get("spread_s") else 0.0
              for m, r in zip(ms, rows)]
        colors = ["#C44E52" if r["planner"] == "auto" or "auto" in r.get("same_plan_as", [])
                  else "#9A9A9A" if r.get("manual") else "#4C72B0" for r in rows]
        x = range(len(rows))
        bars_ax.bar(x, ms, yerr=[[max(v, 0.0) for v in lo], [max(v, 0.0) for v in hi]],
                    capsize=2, color=colors)
        for i, r in enumerate(rows):
            if r.get("oom_measured"):
                bars_ax.annotate("OOM", (i, 0), ha="center", va="bottom", fontsize=7)
        bars_ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=7)
        if sc.get("best_manual_s"):
            bars_ax.axhline(1e3 * sc["best_manual_s"], ls="--", color="k", lw=0.8)
        ratio = sc.get("auto_vs_best_manual")
        cap = sc.get("memory_cap_bytes")
        bars_ax.set_title(f"{sc['name']}" + (f" (cap {cap / 2**30:.1f} GiB)" if cap else "")
                          + (f": auto / best hand-written {ratio:.2f}" if ratio else ""),
                          fontsize=9)
        bars_ax.set_ylabel("measured step, ms")
        bars_ax.grid(axis="y", alpha=0.3)
        pts = [(1e3 * r["sim_step_time_s"], 1e3 * r["measured_step_time_s"], c)
               for r, c in zip(rows, colors)
               if r.get("measured_step_time_s") and not r.get("oom_measured")]
        if pts:
            sim_ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=[p[2] for p in pts],
                           s=14)
            lim = [0.0, max(max(p[:2]) for p in pts) * 1.1]
            sim_ax.plot(lim, lim, color="k", lw=0.6)
            sim_ax.set_xlim(lim)
            sim_ax.set_ylim(lim)
            tau = sc.get("kendall_tau")
            sim_ax.set_title("simulated vs measured"
                             + (f", tau {tau:.2f}" if tau is not None else ""), fontsize=9)
        sim_ax.set_xlabel("simulated ms")
        sim_ax.set_ylabel("measured ms")
    title = f"{result.get('num_devices', '?')}x {result.get('card', '?')}"
    fig.suptitle(f"Plans measured on {title} (grey: hand-written, red: auto)", fontsize=11)
    return _save(fig, path)
