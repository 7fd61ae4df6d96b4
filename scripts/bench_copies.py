"""Cross-GPU copies in one-process placements: ``Tensor.to`` against stream-aware copies.

    python scripts/bench_copies.py bench/results/2026-11-27-h200x2-s17-suite.json \\
        --profiles bench/results/raw --tag s17 --scenarios inception,branchy-mlp \\
        --out bench/results/copies.json

A placement inside one process moves a tensor between GPUs with ``Tensor.to``, and
ATen makes such a copy wait for everything queued on *both* devices' current streams
(``copy_device_to_device``). With many cut edges (the searched placements of
Inception-v3 and the branchy MLP) that barrier can serialise the two GPUs, and the
simulator, which queues copies on the link only, predicts those placements 20-40%
faster than they measure. ``build_local(copy_streams=True)`` copies on a side stream
per device pair instead (:func:`autoplace.executor.local.move_to_streamed`).

This script rebuilds the one-process placements a stored suite measured (the
deterministic planners' plans, from the profiles and links that run stored, exactly as
``scripts/replay_suite.py`` does), and runs each plan both ways in one process on the
same parameters, in interleaved rounds: ``to`` (the executor's default) and
``streams``; ``--ways to,pinned`` instead compares page-locked batches with pageable ones. It checks that both compute the same loss, and writes per plan the median
step time of each way with its spread and the median time of its phases (the forward,
backward and optimizer calls, which return once their work is issued unless they wait
for a device, then the wait for the devices), the simulated time and the time the suite
measured. The one-device plan runs too (its two ways are the same program). ``--trace DIR`` also writes a Chrome trace of 2 steps of each (gzipped).

Without 2 GPUs it runs the CPU smoke scenario ``tiny-mlp`` (no suite needed).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: ``to``: the executor's program; ``streams``: its edges copy on side streams;
#: ``pinned``: the executor's program on page-locked batches (``global_batch(pin=True)``)
#: ``graphs``: the executor's program with every run of ops on one device replayed as a
#: CUDA graph (``build_local(graphs=True)``, autocast without its cache)
#: ``graphs-streams``: both
WAYS = ("to", "streams", "pinned", "graphs", "graphs-streams")
#: a step's wall time by phase: the forward call, the backward call, the optimizer (all
#: return once their work is issued, unless something waits for a device), then the wait
#: for the devices to finish
PHASES = ("forward", "backward", "optimizer", "device_tail")
PLANNERS = "single,two-halves,expert,critical-path,m-etf,m-sct,hash,local-x2-mb"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", default=None,
                    help="a suite's JSON from scripts/bench_plans.py (its links, caps and "
                         "card); without it: the detected cluster, no cap")
    ap.add_argument("--profiles", default=None, help="per-op profiles (see replay_suite.py)")
    ap.add_argument("--tag", default=None, help="the profiles' tag in bench/results/raw")
    ap.add_argument("--scenarios", default=None,
                    help="comma-separated scenarios (default: inception,branchy-mlp,"
                         "gnmt4-capped on GPUs, tiny-mlp on CPU)")
    ap.add_argument("--planners", default=PLANNERS,
                    help="comma-separated plans to run; NAME@mbK: that plan with K microbatches")
    ap.add_argument("--ways", default="to,streams", help=f"comma-separated, of {WAYS}")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per way and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--trace", default=None, help="directory for Chrome traces")
    ap.add_argument("--out", default=None, help="result JSON")
    return ap.parse_args(argv)


def _off(x: float, ref: float, rel: float, floor: float) -> bool:
    """``x`` differs from ``ref`` by more than ``rel`` of ``max(floor, |ref|)``."""
    return abs(x - ref) > rel * max(floor, abs(ref))


def run_plan(wl, graph, plan, devices, args, trace_dir: Path | None, label: str
             ) -> dict[str, Any]:
    """Both ways of one plan, interleaved: per way the step times' median and spread."""
    from autoplace.executor.build import _issue_order
    from autoplace.executor.local import build_local
    from autoplace.executor.runner import _autocast, _optimizer, _sync, global_batch

    order = _issue_order(graph, plan)
    ways = args.ways.split(",")
    progs = {v: build_local(graph.module, plan, devices, wl.loss_fn, order=order,
                            copy_streams=v.endswith("streams"), graphs=v.startswith("graphs"))
             for v in ways}
    opt = _optimizer([p for p in wl.model.parameters() if p.requires_grad], wl, devices[0])

    def fwd(v: str, inputs, targets):
        with _autocast(wl, devices[0], cache=not v.startswith("graphs")):
            return progs[v](inputs, targets)

    with torch.no_grad():
        losses = {v: float(fwd(v, *global_batch(wl, 0, 0, pin=v == "pinned"))) for v in ways}
    if any(_off(x, losses[ways[0]], 1e-3, 1.0) for x in losses.values()):
        raise SystemExit(f"{label}: the ways disagree on batch 0's loss: {losses}")

    step_no = 1

    phases: dict[str, dict[str, list[float]]] = {v: {k: [] for k in PHASES} for v in ways}

    def steps(v: str, n: int, timed: bool = False) -> list[float]:
        nonlocal step_no
        out = []
        for _ in range(n):
            inputs, targets = global_batch(wl, step_no, 0, pin=v == "pinned")
            step_no += 1
            _sync(devices)
            t0 = time.perf_counter()
            loss = fwd(v, inputs, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            _sync(devices)
            t4 = time.perf_counter()
            out.append(t4 - t0)
            if timed:  # where the host's time went: issuing, or waiting for the devices
                for k, x in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    phases[v][k].append(x)
        return out

    times: dict[str, list[float]] = {v: [] for v in ways}
    medians: dict[str, list[float]] = {v: [] for v in ways}
    peaks: dict[str, list[int]] = {}
    res: dict[str, Any] = {"loss_batch0": losses}
    try:
        for _ in range(args.rounds):
            for v in ways:
                for d in devices:
                    if d.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(d)
                steps(v, args.warmup)
                t = steps(v, args.steps, timed=True)
                times[v] += t
                medians[v].append(statistics.median(t))
                peaks[v] = [torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0
                            for d in devices]
        if trace_dir is not None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if devices[0].type == "cuda" else [])
            for v in ways:
                steps(v, 1)
                with profile(activities=acts) as prof:
                    steps(v, 2)
                raw = trace_dir / f"{label}-{v}.json"
                prof.export_chrome_trace(str(raw))
                with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                raw.unlink()
    except torch.OutOfMemoryError as e:
        res["oom"] = str(e).splitlines()[0][:200]
    for v in ways:
        if times[v]:
            res[v] = {"step_time_s": statistics.median(times[v]),
                      **{f"{k}_s": statistics.median(x) for k, x in phases[v].items() if x},
                      "round_medians_s": medians[v],
                      "spread_s": [min(medians[v]), max(medians[v])],
                      "peak_memory_bytes": peaks.get(v)}
    if "oom" not in res and len(ways) > 1:  # with autograd, after any capture (graphs
        # replay now): every way computes the same loss and gradients on batch 0
        agree: dict[str, list[float]] = {}
        for v in ways:
            opt.zero_grad(set_to_none=True)
            loss = fwd(v, *global_batch(wl, 0, 0, pin=v == "pinned"))
            loss.backward()
            grads = [float(p.grad.float().norm()) for p in wl.model.parameters()
                     if p.grad is not None]
            agree[v] = [float(loss.detach()), sum(x * x for x in grads) ** 0.5]
        opt.zero_grad(set_to_none=True)
        res["loss_and_grad_norm_batch0"] = agree
        ref_l, ref_g = agree[ways[0]]
        if any(_off(x[0], ref_l, 1e-3, 1.0) or _off(x[1], ref_g, 1e-2, 1e-6)
               for x in agree.values()):
            raise SystemExit(f"{label}: the ways disagree with autograd: {agree}")
    graphed = next((v for v in ways if v.startswith("graphs")), None)
    if graphed:  # how many pieces replay as graphs, and why others do not
        from autoplace.executor.local import _Graphed

        pieces = [p for p in progs[graphed].program.children() if isinstance(p, _Graphed)]
        res["graphed_pieces"] = len(pieces)
        res["graphed_replaying"] = sum(p._replay is not None for p in pieces)
        res["graph_failures"] = sorted({p.failed for p in pieces if p.failed})
    for v in ways[1:]:
        if ways[0] in res and v in res:
            res[f"{v}_vs_{ways[0]}"] = res[v]["step_time_s"] / res[ways[0]]["step_time_s"]
    progs.clear()  # the optimizer and the programs go with this frame
    gc.collect()
    if devices[0].type == "cuda":
        torch.cuda.empty_cache()
    return res


