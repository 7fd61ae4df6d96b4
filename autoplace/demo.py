"""The main job: the whole chain on one workload, on the devices present.

capture -> the ops profiled on the devices present (so the simulator ranks plans with
this machine's op times, not estimates) -> every baseline planner on the simulator -> the
pre-trained GNN shipped with autoplace places the graph zero-shot (its own row, on 2, 4 or
8 devices) -> a placement policy trained from random weights on the simulator, its learning
printed as it trains (update 0: the untrained policy's samples; then the warm start, which
imitates the best heuristic plan the env reaches; then REINFORCE, per update the simulated
step of the plans it samples: their mean and the fastest, and the best so far) -> the
policy's plan exported -> the policy's plan and the best other plans executed for real (loss
checked against unpartitioned training) -> one table, plus a Gantt chart of the best plan, a
bar chart and the policy's learning curve (``policy_learning.png``, its series in
``policy_learning.json``: :mod:`autoplace.demo_learning`), under ``out``.

The table says where the simulated and the measured orders of the executed plans
disagree, and why (:func:`order_notes`): a simulator that contradicts the measurement
beside it is never shown as if it agreed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from autoplace.cluster import Cluster
from autoplace.demo_learning import LivePrinter, progress_lines, say, write_learning
from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.policies import best_shard_variant, train
from autoplace.sim import simulate

__all__ = ["run_demo", "DEFAULT_PLANNERS", "DEMO_GROUPS", "ZERO_SHOT", "order_notes"]

#: The baselines the demo compares (the full list is ``autoplace plan --list``).
DEFAULT_PLANNERS = ("single", "expert", "hash", "critical-path", "mincut", "m-etf",
                    "hybrid-dp", "ddp", "pipeline")
#: the table's row of the shipped pre-trained GNN's zero-shot plan
ZERO_SHOT = "pretrained:zero-shot"
#: groups the demo's fresh policy places (the graph coarsened to this many)
DEMO_GROUPS = 16


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
        policy: policy trained from random weights (seq2seq, hierarchical, gnn) with warm
            start and REINFORCE on the simulator (:func:`autoplace.policies.train`, nothing
            written; its learning: :mod:`autoplace.demo_learning`).
        budget: its training budget (``60s``, ``500ep``).
        steps: real training steps per executed plan (warm-up included).
        execute_top: other plans (baselines and the zero-shot plan) executed for real beside
            the policy's plan (fastest simulated first; ``single`` always).
        profile_ops: measure the ops on the first device before ranking (kept in
            ``out/profile``, reused by the next demo), and on a GPU the first block under
            the levers (:func:`autoplace.executor.profile_block.profile_block`); False:
            estimated op costs.
    """
    from autoplace import viz, workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import resolve
    from autoplace.costs.profile import profile
    from autoplace.executor.launch import run_plan
    from autoplace.executor.profile_block import describe as describe_block
    from autoplace.executor.profile_block import profile_block
    from autoplace.policies.pretrained import DEVICE_COUNTS, WEIGHTS_PATH, place_pretrained
    from autoplace.search.auto import signature
    from autoplace.search.compare import compare, format_table

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cluster = resolve(cluster_spec, memory_cap)
    wl = workloads.get(model, device="meta", **(options or {}))
    graph = capture_workload(wl)
    say(f"{wl.name}: {len(graph)} ops, {graph.param_bytes / 2**20:.1f} MiB params; "
        f"cluster {cluster.name} ({cluster.num_devices} x {','.join(cluster.device_kinds)})")
    if profile_ops:
        device = cluster.devices[0].name
        say(f"profiling its ops on {device} (the simulator's op times for this machine)")
        try:
            real = workloads.get(model, **(options or {}))
            graph = profile(real, [device], repeats=3, cache_dir=out / "profile")
            if device.startswith("cuda"):  # compiled, checkpointed and graphed blocks
                say("timing its first block eager, compiled, checkpointed and as CUDA "
                    "graphs (what the simulator prices those levers at)")
                rec = profile_block(graph, real.example_inputs(graph.batch_size, "cpu"),
                                    device, autocast_dtype=real.autocast_dtype, repeats=3,
                                    cache_dir=out / "profile")
                say(f"  first block: {describe_block(rec)}")
        except (AutoplaceError, torch.OutOfMemoryError) as e:  # the simulator estimates
            say(f"profiling failed ({str(e).splitlines()[0][:120]}): op costs estimated")

    rows = compare(graph, cluster, list(DEFAULT_PLANNERS), progress=True)
    if cluster.num_devices in DEVICE_COUNTS and WEIGHTS_PATH.is_file():
        # the shipped GNN places the graph zero-shot (no training on it): a row of its own
        t0 = time.perf_counter()
        shipped = place_pretrained(graph, cluster, seed=0)
        if not shipped.planner.get("failed"):
            rows.append(_plan_row(ZERO_SHOT, shipped, graph, cluster, t0))
            say(f"pre-trained gnn, zero-shot: {rows[-1]['sim_step_time_s'] * 1e3:.1f} ms "
                f"({shipped.split()}, {rows[-1]['search_time_s']:.2f} s)")

    t0 = time.perf_counter()
    say(f"training a {policy} policy from random weights for {budget} on the simulator "
        "(update 0: its untrained samples; then a warm start imitating the best heuristic "
        "plan the env reaches, then REINFORCE; per update the simulated step of the plans "
        "it samples: mean and fastest, and the best so far)")
    # no out_dir: the policy, its checkpoint and its plans stay in memory
    res = train(graph, cluster, policy, budget=budget, max_groups=DEMO_GROUPS, progress=False,
                on_update=LivePrinter(budget), checkpoint_every=0)
    history, start, warm = res.history, res.start_samples, res.warm_start
    for line in progress_lines(history, warm, start):
        say(line)
    # the env's actions have no shard mode: it is chosen after the policy
    chosen, _ = best_shard_variant(graph, res.best_plan, cluster)
    policy_row = _plan_row(f"policy:{policy}", chosen, graph, cluster, t0)
    sharded = f"; its shard mode, {chosen.parallel.shard}, chosen after it on the simulator " \
        f"(from {res.best_step_time_s * 1e3:.1f} ms)" if chosen is not res.best_plan else ""
    say(f"  policy: chosen {policy_row['sim_step_time_s'] * 1e3:.1f} ms ({chosen.split()}, "
        f"found by its {res.best_plan.planner.get('trainer', 'training')}{sharded})")
    policy_row["plan"].save(out / "policy_plan.json")
    rows.append(policy_row)

    feasible = sorted((r for r in rows if r["plan"] is not None and not r["oom"]
                       and r is not policy_row), key=lambda r: r["sim_step_time_s"])
    to_run = [policy_row] + feasible[:execute_top]
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
        say(f"executing {r['planner']} ({plan.split()}) for {steps} steps")
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
                     and not r["oom"] and r["planner"] in DEFAULT_PLANNERS), default=None)
    write_learning(out, history, start=start, warm=warm, heuristic_s=heuristic,
                   chosen_s=policy_row["sim_step_time_s"],
                   title=f"policy:{policy} from random weights on {wl.name}, {cluster.name} "
                         "(simulated)")
    print(f"\nplans, reports and plots in {out}/ ({time.perf_counter() - t_start:.0f} s)")
    return rows


def _plan_row(planner: str, plan: Plan, graph: OpGraph, cluster: Cluster,
              t0: float) -> dict[str, Any]:
    """A table row (as :func:`autoplace.search.compare.compare` makes) of a plan made here."""
    res = simulate(graph, plan, cluster)
    plan = plan.with_predicted({"step_time_s": res.step_time_s,
                                "peak_memory_bytes": res.peak_memory_bytes, "oom": res.oom})
    return {"planner": planner, "plan": plan, "parallel": plan.split(),
            "sim_step_time_s": res.step_time_s, "peak_memory_bytes": res.peak_memory_bytes,
            "oom": res.oom, "search_time_s": time.perf_counter() - t0, "error": None,
            "lower_bound_s": res.lower_bound_s,
            "ratio_to_lower_bound": res.step_time_s / res.lower_bound_s
            if res.lower_bound_s else None}


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
