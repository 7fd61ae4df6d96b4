"""Learned placement against every heuristic, on the RL papers' graphs and on families the
pre-trained GNN never saw (simulated step times).

    nice python scripts/bench/bench_learned.py --jobs 2 --hf-module tests.helpers.hf_models
    python scripts/bench/bench_learned.py --quick --out /tmp/learned      # smoke test

Rows: Inception-v3, GNMT and RNNLM at the sizes of the RL placement papers (Mirhoseini
et al. 2017 / 2018), from the zoo, and graphs of families held out of the pre-trained
GNN's training (its card lists them: GNMT, and with ``--hf-module`` the Hugging Face T5,
Mixtral and ViT). For every row and seed (``--seeds``): every heuristic planner and the
hybrid DP once (deterministic), anneal for ``--anneal-s`` per seed, and every learned
planner -- seq2seq, hierarchical and gnn trained on the graph (warm start + REINFORCE),
the pre-trained GNN zero-shot, and the pre-trained GNN fine-tuned -- at two fixed
budgets: ``--seconds`` of wall time on one core (the main table) and ``--episodes``.
Each learned planner's best plan is divided by the best heuristic's (ratio < 1: faster).
Units (row x seed) run ``--jobs`` at a time, one torch thread each.

Writes ``learned.json``, ``learned.md`` and ``learned.png`` to ``--out``, by default a new
run folder ``bench/results/<date>-cpux1-<tag>/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import multiprocessing
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from results import write_run
from run_folder import output_folder

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.costs import estimate_costs
from autoplace.errors import AutoplaceError
from autoplace.plan import Plan
from autoplace.policies import train
from autoplace.policies.pretrained import card, finetune_pretrained, place_pretrained
from autoplace.sim import simulate

#: placement heuristics and the plain options a practitioner writes
HEURISTICS = ("single", "round-robin", "hash", "critical-path", "critical-path-mo", "mincut",
              "expert", "m-topo", "m-etf", "m-sct", "ddp", "zero2", "fsdp", "pipeline")
TRAINED = ("seq2seq", "hierarchical", "gnn", "pretrained+finetune")
LEARNED = (*TRAINED, "pretrained")
#: label -> (spec, options, cluster, cap as a fraction of the one-device peak, kind)
ROWS: dict[str, tuple[str, dict[str, Any], str, float | None, str]] = {
    "inception-v3": ("inception-v3", {"image_size": 299, "width": 1.0, "num_classes": 1000,
                                      "batch_size": 32}, "h100x4", None, "paper"),
    "gnmt-4": ("gnmt-4", {"hidden": 1024, "vocab_size": 32000, "src_len": 50, "tgt_len": 50,
                          "batch_size": 128}, "h100x4", None, "paper, held-out family"),
    "rnnlm": ("rnnlm", {"layers": 2, "hidden": 2048, "vocab_size": 10000, "seq_len": 20,
                        "batch_size": 64}, "h100x2", None, "paper"),
    "gnmt-8-capped": ("gnmt-8", {"hidden": 1024, "vocab_size": 32000, "src_len": 50,
                                 "tgt_len": 50, "batch_size": 128}, "h100x8", 0.5,
                      "paper, held-out family"),
    "hf-t5": ("hf:t5", {"layers": 6, "hidden": 512, "heads": 8}, "h100x4", None,
              "held-out family"),
    "hf-mixtral": ("hf:mixtral", {"layers": 4, "hidden": 256, "heads": 8}, "h100x8", None,
                   "held-out family"),
    "hf-vit-capped": ("hf:vit", {"layers": 6, "hidden": 256, "heads": 8}, "h100x2", 0.5,
                      "held-out family"),
}
QUICK_ROWS = {"gnmt-2-small": ("gnmt-2", {}, "h100x2", None, "held-out family")}


def build(label: str, row: tuple, hf_module: str | None, cap_bytes: int | None = None
          ) -> tuple[Any, Any]:
    """The row's captured graph and its (capped) cluster (``cap_bytes``: the cap an earlier
    run used, instead of the row's fraction of today's simulated peak)."""
    spec, options, cluster_name, cap_fraction, _ = row
    if spec.startswith("hf:"):
        spec = f"{hf_module}:{spec[3:]}"
    graph = capture_workload(workloads.get(spec, device="meta", **options))
    cluster = resolve(cluster_name)
    estimate_costs(graph, cluster)
    if cap_bytes is not None:
        cluster = resolve(cluster_name, cap_bytes)
    elif cap_fraction is not None:
        peak = max(simulate(graph, Plan.single(graph, cluster=cluster), cluster)
                   .peak_memory_bytes)
        cluster = resolve(cluster_name, max(1, int(cap_fraction * peak)))
    return graph, cluster


def step_of(graph: Any, plan: Plan | None, cluster: Any) -> float:
    """Simulated step time of a plan, ``inf`` when it does not fit (or there is none)."""
    if plan is None:
        return math.inf
    r = simulate(graph, plan, cluster)
    return math.inf if r.oom else float(r.step_time_s)


def heuristics(label: str, row: tuple, hf_module: str | None, cap_bytes: int | None = None
               ) -> dict[str, Any]:
    """Every heuristic's and the hybrid DP's step time on one row (deterministic)."""
    graph, cluster = build(label, row, hf_module, cap_bytes)
    out = {"ops": len(graph), "cluster": cluster.name,
           "cap_bytes": cluster.devices[0].memory_cap_bytes, "planners": {}}
    for name in (*HEURISTICS, "hybrid-dp"):
        t = time.perf_counter()
        try:
            step = step_of(graph, planners.get(name)(graph, cluster), cluster)
        except AutoplaceError:
            step = math.inf
        out["planners"][name] = {"step_time_s": step, "time_s": time.perf_counter() - t}
    return out


def unit(label: str, row: tuple, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row and seed: anneal, the zero-shot plan, and every trained planner at both
    budgets."""
    torch.set_num_threads(1)
    graph, cluster = build(label, row, args.hf_module)
    res: dict[str, Any] = {"row": label, "seed": seed, "budgets": {}}
    t = time.perf_counter()
    plan = planners.get("anneal")(graph, cluster, time_budget_s=args.anneal_s, seed=seed)
    res["anneal"] = {"step_time_s": step_of(graph, plan, cluster),
                     "time_s": time.perf_counter() - t}
    zero = place_pretrained(graph, cluster, seed=seed)
    res["pretrained"] = {"step_time_s": step_of(graph, zero, cluster),
                         "time_s": zero.planner["search_time_s"],
                         "scored": zero.planner["scored"]}
    for kind, budget in (("seconds", f"{args.seconds}s"), ("episodes", f"{args.episodes}ep")):
        out = res["budgets"][kind] = {}
        for name in TRAINED:
            t = time.perf_counter()
            if name == "pretrained+finetune":
                tuned = finetune_pretrained(graph, cluster, budget=budget, seed=seed,
                                            batch_size=args.batch_size)
                step, episodes = step_of(graph, tuned.plan, cluster), \
                    int(tuned.history["episodes"][-1]) if tuned.history["episodes"] else 0
                source = tuned.plan.planner.get("source")
                # where REINFORCE starts: the better of the zero-shot plan and the teacher's
                start = min(teacher_step(tuned.warm_start), tuned.zero_shot_step_time_s)
            else:
                r = train(graph, cluster, policy=name, budget=budget, seed=seed,
                          progress=False, tensorboard=False, checkpoint_every=0,
                          batch_size=args.batch_size)
                step = step_of(graph, r.best_plan, cluster)
                episodes = int(r.history["episodes"][-1]) if r.history["episodes"] else 0
                source = r.best_plan.planner.get("trainer") if r.best_plan else None
                start = teacher_step(r.warm_start)
            out[name] = {"step_time_s": step, "time_s": time.perf_counter() - t,
                         "episodes": episodes, "source": source, "start_step_time_s": start}
        print(f"{label} seed {seed} {kind}: " + ", ".join(
            f"{n} {v['step_time_s'] * 1e3:.3f} ms" for n, v in out.items()), flush=True)
    return res


