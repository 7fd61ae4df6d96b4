"""The peak memory of one training step on the CPU, measured tensor storage by storage,
against the simulator's peak for the same graph and plan.

    python scripts/bench/step_memory.py --model gpt-tiny --options vocab_size=8192,d_model=128 \
        --recipes single,checkpoint-blocks --microbatches 1,2 --autocast none,bfloat16

Each case is measured by :func:`autoplace.tools.step_memory.measure_step` (the executor's
own one-device program, its second step, every tensor storage counted until it dies).
Prints one line per case
(measured and simulated MiB, the op at the peak and its largest live tensors) and, with
``--json``, writes them. The simulated peak is ``autoplace.sim.simulate`` on
``resolve("cpu-x1")``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from autoplace import workloads
from autoplace.cluster import resolve
from autoplace.executor.runner import capture_graph
from autoplace.plan import Plan
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate
from autoplace.tools.step_memory import measure_step

MiB = 2**20


def measure(model: str, options: dict[str, Any], recipe: str, microbatches: int,
            autocast: str | None) -> dict[str, Any]:
    """One case: the measured and the simulated peak (bytes) and what was alive."""
    wl = workloads.get(model, **options, autocast_dtype=autocast)
    graph = capture_graph(wl)
    cluster = resolve("cpu-x1")
    plans = {"single": Plan.single(graph, cluster=cluster), **lever_plans(graph, cluster)}
    if recipe not in plans:
        raise SystemExit(f"recipe {recipe!r} unknown; valid: {', '.join(plans)}")
    plan = plans[recipe].with_parallel(microbatches=microbatches)
    step = measure_step(wl, graph, plan, cluster, autocast)
    res = simulate(graph, plan, cluster)
    return {"model": model, "options": options, "recipe": recipe,
            "microbatches": microbatches, "autocast": autocast,
            "measured_bytes": step["measured_bytes"], "static_bytes": step["static_bytes"],
            "simulated_bytes": res.peak_memory_bytes[0], "breakdown": res.memory_breakdown[0],
            "peak_op": step["peak_op"],
            "alive_at_peak": [[n, w] for n, w in step["alive_at_peak"][:8]]}


def _options(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-tiny", help="a zoo workload name")
    ap.add_argument("--options", default="", help="workload options: key=value,key=value")
    ap.add_argument("--recipes", default="single,checkpoint-blocks",
                    help="single and/or lever_plans names, comma-separated")
    ap.add_argument("--microbatches", default="1", help="microbatch counts, comma-separated")
    ap.add_argument("--autocast", default="none,bfloat16",
                    help="none and/or an autocast dtype, comma-separated")
    ap.add_argument("--json", default=None, help="write the cases to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for ac in args.autocast.split(","):
        for recipe in args.recipes.split(","):
            for m in (int(x) for x in args.microbatches.split(",")):
                r = measure(args.model, _options(args.options), recipe, m,
                            None if ac == "none" else ac)
                rows.append(r)
                err = r["simulated_bytes"] / r["measured_bytes"] - 1
                print(f"{recipe} mb={m} autocast={ac}: measured {r['measured_bytes'] / MiB:.2f}"
                      f" MiB, simulated {r['simulated_bytes'] / MiB:.2f} ({err:+.2%}); peak at "
                      f"{r['peak_op']}: " + ", ".join(
                          f"{w} {n / MiB:.1f}" for n, w in r["alive_at_peak"][:4]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "cases": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
