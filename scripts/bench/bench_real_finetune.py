"""A simulator-trained policy, then the same policy fine-tuned on measured step times, and
the best heuristic, measured side by side on the machine's devices.

    python scripts/bench/bench_real_finetune.py                      # this machine's GPU(s)
    python scripts/bench/bench_real_finetune.py --scenarios gpt-1b:22GB --sim-budget 60s
    python scripts/bench/bench_real_finetune.py --smoke --out /tmp/ft   # gpt-tiny on a CPU

A scenario is ``MODEL:CAP``: a zoo workload and a memory cap per device, either a size
(``22GB``) or a fraction of the simulated eager peak (``0.85x``: a cap where plain eager
does not fit). On a simulated H200 (batch 8) eager needs 28.5 GB for gpt-1b and 4.6 GB for
gpt-medium; at the default caps (22 GB, 0.85x = 3.9 GB) eager, selective recompute and
compiled eager run out of memory and every block recomputed fits (20.6 GB, 3.7 GB). The cluster is ``--cluster`` (default ``detect``). On one GPU a placement is
trivial, so the policy also picks the env's levers (``--levers``, default recompute and
compile per group) and the microbatch count. Per scenario:

1. ``sim-only``: :func:`autoplace.policies.train` on the simulator for ``--sim-budget``
   (warm start on), its checkpoint kept;
2. ``fine-tuned``: ``train(backend="real", init=<sim-only checkpoint>)`` for
   ``--real-budget``, the same seed: the sim-only policy's best plans measured at the
   switch, the baselines corrected, REINFORCE on measured step times
   (:mod:`autoplace.policies.stages`);
3. the sim-only run's best plan, the fine-tuned run's, and the ``--heuristics`` fastest
   (simulated) heuristics that fit (eager and :func:`autoplace.planners.manual.lever_plans`)
   are each run ``--rounds`` times in one measuring worker, in interleaved order (odd rounds
   reversed), ``--steps`` steps of which ``--warmup`` untimed each time.

``real_finetune.json`` and ``real_finetune.md`` go to ``--out`` or a new run folder
``bench/results/<date>-<card>x<n>-real-finetune/``, with each training run's folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time

import torch
from results import write_run
from run_folder import output_folder

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import format_bytes, parse_bytes, resolve
from autoplace.costs import estimate_costs
from autoplace.envs.backends import RealBackend
from autoplace.executor.pieces import COMPILE_BACKEND_ENV
from autoplace.plan import Plan, strict_json
from autoplace.planners.manual import lever_plans
from autoplace.policies import train
from autoplace.search.families import signature
from autoplace.sim import simulate

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--scenarios", default="gpt-1b:22GB,gpt-medium:0.85x",
                    help="comma-separated MODEL:CAP (CAP: a size such as 22GB, or a fraction "
                         "of the simulated eager peak such as 0.85x)")
parser.add_argument("--cluster", default="detect", help="cluster preset, JSON or detect")
parser.add_argument("--policy", default="gnn", help="seq2seq, hierarchical or gnn")
parser.add_argument("--levers", default="recompute,compile", help="env levers, comma-separated")
parser.add_argument("--sim-budget", default="60s", help="simulator training budget")
parser.add_argument("--real-budget", default="100s", help="fine-tuning budget (measured)")
parser.add_argument("--batch-size", type=int, default=16, help="plans per update (simulator)")
parser.add_argument("--real-batch-size", type=int, default=4, help="plans per update (measured)")
parser.add_argument("--seed", type=int, default=0, help="training seed (both runs)")
parser.add_argument("--steps", type=int, default=5, help="steps per measurement, warm-up included")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps per measurement")
parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the comparison")
parser.add_argument("--heuristics", type=int, default=2,
                    help="fastest simulated heuristics that fit, measured beside the policies")
parser.add_argument("--threads", type=int, default=None, help="CPU threads of the workers")
parser.add_argument("--smoke", action="store_true",
                    help="gpt-tiny on one CPU device, tiny budgets (a check that it runs)")
parser.add_argument("--out", default=None, help="output folder (default: a new run folder)")
parser.add_argument("--tag", default="real-finetune", help="the new run folder's tag")
args = parser.parse_args()
if args.smoke:
    args.scenarios, args.cluster, args.levers = "gpt-tiny:none", "cpu-x1", "recompute"
    args.sim_budget, args.real_budget, args.batch_size, args.real_batch_size = "3up", "2up", 4, 2
    args.steps, args.warmup, args.rounds, args.heuristics, args.threads = 2, 1, 2, 2, 1
    os.environ.setdefault(COMPILE_BACKEND_ENV, "aot_eager")  # a compiled piece on a CPU
started = time.perf_counter()
cuda = torch.cuda.is_available()
card = torch.cuda.get_device_name(0) if cuda and args.cluster != "cpu-x1" else "cpu"
levers = tuple(x for x in args.levers.split(",") if x)
base = resolve(args.cluster)
out = output_folder(args.out, args.tag, card=card, gpus=base.num_devices if card != "cpu" else 1)


def say(msg: str) -> None:
    print(f"[real-finetune {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cap_of(text: str, graph, cluster) -> int | None:
    """The cap a scenario names: a size, a fraction of the simulated eager peak, or none."""
    if text.lower() == "none":
        return None
    if text.endswith("x"):
        peak = max(simulate(graph, Plan.single(graph), cluster).peak_memory_bytes)
        return int(float(text[:-1]) * peak)
    return parse_bytes(text)


def describe(plan: Plan) -> str:
    """The plan's split and levers in a few words (a one-device plan's whole content)."""
    sel = f", {len(plan.selective)} selective" if plan.selective else ""
    return (f"{plan.split()}, {len(plan.recompute)}{sel} of {plan.num_groups} groups "
            "recomputed")


def measure_interleaved(spec: dict, cluster, plans: dict[str, Plan]) -> dict[str, dict]:
    """Each plan ``--rounds`` times in one worker, in interleaved order (odd rounds reversed)."""
    backend = RealBackend(spec, cluster, steps=args.steps, warmup=args.warmup,
                          threads=args.threads, timeout_s=600.0)
    times: dict[str, list[float]] = {name: [] for name in plans}
    errors: dict[str, str] = {}
    try:
        # discarded: a fresh worker's first run is slow throughout (policies.finetune)
        backend.evaluate(next(iter(plans.values())))
        for r in range(args.rounds):
            order = list(plans) if r % 2 == 0 else list(reversed(plans))
            for name in order:
                m = backend.evaluate(plans[name])
                if m.failed:
                    errors[name] = m.error or "failed"
                else:
                    times[name].append(m.step_time_s)
    finally:
        backend.close()
    return {name: {"plan": describe(plans[name]), "step_times_s": times[name],
                   "median_s": statistics.median(times[name]) if times[name] else None,
                   "min_s": min(times[name], default=None), "max_s": max(times[name], default=None),
                   "error": errors.get(name)} for name in plans}


rows = []
for scenario in args.scenarios.split(","):
    model, _, cap_text = scenario.partition(":")
    t_scenario = time.perf_counter()
    wl = workloads.get(model, device="meta")
    graph = capture_workload(wl)
    estimate_costs(graph, base)
    cap = cap_of(cap_text or "none", graph, base)
    cluster = base.with_memory_cap(cap) if cap else base
    spec = {"spec": model, "options": {"batch_size": wl.batch_size}, "seed": 0}
    env_options = {"levers": levers, "steps": args.steps, "warmup": args.warmup,
                   "worker_threads": args.threads,
                   "workload_options": {"batch_size": wl.batch_size}}
    folder = out / scenario.replace(":", "-").replace(".", "_")
    say(f"{scenario}: {len(graph)} ops, batch {wl.batch_size}, cluster {cluster.name}, cap "
        f"{format_bytes(cap) if cap else 'none'}")

    t = time.perf_counter()
    sim_only = train(model, cluster, policy=args.policy, budget=args.sim_budget,
                     out_dir=folder / "sim-only", force=True, seed=args.seed, progress=False,
                     batch_size=args.batch_size, env_options=env_options)
    sim_train_s = time.perf_counter() - t
    say(f"sim-only: {describe(sim_only.best_plan)}, {sim_only.best_step_time_s * 1e3:.3f} ms "
        f"simulated ({sim_train_s:.0f} s)")
    t = time.perf_counter()
    tuned = train(model, cluster, backend="real", budget=args.real_budget,
                  init=folder / "sim-only" / "checkpoint.pt", out_dir=folder / "fine-tuned",
                  force=True, seed=args.seed, progress=False, batch_size=args.batch_size,
                  real_batch_size=args.real_batch_size)
    real_train_s = time.perf_counter() - t
    stages = tuned.stages
    say(f"fine-tuned: {describe(tuned.best_plan)}, {tuned.best_step_time_s * 1e3:.3f} ms "
        f"measured, faster: {stages['faster']} ({stages['why']}) ({real_train_s:.0f} s)")

    heuristics = {"eager": Plan.single(graph, cluster=cluster), **lever_plans(graph, cluster)}
    simulated = {}
    for name, plan in heuristics.items():
        res = simulate(graph, plan, cluster)
        simulated[name] = None if res.oom else res.step_time_s
    fits = sorted((s, n) for n, s in simulated.items() if s is not None)[:args.heuristics]
    plans = {"sim-trained": sim_only.best_plan, "fine-tuned": tuned.best_plan,
             **{f"heuristic:{n}": heuristics[n] for _, n in fits}}
    if signature(plans["fine-tuned"]) == signature(plans["sim-trained"]):
        plans.pop("fine-tuned")  # the same plan: measured once per round
    measured = measure_interleaved(spec, cluster, plans)
    measured.setdefault("fine-tuned", {**measured["sim-trained"], "same_as": "sim-trained"})
    heur = {k: v for k, v in measured.items() if k.startswith("heuristic:") and v["median_s"]}
    best_heuristic = min(heur, key=lambda k: heur[k]["median_s"]) if heur else None
    sim_ms, tuned_ms = measured["sim-trained"]["median_s"], measured["fine-tuned"]["median_s"]
    rows.append({
        "scenario": scenario, "model": model, "batch_size": wl.batch_size, "ops": len(graph),
        "cluster": cluster.name, "memory_cap_bytes": cap, "levers": list(levers),
        "sim_only": {"plan": describe(sim_only.best_plan), "train_s": sim_train_s,
                     "simulated_step_time_s": sim_only.best_step_time_s,
                     "updates": len(sim_only.history["reward_mean"])},
        "fine_tune": {"plan": describe(tuned.best_plan), "train_s": real_train_s,
                      "best_step_time_s": tuned.best_step_time_s, "stages": stages},
        "heuristics_simulated_s": simulated, "measured": measured,
        "best_heuristic": best_heuristic,
        "fine_tuned_over_sim_trained": tuned_ms / sim_ms if sim_ms and tuned_ms else None,
        "fine_tuned_over_best_heuristic": tuned_ms / heur[best_heuristic]["median_s"]
        if best_heuristic and tuned_ms else None,
        "scenario_s": time.perf_counter() - t_scenario})
    say(f"{scenario}: sim-trained {sim_ms}, fine-tuned {tuned_ms}, best heuristic "
        f"{best_heuristic} ({time.perf_counter() - t_scenario:.0f} s)")


# ---------------------------------------------------------------- write results
meta = {"benchmark": "real_finetune", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{card}, {platform.processor() or platform.machine()}",
        "torch": torch.__version__, "args": vars(args),
        "total_time_s": time.perf_counter() - started}
(out / "real_finetune.json").write_text(json.dumps(strict_json({**meta, "rows": rows}),
                                                   indent=1, default=str, allow_nan=False))


def ms(x: float | None) -> str:
    return f"{x * 1e3:.3f}" if x is not None and math.isfinite(x) else "-"


def ratio(x: float | None) -> str:
    return f"{x:.3f}" if x else "-"


a = meta["args"]
lines = [f"# Simulator-trained vs fine-tuned on measured step times, {meta['date']}", "",
         f"{meta['machine']}; torch {meta['torch']}. Policy {a['policy']}, levers "
         f"{a['levers']}; simulator budget {a['sim_budget']}, measured budget "
         f"{a['real_budget']} ({a['real_batch_size']} plans per update). Step times measured "
         f"in one worker, {a['rounds']} interleaved rounds of {a['steps']} steps "
         f"({a['warmup']} untimed): median [min-max]. Ratio < 1: the fine-tuned plan is faster.",
         "", "| scenario | cap | sim-trained plan | ms | fine-tuned plan | ms | best heuristic "
         "| ms | fine-tuned / sim-trained | fine-tuned / heuristic | measured/simulated at "
         "the switch | faster in training |",
         "| --- | --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | --- |"]


def cell(m: dict) -> str:
    return f"{ms(m['median_s'])} [{ms(m['min_s'])}-{ms(m['max_s'])}]" if m["median_s"] \
        else (m.get("error") or "-")[:60]


for r in rows:
    m, h = r["measured"], r["best_heuristic"]
    switch = r["fine_tune"]["stages"].get("switch", {})
    lines.append(
        f"| {r['scenario']} | {format_bytes(r['memory_cap_bytes']) if r['memory_cap_bytes'] else '-'}"
        f" | {r['sim_only']['plan']} | {cell(m['sim-trained'])} | {r['fine_tune']['plan']} | "
        f"{cell(m['fine-tuned'])} | {h or '-'} | {cell(m[h]) if h else '-'} | "
        f"{ratio(r['fine_tuned_over_sim_trained'])} | "
        f"{ratio(r['fine_tuned_over_best_heuristic'])} | " + ", ".join(
            f"{k} {v:.2f}x" for k, v in switch.get("ratios", {}).items())
        + f" | {r['fine_tune']['stages'].get('faster') or '-'} |")
lines += ["", "Why, per scenario (from the fine-tuning run):", ""]
lines += [f"- {r['scenario']}: {r['fine_tune']['stages'].get('why')}" for r in rows]
(out / "real_finetune.md").write_text("\n".join(lines) + "\n")
write_run(out, tag=args.tag, scenarios=[f"real-finetune:{r['scenario']}" for r in rows],
          kind="experiment", script="scripts/bench/bench_real_finetune.py",
          summary="simulator-trained vs fine-tuned on measured step times vs best heuristic, "
                  "measured interleaved: fine-tuned / sim-trained " + ", ".join(
                      f"{r['scenario']} {ratio(r['fine_tuned_over_sim_trained'])}"
                      for r in rows) + ".")
say(f"wrote {out / 'real_finetune.json'} and .md ({time.perf_counter() - started:.0f} s)")
