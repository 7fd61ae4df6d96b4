"""Train the GNN placer shipped with the package (``policies/pretrained/gnn.pt`` + card).

    nice python scripts/train_pretrained.py --jobs 2               # the shipped weights
    python scripts/train_pretrained.py --quick --out /tmp/pre      # smoke test
    PYTHONPATH=. python scripts/train_pretrained.py --hf-module tests.helpers.hf_models

One :class:`~autoplace.policies.GNNPolicy` per device count (``--devices``, default 2, 4
and 8), each trained on the simulator over a family of graphs: the zoo's architecture
families at many sizes (GPT depth / width / heads, branchy MLPs of 2-8 branches,
ResNets, Inception-v3s, LSTM language models of 2-6 layers) and random layered DAGs, each
on a cluster of that many devices (H100, A100, H200 or CPU presets) with or without a
memory cap (a fraction of the graph's one-device peak). Training is warm start (each
graph's best heuristic plan the env can reach, imitated) then REINFORCE for ``--budget`` in
``--rounds`` rounds, keeping the weights (warm start or a round's) whose zero-shot plans
score best on the training graphs.
Families never seen in training (:data:`HELD_OUT`: GNMT encoder-decoders, and with
``--hf-module`` the Hugging Face T5, Mixtral and ViT) are placed zero-shot at the end,
against the best heuristic plan the env reaches on them; the card records it.

Writes ``gnn.pt`` (one state dict, keys prefixed ``devices<N>.``) and ``gnn.json`` (the
card: command, commit, data, held-out families, results, policy configs) to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import datetime
import json
import math
import multiprocessing
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.costs import estimate_costs
from autoplace.graph import random_dag
from autoplace.plan import Plan
from autoplace.policies import GNNPolicy
from autoplace.policies.pretrained import (
    CARD_PATH,
    EXTRA_FEATURES,
    MAX_GROUPS,
    WEIGHTS_PATH,
    ZERO_SHOT_S,
    _zero_shot,
    make_env,
)
from autoplace.policies.reinforce import ReinforceConfig, parse_budget, reinforce
from autoplace.policies.warm_start import WarmStartTarget, heuristic_target, warm_start
from autoplace.sim import simulate

ROOT = Path(__file__).resolve().parents[1]

#: (label, architecture family, zoo name, options) of the training graphs
FAMILY: list[tuple[str, str, str, dict[str, Any]]] = [
    ("gpt-L1-d64", "gpt", "gpt-tiny", {"n_layers": 1}),
    ("gpt-L2-d64", "gpt", "gpt-tiny", {}),
    ("gpt-L3-d128", "gpt", "gpt-tiny", {"n_layers": 3, "d_model": 128, "n_heads": 4}),
    ("gpt-L6-d64", "gpt", "gpt-tiny", {"n_layers": 6, "batch_size": 8}),
    ("gpt-L2-d256", "gpt", "gpt-small", {"n_layers": 2}),
    ("gpt-L4-d256", "gpt", "gpt-small", {}),
    ("gpt-L6-d384", "gpt", "gpt-small", {"n_layers": 6, "d_model": 384, "n_heads": 6,
                                         "batch_size": 16}),
    ("mlp-b2d2", "mlp", "branchy-mlp", {"branches": 2, "depth": 2}),
    ("mlp-b3d3-sum", "mlp", "branchy-mlp", {"branches": 3, "depth": 3, "hidden": 256,
                                            "combine": "sum"}),
    ("mlp-b4d2-w512", "mlp", "branchy-mlp", {"branches": 4, "depth": 2, "hidden": 512}),
    ("mlp-b6d3", "mlp", "branchy-mlp", {"branches": 6, "depth": 3}),
    ("mlp-b8d2-sum", "mlp", "branchy-mlp", {"branches": 8, "depth": 2, "hidden": 256,
                                            "combine": "sum", "batch_size": 64}),
    ("resnet-1111", "resnet", "resnet50", {"blocks": (1, 1, 1, 1)}),
    ("resnet-2222-w05", "resnet", "resnet50", {"blocks": (2, 2, 2, 2), "width": 0.5}),
    ("resnet-1221-i128", "resnet", "resnet50", {"blocks": (1, 2, 2, 1), "image_size": 128}),
    ("resnet-3463", "resnet", "resnet50", {}),
    ("inception-w025", "inception", "inception-v3", {}),
    ("inception-w05-b16", "inception", "inception-v3", {"width": 0.5, "batch_size": 16}),
    ("rnnlm-L2-h64", "rnn", "rnnlm", {}),
    ("rnnlm-L3-h256", "rnn", "rnnlm", {"layers": 3, "hidden": 256}),
    ("rnnlm-L4-h512", "rnn", "rnnlm", {"layers": 4, "hidden": 512, "seq_len": 35,
                                       "vocab_size": 10000}),
    ("rnnlm-L6-h1024", "rnn", "rnnlm", {"layers": 6, "hidden": 1024, "batch_size": 32}),
    ("rnnlm-L3-h1536", "rnn", "rnnlm", {"layers": 3, "hidden": 1536, "vocab_size": 10000,
                                        "batch_size": 64}),
    ("rnnlm-L4-h3072", "rnn", "rnnlm", {"layers": 4, "hidden": 3072, "vocab_size": 20000,
                                        "seq_len": 30, "batch_size": 32}),
]
#: (label, ops, seed) of the random layered DAGs trained on
DAGS = [(f"dag{n}-s{s}", n, s) for n, s in ((30, 0), (60, 1), (100, 2), (150, 3), (80, 4))]
#: families never trained on: (label, family, zoo name or "hf:<factory>", options)
HELD_OUT: list[tuple[str, str, str, dict[str, Any]]] = [
    ("gnmt-2", "gnmt", "gnmt-2", {}),
    ("gnmt-8", "gnmt", "gnmt-8", {}),
    ("hf-t5", "t5", "hf:t5", {"layers": 2, "hidden": 128}),
    ("hf-mixtral", "mixtral", "hf:mixtral", {"layers": 2, "hidden": 128}),
    ("hf-vit", "vit", "hf:vit", {"layers": 4, "hidden": 128}),
]
HELD_OUT_FAMILIES = sorted({f for _, f, _, _ in HELD_OUT})
#: card kinds of each device count's clusters (presets <kind>x<N>, cpu-x<N>)
KINDS = {2: ("h100", "a100", "h200", "cpu"), 4: ("h100", "a100", "h200", "cpu"),
         8: ("h100", "a100", "h200")}
#: memory caps, as fractions of a graph's one-device peak, in turn (each graph also uncapped)
CAPS = (0.75, 0.5)
MAX_EDGES = 512
#: what a zero-shot plan that does not fit counts as in :func:`training_score`
OUT_OF_MEMORY_RATIO = 4.0


def preset(kind: str, devices: int) -> str:
    return f"cpu-x{devices}" if kind == "cpu" else f"{kind}x{devices}"


def capture(spec: str, options: dict[str, Any], hf_module: str | None):
    if spec.startswith("hf:"):
        spec = f"{hf_module}:{spec[3:]}"
    return capture_workload(workloads.get(spec, device="meta", **options))


def one_device_peak(graph, cluster) -> int:
    estimate_costs(graph, cluster)
    return int(max(simulate(graph, Plan.single(graph, cluster=cluster), cluster)
                   .peak_memory_bytes))


def training_envs(devices: int, quick: bool) -> tuple[list[Any], list[dict[str, Any]]]:
    """The envs of one device count's training family, and what each is."""
    family = FAMILY[:3] if quick else FAMILY
    dags = DAGS[:1] if quick else DAGS
    envs, rows = [], []
    items = [(label, fam, lambda s=spec, o=opts: capture(s, o, None))
             for label, fam, spec, opts in family]
    items += [(label, "dag", lambda n=n, s=s: random_dag(n, seed=s)) for label, n, s in dags]
    kinds = KINDS[devices]
    for i, (label, fam, build) in enumerate(items):
        graph = build()
        # every graph twice: uncapped, and under a cap (CAPS in turn), on two card kinds
        for j, cap_fraction in enumerate((None, CAPS[i % len(CAPS)])):
            if cap_fraction is not None:  # a graph of its own name: the trainer keys by it
                graph = copy.deepcopy(graph)
            graph.name = label if cap_fraction is None else f"{label}-capped"
            cluster = resolve(preset(kinds[(i + j) % len(kinds)], devices))
            cap = None if cap_fraction is None else \
                max(1, int(cap_fraction * one_device_peak(graph, cluster)))
            envs.append(make_env(graph, cluster, memory_cap=cap, max_edges=MAX_EDGES))
            rows.append({"graph": label, "family": fam, "ops": len(graph),
                         "cluster": cluster.name, "cap_fraction_of_one_device_peak": cap_fraction})
    return envs, rows


