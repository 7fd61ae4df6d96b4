"""The demo policy's learning, as it trains and after: the lines it prints, its learning
curve (``policy_learning.png``) and the curve's series (``policy_learning.json``).

Update 0 is the untrained policy's batch of sampled plans; the warm start (imitating the
best heuristic plan the env reaches) comes between updates 0 and 1; REINFORCE's updates
follow. Each update's figures are the simulated step of the plans it sampled (the mean of
those that ran and their share, the fastest) and the best plan so far. A run of a minute
makes thousands of updates: the file and the plot keep at most :data:`MOST_POINTS` of them
(:func:`thin_updates`), the printed summary reads them all.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoplace.files import write_json_atomic
from autoplace.policies.reinforce import parse_budget

__all__ = ["CURVE_SERIES", "FIRST_POINTS", "MOST_POINTS", "UNCHANGED", "LivePrinter", "plot_learning",
           "progress_lines", "say", "thin_updates", "update_line", "warm_target",
           "write_learning"]

#: a sampled plans' mean this close to the start's is reported as unchanged
UNCHANGED = 0.005
#: updates the curve file and plot keep at most (per series)
MOST_POINTS = 500
#: of them, the first updates, all kept (the warm start's effect and REINFORCE's start)
FIRST_POINTS = 100
#: the trainer's history series the curve file keeps: those drawn, their share that ran and
#: the time of each update
CURVE_SERIES = ("sample_mean_step_s", "sample_best_step_s", "sample_ran_frac",
                "best_step_time_s", "elapsed_s")


def say(msg: str) -> None:
    """One line of the demo's progress, on stderr."""
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def warm_target(warm: dict[str, Any]) -> dict[str, Any] | None:
    """The plan the warm start imitated (``source``, ``step_time_s``), if it ran."""
    return next(iter((warm.get("targets") or {}).values()), None)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if math.isfinite(seconds) else "none ran"


def update_line(update: int, row: dict[str, float]) -> str:
    """One update of the policy's training: the simulated step of the plans it sampled
    (mean of its own choices that ran and their share, fastest of the batch) and the best
    plan so far; update 0 is the policy before any training."""
    ran = row.get("sample_ran_frac")
    share = f" ({ran:.0%} ran)" if ran is not None and ran < 1 else ""
    samples = (f"sampled plans mean {_ms(row.get('sample_mean_step_s', math.inf))}{share}, "
               f"fastest {_ms(row.get('sample_best_step_s', math.inf))}")
    if update == 0:
        return f"  policy: update 0 (untrained): {samples}"
    return (f"  policy: update {update} ({row['elapsed_s']:.0f} s): {samples}; best so far "
            f"{_ms(row['best_step_time_s'])}")


class LivePrinter:
    """The trainer's ``on_update``: hands :func:`update_line` to ``say`` for the first update
    and then about every ``budget / 8`` (a wall-time budget; else every 25th update).

    Args:
        budget: the training budget (``"60s"``, ``"500ep"``, ``"40"``).
        say: what prints a line (default: :func:`say`, on stderr).
    """

    def __init__(self, budget: str | int, say: Callable[[str], None] = say) -> None:
        unit, amount = parse_budget(budget)
        self.every_s = amount / 8 if unit == "seconds" else None
        self.next_s = 0.0
        self.say = say

    def __call__(self, update: int, row: dict[str, float]) -> None:
        due = update <= 1 or (row["elapsed_s"] >= self.next_s if self.every_s
                              else update % 25 == 0)
        if due:
            self.say(update_line(update, row))
            if self.every_s:
                self.next_s = row["elapsed_s"] + self.every_s