def teacher_step(warm: dict[str, Any]) -> float:
    """Step time of the plan the warm start imitated (``inf`` without one)."""
    return min((t["step_time_s"] for t in (warm.get("targets") or {}).values()),
               default=math.inf)


def gains(records: list[dict[str, Any]], units: list[dict[str, Any]], kind: str) -> list[str]:
    """Per row and trained planner: the ratio REINFORCE starts from (the warm start's
    teacher; for pretrained+finetune the better of it and the zero-shot plan) and the one
    it ends at, means over seeds: the teacher's share of the gain and REINFORCE's."""
    lines = ["| row | " + " | ".join(f"{n} start -> end" for n in TRAINED) + " |",
             "| --- | " + " | ".join("---:" for _ in TRAINED) + " |"]
    for r in records:
        best = r["best_heuristic_step_time_s"]
        cells = []
        for name in TRAINED:
            per = [u["budgets"][kind][name] for u in units if u["row"] == r["row"]]
            start = [v.get("start_step_time_s", math.inf) / best for v in per]
            end = [v["step_time_s"] / best for v in per]
            cells.append(f"{np.mean(start):.3f} -> {np.mean(end):.3f}")
        lines.append(f"| {r['row']} | " + " | ".join(cells) + " |")
    return lines


def spread(values: list[float]) -> dict[str, float]:
    a = np.array(values, dtype=float)
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
            "std": float(a.std())}


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if math.isfinite(v) and v > 0]
    return float(np.exp(np.mean(np.log(values)))) if values else None


