"""Compare planners on one graph and cluster: the library side of ``autoplace compare``.

:func:`compare` runs every baseline planner (or the ones named), simulates each plan,
and returns one row per planner, fastest first (plans that run out of memory last,
planners that failed after them). With ``execute`` each plan is also run for real.
:func:`format_table` renders the rows as a markdown table.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoplace import planners as registry
from autoplace import sim
from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.planners._common import ensure_costs

__all__ = ["compare", "format_table"]

#: planners that take the best plans found so far as seeds.
_SEEDED = ("anneal",)


def _measured_step(result: Any) -> tuple[float | None, bool, str | None]:
    """``(step_time_s, oom, error)`` from what an ``execute`` callable returned."""
    if result is None:
        return None, False, None
    if isinstance(result, (int, float)):
        return float(result), False, None
    get = result.get if isinstance(result, dict) else (lambda k, d=None: getattr(result, k, d))
    step = get("step_time_s")
    return (None if step is None else float(step)), bool(get("oom", False)), get("error")


def compare(
    graph: OpGraph,
    cluster: Cluster,
    planners: Sequence[str] | None = None,
    *,
    execute: Callable[[Plan], Any] | None = None,
    progress: bool = False,
    options: dict[str, dict[str, Any]] | None = None,
    calibration: Any = None,
) -> list[dict[str, Any]]:
    """Plan with every planner, simulate every plan, and rank them.

    Args:
        graph: the captured graph (costs are estimated when missing).
        cluster: the cluster to plan for.
        planners: planner names (default: all of :func:`autoplace.planners.names`).
        execute: optional ``plan -> step seconds | RunReport | dict`` measuring a plan
            on real devices; adds ``measured_step_time_s`` (and ``measured_oom``).
        progress: print one line per planner to stderr.
        options: per planner name, keyword options for it.
        calibration: a :class:`~autoplace.search.calibration.Calibration` from earlier real runs:
            adds ``calibrated_step_time_s`` (the simulated time times the plan family's
            measured/simulated factor), ``calibrated_peak_bytes`` and ``calibrated_oom``,
            and ranks by the calibrated time.

    Returns:
        Rows (dicts) sorted by simulated step time, OOM plans then failed planners last,
        with keys ``planner``, ``parallel``, ``sim_step_time_s``, ``peak_memory_bytes``
        (per device), ``oom``, ``search_time_s``, ``ratio_to_best``,
        ``ratio_to_lower_bound``, ``lower_bound_s``, ``plan`` (the :class:`Plan`, with
        ``predicted`` filled) and ``error`` (None, or why the planner failed).
    """
    ensure_costs(graph, cluster)
    names = list(planners) if planners is not None else registry.names()
    for name in names:
        registry.get(name)  # unknown names fail before any work
    options = options or {}
    # seeded planners run last so they can start from the best plans of the others
    ordered = [n for n in names if n not in _SEEDED] + [n for n in names if n in _SEEDED]
    lb = sim.lower_bound(graph, cluster)
    rows: list[dict[str, Any]] = []
    for name in ordered:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"planner": name, "plan": None, "parallel": None,
                               "sim_step_time_s": None, "peak_memory_bytes": None,
                               "oom": None, "search_time_s": None, "lower_bound_s": lb,
                               "error": None}
        opts = dict(options.get(name, {}))
        if name in _SEEDED and "seed_plans" not in opts:
            done = sorted((r for r in rows if r["plan"] is not None and not r["oom"]),
                          key=lambda r: r["sim_step_time_s"])
            opts["seed_plans"] = [r["plan"] for r in done[:3]]
        try:
            plan = registry.get(name)(graph, cluster, **opts)
            result = sim.simulate(graph, plan, cluster)
        except AutoplaceError as e:
            row["error"] = str(e)
            row["search_time_s"] = time.perf_counter() - t0
            rows.append(row)
            if progress:
                print(f"[compare] {name}: failed: {e}", file=sys.stderr, flush=True)
            continue
        predicted = result.to_json()
        predicted.pop("timeline", None)
        plan = plan.with_predicted(predicted)
        if calibration is not None:
            peak = max(result.peak_memory_bytes)
            usable = min(d.usable_memory_bytes for d in cluster.devices)
            row.update(calibrated_step_time_s=calibration.step_time(plan, result.step_time_s),
                       calibrated_peak_bytes=calibration.peak_bytes(plan, peak))
            row["calibrated_oom"] = bool(result.oom or row["calibrated_peak_bytes"] > usable)
        row.update(plan=plan, parallel=plan.split(),
                   sim_step_time_s=result.step_time_s,
                   peak_memory_bytes=list(result.peak_memory_bytes), oom=result.oom,
                   search_time_s=float(plan.planner.get("search_time_s",
                                                        time.perf_counter() - t0)))
        if execute is not None:
            try:
                step, oom, err = _measured_step(execute(plan))
            except AutoplaceError as e:
                step, oom, err = None, "memory" in str(e).lower(), str(e)
            row.update(measured_step_time_s=step, measured_oom=oom, measured_error=err)
            if step is not None:
                row["plan"] = plan.with_measured({"step_time_s": step})
        rows.append(row)
        if progress:
            print(f"[compare] {name}: {result.step_time_s * 1e3:.3f} ms"
                  f"{' OOM' if result.oom else ''} ({row['search_time_s']:.2f} s search)",
                  file=sys.stderr, flush=True)
    ok = [r for r in rows if r["error"] is None and not r["oom"]]
    best = min((r["sim_step_time_s"] for r in ok), default=None)
    measured = [r["measured_step_time_s"] for r in rows
                if r.get("measured_step_time_s") is not None and not r.get("measured_oom")]
    best_measured = min(measured, default=None)
    for r in rows:
        s = r["sim_step_time_s"]
        # a plan that does not fit is no fraction of the best: no ratio on its row
        r["ratio_to_best"] = (s / best) if (s is not None and best and not r["oom"]) else None
        r["ratio_to_lower_bound"] = (s / lb) if (s is not None and lb > 0) else None
        m = r.get("measured_step_time_s")
        if execute is not None:
            r["measured_ratio_to_best"] = (m / best_measured) if (
                m and best_measured and not r.get("measured_oom")) else None
    time_key = "calibrated_step_time_s" if calibration is not None else "sim_step_time_s"
    rows.sort(key=lambda r: (r["error"] is not None, bool(r["oom"]),
                             r.get(time_key) if r.get(time_key) is not None else 0.0))
    return rows


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.3f}"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`compare` as a markdown table."""
    measured = any("measured_step_time_s" in r for r in rows)
    calibrated = any("calibrated_step_time_s" in r for r in rows)
    head = ["planner", "plan", "sim ms", "x best", "x bound", "peak GiB (max)", "OOM",
            "search s"]
    if calibrated:
        head += ["calibrated ms", "calibrated OOM"]
    if measured:
        head += ["measured ms", "measured x best"]
    order = any(r.get("order_note") for r in rows)
    if order:  # the demo's note where simulated and measured orders disagree
        head += ["sim vs measured"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["error"] is not None:
            cells = [r["planner"], "failed: " + r["error"].splitlines()[0][:60]] + [""] * (
                len(head) - 2)
        else:
            peak = max(r["peak_memory_bytes"]) / 2**30 if r["peak_memory_bytes"] else 0.0
            cells = [r["planner"], r["plan"].describe().split(": ", 1)[-1],
                     _ms(r["sim_step_time_s"]), _ratio(r["ratio_to_best"]),
                     _ratio(r["ratio_to_lower_bound"]), f"{peak:.2f}",
                     "OOM" if r["oom"] else "", f"{r['search_time_s']:.2f}"]
            if calibrated:
                cells += [_ms(r.get("calibrated_step_time_s")),
                          "OOM" if r.get("calibrated_oom") else ""]
            if measured:
                m = r.get("measured_step_time_s")
                cells += ["OOM" if r.get("measured_oom") else _ms(m),
                          _ratio(r.get("measured_ratio_to_best"))]
            if order:
                cells += [r.get("order_note") or ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
