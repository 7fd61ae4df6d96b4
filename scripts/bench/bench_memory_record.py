"""Where the memory of sharded plans goes under a cap, from the allocator's own record.

Runs each case once on 2 GPUs with ``RunOptions.memory_dir`` (the CUDA caching
allocator's history over the first timed step, :mod:`autoplace.executor.memory_record`)
and writes, per case, the measured step, peaks, allocator retries, the simulator's peak
and its breakdown, and rank 0's record summary (reserved memory by stream, what was alive
at the allocated peak by where it was allocated) to OUT/memory.json. The snapshots stay
in /tmp (too large to keep).

Case sets (SET, default ``sharded``):

* ``sharded``: gpt-1b at 16 GiB (FSDP2 + per-block checkpointing eager and compiled,
  ZeRO-2 and FSDP2 compiled, the two halves) and GNMT-4 at the suite's 4.37 GiB (FSDP2 +
  per-block checkpointing eager and compiled, FSDP2 by modules);
* ``flows``: gpt-1b's one-process flows and pipelines that ``auto`` measured at 16 GiB,
  run without a cap so their whole peak shows (simulated at 16 GiB): 2-stage GPipe with 2
  and 4 microbatches, eager and compiled, and the two halves with 2 microbatches, eager and
  compiled; each flow also with ``torch.profiler`` (``trace``: ``autoplace trace-summary``
  of the timed steps: per device the GPU's busy, idle and compute time, the host's
  busiest operations);
* ``gnmt``: GNMT-4's sharded plans at the suite's 4.37 GiB: FSDP2 by blocks and by
  modules, ZeRO-2, FSDP2 + per-block checkpointing (its LSTMs under FSDP2);
* ``gnmt-placements``: GNMT-4's 2-device placements by expert, hash, anneal, m-etf and the
  two halves, run without a cap so their whole peak shows (simulated at 4.37 GiB: expert's,
  hash's and anneal's ran out of memory there, simulated to fit or nearly).

    python scripts/bench/bench_memory_record.py OUT DEADLINE_S [SET]
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from autoplace import planners, workloads
from autoplace.cluster import Cluster
from autoplace.costs.profile import profile
from autoplace.errors import AutoplaceError
from autoplace.executor.launch import run_plan
from autoplace.executor.report import RunReport
from autoplace.executor.runner import RunOptions
from autoplace.files import write_json_atomic
from autoplace.planners.manual import hand_written, lever_plans
from autoplace.planners.pipeline_dp import fsdp, pipeline, zero2
from autoplace.sim import simulate
from autoplace.tools.trace_summary import summarize

GNMT = dict(hidden=1024, vocab_size=32000, src_len=50, tgt_len=50, batch_size=128)
GNMT_CAP = 4693539840  # the suite's: 75% of what one H200 measured for one device
GIB = 2**30


def cases(base: Cluster) -> list[tuple[str, Any, Any, Any, Cluster]]:
    out = []
    wl = workloads.get("gpt-1b")
    g = profile(wl, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    cl = base.with_memory_cap(16 * GIB)
    ck = lever_plans(g, cl)["fsdp+checkpoint-blocks+compile"]
    out += [("gpt1b-fsdp+ckpt", wl, g, ck.with_parallel(compile=False), cl),
            ("gpt1b-fsdp+ckpt+compile", wl, g, ck, cl),
            ("gpt1b-zero2+compile", wl, g, zero2(g, cl).with_parallel(compile=True), cl),
            ("gpt1b-fsdp+compile", wl, g, fsdp(g, cl).with_parallel(compile=True), cl),
            ("gpt1b-two-halves", wl, g, hand_written(g, cl, levers=False)["two-halves"], cl)]
    wl2 = workloads.get("gnmt-4", **GNMT)
    g2 = profile(wl2, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    cl2 = base.with_memory_cap(GNMT_CAP)
    ck2 = lever_plans(g2, cl2)["fsdp+checkpoint-blocks+compile"]
    out += [("gnmt-fsdp+ckpt", wl2, g2, ck2.with_parallel(compile=False), cl2),
            ("gnmt-fsdp+ckpt+compile", wl2, g2, ck2, cl2),
            ("gnmt-fsdp-modules", wl2, g2,
             fsdp(g2, cl2).with_parallel(shard_units="modules"), cl2)]
    return out


def gnmt_cases(base: Cluster) -> list[tuple[str, Any, Any, Any, Cluster]]:
    """The ``gnmt`` set: (name, workload, graph, plan, cluster), each at the cap."""
    wl = workloads.get("gnmt-4", **GNMT)
    g = profile(wl, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    cl = base.with_memory_cap(GNMT_CAP)
    ck = lever_plans(g, cl)["fsdp+checkpoint-blocks+compile"].with_parallel(compile=False)
    return [("gnmt-fsdp", wl, g, fsdp(g, cl), cl),
            ("gnmt-fsdp-modules", wl, g, fsdp(g, cl).with_parallel(shard_units="modules"), cl),
            ("gnmt-zero2", wl, g, zero2(g, cl), cl),
            ("gnmt-fsdp+ckpt", wl, g, ck, cl)]


def gnmt_placement_cases(base: Cluster) -> list[tuple[str, Any, Any, Any, Cluster]]:
    """The ``gnmt-placements`` set: (name, workload, graph, plan, cluster to simulate on);
    each runs on ``base`` without a cap."""
    wl = workloads.get("gnmt-4", **GNMT)
    g = profile(wl, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    cl = base.with_memory_cap(GNMT_CAP)
    out = [(f"gnmt-{name}", wl, g, planners.get(name)(g, cl), cl)
           for name in ("expert", "hash", "anneal", "m-etf")]
    return out + [("gnmt-two-halves", wl, g, hand_written(g, cl, levers=False)["two-halves"],
                   cl)]


def flow_cases(base: Cluster) -> list[tuple[str, Any, Any, Any, Cluster]]:
    """The ``flows`` set: (name, workload, graph, plan, cluster to simulate on); each runs
    on ``base`` without a cap."""
    wl = workloads.get("gpt-1b")
    g = profile(wl, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    cl = base.with_memory_cap(16 * GIB)
    halves = hand_written(g, cl, levers=False)["two-halves"]
    out = []
    for c in (False, True):
        tag = "+compile" if c else ""
        for mb in (2, 4):
            out.append((f"gpt1b-gpipe-mb{mb}{tag}", wl, g,
                        pipeline(g, cl, stages=2, microbatches=mb).with_parallel(compile=c), cl))
        out.append((f"gpt1b-halves-mb2{tag}", wl, g,
                    halves.with_parallel(microbatches=2, compile=c), cl))
    return out


def trace_of(path: Path) -> dict[str, Any] | None:
    """One rank's trace of the timed steps, summarised by ``autoplace trace-summary``
    (:func:`autoplace.tools.trace_summary.summarize`); None where it has no steps."""
    try:
        return summarize(path)
    except SystemExit:  # a trace without the run's step spans
        return None


def gib(b: float | None) -> float | None:
    return None if b is None else round(b / GIB, 3)


def main(out_dir: Path, deadline_s: float, which: str = "sharded") -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res: list[dict[str, Any]] = []
    base = Cluster.detect().subset([0, 1])
    todo = {"sharded": cases, "flows": flow_cases, "gnmt": gnmt_cases,
            "gnmt-placements": gnmt_placement_cases}[which](base)
    if which == "flows":  # each flow again with the profiler on
        todo += [(n + "+trace", wl, g, p, cl) for n, wl, g, p, cl in todo]
    for name, wl, g, plan, cl in todo:
        if time.perf_counter() - t0 > deadline_s:
            print(f"deadline: {name} and the rest not run", flush=True)
            break
        sim = simulate(g, plan, cl)
        mem_dir = Path("/tmp/memory-record") / name
        traced = name.endswith("+trace")
        # flows and placements: no cap, their whole peak shows
        run_cl = base if which in ("flows", "gnmt-placements") else cl
        t = time.perf_counter()
        try:
            r = run_plan(plan, wl, cluster=run_cl, options=RunOptions(
                steps=8, warmup=3, reference=False,
                memory_dir=None if traced else str(mem_dir),
                trace_dir=str(mem_dir) if traced else None), timeout_s=300)
        except AutoplaceError as e:  # a rank died: that case failed, the others run
            r = RunReport(plan=plan.describe(), error=str(e)).finish()
        except Exception as e:  # noqa: BLE001 -- a one-process case raised (GNMT-4's
            # annealed placement: a SystemError from autograd's engine): record it, go on
            r = RunReport(plan=plan.describe(), error=f"{type(e).__name__}: {e}").finish()
        gc.collect()  # a one-process case's model goes before the next case
        rec = json.loads((mem_dir / "memory-rank0.json").read_text()) \
            if (mem_dir / "memory-rank0.json").exists() else None
        row = dict(case=name, plan=plan.describe(), ok=r.error is None,
                   ms=round(r.step_time_s * 1e3, 2) if r.error is None else None,
                   sim_ms=round(sim.step_time_s * 1e3, 2),
                   peak_gib=[gib(b) for b in r.peak_memory_bytes],
                   sim_peak_gib=[gib(b) for b in sim.peak_memory_bytes],
                   sim_breakdown=sim.memory_breakdown,
                   reserved_gib=gib(r.reserved_peak_bytes), retries=r.allocator_retries,
                   error=(r.error or "")[:300], wall_s=round(time.perf_counter() - t, 1),
                   step_ms=[round(x * 1e3, 2) for x in (r.step_times_s or [])],
                   record=rec,
                   trace=trace_of(mem_dir / "trace-rank0.json")
                   if traced and (mem_dir / "trace-rank0.json").exists() else None)
        res.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("record", "sim_breakdown")}),
              flush=True)
        if traced and plan.parallel.pipeline > 1 and (mem_dir / "trace-rank1.json").exists():
            row["trace_rank1"] = trace_of(mem_dir / "trace-rank1.json")
        if rec:
            for d in rec["devices"]:
                print("   peak by source (GiB):", {k: gib(v) for k, v in
                                                   d["allocated_at_peak_by_source"].items()},
                      "reserved at peak by stream:", {k: gib(v) for k, v in
                                                      d["reserved_at_peak_by_stream"].items()},
                      "stream peaks:", {k: gib(v) for k, v in
                                        d["reserved_stream_peaks"].items()},
                      "ooms", d["ooms"], flush=True)
        write_json_atomic(out_dir / "memory.json", res)


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "sharded")
