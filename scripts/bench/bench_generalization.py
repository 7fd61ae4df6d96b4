"""Zero-shot placement: a GNN trained on a family of graphs places held-out graphs.

    python scripts/bench/bench_generalization.py           # defaults below
    python scripts/bench/bench_generalization.py --quick   # smoke test

Training family: zoo workloads at several sizes (gpt-tiny, gnmt, branchy-mlp, rnnlm,
resnet50 variants) plus ``random_dag`` graphs. Held out: other sizes of the same
models, a model family member never seen at that depth, and fresh random DAGs. For
each held-out graph the family policy places it without training (``place``: greedy
plus ``--samples`` sampled plans scored on the simulator, timed), and a policy trained
on that graph alone (``--dedicated-policy``, ``--graph-budget``) gives the reference.
Goal: zero-shot within 10% of the dedicated policy (simulated step time), in under a
second per graph. Writes ``generalization.json`` and ``.md`` to ``--out``, by default a new
run folder ``bench/results/<date>-cpux1-<tag>/``.
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
from autoplace.cluster import resolve
from autoplace.costs import estimate_costs
from autoplace.graph import random_dag
from autoplace.plan import Plan
from autoplace.policies import place, train
from autoplace.sim import simulate

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--cluster", default="h100x2", help="cluster preset")
parser.add_argument("--family-budget", default="12000ep", help="training budget on the family")
parser.add_argument("--graph-budget", default="2000ep", help="budget of each dedicated policy")
parser.add_argument("--dedicated-policy", default="gnn", help="policy trained per graph")
parser.add_argument("--samples", type=int, default=16, help="sampled plans scored zero-shot")
parser.add_argument("--max-groups", type=int, default=16, help="groups a graph is coarsened to")
parser.add_argument("--hidden", type=int, default=64, help="GNN width")
parser.add_argument("--conv", default="sage", help="GNN convolution: sage or gat")
parser.add_argument("--batch-size", type=int, default=16, help="episodes per update")
parser.add_argument("--seed", type=int, default=0, help="training seed")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
parser.add_argument("--quick", action="store_true", help="smoke test: tiny budgets")
parser.add_argument("--out", default=None,
                    help="output folder (default: a new run folder under bench/results)")
parser.add_argument("--tag", default="generalization",
                    help="the new run folder's tag (without --out)")
args = parser.parse_args()
if args.quick:
    args.family_budget, args.graph_budget, args.samples = "4", "2", 4
torch.set_num_threads(args.threads)
cluster = resolve(args.cluster)

# (label, zoo name, options) of the models; random DAGs are (label, ops, seed)
FAMILY = [
    ("gpt-tiny-L1", "gpt-tiny", {"n_layers": 1}), ("gpt-tiny-L2", "gpt-tiny", {"n_layers": 2}),
    ("gpt-tiny-L3", "gpt-tiny", {"n_layers": 3}), ("gnmt-2", "gnmt-2", {}),
    ("gnmt-4", "gnmt-4", {}), ("branchy-b2d2", "branchy-mlp", {"branches": 2, "depth": 2}),
    ("branchy-b4d3", "branchy-mlp", {"branches": 4, "depth": 3}),
    ("rnnlm-L2", "rnnlm", {"layers": 2}), ("rnnlm-L4", "rnnlm", {"layers": 4}),
    ("resnet-small", "resnet50", {"blocks": (1, 1, 1, 1)}),
]
FAMILY_DAGS = [(f"dag{n}-s{s}", n, s) for n in (30, 60, 100) for s in (0, 1, 2)]
HELD_OUT = [
    ("gpt-tiny-L4", "gpt-tiny", {"n_layers": 4}), ("gnmt-8", "gnmt-8", {}),
    ("branchy-b3d4", "branchy-mlp", {"branches": 3, "depth": 4}),
    ("rnnlm-L3", "rnnlm", {"layers": 3}), ("resnet-2222", "resnet50", {"blocks": (2, 2, 2, 2)}),
]
HELD_OUT_DAGS = [("dag80-s100", 80, 100), ("dag150-s101", 150, 101)]
if args.quick:
    FAMILY, FAMILY_DAGS = FAMILY[:2], FAMILY_DAGS[:2]
    HELD_OUT, HELD_OUT_DAGS = [], HELD_OUT_DAGS[:1]


def model_graph(name: str, options: dict):
    graph = capture_workload(workloads.get(name, device="meta", **options))
    estimate_costs(graph, cluster)
    return graph


def dag_graph(ops: int, seed: int):
    graph = random_dag(ops, seed=seed, device_kind=cluster.devices[0].kind)
    estimate_costs(graph, cluster)
    return graph


started = time.perf_counter()
family = [model_graph(n, o) for _, n, o in FAMILY] + [dag_graph(n, s) for _, n, s in FAMILY_DAGS]
held = [(label, model_graph(n, o)) for label, n, o in HELD_OUT]
held += [(label, dag_graph(n, s)) for label, n, s in HELD_OUT_DAGS]
print(f"family: {len(family)} graphs ({sum(len(g) for g in family)} ops), held out: {len(held)}")

# 1. one GNN on the whole family
work = Path(tempfile.mkdtemp(prefix="autoplace-gen-"))
t = time.perf_counter()
fam = train(family, cluster, policy="gnn", budget=args.family_budget, out_dir=work / "family",
            seed=args.seed, max_groups=args.max_groups, progress=True,
            batch_size=args.batch_size, policy_options={"hidden": args.hidden, "conv": args.conv})
family_train_s = time.perf_counter() - t
print(f"family training: {family_train_s:.0f} s, {len(fam.history['reward_mean'])} updates")

# 2. every held-out graph: zero-shot vs a policy trained on it vs the baselines
rows = []
for label, graph in held:
    plan = place(work / "family" / "checkpoint.pt", graph, cluster, samples=args.samples,
                 seed=args.seed)
    zero_s = plan.planner["search_time_s"]
    zero = simulate(graph, plan, cluster)
    zero_step = math.inf if zero.oom else zero.step_time_s
    t = time.perf_counter()
    own = train(graph, cluster, policy=args.dedicated_policy, budget=args.graph_budget,
                out_dir=work / label, seed=args.seed, max_groups=args.max_groups,
                progress=False, batch_size=args.batch_size, tensorboard=False)
    own_s = time.perf_counter() - t
    base = {}
    for name in ("critical-path", "m-etf", "expert"):
        r = simulate(graph, planners.get(name)(graph, cluster), cluster)
        base[name] = math.inf if r.oom else r.step_time_s
    ratio = zero_step / own.best_step_time_s
    rows.append({"graph": label, "ops": len(graph), "zero_shot_step_time_s": zero_step,
                 "zero_shot_time_s": zero_s, "zero_shot_plan": plan.describe(),
                 "dedicated_step_time_s": own.best_step_time_s, "dedicated_train_s": own_s,
                 "ratio_zero_shot_to_dedicated": ratio, "within_10pct": ratio <= 1.10,
                 "baselines": base,
                 "single_step_time_s": simulate(graph, Plan.single(graph), cluster).step_time_s})
    print(f"{label:14s} ops={len(graph):4d} zero-shot {zero_step * 1e3:8.3f} ms "
          f"({zero_s:.2f} s)  dedicated {own.best_step_time_s * 1e3:8.3f} ms ({own_s:.0f} s)  "
          f"ratio {ratio:.3f}  best baseline {min(base.values()) * 1e3:.3f} ms", flush=True)

# ---------------------------------------------------------------- write results
out = output_folder(args.out, args.tag)
meta = {"benchmark": "gnn_zero_shot_generalization", "backend": "sim (simulated step times)",
        "cluster": args.cluster, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} torch threads",
        "torch": torch.__version__, "args": vars(args), "family_train_s": family_train_s,
        "family": [f[0] for f in FAMILY + FAMILY_DAGS], "total_time_s":
        time.perf_counter() - started}
(out / "generalization.json").write_text(json.dumps({**meta, "rows": rows}, indent=1,
                                                           default=str))
lines = [
    f"# GNN zero-shot placement on held-out graphs ({args.cluster}, simulated), {meta['date']}",
    "", f"Family: {len(meta['family'])} graphs, trained {args.family_budget} "
    f"({family_train_s:.0f} s). Dedicated: {args.dedicated_policy}, {args.graph_budget} per graph. "
    f"Zero-shot (no training on the graph): greedy plan, greedy placement under each "
    f"hybrid split, and {args.samples} samples, scored on the simulator.", "",
    "| graph | ops | zero-shot ms | zero-shot s | dedicated ms | ratio | within 10% "
    "| best baseline ms |",
    "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
]
for r in rows:
    lines.append(f"| {r['graph']} | {r['ops']} | {r['zero_shot_step_time_s'] * 1e3:.3f} | "
                 f"{r['zero_shot_time_s']:.2f} | {r['dedicated_step_time_s'] * 1e3:.3f} | "
                 f"{r['ratio_zero_shot_to_dedicated']:.3f} | "
                 f"{'yes' if r['within_10pct'] else 'no'} | "
                 f"{min(r['baselines'].values()) * 1e3:.3f} |")
(out / "generalization.md").write_text("\n".join(lines) + "\n")
within = sum(bool(r["within_10pct"]) for r in rows)
write_run(out, tag=args.tag, scenarios=["generalization:zero-shot"], kind="experiment",
          script="scripts/bench/bench_generalization.py",
          summary=f"GNN policy zero-shot on {len(rows)} held-out graphs: {within} within 10% "
                  "of a policy trained on that graph.")
print(f"wrote {out / 'generalization.json'} and .md ({time.perf_counter() - started:.0f} s)")
