"""What a one-GPU user writes by hand against autoplace, measured side by side on one card.

    python scripts/bench/bench_levers.py --model gpt-1b --memory-cap 22GB --budget 60s
    python scripts/bench/bench_levers.py --smoke --out /tmp/levers   # gpt-tiny, CPU allowed
    python scripts/bench/bench_levers.py --replay bench/results/<run>  # simulator vs measured

Per case (the model under each ``--memory-cap``; ``none``: no cap), written by hand on the
workload's own module: ``eager``; ``compile`` (``torch.compile`` on each block: the children
of the outermost parameter-holding ``nn.ModuleList`` s, as ``model.blocks``);
``checkpoint`` (``torch.utils.checkpoint``, non-reentrant, on each block);
``checkpoint+compile`` (compiled outside the checkpoint, as torchtitan); Hugging Face
models' ``gradient_checkpointing_enable()``; the cap set with
``torch.cuda.set_per_process_memory_fraction``. Beside them autoplace executes every
per-block recipe (:func:`autoplace.planners.manual.lever_plans`) and the plan ``auto_plan``
chooses under the cap (``--budget``; ``--profile-dir``: ops profiled first). With
``--no-auto`` and ``--recipes`` a run is an execution check: autoplace's recipes beside the
same written by hand (``eager-blocks``, the blocks run eager, beside ``eager``), with the
throughput of each over its twin and the rounds in which it was the faster.

Every run is a ``--worker`` subprocess (compile caches, allocator state and out-of-memory
errors stay in it) reading the initial weights from one file; rounds are interleaved (odd
ones reversed), ``--warmup`` steps (compilation) then ``--steps`` timed ones on the data
drawn after ``torch.manual_seed(seed + step)``. Losses are compared with eager's (uncapped
where eager does not fit). ``levers.json`` and ``levers.md`` go to ``--out`` or a new run
folder ``bench/results/<date>-<card>x1-levers-<model>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from results import write_run
from run_folder import output_folder
from torch import nn
from torch.utils.checkpoint import checkpoint

# autoplace is imported where it is used: a worker imports only what its run needs
COMPILE_BACKEND_ENV = "AUTOPLACE_COMPILE_BACKEND"  # autoplace.executor.pieces reads it too
HAND = ("eager", "compile", "checkpoint", "checkpoint+compile", "hf-gradient-checkpointing")
#: autoplace's recipe -> the same written by hand
TWINS = {"eager-blocks": "eager", "compile-blocks": "compile",
         "checkpoint-blocks": "checkpoint", "checkpoint-blocks+compile": "checkpoint+compile"}
TARGET = 0.97  # autoplace's throughput over the same recipe's by hand


def slug_of(name: str) -> str:
    """A case's or model's name as file names use it (``gpt-1b @22GiB`` -> ``gpt-1b-22gib``)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def say(msg: str) -> None:
    print(f"[levers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------- workers
def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The model's outermost ``nn.ModuleList`` s that hold parameters: its blocks."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and any(True for _ in m.parameters()) \
                and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return [m for _, m in found]


class CheckpointBlock(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str) -> Any:  # a model may read its blocks' attributes
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)


def apply_option(model: nn.Module, option: str, backend: str) -> nn.Module:
    """``model`` set up for ``option`` (one of :data:`HAND`) the way a user writes it."""
    if option == "hf-gradient-checkpointing":
        model.gradient_checkpointing_enable()
    elif option != "eager":
        for blocks in block_lists(model):
            for i, block in enumerate(blocks):
                block = CheckpointBlock(block) if "checkpoint" in option else block
                blocks[i] = torch.compile(block, backend=backend) if "compile" in option \
                    else block
    return model.train()


def _workload(cfg: dict[str, Any]):
    from autoplace.executor.weights import load_workload

    return load_workload(cfg["spec"], cfg["weights"])