def progress_lines(history: dict[str, list[float]], warm: dict[str, Any],
                   start: dict[str, float] | None = None) -> list[str]:
    """How the policy learned: its sampled plans before training (``start``, update 0), the
    plan the warm start imitated, then the first update of REINFORCE and the updates at a
    quarter, half, three quarters and the end (:func:`update_line`), and how far the sampled
    plans' mean came from the start to the end: the percent faster or slower, or
    ``unchanged`` within :data:`UNCHANGED`."""
    lines = [update_line(0, start)] if start else []
    target = warm_target(warm)
    if target is not None:
        lines.append(f"  policy: warm start imitates {target['source']}'s plan, "
                     f"{target['step_time_s'] * 1e3:.3f} ms")
    n = len(history.get("best_step_time_s", []))
    for i in sorted({0} | {max(0, (n * k) // 4 - 1) for k in (1, 2, 3, 4)} if n else ()):
        lines.append(update_line(i + 1, {k: v[i] for k, v in history.items() if len(v) == n}))
    means = [m for m in history.get("sample_mean_step_s", []) if math.isfinite(m)]
    first = (start or {}).get("sample_mean_step_s", math.inf)
    if means and math.isfinite(first):
        k = max(1, len(means) // 10)  # the last tenth of the updates, averaged
        last = sum(means[-k:]) / k
        change = 1 - last / first
        how = "unchanged" if abs(change) <= UNCHANGED else \
            f"{abs(change) * 100:.1f}% {'faster' if change > 0 else 'slower'}"
        lines.append(f"  policy: sampled plans' mean step {first * 1e3:.1f} ms before training"
                     f" -> {last * 1e3:.1f} ms over the last tenth of the updates ({how})")
    return lines


def thin_updates(n: int, most: int = MOST_POINTS, first: int = FIRST_POINTS) -> list[int]:
    """The updates (numbered from 1) a curve of ``n`` updates keeps: all of them up to
    ``most``; else the first ``first``, the last, and an even stride between."""
    if most < first + 2:
        raise ValueError(f"most must leave room for the first {first} updates and the "
                         f"last two strides, got most={most}")
    if n <= most:
        return list(range(1, n + 1))
    rest = most - first  # from update first + 1 to update n, both kept
    stride = (n - first - 1) / (rest - 1)
    return list(range(1, first + 1)) + sorted({first + 1 + round(i * stride)
                                               for i in range(rest)})


def plot_learning(history: dict[str, list[float]], path: Path, *,
                  heuristic_s: float | None, title: str, start: dict[str, float] | None = None,
                  warm_s: float | None = None, chosen_s: float | None = None,
                  updates: list[int] | None = None) -> None:
    """The policy's learning curve: per update, the sampled plans' mean and fastest
    simulated step and the best so far (update 0: ``start``, the samples before any
    training; the warm start between 0 and 1, its imitated plan ``warm_s`` marked there),
    the plan chosen at the end (``chosen_s``, where it differs from the best so far: its
    shard mode chosen after the policy), against the best baseline. ``updates``: the update
    numbers of ``history``'s entries when it is thinned (:func:`thin_updates`; default 1,
    2, ...). Past 50 updates the update axis is logarithmic beyond 1, so update 0, the warm
    start and the first updates stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ms(values: list[float]) -> list[float]:
        return [v * 1e3 if math.isfinite(v) else float("nan") for v in values]

    fig, ax = plt.subplots(figsize=(7, 4))
    points = len(history.get("best_step_time_s", []))
    updates = list(updates) if updates is not None else list(range(1, points + 1))
    if len(updates) != points:
        raise ValueError(f"updates has {len(updates)} numbers for {points} points of history")
    n = updates[-1] if updates else 0
    first = 0 if start else 1
    x = ([0] if start else []) + updates
    for key, label, style in (("sample_mean_step_s", "sampled plans, mean", "o-"),
                              ("sample_best_step_s", "sampled plans, fastest", ":"),
                              ("best_step_time_s", "best so far", "-")):
        if len(history.get(key, [])) == points:
            at_start = [start.get("sample_best_step_s" if key == "best_step_time_s" else key,
                                  math.inf)] if start else []
            ax.plot(x, ms(at_start + history[key]), style, label=label,
                    markersize=3 if key == "sample_mean_step_s" and n <= 50 else 0)
    if warm_s is not None and math.isfinite(warm_s):
        ax.axvline(0.5, color="tab:green", linewidth=0.8, alpha=0.5)
        ax.plot([0.5], [warm_s * 1e3], "*", color="tab:green", markersize=10,
                label="warm start: the plan imitated")
    best_end = (history.get("best_step_time_s") or [math.inf])[-1]
    if chosen_s is not None and math.isfinite(chosen_s) and chosen_s < best_end:
        ax.plot([max(n, 1)], [chosen_s * 1e3], "D", color="tab:red", markersize=6,
                label="the policy's plan, shard mode chosen after it")
    if heuristic_s is not None and math.isfinite(heuristic_s):
        ax.axhline(heuristic_s * 1e3, color="k", linestyle="--", linewidth=1,
                   label="best baseline")
    if n > 50:
        ax.set_xscale("symlog", linthresh=1.0, linscale=0.5)
    ax.set_xlim(first - 0.3, (1.5 * n if n > 50 else n) + 0.3)
    ax.set_xlabel("update (0: untrained; then the warm start; 1 on: REINFORCE)")
    ax.set_ylabel("simulated step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_learning(out: Path, history: dict[str, list[float]], *, start: dict[str, float],
                   warm: dict[str, Any], chosen_s: float, heuristic_s: float | None,
                   title: str) -> None:
    """``out/policy_learning.json`` and ``out/policy_learning.png``: the curve's series
    (:data:`CURVE_SERIES`) thinned to at most :data:`MOST_POINTS` updates (``updates``
    numbers those kept), the untrained policy's samples (``start``), the plan the warm start
    imitated, the policy's chosen plan's and the best heuristic's simulated step."""
    n = len(history.get("best_step_time_s", []))
    kept = thin_updates(n)
    thinned = {k: [history[k][u - 1] for u in kept] for k in CURVE_SERIES
               if len(history.get(k, [])) == n}
    target = warm_target(warm)
    write_json_atomic(out / "policy_learning.json", {
        "updates_total": n,
        "thinned": (f"{len(kept)} of {n} updates: the first {FIRST_POINTS}, the last and an "
                    "even stride between; updates numbers them" if len(kept) < n
                    else "every update"),
        "updates": kept, "history": thinned, "start": start, "warm_start": target,
        "chosen_step_time_s": chosen_s, "best_heuristic_step_time_s": heuristic_s})
    plot_learning(thinned, out / "policy_learning.png", start=start, heuristic_s=heuristic_s,
                  warm_s=(target or {}).get("step_time_s"), chosen_s=chosen_s, title=title,
                  updates=kept)
