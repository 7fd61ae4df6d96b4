"""The main job: the whole chain on one workload, on the devices present.

capture -> the ops profiled on the devices present (so the simulator ranks plans with
this machine's op times, not estimates) -> every baseline planner on the simulator -> the
placement policy: the pre-trained GNN shipped with autoplace places the graph zero-shot and
is fine-tuned on it briefly (warm start from the best heuristic plan, then REINFORCE; on 2, 4
or 8 devices, else a policy trained from scratch), its learning printed as it trains (per
update, the simulated step of the plans it samples: their mean and the fastest, and the best
so far) -> the policy's plan exported -> the policy's plan and the best baselines executed
for real (loss checked against unpartitioned training) -> one table, plus a Gantt chart of
the best plan, a bar chart and the policy's learning curve (``policy_learning.png``, its
series in ``policy_learning.json``), under ``out``.

The table says where the simulated and the measured orders of the executed plans
disagree, and why (:func:`order_notes`): a simulator that contradicts the measurement
beside it is never shown as if it agreed.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic

__all__ = ["run_demo", "DEFAULT_PLANNERS", "LivePrinter", "order_notes", "plot_learning",
           "progress_lines", "update_line"]

#: The baselines the demo compares (the full list is ``autoplace plan --list``).
DEFAULT_PLANNERS = ("single", "expert", "hash", "critical-path", "mincut", "m-etf",
                    "hybrid-dp", "ddp", "pipeline")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def run_demo(
    model: str,
    cluster_spec: str,
    *,
    memory_cap: str | None = None,
    options: dict[str, Any] | None = None,
    out_dir: str | Path = "runs/demo",
    policy: str = "gnn",
    budget: str = "60s",
    steps: int = 6,
    execute_top: int = 3,
    profile_ops: bool = True,
) -> list[dict[str, Any]]:
    """Run the chain and print the table; returns its rows.

    Args:
        model: zoo name or ``module:factory``.
        cluster_spec: preset, ``detect`` or a cluster JSON path.
        memory_cap: cap every device (``"16GB"``).
        options: workload options.
        out_dir: where plans, reports and plots go.
        policy: policy trained with REINFORCE (seq2seq, hierarchical, gnn: the pre-trained
            GNN, fine-tuned, where it places on the cluster's device count).
        budget: its training (or fine-tuning) budget (``60s``, ``500ep``).
        steps: real training steps per executed plan (warm-up included).
        execute_top: baselines executed for real beside the policy's plan (fastest
            simulated first; ``single`` always).
        profile_ops: measure the ops on the first device before ranking (kept in
            ``out/profile``, reused by the next demo); False: estimated op costs.
    """
    from autoplace import viz, workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import resolve
    from autoplace.costs.profile import profile
    from autoplace.executor.launch import run_plan
    from autoplace.policies import train
    from autoplace.policies.pretrained import DEVICE_COUNTS, finetune_pretrained
    from autoplace.search.auto import signature
    from autoplace.search.compare import compare, format_table
    from autoplace.sim import simulate

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cluster = resolve(cluster_spec, memory_cap)
    wl = workloads.get(model, device="meta", **(options or {}))
    graph = capture_workload(wl)
    _say(f"{wl.name}: {len(graph)} ops, {graph.param_bytes / 2**20:.1f} MiB params; "
         f"cluster {cluster.name} ({cluster.num_devices} x {','.join(cluster.device_kinds)})")
    if profile_ops:
        device = cluster.devices[0].name
        _say(f"profiling its ops on {device} (the simulator's op times for this machine)")
        try:
            graph = profile(workloads.get(model, **(options or {})), [device], repeats=3,
                            cache_dir=out / "profile")
        except (AutoplaceError, torch.OutOfMemoryError) as e:  # the simulator estimates
            _say(f"profiling failed ({str(e).splitlines()[0][:120]}): op costs estimated")

    rows = compare(graph, cluster, list(DEFAULT_PLANNERS), progress=True)

    t0 = time.perf_counter()
    if policy == "gnn" and cluster.num_devices in DEVICE_COUNTS:
        # the shipped GNN places the graph zero-shot, then trains on it: warm start (the
        # best heuristic plan the env reaches) and REINFORCE from the pre-trained weights
        _say(f"pre-trained gnn: zero-shot, then fine-tuned for {budget} on the simulator "
             "(per update: the simulated step of the plans it samples, mean and fastest)")
        tuned = finetune_pretrained(graph, cluster, budget=budget, seed=0,
                                    on_update=LivePrinter(budget))
        policy_plan = tuned.plan
        history = tuned.history
        start = tuned.start_samples
        for line in progress_lines(tuned.history, tuned.zero_shot_step_time_s,
                                   tuned.warm_start, start):
            _say(line)
        _say(f"  policy: chosen {tuned.step_time_s * 1e3:.3f} ms ({policy_plan.split()}, "
             f"from the {tuned.plan.planner.get('source')} plan)")
        zero_s = tuned.zero_shot_step_time_s
    else:
        _say(f"training a {policy} policy for {budget} on the simulator")
        # a fresh policy every demo: the demo's own folder, replaced each time it runs
        res = train(graph, cluster, policy=policy, backend="sim", budget=budget,
                    out_dir=str(out / "policy"), seed=0, max_groups=16, progress=True,
                    force=True)
        policy_plan = res.best_plan
        history, zero_s, start = res.history, None, None
        for line in progress_lines(res.history, None, res.warm_start):
            _say(line)
    sim_res = simulate(graph, policy_plan, cluster)
    policy_plan = policy_plan.with_predicted({"step_time_s": sim_res.step_time_s,
                                              "peak_memory_bytes": sim_res.peak_memory_bytes,
                                              "oom": sim_res.oom})
    policy_plan.save(out / "policy_plan.json")
    rows.append({"planner": f"policy:{policy}", "plan": policy_plan,
                 "parallel": policy_plan.split(),
                 "sim_step_time_s": sim_res.step_time_s,
                 "peak_memory_bytes": sim_res.peak_memory_bytes, "oom": sim_res.oom,
                 "search_time_s": time.perf_counter() - t0, "error": None,
                 "lower_bound_s": sim_res.lower_bound_s,
                 "ratio_to_lower_bound": sim_res.step_time_s / sim_res.lower_bound_s
                 if sim_res.lower_bound_s else None})

    feasible = sorted((r for r in rows if r["plan"] is not None and not r["oom"]
                       and r["planner"] != f"policy:{policy}"),
                      key=lambda r: r["sim_step_time_s"])
    to_run = [rows[-1]] + feasible[:execute_top]
    to_run += [r for r in rows if r["planner"] == "single" and r not in to_run]
    # a plan is run once: planners that found the same one (every plan on one device, say)
    # share its measurement instead of showing run-to-run noise as differences between them
    ran: dict[tuple, dict[str, Any]] = {}
    for r in to_run:
        plan = r["plan"]
        first = ran.setdefault(signature(plan), r)
        if first is not r:
            for k in ("measured_step_time_s", "measured_error", "max_loss_rel_diff"):
                r[k] = first.get(k)
            r["same_plan_as"] = first["planner"]
            continue
        _say(f"executing {r['planner']} ({plan.split()}) for {steps} steps")
        report = run_plan(plan, wl.spec, cluster=cluster, steps=steps, warmup=2,
                          reference=True)
        report.save(out / f"report-{r['planner'].replace(':', '-')}.json")
        r["measured_step_time_s"] = report.step_time_s if not report.error else None
        r["measured_error"] = report.error
        r["max_loss_rel_diff"] = report.max_loss_rel_diff
    measured = [r["measured_step_time_s"] for r in rows if r.get("measured_step_time_s")]
    best_m = min(measured, default=None)
    best_s = min((r["sim_step_time_s"] for r in rows if r["plan"] is not None and not r["oom"]),
                 default=None)
    for r in rows:
        s, m = r.get("sim_step_time_s"), r.get("measured_step_time_s")
        r["ratio_to_best"] = s / best_s if s and best_s and not r.get("oom") else None
        r["measured_ratio_to_best"] = m / best_m if m and best_m else None
    rows.sort(key=lambda r: (r.get("error") is not None, bool(r.get("oom")),
                             r.get("sim_step_time_s") or 0.0))
    notes = order_notes(rows, cluster)

    print(f"\n{wl.name} on {cluster.name} ({cluster.num_devices} devices: "
          f"{', '.join(d.name for d in cluster.devices)})")
    print(format_table(rows))
    for note in notes:
        print(note)
    for r in rows:
        if r.get("same_plan_as"):
            print(f"  {r['planner']}: the same plan as {r['same_plan_as']} (measured once)")
        elif r.get("max_loss_rel_diff") is not None:
            print(f"  {r['planner']}: loss vs unpartitioned reference, max relative diff "
                  f"{r['max_loss_rel_diff']:.2e}")
    write_json_atomic(out / "compare.json", [{k: v for k, v in r.items() if k != "plan"}
                                             for r in rows], default=str)
    best = next((r for r in rows if r["plan"] is not None and not r["oom"]), None)
    if best is not None:
        best["plan"].save(out / "best_plan.json")
        tl = simulate(graph, best["plan"], cluster, timeline=True)
        viz.gantt(tl.timeline, out / "gantt.png",
                  title=f"{best['planner']}: {tl.step_time_s * 1e3:.2f} ms simulated")
    viz.bar_chart(rows, out / "compare.png", value="sim_step_time_s", scale=1e3,
                  ylabel="simulated step (ms)", title=f"{wl.name} on {cluster.name}")
    heuristic = min((r["sim_step_time_s"] for r in rows if r["plan"] is not None
                     and not r["oom"] and not r["planner"].startswith("policy:")), default=None)
    write_json_atomic(out / "policy_learning.json", {"start": start, "history": history,
                                                     "zero_shot_step_time_s": zero_s})
    plot_learning(history, out / "policy_learning.png", zero_shot_s=zero_s, start=start,
                  heuristic_s=heuristic, title=f"policy:{policy} learning on {wl.name}, "
                                               f"{cluster.name} (simulated)")
    print(f"\nplans, reports and plots in {out}/ ({time.perf_counter() - t_start:.0f} s)")
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if math.isfinite(seconds) else "none ran"


def update_line(update: int, row: dict[str, float]) -> str:
    """One update of the policy's training: the simulated step of the plans it sampled
    (mean of its own choices that ran and their share, fastest of the batch) and the best
    plan so far; update 0 is the policy before any training on the graph."""
    ran = row.get("sample_ran_frac")
    share = f" ({ran:.0%} ran)" if ran is not None and ran < 1 else ""
    samples = (f"sampled plans mean {_ms(row.get('sample_mean_step_s', math.inf))}{share}, "
               f"fastest {_ms(row.get('sample_best_step_s', math.inf))}")
    if update == 0:
        return f"  policy: before training on this graph: {samples}"
    return (f"  policy: update {update} ({row['elapsed_s']:.0f} s): {samples}; best so far "
            f"{_ms(row['best_step_time_s'])}")


class LivePrinter:
    """The trainer's ``on_update``: prints :func:`update_line` for the first update and then
    about every ``budget / 8`` (a wall-time budget; else every 8th of a 25-update span)."""

    def __init__(self, budget: str | int) -> None:
        from autoplace.policies.reinforce import parse_budget

        unit, amount = parse_budget(budget)
        self.every_s = amount / 8 if unit == "seconds" else None
        self.next_s = 0.0

    def __call__(self, update: int, row: dict[str, float]) -> None:
        due = update <= 1 or (row["elapsed_s"] >= self.next_s if self.every_s
                              else update % 25 == 0)
        if due:
            _say(update_line(update, row))
            if self.every_s:
                self.next_s = row["elapsed_s"] + self.every_s


def progress_lines(history: dict[str, list[float]], zero_shot_s: float | None,
                   warm: dict[str, Any], start: dict[str, float] | None = None) -> list[str]:
    """How the policy learned: its zero-shot plan (pre-trained), its sampled plans before
    training (``start``), the plan the warm start imitated, then the first update of
    REINFORCE and the updates at a quarter, half, three quarters and the end
    (:func:`update_line`; the env's step times: the zero-shot plan's may also have had its
    shard mode chosen), and how far the sampled plans' mean came from the start to the end."""
    lines = []
    if zero_shot_s is not None:
        lines.append(f"  policy: pre-trained zero-shot plan {zero_shot_s * 1e3:.3f} ms")
    if start:
        lines.append(update_line(0, start))
    for target in (warm.get("targets") or {}).values():
        lines.append(f"  policy: warm start imitates {target['source']}'s plan, "
                     f"{target['step_time_s'] * 1e3:.3f} ms")
        break
    n = len(history.get("best_step_time_s", []))
    for i in sorted({0} | {max(0, (n * k) // 4 - 1) for k in (1, 2, 3, 4)} if n else ()):
        lines.append(update_line(i + 1, {k: v[i] for k, v in history.items() if len(v) == n}))
    means = [m for m in history.get("sample_mean_step_s", []) if math.isfinite(m)]
    first = (start or {}).get("sample_mean_step_s", math.inf)
    if means and math.isfinite(first):
        k = max(1, len(means) // 10)  # the last tenth of the updates, averaged
        last = sum(means[-k:]) / k
        lines.append(f"  policy: sampled plans' mean step {first * 1e3:.1f} ms before training"
                     f" -> {last * 1e3:.1f} ms over the last tenth of the updates "
                     f"({abs(1 - last / first) * 100:.1f}% "
                     f"{'faster' if last <= first else 'slower'})")
    return lines


def plot_learning(history: dict[str, list[float]], path: Path, *,
                  zero_shot_s: float | None, heuristic_s: float | None, title: str,
                  start: dict[str, float] | None = None) -> None:
    """The policy's learning curve: per update, the sampled plans' mean and fastest
    simulated step and the best so far (update 0: ``start``, the samples before any
    training), against the zero-shot plan and the best baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ms(values: list[float]) -> list[float]:
        return [v * 1e3 if math.isfinite(v) else float("nan") for v in values]

    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(history.get("best_step_time_s", []))
    first = 0 if start else 1
    x = list(range(first, n + 1))
    for key, label, style in (("sample_mean_step_s", "sampled plans, mean", "o-"),
                              ("sample_best_step_s", "sampled plans, fastest", ":"),
                              ("best_step_time_s", "best so far", "-")):
        if len(history.get(key, [])) == n:
            at_start = [start.get("sample_best_step_s" if key == "best_step_time_s" else key,
                                  math.inf)] if start else []
            ax.plot(x, ms(at_start + history[key]), style, label=label,
                    markersize=3 if key == "sample_mean_step_s" else None)
    for value, label, colour in ((zero_shot_s, "pre-trained zero-shot", "grey"),
                                 (heuristic_s, "best baseline", "k")):
        if value is not None and math.isfinite(value):
            ax.axhline(value * 1e3, color=colour, linestyle="--", linewidth=1, label=label)
    ax.set_xlabel("update (0: before training on the graph; 1 on: REINFORCE after the "
                  "warm start)")
    ax.set_ylabel("simulated step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: measured step times this close (6 steps on a shared machine) are a tie, not an order
TIE = 1.05


def order_notes(rows: list[dict[str, Any]], cluster: Any) -> list[str]:
    """Where the executed plans' simulated and measured orders disagree, and why.

    Marks each executed row that the simulator ranked ahead of a plan measured faster
    (beyond :data:`TIE`) with ``order_note`` (a column of the table) and returns the lines
    printed under it: one saying the orders agree, or the disagreements and their cause.
    """
    ran = [r for r in rows if r.get("measured_step_time_s") and not r.get("same_plan_as")
           and r.get("sim_step_time_s")]
    ran.sort(key=lambda r: r["sim_step_time_s"])
    wrong = []
    for i, a in enumerate(ran):
        for b in ran[i + 1:]:  # a simulated faster than b
            if a["measured_step_time_s"] > TIE * b["measured_step_time_s"]:
                wrong.append((a, b))
    for a, b in wrong:
        ratio = a["measured_step_time_s"] / b["measured_step_time_s"]
        a["order_note"] = a.get("order_note") or f"measured {ratio:.2f}x {b['planner']}'s step"
    if len(ran) < 2:
        return []
    if not wrong:
        return [f"simulated and measured orders agree for the {len(ran)} plans executed "
                f"(within {TIE - 1:.0%})"]
    lines = ["simulated and measured orders disagree (sim vs measured column): " + "; ".join(
        f"{a['planner']} was simulated {a['sim_step_time_s'] / b['sim_step_time_s']:.2f}x "
        f"{b['planner']}'s step and measured "
        f"{a['measured_step_time_s'] / b['measured_step_time_s']:.2f}x" for a, b in wrong)]
    if cluster.is_cpu:
        lines.append("  why: on a CPU the 'devices' are the same cores, caches and memory: "
                     "the processes of a multi-process plan compete for them, and gloo's "
                     "collectives run on them too, which the simulator (one independent "
                     "device each, op times profiled in one process) does not model. Trust "
                     "the measured column.")
    else:
        lines.append("  why: the simulator's collective, host and memory costs are models; "
                     "autoplace plan --planner auto measures the best candidates and "
                     "calibrates the simulator with what it measured. Trust the measured "
                     "column.")
    return lines