def hand_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train under a hand-written option: step times, losses, peak memory."""
    wl = _workload(cfg)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda and cfg["cap_bytes"]:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg["cap_bytes"] / total), dev)
    amp = torch.autocast("cuda", dtype=getattr(torch, wl.autocast_dtype)) \
        if cuda and wl.autocast_dtype else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses, out = [], [], {"oom": False, "error": None}
    try:
        model = apply_option(wl.model.to(dev), cfg["option"],
                             os.environ.get(COMPILE_BACKEND_ENV, "inductor"))
        opt = torch.optim.AdamW(model.parameters(), lr=wl.lr, **({"fused": True} if cuda else {}))
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        for step in range(cfg["steps"]):
            torch.manual_seed(cfg["seed"] + step)
            inputs, targets = wl.make_batch(wl.batch_size, "cpu")
            inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs]
            targets = targets.to(dev)
            sync()
            t0 = time.perf_counter()
            with amp:
                loss = wl.loss_fn(model(*inputs), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
    except Exception as e:  # noqa: BLE001 - an option that fails is a result
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        out.update(oom=oom, error=f"{type(e).__name__}: {str(e)[:300]}")
    out.update(step_times_s=times[cfg["warmup"]:], warmup_step_s=times[:cfg["warmup"]],
               loss=losses, peak_memory_bytes=torch.cuda.max_memory_allocated(dev) if cuda else 0,
               reserved_peak_bytes=torch.cuda.max_memory_reserved(dev) if cuda else None)
    return out


def autoplace_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run a one-process plan with autoplace's executor."""
    from autoplace.cluster import Cluster
    from autoplace.executor.runner import RunOptions, run_here
    from autoplace.plan import Plan

    opts = RunOptions(steps=cfg["steps"], warmup=cfg["warmup"], reference=False,
                      seed=cfg["seed"])
    rep = run_here(_workload(cfg), Plan.load(cfg["plan"]), Cluster.from_json(cfg["cluster"]),
                   opts, copy_model=False)
    return {"step_times_s": rep.step_times_s, "warmup_step_s": rep.extra.get("warmup_step_s"),
            "loss": rep.loss, "peak_memory_bytes": max(rep.peak_memory_bytes or [0]),
            "reserved_peak_bytes": rep.reserved_peak_bytes, "oom": rep.oom, "error": rep.error}