def zero_shot_vs_target(policy: GNNPolicy, env: Any, target: WarmStartTarget, seed: int
                        ) -> dict[str, Any]:
    """The zero-shot plan's step time against the best heuristic plan the env reaches, the
    zero-shot search given the time ``autoplace plan --policy pretrained`` gives it."""
    t = time.perf_counter()
    rank, step, _, _ = _zero_shot(env, policy, 16, seed, ZERO_SHOT_S)
    zero_s = time.perf_counter() - t
    fits = math.isfinite(target.step_time_s) and not target.info.get("error")
    return {"zero_shot_step_time_s": None if rank[0] else step,
            "heuristic_step_time_s": target.step_time_s if fits else None,
            "heuristic": target.source, "zero_shot_fits": not rank[0], "heuristic_fits": fits,
            "ratio": step / target.step_time_s if fits and not rank[0] else None,
            "zero_shot_s": zero_s}


def training_score(policy: GNNPolicy, envs: list[Any], targets: list[WarmStartTarget],
                   seed: int) -> tuple[float, list[dict[str, Any]]]:
    """Zero-shot quality on the training graphs: the geometric mean over graphs whose
    heuristic plan fits of zero-shot / heuristic step time (a zero-shot plan that does not
    fit counts :data:`OUT_OF_MEMORY_RATIO`), and the per-graph rows."""
    policy.eval()
    rows = [zero_shot_vs_target(policy, env, t, seed) for env, t in zip(envs, targets)]
    ratios = [r["ratio"] if r["zero_shot_fits"] else OUT_OF_MEMORY_RATIO
              for r in rows if r["heuristic_fits"]]
    return geomean(ratios) or 1.0, rows


