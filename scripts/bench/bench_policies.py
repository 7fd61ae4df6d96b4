"""RL policies vs baseline planners on the simulator: one row per scenario and policy.

    python scripts/bench/bench_policies.py                # every zoo workload, 2 and 4 GPUs,
                                                          # without and with a memory cap
    python scripts/bench/bench_policies.py --quick        # smoke test: 1 workload, tiny budget
    python scripts/bench/bench_policies.py --workloads gpt-small,gnmt-8 --budget 5000ep

A scenario is workload x cluster preset x memory cap. The cap is a fraction of the
simulated single-device peak memory (``--caps none,0.6``: uncapped, then 60% of what
one device would need), so a capped model has to be split. For each scenario every
baseline (``--baselines``) plans on the whole op graph and each policy trains with
REINFORCE on the simulator (``--budget`` per row, never more than ``--row-limit-s``)
over the graph coarsened to ``--max-groups`` groups (``auto``: a count per graph from
its branch structure, ``autoplace.grouping.auto_group_count``). The table gives each
policy's best simulated step time, the best baseline's, their ratio, the lower bound and
the training time. Writes ``policies.json`` and ``policies.md`` to ``--out``, by default a
new run folder ``bench/results/<date>-cpux1-<tag>/``.

The table can run as parts side by side (one process per core) and be merged:

    python scripts/bench/bench_policies.py --workloads gpt-tiny,gpt-small --out /tmp/a &
    python scripts/bench/bench_policies.py --workloads gnmt-2,gnmt-4 --out /tmp/b &
    wait
    python scripts/bench/bench_policies.py --merge /tmp/a/policies.json,/tmp/b/policies.json
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
from autoplace.sim import lower_bound, simulate
from autoplace.sim.workspace import blas_workspace_bytes

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--workloads", default="all", help="comma-separated zoo names, or all")
parser.add_argument("--clusters", default="h100x2,h100x4", help="comma-separated presets")
parser.add_argument("--caps", default="none,0.6",
                    help="memory caps as fractions of the single-device peak; none = uncapped")
parser.add_argument("--policies", default="seq2seq,hierarchical,gnn", help="policies to train")
parser.add_argument("--baselines", default="hash,critical-path,mincut,expert,m-etf",
                    help="baseline planners to compare with")
parser.add_argument("--budget", default="10000ep", help="training budget per row (see train)")
parser.add_argument("--row-limit-s", type=float, default=20.0,
                    help="wall-time cap of one policy's training")
parser.add_argument("--batch-size", type=int, default=16, help="episodes per update")
parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
parser.add_argument("--max-groups", default="auto",
                    help="groups a graph is coarsened to: a number, or auto "
                         "(autoplace.grouping.auto_group_count: 16, plus 2 per multi-branch "
                         "block after the first, at most 32; 8 for a small fork-join graph)")
parser.add_argument("--grouping", default="branch",
                    help="coarsening method of the env: branch, contiguous or module")
parser.add_argument("--split-explore", type=float, default=0.5,
                    help="share of each batch whose hybrid split is forced (stratified)")
parser.add_argument("--hybrid-entropy-coef", type=float, default=0.05,
                    help="extra entropy bonus of the split head")
parser.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus")
parser.add_argument("--seed", type=int, default=0, help="training seed")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--quick", action="store_true",
                    help="smoke test: gnmt-2 on h100x2, 3 updates")
parser.add_argument("--out", default=None,
                    help="output folder (default: a new run folder under bench/results)")
parser.add_argument("--tag", default="policies", help="the new run folder's tag (without --out)")
parser.add_argument("--merge", default=None,
                    help="comma-separated JSON files of earlier runs (e.g. parts of the table "
                         "run side by side with --workloads): train nothing, write their rows "
                         "as one table, with the first file's settings; a row of a later file "
                         "replaces the same (workload, cluster, cap, policy) row of an earlier "
                         "one, so rows retrained with a longer --row-limit-s can be merged in")
args = parser.parse_args()
if args.quick:
    args.workloads, args.clusters, args.budget = "gnmt-2", "h100x2", "3"
torch.set_num_threads(args.threads)

names = workloads.names() if args.workloads == "all" else args.workloads.split(",")
caps = [None if c == "none" else float(c) for c in args.caps.split(",")]
rows: list[dict] = []
started = time.perf_counter()
parts = [json.loads(Path(f).read_text()) for f in args.merge.split(",")] if args.merge else []
if parts:
    names = []  # nothing to run
    merged: dict[tuple, dict] = {}
    for part in parts:
        for r in part["rows"]:
            r.setdefault("row_limit_s", part["args"]["row_limit_s"])
            merged[(r["workload"], r["cluster"], r["cap_fraction"], r["policy"])] = r
    rows = list(merged.values())
    for key, value in parts[0]["args"].items():
        if key not in ("merge", "tag", "out", "workloads"):
            setattr(args, key, value)

for workload in names:
    graph = capture_workload(workloads.get(workload, device="meta"))
    max_groups = (auto_group_count(graph) if args.max_groups == "auto"
                  else int(args.max_groups))
    for preset in args.clusters.split(","):
        base_cluster = resolve(preset)
        estimate_costs(graph, base_cluster)
        single = simulate(graph, Plan.single(graph), base_cluster)
        for cap in caps:
            cluster = base_cluster
            if cap is not None:
                w = blas_workspace_bytes(base_cluster.devices[0])  # a constant no split divides
                cluster = base_cluster.with_memory_cap(
                    int(w + cap * (single.peak_memory_bytes[0] - w)))
            scenario = {"workload": workload, "ops": len(graph), "cluster": preset,
                        "devices": cluster.num_devices,
                        "memory_cap": None if cap is None else format_bytes(
                            cluster.devices[0].usable_memory_bytes),
                        "cap_fraction": cap, "max_groups": max_groups,
                        "single_step_time_s": single.step_time_s,
                        "lower_bound_s": lower_bound(graph, cluster)}

            # baselines: plan the whole op graph, score on the simulator
            scores = {}
            for name in args.baselines.split(","):
                t = time.perf_counter()
                try:
                    result = simulate(graph, planners.get(name)(graph, cluster), cluster)
                    scores[name] = math.inf if result.oom else result.step_time_s
                except Exception as e:  # noqa: BLE001 - a failing baseline is a table entry
                    print(f"  {name} failed on {workload}/{preset}: {e}")
                    scores[name] = math.inf
                scores[name + "_search_s"] = time.perf_counter() - t
            best_name = min(args.baselines.split(","), key=lambda n: scores[n])
            best_baseline = scores[best_name]

            # policies: REINFORCE on the simulator
            for policy in args.policies.split(","):
                with tempfile.TemporaryDirectory() as tmp:
                    t = time.perf_counter()
                    res = train(graph, cluster, policy=policy, budget=args.budget, out_dir=tmp,
                                seed=args.seed, max_groups=max_groups, progress=False,
                                batch_size=args.batch_size, lr=args.lr,
                                time_limit_s=args.row_limit_s, tensorboard=False,
                                env_options={"grouping": args.grouping},
                                split_explore=args.split_explore,
                                hybrid_entropy_coef=args.hybrid_entropy_coef,
                                entropy_coef=args.entropy_coef)
                    train_s = time.perf_counter() - t
                step = res.best_step_time_s
                if res.best_plan is not None:  # re-score outside the env, as baselines are
                    check = simulate(graph, res.best_plan, cluster)
                    step = math.inf if check.oom else check.step_time_s
                rows.append({
                    **scenario, "policy": policy, "policy_step_time_s": step,
                    "policy_plan": res.best_plan.describe() if res.best_plan else None,
                    "train_time_s": train_s, "updates": len(res.history["reward_mean"]),
                    "row_limit_s": args.row_limit_s,
                    "best_baseline": best_name, "best_baseline_step_time_s": best_baseline,
                    "ratio_to_best_baseline": step / best_baseline if math.isfinite(
                        best_baseline) else None,
                    "ratio_to_lower_bound": step / scenario["lower_bound_s"],
                    "baselines": scores,  # null in the JSON: the plan does not fit
                })
                r = rows[-1]
                print(f"{workload:13s} {preset:7s} cap={scenario['memory_cap'] or '-':>7s} "
                      f"{policy:12s} {step * 1e3:8.3f} ms  best baseline {best_name} "
                      f"{best_baseline * 1e3:8.3f} ms  ratio "
                      f"{r['ratio_to_best_baseline'] or float('nan'):.3f}  "
                      f"train {train_s:6.1f} s", flush=True)

# ---------------------------------------------------------------- write results
out = output_folder(args.out, args.tag)
meta = {"benchmark": "policies_vs_baselines", "backend": "sim (simulated step times)",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                   "torch threads (training ran on CPU; step times are simulated)",
        "torch": torch.__version__, "args": vars(args),
        "total_time_s": time.perf_counter() - started}
if parts:
    meta["date"] = max(p["date"] for p in parts)
    meta["machine"] = parts[0]["machine"]
    meta["total_time_s"] = sum(p["total_time_s"] for p in parts)
    meta["merged_from"] = [{"workloads": p["args"]["workloads"], "date": p["date"],
                            "total_time_s": p["total_time_s"]} for p in parts]


def ms(x: float | None) -> str:
    return f"{x * 1e3:.3f}" if x is not None and math.isfinite(x) else "OOM"


(out / "policies.json").write_text(json.dumps(strict_json({**meta, "rows": rows}),
                                                     indent=1, default=str, allow_nan=False))
lines = [
    f"# Policies vs baselines (simulated), {meta['date']}", "",
    f"Budget {args.budget} per row (cap {args.row_limit_s:.0f} s), batch {args.batch_size}, "
    f"max_groups {args.max_groups}, grouping {args.grouping}, split_explore "
    f"{args.split_explore}, seed {args.seed}; {meta['machine']}; torch {meta['torch']}.",
    "Ratio < 1: the policy's plan is faster than the best baseline's.", "",
]
if args.max_groups == "auto":
    counts = {r["workload"]: r.get("max_groups") for r in rows}
    lines[-1:-1] = ["Groups per workload (auto_group_count: 16, plus 2 per block of three "
                    "or more parallel branches after the first, at most 32; 8 for a graph "
                    "of one such block and at most 8 linear chains): " + ", ".join(
                        f"{w} {k}" for w, k in counts.items()) + "."]
if parts:
    lines[-1:-1] = [f"Run as {len(parts)} processes (workload subsets side by side), merged "
                    f"with --merge; total {meta['total_time_s']:.0f} s of process time."]
    longer = [r for r in rows if r["row_limit_s"] > args.row_limit_s]
    if longer:
        limits = ", ".join(sorted({f"{r['row_limit_s']:.0f} s" for r in longer}))
        lines[-1:-1] = [f"{len(longer)} rows were retrained with a longer time cap ({limits}; "
                        "column 'cap s'), the rest use the cap above."]
lines += [
    "| policy | geomean ratio | faster | tie (within 0.1%) | slower | worst | train s (max) |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
]
geomeans: dict[str, float] = {}
for policy in args.policies.split(","):
    mine = [r for r in rows if r["policy"] == policy and r["ratio_to_best_baseline"]]
    if not mine:
        continue
    ratios = [r["ratio_to_best_baseline"] for r in mine]
    geo = geomeans[policy] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    lines.append(
        f"| {policy} | {geo:.3f} | {sum(x < 0.999 for x in ratios)} | "
        f"{sum(0.999 <= x <= 1.001 for x in ratios)} | {sum(x > 1.001 for x in ratios)} | "
        f"{max(ratios):.3f} | {max(r['train_time_s'] for r in mine):.1f} |")
lines += [
    "",
    "| workload | cluster | cap | policy | policy ms | best baseline | baseline ms | ratio "
    "| / lower bound | train s | cap s |",
    "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
]
for r in rows:
    ratio = r["ratio_to_best_baseline"]
    lines.append(
        f"| {r['workload']} | {r['cluster']} | {r['memory_cap'] or '-'} | {r['policy']} | "
        f"{ms(r['policy_step_time_s'])} | {r['best_baseline']} | "
        f"{ms(r['best_baseline_step_time_s'])} | {f'{ratio:.3f}' if ratio else '-'} | "
        f"{r['ratio_to_lower_bound']:.2f} | {r['train_time_s']:.1f} | "
        f"{r.get('row_limit_s', args.row_limit_s):.0f} |")
(out / "policies.md").write_text("\n".join(lines) + "\n")
write_run(out, tag=args.tag, scenarios=[f"policies:{w}" for w in dict.fromkeys(
              r["workload"] for r in rows)], kind="experiment",
          script="scripts/bench/bench_policies.py",
          summary=f"{', '.join(geomeans) or 'no'} policies against the heuristics on the "
                  f"simulator, {len(rows)} rows: geometric-mean ratio "
                  + (", ".join(f"{p} {g:.3f}" for p, g in geomeans.items()) or "-") + ".")
print(f"wrote {out / 'policies.json'} and .md ({time.perf_counter() - started:.0f} s)")
