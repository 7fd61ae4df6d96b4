"""An offloaded plan's CPU threads, measured: one thread a rank against the node's cores shared.

    python scripts/bench/bench_offload_threads.py --out OUT             # on a 2+ GPU machine
    python scripts/bench/bench_offload_threads.py --model gpt-1b --devices 2 --out OUT

An offloaded plan (FSDP2's ``CPUOffloadPolicy``: ``parallel.offload``) steps its AdamW on
the CPU, on the critical path. torchrun starts every rank with ``OMP_NUM_THREADS=1``;
the executor gives each rank of an offloaded plan on a GPU an even share of the node's
cores instead (:func:`autoplace.executor.offload.host_threads`). This script runs the
hand-written ``fsdp+offload`` plan (:func:`autoplace.planners.manual.hand_written`) with
``autoplace run``'s launcher, alternately with the ranks pinned to as many cores as
there are ranks (``taskset``: one thread a rank, as before) and with every core, for
``--rounds`` rounds, and writes the step times beside the simulated one to
``offload-threads.json`` in ``--out`` (by default a new run folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-1b", help="zoo workload")
    p.add_argument("--devices", type=int, default=2, help="GPUs (ranks) of the plan")
    p.add_argument("--steps", type=int, default=6, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of both")
    p.add_argument("--out", default=None, help="output folder (default: a new run folder)")
    p.add_argument("--run-one", nargs=2, metavar=("PLAN", "REPORT"), help=argparse.SUPPRESS)
    return p.parse_args()


def run_one(args: argparse.Namespace) -> None:
    """One run of the plan file, its report written as JSON (a child process)."""
    from autoplace.executor.launch import run_plan
    from autoplace.executor.runner import RunOptions

    plan, report = args.run_one
    rep = run_plan(plan, args.model, cluster="detect", timeout_s=300,
                   options=RunOptions(steps=args.steps, warmup=args.warmup, reference=False))
    Path(report).write_text(json.dumps(rep.to_json()))


def main() -> int:
    args = parse_args()
    if args.run_one:
        run_one(args)
        return 0
    from autoplace import workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import resolve
    from autoplace.planners.manual import hand_written
    from autoplace.sim import simulate

    if not torch.cuda.is_available() or torch.cuda.device_count() < args.devices:
        print(f"needs {args.devices} GPUs; this machine has {torch.cuda.device_count()}")
        return 2
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(args.devices)))
    if args.out is None:
        from results import new_run_dir
        out = new_run_dir(time.strftime("%Y-%m-%d"), torch.cuda.get_device_name(0),
                          args.devices, "offload-threads")
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    cluster = resolve("detect")
    graph = capture_workload(workloads.get(args.model))
    plan = hand_written(graph, cluster)["fsdp+offload"]
    plan_file = out / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    sim = simulate(graph, plan, cluster).step_time_s
    print(f"{args.model} fsdp+offload on {args.devices} GPUs: simulated {sim * 1e3:.1f} ms",
          flush=True)
    cores = len(os.sched_getaffinity(0))
    modes = {"one thread a rank": ["taskset", "-c", f"0-{args.devices - 1}"],
             "cores shared": []}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode, prefix in modes.items():
            report = out / f"report-{len(runs[mode])}-{mode.replace(' ', '-')}.json"
            t = time.perf_counter()
            proc = subprocess.run([*prefix, sys.executable, __file__, "--model", args.model,
                                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                                   "--run-one", str(plan_file), str(report)],
                                  capture_output=True, text=True)
            if proc.returncode or not report.exists():
                print(f"round {r} {mode}: failed (exit {proc.returncode}): "
                      f"{proc.stderr[-800:]}", flush=True)
                continue
            rep = json.loads(report.read_text())
            runs[mode].append(rep)
            print(f"round {r} {mode}: {rep['step_time_s'] * 1e3:.1f} ms a step, "
                  f"{rep.get('extra', {}).get('host_threads')} threads a rank "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    result = {
        "model": args.model, "devices": args.devices, "cores": cores,
        "card": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "sim_step_time_s": sim,
        "modes": {m: {"step_time_s": statistics.median(x["step_time_s"] for x in reps)
                      if reps else None,
                      "step_times_s": [x["step_times_s"] for x in reps],
                      "host_threads": [x.get("extra", {}).get("host_threads") for x in reps],
                      "peak_memory_bytes": [x.get("peak_memory_bytes") for x in reps]}
                  for m, reps in runs.items()},
    }
    (out / "offload-threads.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({m: v["step_time_s"] for m, v in result["modes"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