def summarise(rows: dict[str, tuple], base: dict[str, Any], units: list[dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """One record per row: the best heuristic, the search planners and every learned
    planner's ratio to the best heuristic per budget (mean and spread over seeds)."""
    out = []
    for label in rows:
        b = base[label]
        heur = {k: v["step_time_s"] for k, v in b["planners"].items() if k in HEURISTICS}
        mine = [u for u in units if u["row"] == label]
        hybrid = b["planners"]["hybrid-dp"]["step_time_s"]
        best_name = min(heur, key=heur.get)
        best = heur[best_name]
        reference = "best heuristic"
        if not math.isfinite(best):  # no heuristic fits: the fastest search plan is the bar
            search = {"hybrid-dp": hybrid, "anneal": min(u["anneal"]["step_time_s"]
                                                         for u in mine)}
            best_name = min(search, key=search.get)
            best, reference = search[best_name], "no heuristic fits: best search plan"
        anneal = [u["anneal"]["step_time_s"] / best for u in mine]
        rec = {"row": label, "kind": rows[label][4], "ops": b["ops"], "cluster": b["cluster"],
               "cap_bytes": b["cap_bytes"], "seeds": [u["seed"] for u in mine],
               "best_heuristic": best_name, "best_heuristic_step_time_s": best,
               "reference": reference, "heuristics": heur, "hybrid_dp_ratio": hybrid / best,
               "anneal_ratio": spread(anneal), "budgets": {}}
        rec["search_beats_heuristics"] = bool(rec["hybrid_dp_ratio"] < 0.999
                                              or min(anneal) < 0.999)
        zero = [u["pretrained"]["step_time_s"] / best for u in mine]
        for kind in ("seconds", "episodes"):
            per = {"pretrained": {"ratios": zero}}
            for name in TRAINED:
                per[name] = {"ratios": [u["budgets"][kind][name]["step_time_s"] / best
                                        for u in mine],
                             "episodes": [u["budgets"][kind][name]["episodes"] for u in mine]}
            for v in per.values():
                v.update(spread(v["ratios"]), all_at_most_1=bool(max(v["ratios"]) <= 1.0 + 1e-9))
            rec["budgets"][kind] = per
        gnn = [u["budgets"]["seconds"]["gnn"]["step_time_s"] for u in mine]
        rec["zero_shot_vs_dedicated_gnn"] = spread(
            [u["pretrained"]["step_time_s"] / g for u, g in zip(mine, gnn)])
        rec["zero_shot_time_s"] = spread([u["pretrained"]["time_s"] for u in mine])
        out.append(rec)
    return out


def table(records: list[dict[str, Any]], kind: str) -> list[str]:
    head = "| row | ops | cluster | best heuristic (ms) | hybrid-dp | anneal | " + \
        " | ".join(LEARNED) + " |"
    lines = [head, "| --- | ---: | --- | --- | ---: | ---: | " + " | ".join(
        "---:" for _ in LEARNED) + " |"]
    for r in records:
        cells = []
        for name in LEARNED:
            v = r["budgets"][kind][name]
            cells.append(f"{v['mean']:.3f} ({v['min']:.3f}-{v['max']:.3f})")
        a = r["anneal_ratio"]
        cap = " capped" if r["cap_bytes"] else ""
        note = "" if r.get("reference", "best heuristic") == "best heuristic" else " (no heuristic fits)"
        lines.append(f"| {r['row']} | {r['ops']} | {r['cluster']}{cap} | {r['best_heuristic']} "
                     f"{r['best_heuristic_step_time_s'] * 1e3:.3f}{note} | "
                     f"{r['hybrid_dp_ratio']:.3f} | "
                     f"{a['mean']:.3f} | " + " | ".join(cells) + " |")
    return lines


def targets(records: list[dict[str, Any]], kind: str) -> list[str]:
    lines = []
    search_rows = [r for r in records if r["search_beats_heuristics"]]
    for name in LEARNED:
        worst = max(max(r["budgets"][kind][name]["ratios"]) for r in records)
        over = sum(not r["budgets"][kind][name]["all_at_most_1"] for r in records)
        g = geomean([x for r in search_rows for x in r["budgets"][kind][name]["ratios"]])
        lines.append(f"| {name} | {over} of {len(records)} | {worst:.3f} | "
                     + (f"{g:.3f}" if g else "-") + " |")
    return ["| learned planner | rows with a seed > 1.00x | worst ratio | geomean on rows "
            f"where hybrid-dp or anneal beat the heuristics ({len(search_rows)}) |",
            "| --- | --- | ---: | ---: |", *lines]


def summary_line(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The run's one-line summary: pairs above the best heuristic and the trained planners'
    geometric means on the rows where search beats the heuristics (60 s budget)."""
    over = sum(not r["budgets"]["seconds"][n]["all_at_most_1"] for r in records for n in LEARNED)
    rows = [r for r in records if r["search_beats_heuristics"]]
    means = [geomean([x for r in rows for x in r["budgets"]["seconds"][n]["ratios"]])
             for n in TRAINED]
    means = [m for m in means if m is not None]
    span = f"; trained planners' geomean {min(means):.3f}-{max(means):.3f} of the best " \
        f"heuristic on the {len(rows)} rows where search beats it" if means else ""
    return (f"learned planners on {len(records)} rows x {args.seeds} seeds "
            f"({args.seconds:g} s): {over} (planner, row) pairs above the best heuristic in "
            f"some seed{span}")


def plot(records: list[dict[str, Any]], path: Path, kind: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(records)), 4))
    width = 0.8 / (len(LEARNED) + 1)
    x = np.arange(len(records))
    top = 2.0  # a plan that does not fit (ratio inf) is drawn at the top, hatched

    def clip(x: float) -> float:
        return min(x, top) if math.isfinite(x) else top

    for i, name in enumerate(("hybrid-dp", *LEARNED)):
        if name == "hybrid-dp":
            mean = np.array([clip(r["hybrid_dp_ratio"]) for r in records])
            err = None
        else:
            vals = [r["budgets"][kind][name] for r in records]
            mean = np.array([clip(v["mean"]) for v in vals])
            err = np.array([[max(0.0, m - clip(v["min"])) for m, v in zip(mean, vals)],
                            [max(0.0, clip(v["max"]) - m) for m, v in zip(mean, vals)]])
        ax.bar(x + (i - len(LEARNED) / 2) * width, mean, width, yerr=err, capsize=2, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    low = min([clip(r["hybrid_dp_ratio"]) for r in records]
              + [clip(r["budgets"][kind][n]["min"]) for r in records for n in LEARNED])
    ax.set_ylim(bottom=max(0.0, min(0.9, low - 0.05)))
    ax.set_xticks(x, [r["row"] for r in records], rotation=15)
    ax.set_ylabel("step time / best heuristic's (2 = does not fit)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="all", help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row")
    parser.add_argument("--seconds", type=float, default=None,
                        help="wall-time budget (main; default 60, with --quick 3)")
    parser.add_argument("--episodes", type=int, default=1000, help="episode budget")
    parser.add_argument("--anneal-s", type=float, default=10, help="anneal's time per seed")
    parser.add_argument("--batch-size", type=int, default=16, help="episodes per update")
    parser.add_argument("--jobs", type=int, default=1, help="units run at once")
    parser.add_argument("--hf-module", default=None,
                        help="module with the Hugging Face factories t5, mixtral, vit (e.g. "
                             "tests.helpers.hf_models, repository root on PYTHONPATH); "
                             "without it the hf-* rows are left out")
    parser.add_argument("--quick", action="store_true", help="smoke test: one small row")
    parser.add_argument("--from-json", default=None,
                        help="rewrite the tables, plot and run.json of an earlier run from its "
                             "learned.json (its units; the deterministic heuristics rerun)")
    parser.add_argument("--out", default=None, help="output folder (default: a new run folder)")
    parser.add_argument("--tag", default="learned", help="the new run folder's tag")
    args = parser.parse_args()
    if args.quick:
        rows = QUICK_ROWS
        args.seeds, args.episodes, args.anneal_s = 1, 32, 0.5
    else:
        names = list(ROWS) if args.rows == "all" else args.rows.split(",")
        unknown = [n for n in names if n not in ROWS]
        if unknown:
            parser.error(f"unknown rows {unknown}; valid: {', '.join(ROWS)}")
        rows = {n: ROWS[n] for n in names if args.hf_module or not ROWS[n][0].startswith("hf:")}
    if args.seconds is None:
        args.seconds = 3 if args.quick else 60
    torch.set_num_threads(1)
    started = time.perf_counter()
    earlier = json.loads(Path(args.from_json).read_text()) if args.from_json else None
    if earlier is not None:  # the earlier run's options, its rows and units
        for key in ("seeds", "seconds", "episodes", "anneal_s", "jobs", "hf_module"):
            setattr(args, key, earlier["args"][key])
        rows = {r["row"]: (ROWS | QUICK_ROWS)[r["row"]] for r in earlier["rows"]
                if args.rows == "all" or r["row"] in args.rows.split(",")}
    caps = {r["row"]: r["cap_bytes"] for r in earlier["rows"]} if earlier else {}
    # env.json is written now, with the commit that runs (a rewrite keeps the run's own)
    out = Path(args.from_json).parent if earlier is not None and args.out is None else \
        output_folder(args.out, args.tag)
    base = {label: heuristics(label, row, args.hf_module, caps.get(label))
            for label, row in rows.items()}
    work = [(label, row, seed) for seed in range(args.seeds) for label, row in rows.items()]
    if earlier is not None:
        units = earlier["units"]
    elif args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = [pool.submit(unit, label, row, seed, args) for label, row, seed in work]
            units = [f.result() for f in futures]
    else:
        units = [unit(label, row, seed, args) for label, row, seed in work]
    records = summarise(rows, base, units)
    info = card()
    meta = {"benchmark": "learned_placement", "backend": "sim (simulated step times)",
            "date": earlier["date"] if earlier else
            datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, 1 torch thread per unit, {args.jobs} unit(s) "
                       f"at once; torch {torch.__version__}", "args": vars(args),
            "pretrained": {"commit": info.get("commit"), "command": info.get("command"),
                           "held_out_families": info.get("held_out_families")},
            "total_time_s": earlier["total_time_s"] if earlier else time.perf_counter() - started}
    (out / "learned.json").write_text(json.dumps({**meta, "rows": records, "units": units},
                                                 indent=1, default=str))
    zero_lines = ["| row | zero-shot / best heuristic | zero-shot / gnn trained on the graph "
                  f"({args.seconds:g} s) | within 5% | zero-shot s |", "| --- | ---: | ---: | --- | ---: |"]
    for r in records:
        z, d = r["budgets"]["seconds"]["pretrained"], r["zero_shot_vs_dedicated_gnn"]
        zero_lines.append(f"| {r['row']} | {z['mean']:.3f} | {d['mean']:.3f} ({d['min']:.3f}-"
                          f"{d['max']:.3f}) | {'yes' if d['max'] <= 1.05 else 'no'} | "
                          f"{r['zero_shot_time_s']['max']:.2f} |")
    lines = [
        f"# Learned placement vs heuristics (simulated), {meta['date']}", "",
        f"Machine: {meta['machine']}. Seeds: {args.seeds}. Ratio = the planner's best plan's "
        "simulated step time / the best heuristic's (< 1: faster); mean (min-max over seeds). "
        f"Heuristics: {', '.join(HEURISTICS)}. anneal: {args.anneal_s:g} s per seed. "
        "pretrained = the shipped GNN zero-shot (no training on the graph); "
        "pretrained+finetune = it trained further on the graph. No heuristic compiles; on "
        "GPU clusters the learned planners (and anneal) may choose parallel.compile. "
        "Held-out families "
        f"(never trained on): {', '.join(info.get('held_out_families', []))}.", "",
        *([f"Tables rewritten {datetime.datetime.now().isoformat(timespec='seconds')} from "
           "learned.json: the heuristics and the hybrid DP simulated again (same caps)."]
          if earlier else []), "",
        f"## Main table: {args.seconds:g} s per planner and seed, one core", "",
        *table(records, "seconds"), "", *targets(records, "seconds"), "",
        "Where the gain comes from: the ratio each trained planner's REINFORCE starts from "
        "(the plan its warm start imitates, the teacher: the best of the heuristics and the "
        "hybrid DP the env reaches, each also compiled on GPUs; for pretrained+finetune the "
        "better of that and the zero-shot plan) -> the ratio it ends at, means over seeds.",
        "", *gains(records, units, "seconds"), "",
        f"## {args.episodes} episodes per planner and seed", "",
        *table(records, "episodes"), "", *targets(records, "episodes"), "",
        "## Zero-shot against a GNN trained on the graph", "", *zero_lines, "",
    ]
    (out / "learned.md").write_text("\n".join(lines) + "\n")
    plot(records, out / "learned.png", "seconds",
         f"learned planners, {args.seconds:g} s budget (bars: min-max over seeds)")
    write_run(out, tag=args.tag, scenarios=[f"learned:{r['row']}" for r in records],
              kind="experiment", script="scripts/bench/bench_learned.py",
              summary=summary_line(records, args))
    print(f"wrote {out / 'learned.md'} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