def train_devices(devices: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train the policy of one device count; returns its state dict, config and stats.

    Warm start (imitating every graph's best heuristic plan) runs first with its own,
    larger learning rate; REINFORCE then continues in ``--rounds`` rounds. REINFORCE on a
    family can pull the policy off the plans it imitated, so after the warm start and after
    every round the zero-shot plans of the training graphs are scored
    (:func:`training_score`) and the best weights so far are kept: the card says which.
    """
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    envs, rows = training_envs(devices, args.quick)
    torch.manual_seed(args.seed)
    policy = GNNPolicy.from_spaces(envs[0].observation_space, envs[0].action_space,
                                   hidden=args.hidden, layers=args.layers, conv=args.conv)
    targets = [heuristic_target(env) for env in envs]
    warm = warm_start(policy, envs, [t.action for t in targets], steps=args.warm_start_steps,
                      lr=args.warm_start_lr)
    warm_s = time.perf_counter() - t0
    score, graph_rows = training_score(policy, envs, targets, args.seed)
    best = (score, 0, copy.deepcopy(policy.state_dict()), graph_rows)
    rounds = [{"round": 0, "what": "warm start", "score": score}]
    unit, amount = parse_budget(args.budget)
    per_round = {"updates": f"{math.ceil(amount / args.rounds)}",
                 "episodes": f"{math.ceil(amount / args.rounds)}ep",
                 "seconds": f"{amount / args.rounds:.1f}s"}[unit]
    updates = episodes = 0
    for r in range(1, args.rounds + 1):
        cfg = ReinforceConfig(budget=per_round, batch_size=args.batch_size, lr=args.lr,
                              lr_schedule="constant", seed=args.seed + r,
                              progress=not args.quiet, tensorboard=False, checkpoint_every=0,
                              warm_start=False)
        result = reinforce(envs, policy, cfg)
        updates, episodes = updates + result.updates, episodes + result.episodes
        score, graph_rows = training_score(policy, envs, targets, args.seed)
        rounds.append({"round": r, "what": f"REINFORCE to update {updates}", "score": score})
        if score < best[0]:
            best = (score, r, copy.deepcopy(policy.state_dict()), graph_rows)
    policy.load_state_dict(best[2])
    policy.eval()
    train_s = time.perf_counter() - t0
    for env, row, graph_row in zip(envs, rows, best[3]):
        row.update(graph_row)
        env.close()
    held = []
    for label, fam, spec, opts in HELD_OUT[:1] if args.quick else HELD_OUT:
        if spec.startswith("hf:") and not args.hf_module:
            continue
        cluster = resolve(preset("h100", devices))
        env = make_env(capture(spec, opts, args.hf_module), cluster)
        sized = GNNPolicy(**{**policy.config, "max_groups": env.unwrapped.config.max_groups})
        sized.load_state_dict(policy.state_dict())
        sized.eval()
        held.append({"graph": label, "family": fam, "ops": len(env.unwrapped.graph),
                     "cluster": cluster.name,
                     **zero_shot_vs_target(sized, env, heuristic_target(env), args.seed)})
        env.close()
    config = {k: v for k, v in policy.config.items() if k != "max_groups"}
    stats = {"updates": updates, "episodes": episodes, "rounds": rounds,
             "kept_round": best[1],
             "train_s": round(train_s, 1), "warm_start": {**warm, "s": round(warm_s, 1)},
             "training_graphs": rows,
             "held_out_graphs": held}
    return {"devices": devices, "state": policy.state_dict(), "config": config,
            "stats": stats}


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return float(np.exp(np.mean(np.log(values)))) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="2,4,8", help="device counts, one policy each")
    parser.add_argument("--budget", default="800",
                        help="REINFORCE budget per device count: updates (800), episodes "
                             "(9600ep) or wall time (5m)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="REINFORCE rounds the budget is split into; the weights kept are "
                             "those of the round (or the warm start) whose zero-shot plans "
                             "score best on the training graphs")
    parser.add_argument("--batch-size", type=int, default=16, help="episodes per update")
    parser.add_argument("--lr", type=float, default=1e-3, help="REINFORCE's learning rate")
    parser.add_argument("--warm-start-lr", type=float, default=3e-3,
                        help="the warm start's learning rate")
    parser.add_argument("--warm-start-steps", type=int, default=1000,
                        help="most imitation steps of the warm start (it stops once every "
                             "graph's greedy plan is its heuristic plan)")
    parser.add_argument("--hidden", type=int, default=64, help="GNN width")
    parser.add_argument("--layers", type=int, default=3, help="message-passing rounds")
    parser.add_argument("--conv", default="sage", help="sage or gat")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per job")
    parser.add_argument("--jobs", type=int, default=1, help="device counts trained at once")
    parser.add_argument("--hf-module", default=None,
                        help="module with the Hugging Face factories t5, mixtral, vit for the "
                             "held-out evaluation (e.g. tests.helpers.hf_models, with the "
                             "repository root on PYTHONPATH)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 graphs, 3 updates")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--out", default=str(WEIGHTS_PATH.parent), help="output folder")
    args = parser.parse_args()
    if args.quick:
        args.budget, args.warm_start_steps, args.rounds = "2", 20, 2
    devices = [int(d) for d in args.devices.split(",")]
    started = time.perf_counter()
    if args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            parts = list(pool.map(train_devices, devices, [args] * len(devices)))
    else:
        parts = [train_devices(d, args) for d in devices]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {f"devices{p['devices']}.{k}": v.detach().clone()
             for p in parts for k, v in p["state"].items()}
    torch.save(state, out / WEIGHTS_PATH.name)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip() or None
    results = {}
    for p in parts:
        s = p["stats"]
        summary = {}
        for part in ("training", "held_out"):
            graphs = s[f"{part}_graphs"]
            summary[f"zero_shot_vs_best_heuristic_geomean_{part}"] = geomean(
                [r["ratio"] for r in graphs])
            summary[f"zero_shot_out_of_memory_where_heuristic_fits_{part}"] = sum(
                r["heuristic_fits"] and not r["zero_shot_fits"] for r in graphs)
        results[f"devices{p['devices']}"] = {**summary, **s}
    info = {
        "format": "autoplace.pretrained-card/1",
        "what": "GNNPolicy (GraphSAGE, both edge directions) per device count, trained with "
                "warm start + REINFORCE on the simulator; env options from "
                "autoplace.policies.pretrained.env_options, group features of the env plus "
                f"{list(EXTRA_FEATURES)}",
        "command": "python scripts/train_pretrained.py " + " ".join(sys.argv[1:]),
        "commit": commit, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {args.threads} torch thread(s) per job, "
                   f"{args.jobs} job(s); torch {torch.__version__}",
        "total_s": round(time.perf_counter() - started, 1),
        "max_groups": MAX_GROUPS,
        "data": {"families": sorted({f for _, f, _, _ in FAMILY} | {"random-dag"}),
                 "graphs": [label for label, *_ in FAMILY] + [label for label, *_ in DAGS],
                 "cluster_kinds": {str(k): list(v) for k, v in KINDS.items()},
                 "memory_caps": "each graph uncapped and under a cap of 0.75 or 0.5 (in "
                                "turn) of its one-device peak"},
        "held_out_families": HELD_OUT_FAMILIES,
        "held_out_graphs": {label: {"spec": spec, "options": opts}
                            for label, _, spec, opts in HELD_OUT},
        "training": {k: v for k, v in vars(args).items() if k not in ("out", "quiet")},
        "results": results,
        "policies": {f"devices{p['devices']}": p["config"] for p in parts},
    }
    (out / CARD_PATH.name).write_text(json.dumps(info, indent=1, default=str) + "\n")
    size = (out / WEIGHTS_PATH.name).stat().st_size
    for key, r in results.items():
        print(f"{key}: {r['updates']} updates, {r['episodes']} episodes, {r['train_s']} s; "
              "zero-shot / best heuristic (geomean where both fit): training "
              f"{r['zero_shot_vs_best_heuristic_geomean_training']}, held out "
              f"{r['zero_shot_vs_best_heuristic_geomean_held_out']}; zero-shot out of memory "
              f"where the heuristic fits: {r['zero_shot_out_of_memory_where_heuristic_fits_training']}"
              f" training, {r['zero_shot_out_of_memory_where_heuristic_fits_held_out']} held out")
    print(f"wrote {out / WEIGHTS_PATH.name} ({size / 1024:.0f} KiB) and {CARD_PATH.name} "
          f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
