"""FSDP2 and ZeRO-2 with two unit rules side by side: blocks + root, or blocks + one unit per
other module holding parameters.

    python scripts/bench_fsdp_units.py --out fsdp-units.json [--scenarios gnmt4-capped,gpt1b-16GB]

For each scenario of ``scripts/bench_plans.py`` (its workload and memory cap) runs the
hand-written FSDP2 plan and its ZeRO-2 twin under each unit rule (``parallel.shard_units``),
with ``--uncapped`` also without the cap, in interleaved order, on the devices present,
and records every run's step times, peak memory and losses.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plans import SCENARIOS  # noqa: E402

from autoplace import planners, workloads  # noqa: E402
from autoplace.capture import capture_workload  # noqa: E402
from autoplace.cluster import parse_bytes, resolve  # noqa: E402
from autoplace.executor.launch import run_plan  # noqa: E402

CAPS = {"gnmt4-capped": "4.37182GiB"}  # bench_plans measures it; the value of its runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", default="gnmt4-capped,gpt1b-16GB")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--deadline-s", type=float, default=400.0)
    p.add_argument("--units", default="blocks,modules", help="unit rules to run")
    p.add_argument("--plans", default="fsdp,zero2")
    p.add_argument("--cap", default=None,
                   help="memory cap of every scenario (default: its own; gnmt4-capped's "
                        "measured one is 4.37182GiB)")
    p.add_argument("--trace", default=None,
                   help="also record each run's timed steps with torch.profiler under this "
                        "folder (summarise with scripts/trace_summary.py)")
    p.add_argument("--uncapped", action="store_true",
                   help="also run every variant without the scenario's memory cap")
    args = p.parse_args()
    t0 = time.time()
    rows = []
    for name in args.scenarios.split(","):
        sc = SCENARIOS[name]
        cap = args.cap or CAPS.get(name, sc["cap"])
        if cap == "auto":
            p.error(f"{name}'s cap is measured by bench_plans.py; pass --cap")
        wl = workloads.get(sc["model"], **sc["options"])
        spec = {"spec": sc["model"], "options": sc["options"]}
        clusters = {"capped": resolve("detect", parse_bytes(cap))} if cap else {}
        if args.uncapped or not cap:
            clusters["uncapped"] = resolve("detect")
        g = capture_workload(wl)
        fsdp = planners.get("fsdp")(g, next(iter(clusters.values())))
        plans = {"fsdp": fsdp, "zero2": fsdp.with_parallel(shard="zero2")}
        plans = {k: plans[k] for k in args.plans.split(",")}
        for r in range(args.rounds):
            for (pname, plan), units, (cname, cluster) in itertools.product(
                    plans.items(), args.units.split(","), clusters.items()):
                if time.time() - t0 > args.deadline_s:
                    break
                s = time.time()
                try:
                    trace = (f"{args.trace}/{name}-{pname}-{units}-{cname}-r{r}"
                             if args.trace else None)
                    rep = run_plan(plan.with_parallel(shard_units=units), spec, cluster=cluster,
                                   steps=args.steps, warmup=2, reference=False, timeout_s=120,
                                   trace_dir=trace)
                    row = dict(scenario=name, plan=pname, units=units, cap=cname, round=r,
                               step_time_s=rep.step_time_s, step_times_s=rep.step_times_s,
                               peak_memory_bytes=rep.peak_memory_bytes, loss=rep.loss,
                               oom=rep.oom, error=rep.error,
                               allocator=rep.extra.get("allocator", {}))
                except Exception as e:  # noqa: BLE001 - recorded, the others still run
                    row = dict(scenario=name, plan=pname, units=units, cap=cname,
                               round=r, error=str(e)[-400:])
                row["wall_s"] = time.time() - s
                rows.append(row)
                peaks = [round(b / 2**30, 2) for b in row.get("peak_memory_bytes") or []]
                print(f"{name} {pname} {units} {cname} r{r}: "
                      f"{1e3 * row.get('step_time_s', float('nan')):.1f} ms peak {peaks} "
                      f"allocator {row.get('allocator')} "
                      f"err {row.get('error')} ({row['wall_s']:.0f} s)", flush=True)
                Path(args.out).write_text(json.dumps(rows, indent=1))
    summary = {}
    for row in rows:
        if row.get("step_times_s"):
            key = (row["scenario"], row["plan"], row["units"], row["cap"])
            summary.setdefault(key, []).extend(row["step_times_s"])
    for key, ts in summary.items():
        print(*key, f"median {1e3 * statistics.median(ts):.1f} ms over {len(ts)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
