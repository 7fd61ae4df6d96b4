"""What one GPU holds at a step's allocated peak, beside what the simulator says.

Runs each case once on GPU 0 with the allocator's history recorded (``RunOptions.memory_dir``,
:mod:`autoplace.executor.memory_record`) and writes per case the measured peak, what was
allocated before the recorded step beyond the parameters and AdamW state, the sites
holding most of the peak (``largest_at_peak``), and the simulator's peak and breakdown for
the same plan on the same card. The cases, one process each:

* GNMT-4 at the suite's size and Inception-v3 (batch 32, 299 px), one device, with one
  and with eight microbatches (the second's peak lies in one microbatch's backward with
  every gradient alive, as a 1F1B stage's does);
* a U-Net of convolutions only (``scripts/bench/user_models.py:unet``): no matmul, so no
  cuBLAS workspace; it and the residual MLP under the plan ``auto`` chose for them on one
  H200 (one device replayed as CUDA graphs, stored with their levers runs);
* gpt-1b at batch 4, GNMT-4 at 64 and branchy-mlp at 512 (a rank's batch in the 2-GPU
  suites) under FSDP2 in a group of one with its shards offloaded, with their blocks
  recomputed and without.

Writes ``OUT/peak.json`` and ``OUT/peak.md``; with ``ONLY``, the cases whose name holds it.

    python scripts/bench/peak_contents.py OUT [ONLY]
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import Cluster
from autoplace.executor.launch import run_plan
from autoplace.executor.runner import RunOptions
from autoplace.files import write_atomic, write_json_atomic
from autoplace.plan import Plan
from autoplace.planners.manual import hand_written, lever_plans
from autoplace.sim import simulate
from autoplace.sim.model import OPTIMIZER_STATE_PER_PARAM_BYTE, graph_arrays

GNMT = dict(hidden=1024, vocab_size=32000, src_len=50, tgt_len=50, batch_size=128)
INCEPTION = dict(image_size=299, width=1.0, num_classes=1000, batch_size=32)
UNET = "user_models:unet"
BRANCHY = dict(in_dim=1024, hidden=2048, branches=8, depth=4, num_classes=1000, batch_size=512)
GIB, MIB = 2**30, 2**20
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def cases(cl: Cluster) -> list[tuple[str, str, dict[str, Any], Any]]:
    """``(case, workload, options, plan)``."""
    out = []
    for name, opts in (("gnmt-4", GNMT), ("inception-v3", INCEPTION), (UNET, {})):
        g = capture_workload(workloads.get(name, device="meta", **opts))
        single = hand_written(g, cl, levers=False)["single"]
        out.append((f"{name} single", name, opts, single))
        if name != UNET:
            out.append((f"{name} single mb=8", name, opts,
                        single.with_parallel(microbatches=8)))
    for run, model in (("2026-11-29-h200x1-levers-residual-mlp-3", "residual-mlp"),
                       ("2026-11-30-h200x1-levers-unet-4", "unet")):
        plan = Plan.load(RESULTS / run / "plans" / f"{model}-no-cap-auto.json")
        name = f"user_models:{model.replace('-', '_')}"
        out.append((f"{name} auto (CUDA graphs)", name, {}, plan))
    g = capture_workload(workloads.get("gpt-1b", device="meta", batch_size=4))
    lv = lever_plans(g, cl)
    off = lv["fsdp+offload+checkpoint-blocks"]
    out.append(("gpt-1b b4 fsdp+offload+checkpoint-blocks", "gpt-1b", {"batch_size": 4}, off))
    out.append(("gpt-1b b4 fsdp+offload", "gpt-1b", {"batch_size": 4}, lv["fsdp+offload"]))
    for name, opts in (("gnmt-4", {**GNMT, "batch_size": 64}), ("branchy-mlp", BRANCHY)):
        g = capture_workload(workloads.get(name, device="meta", **opts))
        lv = lever_plans(g, cl)
        b = opts["batch_size"]
        out.append((f"{name} b{b} fsdp+offload", name, opts, lv["fsdp+offload"]))
        out.append((f"{name} b{b} fsdp+offload+checkpoint-blocks", name, opts,
                    lv["fsdp+offload+checkpoint-blocks"]))
    return out


def main(out_dir: Path, only: str = "") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    cl = Cluster.detect().subset([0])
    rows: list[dict[str, Any]] = []
    for case, name, opts, plan in cases(cl):
        if only not in case:
            continue
        g = capture_workload(workloads.get(name, device="meta", **opts))
        sim = simulate(g, plan, cl)
        state = float(graph_arrays(g).param_bytes.sum()) * (1 + OPTIMIZER_STATE_PER_PARAM_BYTE)
        mem_dir = Path("/tmp/peak-contents") / case.replace(" ", "_").replace(":", "-")
        row: dict[str, Any] = dict(case=case, plan=plan.describe(),
                                   sim_peak_gib=sim.peak_memory_bytes[0] / GIB,
                                   sim_breakdown=sim.memory_breakdown[0])
        try:
            r = run_plan(plan, workloads.get(name, **opts), cluster=cl, options=RunOptions(
                steps=5, warmup=3, reference=False, memory_dir=str(mem_dir)), timeout_s=300)
            row.update(ms=r.step_time_s * 1e3, peak_gib=r.peak_memory_bytes[0] / GIB,
                       error=r.error)
        except Exception as e:  # noqa: BLE001 -- a case that fails is recorded, others run
            row.update(ms=None, peak_gib=None, error=f"{type(e).__name__}: {e}"[:300])
        gc.collect()
        rec_file = mem_dir / "memory-rank0.json"
        if rec_file.exists():
            dev = json.loads(rec_file.read_text())["devices"][0]
            row.update(record_peak_gib=dev["allocated_peak_bytes"] / GIB,
                       before_gib=dev["allocated_before_bytes"] / GIB,
                       # host-offloaded and sharded plans hold less than the whole state
                       before_beyond_state_mib=None if plan.parallel.shard != "none"
                       else (dev["allocated_before_bytes"] - state) / MIB,
                       by_source=dev["allocated_at_peak_by_source"],
                       largest_at_peak=dev["largest_at_peak"])
        if row.get("peak_gib"):
            row["sim_error"] = row["sim_peak_gib"] / row["peak_gib"] - 1
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("case", "ms", "peak_gib", "sim_peak_gib",
                                                  "before_beyond_state_mib", "error")}),
              flush=True)
        for s in row.get("largest_at_peak", [])[:12]:
            print(f"    {s['bytes'] / MIB:9.1f} MiB  x{s['blocks']:<4d} {s['site']}", flush=True)
        write_json_atomic(out_dir / "peak.json", rows)
    lines = ["| case | measured GiB | simulated GiB | error | before the step beyond "
             "parameters and AdamW state |", "|---|---|---|---|---|"]
    for r in rows:
        beyond = r.get("before_beyond_state_mib")
        lines.append(f"| {r['case']} | {r['peak_gib'] or 0:.3f} | {r['sim_peak_gib']:.3f} | "
                     f"{r.get('sim_error', 0):+.1%} | "
                     f"{'-' if beyond is None else f'{beyond:.0f} MiB'} |")
    write_atomic(out_dir / "peak.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