def _ms(res: dict[str, Any], way: str) -> str:
    r = res.get(way)
    if not r:
        return "failed"
    return (f"{r['step_time_s'] * 1e3:.1f} ms ({r['spread_s'][0] * 1e3:.1f}-"
            f"{r['spread_s'][1] * 1e3:.1f}; " + "/".join(
                f"{r[f'{k}_s'] * 1e3:.1f}" for k in PHASES if f"{k}_s" in r) + ")")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import bench_plans as bp
    import replay_suite as rs

    from autoplace import workloads
    from autoplace.cluster import Cluster
    from autoplace.executor.runner import capture_graph
    from autoplace.costs.profile import apply_cached
    from autoplace.sim import simulate

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devices = ([torch.device("cuda", 0), torch.device("cuda", 1)] if gpu
               else [torch.device("cpu"), torch.device("cpu")])
    result: dict[str, Any] | None = {"scenarios": [], "num_devices": 2}
    if args.results:
        result = rs.read_suite(args.results)
        if result is None:
            return 2
    stored = {r["name"]: r for r in result["scenarios"]}
    names = (args.scenarios or ("inception,branchy-mlp,gnmt4-capped" if gpu else "tiny-mlp")
             ).split(",")
    unknown = [n for n in names if n not in bp.SCENARIOS]
    if unknown:
        print(f"error: unknown scenario(s) {unknown}; valid: {sorted(bp.SCENARIOS)}",
              file=sys.stderr)
        return 2
    wanted = args.planners.split(",")
    bad = [w for w in args.ways.split(",") if w not in WAYS]
    if bad:
        print(f"error: unknown way(s) {bad}; valid: {list(WAYS)}", file=sys.stderr)
        return 2
    folder = rs._profile_dir(args.profiles, args.tag)
    trace_dir = Path(args.trace) if args.trace else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0) if gpu else "cpu"
    out: dict[str, Any] = {"benchmark": "one-process-copies", "card": card,
                           "torch_version": torch.__version__,
                           "date": datetime.date.today().isoformat(),
                           "suite": args.results, "steps": args.steps,
                           "warmup": args.warmup, "rounds": args.rounds, "scenarios": []}
    t_start = time.time()
    try:
        for name in names:
            rec = stored.get(name, {})
            if args.results:
                cl = rs.scenario_cluster(result, rec) if rec else rs.base_cluster(result)
            else:
                cl = Cluster.detect()
            kind = cl.devices[0].kind
            meta_graph, profiled, plans = rs.rebuild_plans(name, cl, folder, kind)
            sc = bp.SCENARIOS[name]
            wl = workloads.get(sc["model"], **sc["options"])
            graph = capture_graph(wl)
            if folder:
                apply_cached(graph, folder, [kind])  # the executor's issue order uses it
            cap = rec.get("memory_cap_bytes")
            for d in devices:
                if d.type == "cuda":
                    total = torch.cuda.get_device_properties(d).total_memory
                    torch.cuda.set_per_process_memory_fraction(
                        min(1.0, cap / total) if cap else 1.0, d)
            measured = {p["planner"]: p for p in rec.get("plans", [])}
            rows = []
            seen: dict[str, str] = {}
            for planner in wanted:
                base, _, mb = planner.partition("@mb")  # NAME@mbK: K microbatches
                plan = plans.get(base)
                if plan is None:
                    continue
                if mb:
                    plan = plan.with_parallel(microbatches=int(mb))
                par = plan.parallel
                if par.pipeline > 1 or par.data > 1:
                    continue  # not a one-process plan
                key = json.dumps([plan.to_json()["groups"], list(plan.placement)],
                                 sort_keys=True) + str(par)
                if key in seen:
                    rows.append({"planner": planner, "same_plan_as": seen[key]})
                    continue
                seen[key] = planner
                m = measured.get(planner, {})
                print(f"[{time.time() - t_start:6.1f}s] {name} {planner} ({plan.split()})",
                      flush=True)
                res = run_plan(wl, graph, plan, devices[:plan.devices_per_replica], args,
                               trace_dir, f"{name}-{planner}")
                row = {"planner": planner, "split": plan.split(),
                       "sim_step_time_s": simulate(meta_graph, plan, cl).step_time_s,
                       "suite_measured_step_time_s": m.get("measured_step_time_s"), **res}
                rows.append(row)
                print("    " + ", ".join(f"{v} {_ms(res, v)}" for v in args.ways.split(","))
                      + "; simulated "
                      f"{row['sim_step_time_s'] * 1e3:.1f} ms"
                      + (f", suite measured {m['measured_step_time_s'] * 1e3:.1f} ms"
                         if m.get("measured_step_time_s") else "")
                      + (f"; out of memory: {res['oom']}" if "oom" in res else ""),
                      flush=True)
                if "graphed_pieces" in res:
                    print(f"    graphs: {res['graphed_replaying']} of {res['graphed_pieces']} "
                          f"pieces replay; failures: {res['graph_failures']}", flush=True)
            out["scenarios"].append({"name": name, "profiled": profiled,
                                     "memory_cap_bytes": cap, "plans": rows})
            del wl, graph
            gc.collect()
    finally:
        if folder is not None and folder != args.profiles:
            shutil.rmtree(folder, ignore_errors=True)
    out["wall_s"] = time.time() - t_start
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
