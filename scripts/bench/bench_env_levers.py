"""GNN policy with and without the lever heads (issue priority and recompute per group),
on the simulator, under a memory cap where recompute matters.

    python scripts/bench/bench_env_levers.py                 # 3 workloads x 2 seeds x 2 arms
    python scripts/bench/bench_env_levers.py --quick         # smoke test: tiny budget
    python scripts/bench/bench_env_levers.py --seeds 0 --out /tmp/a   # one part of the table
    python scripts/bench/bench_env_levers.py --merge /tmp/a/env_levers.json,/tmp/b/env_levers.json

A scenario is a zoo workload at a batch size where activations dominate memory, on a
cluster preset, with every device capped at ``--cap`` of the simulated single-device peak
(the cap at which, in the simulator, plain DDP no longer fits and DDP with every group
recomputed does). For each scenario every heuristic (``--baselines``) plans the whole op
graph; the best simulated step time that fits is the reference. Then a GNN policy trains
with REINFORCE (warm start on, the same wall-time budget per row) twice per seed: with
the env's plain action (a device per group and the hybrid split) and with
``levers=("priority", "recompute")``. The compile lever is left out: the simulator prices
a compiled piece as eager, so it would only add noise to the reward. The best plan of
every run is re-simulated outside the env. Writes ``env_levers.json`` and
``env_levers.md`` to ``--out`` (default: a new run folder
``bench/results/<date>-cpux1-env-levers/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import torch
from results import write_run
from run_folder import output_folder

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import format_bytes, resolve
from autoplace.costs import estimate_costs
from autoplace.grouping import auto_group_count
from autoplace.plan import Plan, strict_json
from autoplace.policies import train
from autoplace.sim import simulate
from autoplace.sim.workspace import blas_workspace_bytes

#: workload -> options: batch sizes where activations are most of a device's memory
SCENARIOS = {"gpt-small": {"batch_size": 32}, "inception-v3": {"batch_size": 64},
             "gnmt-4": {"batch_size": 256}}
ARMS = {"plain": (), "levers": ("priority", "recompute")}

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--workloads", default=",".join(SCENARIOS), help="comma-separated")
parser.add_argument("--cluster", default="h100x2", help="cluster preset (simulated)")
parser.add_argument("--cap", type=float, default=0.5,
                    help="memory cap per device, a fraction of the single-device peak")
parser.add_argument("--seeds", default="0,1", help="comma-separated training seeds")
parser.add_argument("--budget-s", type=float, default=150.0, help="training wall time per row")
parser.add_argument("--batch-size", type=int, default=16, help="episodes per update")
parser.add_argument("--baselines", default="hash,critical-path,mincut,expert,m-etf,hybrid-dp,"
                    "pipeline,ddp,zero2,fsdp,single", help="heuristics to compare with")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--quick", action="store_true", help="smoke test: gnmt-4, 2 updates")
parser.add_argument("--out", default=None, help="output folder (default: a new run folder)")
parser.add_argument("--tag", default="env-levers", help="the new run folder's tag")
parser.add_argument("--merge", default=None,
                    help="comma-separated env_levers.json of parts run side by side: train "
                         "nothing, write their rows as one table")
args = parser.parse_args()
torch.set_num_threads(args.threads)
started = time.perf_counter()
budget = "2" if args.quick else f"{args.budget_s:g}s"
names = ["gnmt-4"] if args.quick else args.workloads.split(",")
seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]

rows: list[dict] = []
scenarios: dict[str, dict] = {}
parts = [json.loads(Path(f).read_text()) for f in args.merge.split(",")] if args.merge else []
for part in parts:
    rows += part["rows"]
    scenarios.update(part["scenarios"])
if parts:
    names = []

for workload in names:
    options = SCENARIOS.get(workload, {})
    graph = capture_workload(workloads.get(workload, device="meta", **options))
    base = resolve(args.cluster)
    estimate_costs(graph, base)
    single = simulate(graph, Plan.single(graph), base)
    w = blas_workspace_bytes(base.devices[0])  # cuBLAS's workspaces: no split divides them
    cluster = base.with_memory_cap(int(w + args.cap * (single.peak_memory_bytes[0] - w)))
    heuristics = {}
    for name in args.baselines.split(","):
        try:
            plan = planners.get(name)(graph, cluster)
            res = simulate(graph, plan, cluster)
            heuristics[name] = {"step_time_s": None if res.oom else res.step_time_s,
                                "plan": plan.describe()}
        except Exception as e:  # noqa: BLE001 - a failing heuristic is a table entry
            heuristics[name] = {"step_time_s": None, "plan": f"failed: {e}"[:120]}
    fits = {k: v["step_time_s"] for k, v in heuristics.items() if v["step_time_s"]}
    best = min(fits, key=fits.__getitem__) if fits else None
    scenarios[workload] = {
        "options": options, "ops": len(graph), "cluster": args.cluster,
        "memory_cap": format_bytes(cluster.devices[0].usable_memory_bytes),
        "single_step_time_s": single.step_time_s,
        "single_peak_bytes": single.peak_memory_bytes[0], "heuristics": heuristics,
        "best_heuristic": best, "best_heuristic_step_time_s": fits.get(best)}
    max_groups = auto_group_count(graph)
    for seed in seeds:
        for arm, levers in ARMS.items():
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                res = train(graph, cluster, policy="gnn", budget=budget, out_dir=tmp,
                            seed=seed, max_groups=max_groups, progress=False,
                            batch_size=args.batch_size, tensorboard=False,
                            env_options={"levers": levers})
                train_s = time.perf_counter() - t
            step, plan = math.inf, res.best_plan
            if isinstance(plan, Plan):  # re-scored outside the env
                check = simulate(graph, plan, cluster)
                step = math.inf if check.oom else check.step_time_s
            ref = scenarios[workload]["best_heuristic_step_time_s"]
            rows.append({
                "workload": workload, "seed": seed, "arm": arm, "levers": list(levers),
                "step_time_s": step, "train_time_s": train_s,
                "updates": len(res.history["reward_mean"]),
                "episodes": int(res.history["episodes"][-1]) if res.history["episodes"] else 0,
                # the plan the warm start imitated: None when even it does not fit the cap
                "warm_start_step_time_s": next(
                    (t["step_time_s"] for t in res.warm_start.get("targets", {}).values()
                     if t.get("fits")), None),
                "warm_start_source": next(
                    (t["source"] for t in res.warm_start.get("targets", {}).values()), None),
                "plan": plan.describe() if isinstance(plan, Plan) else None,
                "recomputed_groups": len(plan.recompute) + len(plan.selective)
                if isinstance(plan, Plan) else None,
                "priority": list(plan.priority) if isinstance(plan, Plan) else None,
                "ratio_to_best_heuristic": step / ref if ref and math.isfinite(step) else None})
            r = rows[-1]
            print(f"{workload:13s} seed {seed} {arm:7s} {step * 1e3:9.3f} ms  best heuristic "
                  f"{best} {(ref or math.inf) * 1e3:9.3f} ms  ratio "
                  f"{r['ratio_to_best_heuristic'] or float('nan'):.3f}  {r['updates']} updates "
                  f"in {train_s:.0f} s  plan {r['plan']}", flush=True)

# ---------------------------------------------------------------- write results
out = output_folder(args.out, args.tag)
meta = {"benchmark": "env_levers", "backend": "sim (simulated step times)",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, 2-core CPU, "
                   f"{torch.get_num_threads()} torch thread(s); step times are simulated",
        "torch": torch.__version__, "args": vars(args),
        "total_time_s": time.perf_counter() - started}
if parts:
    meta.update(date=max(p["date"] for p in parts), args={**parts[0]["args"], "merge": args.merge},
                total_time_s=sum(p["total_time_s"] for p in parts))
(out / "env_levers.json").write_text(json.dumps(strict_json(
    {**meta, "scenarios": scenarios, "rows": rows}), indent=1, default=str, allow_nan=False))


def ms(x: float | None) -> str:
    return f"{x * 1e3:.3f}" if x is not None and math.isfinite(x) else "OOM"


a = meta["args"]
lines = [f"# GNN policy with and without lever heads (simulated), {meta['date']}", "",
         f"Cluster {a['cluster']} (simulated), every device capped at {a['cap']} of the "
         f"single-device peak; GNN policy, REINFORCE with warm start, {a['budget_s']:.0f} s of "
         f"training per row, batch {a['batch_size']}; arms: plain (device per group + hybrid "
         "split) and levers (plus priority and recompute per group). "
         f"{meta['machine']}; torch {meta['torch']}. Ratio < 1: faster than the best "
         "heuristic.", "",
         "| workload | cap | best heuristic | its ms | arm | warm start ms per seed | "
         "best ms per seed | mean ratio | plans (recomputed groups) | updates |",
         "| --- | --- | --- | ---: | --- | --- | --- | ---: | --- | --- |"]
summary = {}
for workload, sc in scenarios.items():
    for arm in ARMS:
        mine = [r for r in rows if r["workload"] == workload and r["arm"] == arm]
        if not mine:
            continue
        ratios = [r["ratio_to_best_heuristic"] for r in mine if r["ratio_to_best_heuristic"]]
        mean = sum(ratios) / len(ratios) if ratios else None
        summary[(workload, arm)] = mean
        lines.append(
            f"| {workload} (batch {sc['options'].get('batch_size', '-')}) | {sc['memory_cap']} | "
            f"{sc['best_heuristic']} | {ms(sc['best_heuristic_step_time_s'])} | {arm} | "
            + " / ".join(f"{ms(r['warm_start_step_time_s'])} ({r['warm_start_source']})"
                         for r in mine) + " | "
            + " / ".join(ms(r["step_time_s"]) for r in mine)
            + f" | {f'{mean:.3f}' if mean else '-'} | "
            + "; ".join(f"{r['plan']} ({r['recomputed_groups']})" for r in mine)
            + " | " + " / ".join(str(r["updates"]) for r in mine) + " |")
lines += ["", "Heuristics per workload (simulated ms; OOM: does not fit the cap):", ""]
for workload, sc in scenarios.items():
    lines.append(f"- {workload}: " + ", ".join(
        f"{k} {ms(v['step_time_s'])}" for k, v in sc["heuristics"].items()))
(out / "env_levers.md").write_text("\n".join(lines) + "\n")
write_run(out, tag=args.tag, scenarios=[f"env-levers:{w}" for w in scenarios],
          kind="experiment", script="scripts/bench/bench_env_levers.py",
          summary="GNN policy with and without priority/recompute heads vs the best heuristic "
                  "under a memory cap (simulated): mean ratio " + ", ".join(
                      f"{w} {arm} {v:.3f}" for (w, arm), v in summary.items() if v) + ".")
print(f"wrote {out / 'env_levers.json'} and .md ({time.perf_counter() - started:.0f} s)")