def prepare_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build the workload on the first device, save its initial weights for every run,
    and with a profile folder profile its ops there."""
    from autoplace import workloads
    from autoplace.costs.profile import profile
    from autoplace.executor.weights import save_weights

    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    spec = cfg["spec"]
    wl = workloads.get(spec["spec"], seed=spec["seed"], device=dev, **spec["options"])
    save_weights(wl.model, cfg["weights"])
    if cfg.get("profile_dir"):
        graph = profile(wl, [dev], repeats=3, cache_dir=cfg["profile_dir"])
        if dev.startswith("cuda"):  # the first block compiled and recomputed vs eager
            from autoplace.executor.profile_block import profile_block

            rec = profile_block(graph, wl.example_inputs(graph.batch_size, "cpu"), dev,
                                autocast_dtype=wl.autocast_dtype, repeats=5,
                                cache_dir=cfg["profile_dir"])
            return {"error": None, "block": rec}
    return {"error": None}


WORKERS = {"hand": hand_run, "autoplace": autoplace_run, "prepare": prepare_run}


def run_worker(kind: str, cfg: dict[str, Any], timeout_s: float = 900) -> dict[str, Any]:
    """Run ``kind`` (:data:`WORKERS`) in a subprocess of this script; its JSON result."""
    with tempfile.TemporaryDirectory(prefix="levers-") as tmp:
        conf, result = Path(tmp) / "config.json", Path(tmp) / "result.json"
        conf.write_text(json.dumps(cfg))
        cmd = [sys.executable, __file__, "--worker", kind, "--config", str(conf),
               "--result", str(result)]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            tail = (p.stdout[-1500:] + p.stderr[-1500:]).strip()
            r = json.loads(result.read_text()) if p.returncode == 0 and result.exists() else \
                {"error": f"worker exited {p.returncode}: {tail}",
                 "oom": "out of memory" in tail.lower()}
        except subprocess.TimeoutExpired:
            r = {"error": f"stopped after {timeout_s:.0f} s", "oom": False}
        return {**r, "wall_s": round(time.perf_counter() - t, 1)}


# --------------------------------------------------------------------- driving
def recipe_plans(graph, cluster, smoke: bool = False) -> dict[str, Any]:
    """autoplace's per-block recipes (:func:`autoplace.planners.manual.lever_plans`) and
    ``eager-blocks``, the same block groups run eager: autoplace's execution of what eager
    by hand runs (an execution check's, run only when ``--recipes`` names it); with
    ``smoke`` on a CPU also ``compile-blocks``, which lever_plans makes on GPUs only."""
    from autoplace.planners.manual import lever_plans

    plans = lever_plans(graph, cluster)
    if not plans:
        return plans
    plain = replace(plans["checkpoint-blocks"], recompute=frozenset(),
                    planner={**plans["checkpoint-blocks"].planner, "name": "eager-blocks"})
    plans["eager-blocks"] = plain
    if smoke and "compile-blocks" not in plans:  # on CPU: none compiled
        plans["compile-blocks"] = plain.with_parallel(compile=True)
    return plans


def run_case(name: str, cap: int | None, ctx: dict[str, Any], save) -> None:
    """auto_plan, then every option of one case in interleaved rounds."""
    from autoplace.search.auto import auto_plan
    from autoplace.search.families import signature

    a = ctx["args"]
    cluster = ctx["cluster"].with_memory_cap(cap) if cap else ctx["cluster"]
    case: dict[str, Any] = {"name": name, "memory_cap_bytes": cap, "runs": {},
                            "scenario": scenario_name(ctx["name"], cap, a.no_auto)}
    ctx["out"]["cases"].append(case)
    plans = recipe_plans(ctx["graph"], cluster, smoke=a.smoke)
    asked = a.recipes.split(",") if a.recipes else [k for k in plans if k != "eager-blocks"]
    plans = {k: v for k, v in plans.items() if k in asked}
    if a.no_auto:
        case["auto"] = {"skipped": "--no-auto"}
    else:
        say(f"{name}: auto_plan, budget {a.budget}")
        t = time.perf_counter()
        try:
            auto = auto_plan(ctx["spec"], cluster, budget=a.budget, graph=ctx["graph"],
                             cache_dir=a.profile_dir, planners=["single"] if a.smoke else None)
            same = next((k for k, p in plans.items() if signature(p) == signature(auto)), None)
            case["auto"] = {"plan": auto.describe(), "split": auto.split(), "same_as": same,
                            "search_s": round(time.perf_counter() - t, 1)}
            plans.update({} if same else {"auto": auto})
            say(f"  auto chose {auto.split()}" + (f" (= {same})" if same else ""))
        except Exception as e:  # noqa: BLE001 - a search that fails is a result
            case["auto"] = {"error": f"{type(e).__name__}: {e}"}
            say(f"  auto failed: {e}")
    slug = slug_of(name)
    paths = {k: ctx["folder"] / "plans" / f"{slug}-{k.replace('+', '-')}.json" for k in plans}
    for k, plan in plans.items():
        plan.save(paths[k])
    options = [("hand", o) for o in ctx["hand"]] + [("autoplace", k) for k in plans]
    base = {**ctx["worker"], "cap_bytes": cap, "cluster": cluster.to_json()}
    for rnd in range(a.rounds):
        for kind, opt in options if rnd % 2 == 0 else options[::-1]:
            runs = case["runs"].setdefault(f"{kind}:{opt}", [])
            if any(r.get("error") for r in runs):
                continue  # out of memory (or failed) once: not again
            r = run_worker(kind, {**base, "option": opt, "plan": str(paths.get(opt, ""))})
            runs.append(r)
            ms = "OOM" if r.get("oom") else f"error: {r['error'][:300]}" if r.get("error") \
                else f"{statistics.median(r['step_times_s']) * 1e3:.1f} ms"
            say(f"  round {rnd} {kind}:{opt}: {ms} (peak "
                f"{(r.get('peak_memory_bytes') or 0) / 2**30:.1f} GiB, {r['wall_s']:.0f} s)")
            save()


def reference_loss(case: dict[str, Any], ctx: dict[str, Any], final: bool) -> list[float]:
    """Eager's losses in this case, else (eager did not fit) an uncapped eager run's."""
    eager = next((r for r in case["runs"].get("hand:eager", []) if not r.get("error")), None)
    case["loss_reference"] = "eager" if eager else "eager without the cap"
    if eager is not None or not final:
        return eager["loss"] if eager else []
    if "uncapped" not in ctx:
        say("eager without the cap, for the loss reference")
        ctx["uncapped"] = run_worker("hand", {**ctx["worker"], "cap_bytes": None,
                                              "option": "eager"})
    return ctx["uncapped"].get("loss") or []


def summarise(case: dict[str, Any], ref: list[float]) -> None:
    """Per option: step time (median of every timed step), spread, memory, loss diff."""
    rows = {}
    for key, runs in case["runs"].items():
        ok = [r for r in runs if not r.get("error") and r.get("step_times_s")]
        steps = [t for r in ok for t in r["step_times_s"]]
        meds = [statistics.median(r["step_times_s"]) for r in ok]
        loss = ok[0]["loss"] if ok else []
        pairs = list(zip(loss, ref))
        rows[key] = {
            "step_time_s": statistics.median(steps) if steps else None,
            "round_medians_s": meds, "spread_s": [min(meds), max(meds)] if meds else None,
            "warmup_s": sum(ok[0]["warmup_step_s"] or []) if ok else None,
            "peak_memory_bytes": max((r["peak_memory_bytes"] for r in ok), default=None),
            "reserved_peak_bytes": max((r["reserved_peak_bytes"] or 0 for r in ok), default=0)
            or None,
            "loss_rel_diff": max((abs(x - y) / max(abs(y), 1e-12) for x, y in pairs),
                                 default=None),
            "oom": any(r.get("oom") for r in runs),
            "error": next((r["error"] for r in runs if r.get("error")), None), "loss": loss}
    hand = {k: v["step_time_s"] for k, v in rows.items() if k.startswith("hand:")
            and v["step_time_s"]}
    best = min(hand, key=hand.get, default=None)
    case["best_hand"], case["best_hand_s"] = best, hand.get(best)
    for key, row in rows.items():
        kind, name = key.split(":", 1)
        s = row["step_time_s"]
        row["vs_best_hand"] = s / case["best_hand_s"] if s and best else None
        row["same_by_hand"] = TWINS.get(name) if kind == "autoplace" else None
        twin = rows.get(f"hand:{row['same_by_hand']}", {})
        by_hand = twin.get("step_time_s")
        row["throughput_vs_same_by_hand"] = by_hand / s if by_hand and s else None
        # rounds in which autoplace's was the faster of the two (a round runs them in turn)
        pairs = list(zip(row["round_medians_s"], twin.get("round_medians_s") or []))
        row["rounds_ahead"] = [sum(a < b for a, b in pairs), len(pairs)] \
            if row["throughput_vs_same_by_hand"] else None
    auto = case["auto"]
    chosen = rows.get(f"autoplace:{auto.get('same_as') or 'auto'}", {})
    auto.update(step_time_s=chosen.get("step_time_s"), vs_best_hand=chosen.get("vs_best_hand"))
    case["options"] = rows


def scenario_name(name: str, cap: int | None, execution: bool = False) -> str:
    """A case's scenario in the results index: ``levers:gpt-1b``, ``levers:gpt-1b@22GiB``;
    ``levers-execution:...`` for a run without auto's plan (an execution check)."""
    kind = "levers-execution" if execution else "levers"
    return f"{kind}:{name}" + (f"@{cap / 2**30:g}GiB" if cap else "")


def headline(case: dict[str, Any]) -> dict[str, Any]:
    """A case's row of ``run.json``: ms of the best by hand and of auto's plan (the recipe
    it equals, else its split), and the throughput of autoplace's execution of each recipe
    over the same by hand."""
    au, ms = case["auto"], (lambda x: x and round(x * 1e3, 1))
    best = case["best_hand"] and case["best_hand"].split(":", 1)[1]
    return {"scenario": case["scenario"], "case": case["name"], "best_hand_written": best,
            "best_hand_written_ms": ms(case["best_hand_s"]),
            "auto_plan": au.get("same_as") or au.get("split"),
            "auto_ms": ms(au.get("step_time_s")),
            "auto_vs_best": au.get("vs_best_hand") and round(au["vs_best_hand"], 3),
            **{f"{k.split(':')[1]}_vs_by_hand": round(v["throughput_vs_same_by_hand"], 3)
               for k, v in case["options"].items() if v["throughput_vs_same_by_hand"]}}


def fmt(x: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return "" if x is None or not math.isfinite(x) else format(x * scale, spec)


def markdown(out: dict[str, Any]) -> str:
    lines = [f"# By hand vs autoplace on one {out['card']}: {out['model']}", "",
             f"torch {out['torch_version']}, {out['date']}, compile backend "
             f"{out['compile_backend']}, PYTORCH_CUDA_ALLOC_CONF "
             f"{out['alloc_conf'] or 'unset'}. ms: median of the {out['steps']} timed steps (after "
             f"{out['warmup']} warm-up) of {out['rounds']} interleaved rounds; min..max of the "
             "rounds' medians. Loss diff: the largest relative difference of a step's loss "
             f"from eager's. Target: autoplace's execution of a recipe at >= {TARGET}x the "
             "throughput of the same by hand (ahead: the rounds in which autoplace's was the "
             "faster of the two).", "",
             "| case | option | ms | min..max | warm-up s | peak GiB (reserved) | loss diff "
             "| / best by hand | throughput vs same by hand |", "|" + "---|" * 9]
    for c in out["cases"]:
        for key, r in sorted(c.get("options", {}).items(),
                             key=lambda kv: (kv[1]["step_time_s"] is None, kv[0])):
            sp, res = r["spread_s"], r["reserved_peak_bytes"]
            sp = f"{fmt(sp[0], '.1f', 1e3)}..{fmt(sp[1], '.1f', 1e3)}" if sp else ""
            peak = fmt(r["peak_memory_bytes"], ".1f", 2**-30) \
                + (f" ({fmt(res, '.1f', 2**-30)})" if res else "")
            ms = fmt(r["step_time_s"], ".1f", 1e3) or ("OOM" if r["oom"] else "error")
            ahead = r.get("rounds_ahead")
            twin = (f" ({r['same_by_hand']}; ahead in {ahead[0]} of {ahead[1]} rounds)"
                    if ahead else f" ({r['same_by_hand']})") \
                if r["throughput_vs_same_by_hand"] else ""
            lines.append(
                f"| {c['name']} | {key} | {ms} | {sp} | {fmt(r['warmup_s'], '.1f')} | {peak} | "
                f"{fmt(r['loss_rel_diff'], '.1e')} | {fmt(r['vs_best_hand'])} | "
                f"{fmt(r['throughput_vs_same_by_hand'])}{twin} |")
        au = c["auto"]
        chose = (f"{au['split']} ({au['plan']}{', = ' + au['same_as'] if au['same_as'] else ''})"
                 f": {fmt(au['step_time_s'], '.1f', 1e3)} ms, {fmt(au['vs_best_hand'])}x the "
                 f"best by hand (search {au['search_s']} s)") if "plan" in au \
            else f"nothing: {au.get('error') or 'auto_plan not run (' + au['skipped'] + ')'}"
        lines += ["", f"**{c['name']}**: best by hand {c.get('best_hand')} "
                  f"({fmt(c.get('best_hand_s'), '.1f', 1e3)} ms); autoplace chose {chose}.", ""]
    return "\n".join(lines)


#: the per-block recipe each measured option runs (``eager``: the one-device plan)
RECIPE_OF = {"hand:eager": "eager", "hand:compile": "compile-blocks",
             "hand:checkpoint": "checkpoint-blocks",
             "hand:checkpoint+compile": "checkpoint-blocks+compile",
             "hand:hf-gradient-checkpointing": "checkpoint-blocks"}


def hand_block_groups(graph, model: nn.Module, groups: dict[str, int] | None = None
                      ) -> frozenset[int]:
    """The groups (``groups``, default :func:`autoplace.lowering.block_groups`) that hold
    the blocks a hand-written per-block recipe wraps (:func:`block_lists`: the members of
    the model's outermost ModuleLists), by the captured ops' module paths."""
    from autoplace.lowering import block_groups

    names = {id(m): n for n, m in model.named_modules()}
    prefixes = tuple(f"{names[id(blocks)]}.{i}" for blocks in block_lists(model)
                     for i in range(len(blocks)))
    groups = groups or block_groups(graph)
    return frozenset(groups[op.name] for op in graph.ops if op.module_path and any(
        op.module_path == p or op.module_path.startswith(p + ".") for p in prefixes))


def replay(folder: Path, profile_dir: str | None = None) -> str:
    """The simulator on every option of a stored run (``levers.json``): each option's
    plan (its recipe; eager: one device) simulated on the card's preset under the case's
    cap, against its measured step time and peak memory; per case the median error and
    Kendall tau over the distinct plans; with ``profile_dir`` (the run's ``--profile-dir``)
    on the op times and compiled block profiled on the card, else estimated. Writes
    ``sim-check.json`` / ``sim-check.md``."""
    from scipy.stats import kendalltau

    from autoplace import workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import resolve
    from autoplace.costs.profile import apply_cached
    from autoplace.costs.profile_cache import apply_by_name
    from autoplace.plan import Plan
    from autoplace.search.families import family
    from autoplace.sim import simulate

    out = json.loads((folder / "levers.json").read_text())
    card = out["card"].lower().replace("nvidia", "").strip().split()[0]
    card = "cpu-" if card == "cpu" else card  # the preset's name: cpu-x1, h200x1
    meta = workloads.get(out["model"], device="meta", **out["options"])
    graph = capture_workload(meta)
    extra = 0
    if profile_dir and not apply_cached(graph, profile_dir, [card]):
        # the card's torch exported another graph: its one profile, by op name
        found = sorted(Path(profile_dir).glob(f"*-{card}.json"))
        if len(found) != 1:
            raise ValueError(f"--profile-dir {profile_dir}: no single {card} profile "
                             f"({len(found)} found) for graph {graph.fingerprint}")
        extra = apply_by_name(graph, json.loads(found[0].read_text()), card,
                              resolve(f"{card}x1"))
    from autoplace.executor.profile_block import describe

    info = (getattr(graph, "profile_info", None) or {}).get(card) or {}
    costs = ("op costs profiled on the card; first block: " + (
        describe({k: info.get(k) for k in ("compiled", "recompute", "graphs")})
        if "recompute" in info else "not profiled") if profile_dir else
        "op costs estimated (as `auto` had them in this run: no profile)")
    if extra:
        costs += (f"; {extra} ops that this machine's capture has and the card's did not "
                  f"(torch.export's graph of torch {torch.__version__} against the card's "
                  f"{out['torch_version']}) at estimated costs")
    rows, cases = [], []
    for c in out["cases"]:
        cluster = resolve(f"{card}x1", memory_cap=c["memory_cap_bytes"])
        plans = {"eager": Plan.single(graph), **recipe_plans(graph, cluster)}
        slug = slug_of(c["name"])
        for k in list(plans):  # the recipe's plan as it ran, where the run kept it
            kept = folder / "plans" / f"{slug}-{k.replace('+', '-')}.json"
            if k != "eager" and kept.exists():
                ran = Plan.load(kept)
                if ran.model.get("fingerprint") == graph.fingerprint:
                    plans[k] = ran
        auto_file = folder / "plans" / f"{slug}-auto.json"
        if auto_file.exists():  # auto's own plan (not one of the recipes)
            plans["auto"] = Plan.load(auto_file)
            if plans["auto"].model.get("fingerprint") != graph.fingerprint:  # other torch
                if len(set(plans["auto"].groups.values())) != 1:
                    del plans["auto"]  # a grouping of the card's graph: not rebuilt here
                else:  # one group: the same plan on this machine's graph
                    plans["auto"] = Plan.single(graph, parallel=plans["auto"].parallel)
        by_recipe: dict[str, dict[str, Any]] = {}
        for key, r in c["options"].items():
            recipe = RECIPE_OF.get(key) or ((c["auto"].get("same_as") or "auto")
                                            if key == "autoplace:auto" else key.split(":", 1)[1])
            if recipe not in plans:
                continue
            if key.startswith("hand:") and plans[recipe].recompute:
                # by hand only the blocks of the model's ModuleLists are checkpointed
                mine = frozenset(plans[recipe].recompute & hand_block_groups(
                    graph, meta.model, plans[recipe].groups))
                if mine != plans[recipe].recompute:
                    recipe = f"{recipe} (its ModuleLists' blocks)"
                    plans[recipe] = replace(plans[RECIPE_OF[key]], recompute=mine)
            sim = simulate(graph, plans[recipe], cluster)
            row = {"case": c["name"], "option": key, "recipe": recipe,
                   "family": family(plans[recipe]),
                   "measured_ms": r["step_time_s"] and r["step_time_s"] * 1e3,
                   "measured_oom": r["oom"], "sim_ms": sim.step_time_s * 1e3,
                   "sim_oom": sim.oom, "measured_peak_gib": r["peak_memory_bytes"]
                   and r["peak_memory_bytes"] / 2**30,
                   "measured_reserved_gib": r["reserved_peak_bytes"]
                   and r["reserved_peak_bytes"] / 2**30,
                   "sim_peak_gib": max(sim.peak_memory_bytes) / 2**30}
            for k, m in (("time_err", "ms"), ("peak_err", "peak_gib")):
                meas = row[f"measured_{m}"]
                row[k] = row[f"sim_{m}"] / meas - 1 if meas else None
            rows.append(row)
            if row["measured_ms"] and not r["oom"]:  # one point per distinct plan
                by_recipe.setdefault(recipe, row) if key.startswith("autoplace:") \
                    or recipe not in by_recipe else None
        pts = [r for r in by_recipe.values() if r["measured_ms"]]
        tau = kendalltau([r["sim_ms"] for r in pts], [r["measured_ms"] for r in pts]).statistic \
            if len(pts) >= 3 else None
        oom_right = sum(r["sim_oom"] == r["measured_oom"] for r in rows if r["case"] == c["name"])
        cases.append({
            "case": c["name"], "plans": len(pts),
            "median_abs_time_err": statistics.median(abs(r["time_err"]) for r in pts)
            if pts else None,
            # a CPU run measures no peak
            "median_abs_peak_err": statistics.median(abs(r["peak_err"]) for r in pts)
            if pts and all(r["peak_err"] is not None for r in pts) else None,
            "kendall_tau": tau, "oom_agree": f"{oom_right}/"
            f"{sum(r['case'] == c['name'] for r in rows)}"})
    result = {"source": str(folder), "cluster": f"{card}x1 preset, {costs}",
              "cases": cases, "rows": rows}
    (folder / "sim-check.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    lines = [f"# The simulator on every option of this run ({out['model']})", "",
             f"Each option's plan simulated on the {card}x1 preset under the case's cap, "
             f"{costs}; hand-written "
             "options as their recipe's plan (eager: one device). Errors: simulated / "
             "measured - 1; peak: allocated.", "",
             "| case | plans | median abs time error | median abs peak error | Kendall tau "
             "| OOM agree |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['case']} | {c['plans']} | {fmt(c['median_abs_time_err'], '.1%')} | "
              f"{fmt(c['median_abs_peak_err'], '.1%')} | {fmt(c['kendall_tau'])} | "
              f"{c['oom_agree']} |" for c in cases]
    lines += ["", "| case | option | recipe | measured ms | sim ms | time err | measured peak "
              "GiB (reserved) | sim peak GiB | peak err |", "|" + "---|" * 9]
    for r in rows:
        ms = "OOM" if r["measured_oom"] else fmt(r["measured_ms"], ".1f")
        res = f" ({fmt(r['measured_reserved_gib'], '.1f')})" if r["measured_reserved_gib"] else ""
        lines.append(
            f"| {r['case']} | {r['option']} | {r['recipe']} | {ms} | "
            f"{fmt(r['sim_ms'], '.1f')}{' OOM' if r['sim_oom'] else ''} | "
            f"{fmt(r['time_err'], '+.1%')} | {fmt(r['measured_peak_gib'], '.1f')}{res} | "
            f"{fmt(r['sim_peak_gib'], '.1f')} | {fmt(r['peak_err'], '+.1%')} |")
    text = "\n".join(lines) + "\n"
    (folder / "sim-check.md").write_text(text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="zoo name or module:factory (default gpt-1b)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="workload option (repeatable; values read as JSON)")
    p.add_argument("--batch-size", type=int, default=None, help="the workload's batch size")
    p.add_argument("--memory-cap", default="none", help="caps, comma-separated; none: no cap")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions")
    p.add_argument("--budget", default="5m", help="auto_plan's time budget (90s, 5m)")
    p.add_argument("--recipes", default=None, help="autoplace's per-block recipes to run, "
                   "comma-separated (default: every one lever_plans makes; eager-blocks, "
                   "the blocks run eager, only when named)")
    p.add_argument("--hand", default=None, help="hand-written options to run, comma-separated "
                   f"(default: every one of {', '.join(HAND)} the model has)")
    p.add_argument("--no-auto", action="store_true", help="run no auto_plan: only the recipes "
                   "and the hand-written options (an execution check)")
    p.add_argument("--profile-dir", default=None, help="profile the ops (and on a GPU the "
                   "first block compiled) into this folder first and plan with them (auto's "
                   "calibration is kept there too); with --replay: the run's profile folder")
    p.add_argument("--name", default=None, help="the scenario's name in the results index "
                   "(default: the model's; levers:NAME, levers:NAME@CAP under a cap)")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed")
    p.add_argument("--out", default=None, help="output folder (default: a new run folder)")
    p.add_argument("--smoke", action="store_true", help="gpt-tiny, 3 steps, 1 round, budget 0, "
                   "compiled with aot_eager: runs on a CPU")
    p.add_argument("--replay", default=None, metavar="RUN_FOLDER",
                   help="simulate every option of a stored run and compare (sim-check.md)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.model = a.model or "gpt-tiny"
        a.steps, a.warmup, a.rounds, a.budget = 3, 1, 1, "0s"
        os.environ[COMPILE_BACKEND_ENV] = "aot_eager"
    a.model = a.model or "gpt-1b"
    if min(a.steps, a.rounds) < 1 or a.warmup < 0:
        p.error(f"--steps {a.steps} and --rounds {a.rounds} must be >= 1, --warmup >= 0")
    return a


def main() -> int:
    a = parse_args()
    if a.replay:
        print(replay(Path(a.replay), a.profile_dir))
        return 0
    if a.worker:
        if not torch.cuda.is_available():  # on a small shared CPU more threads only contend
            torch.set_num_threads(1)
        result = WORKERS[a.worker](json.loads(Path(a.config).read_text()))
        Path(a.result).write_text(json.dumps(result))
        return 0
    from autoplace import workloads
    from autoplace.capture import capture_workload
    from autoplace.cli.args import parse_options
    from autoplace.cluster import Cluster, parse_bytes, resolve
    from autoplace.costs.profile import apply_cached

    cuda = torch.cuda.is_available()
    cluster = Cluster.detect().subset([0]) if cuda else resolve("cpu-x1")
    try:
        caps = [None if c.strip().lower() == "none" else parse_bytes(c.strip())
                for c in a.memory_cap.split(",")]
        spec = {"spec": a.model, "options": parse_options(a), "seed": a.seed}
        meta = workloads.get(a.model, device="meta", seed=a.seed, **spec["options"])
        graph = capture_workload(meta)
        valid = set(recipe_plans(graph, cluster, smoke=a.smoke))
        unknown = set(a.recipes.split(",")) - valid if a.recipes else set()
        if unknown:
            raise ValueError(f"--recipes: unknown {', '.join(sorted(unknown))}; valid for "
                             f"{a.model}: {', '.join(sorted(valid))}")
        hand = [o for o in HAND if o == "eager" or (
            hasattr(meta.model, "gradient_checkpointing_enable") if o.startswith("hf-")
            else bool(block_lists(meta.model)))]
        asked = a.hand.split(",") if a.hand else hand
        if unknown := set(asked) - set(hand):
            raise ValueError(f"--hand: unknown {', '.join(sorted(unknown))}; valid for "
                             f"{a.model}: {', '.join(hand)}")
        hand = [o for o in hand if o in asked]
    except Exception as e:  # noqa: BLE001 - a message the user can act on, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    # a stopped driver (timeout's SIGTERM) stops its running worker too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    card = torch.cuda.get_device_name(0) if cuda else "cpu"
    tag = "levers-" + slug_of(a.name or meta.name)
    folder = output_folder(a.out, tag, card=card, gpus=1)
    (folder / "plans").mkdir(exist_ok=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    weights = shm / f"levers-weights-{os.getpid()}.pt"
    ctx: dict[str, Any] = {
        "args": a, "spec": spec, "name": a.name or meta.name, "cluster": cluster,
        "folder": folder, "graph": graph,
        "worker": {"spec": spec, "weights": str(weights), "seed": a.seed, "warmup": a.warmup,
                   "steps": a.warmup + a.steps},
        "hand": hand}
    out = ctx["out"] = {
        "benchmark": "levers", "model": a.model, "options": spec["options"], "card": card,
        "torch_version": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds, "budget": a.budget,
        "compile_backend": os.environ.get(COMPILE_BACKEND_ENV, "inductor"),
        # every run's allocator setting (autoplace's executor leaves a user's alone)
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "batch_size": meta.batch_size, "autocast_dtype": meta.autocast_dtype, "cases": []}
    t_start = time.perf_counter()

    def save(final: bool = False) -> None:
        for c in out["cases"]:
            summarise(c, reference_loss(c, ctx, final))
        out.update(wall_s=round(time.perf_counter() - t_start, 1), partial=not final)
        (folder / "levers.json").write_text(json.dumps(out, indent=1, allow_nan=False))
        (folder / "levers.md").write_text(markdown(out))

    try:
        say(f"{a.model}: initial weights" + (", ops profiled" if a.profile_dir else ""))
        r = run_worker("prepare", {**ctx["worker"], "profile_dir": a.profile_dir})
        if r.get("error"):
            raise RuntimeError(f"building {a.model} failed: {r['error']}")
        if a.profile_dir and not apply_cached(graph, a.profile_dir, [cluster.devices[0].kind]):
            say(f"  no profile in {a.profile_dir} for this graph: estimated op times")
        for cap in caps:
            run_case(f"{meta.name} " + (f"@{cap / 2**30:g}GiB" if cap else "no cap"), cap, ctx,
                     save)
        save(final=True)
    finally:
        weights.unlink(missing_ok=True)
    # without auto's plan a run checks execution only: it heads no scenario of the index
    heads = [headline(c) for c in out["cases"]]
    write_run(folder, tag=tag, kind="experiment", script="scripts/bench/bench_levers.py",
              scenarios=[h["scenario"] for h in heads], headline=[] if a.no_auto else heads,
              **({"execution": heads} if a.no_auto else {}),
              summary=f"{a.model} on one {card}: eager, torch.compile and checkpointing per block "
                      "by hand vs autoplace's execution of the same recipes and its auto plan.")
    say(f"wrote {folder / 'levers.json'} and {folder / 'levers.md'}")
    print((folder / "levers.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
