"""Two checks under a memory cap on 2 GPUs, results in OUT/exp.json:

1. GNMT-4 at the suite's size as a 2-stage pipeline of 2 microbatches (1F1B), compiled and
   eager, with the stages hybrid-dp cuts (auto's candidate that failed in
   ``2026-11-29-h200x2-suite-levers-gnmt-inception``).
2. The caching allocator's ``garbage_collection_threshold`` beside expandable segments (the
   executor's setting under a cap): GNMT-4's ZeRO-2 and FSDP2 at 4.4 GiB, each setting
   twice, interleaved, and gpt-1b's FSDP2 + per-block checkpointing + compile at 16 GiB,
   with their allocator retries.

    python scripts/bench/bench_allocator_gc.py OUT DEADLINE_S
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from autoplace import workloads
from autoplace.cluster import Cluster
from autoplace.costs.profile import profile
from autoplace.executor import execute
from autoplace.executor.runner import capture_graph
from autoplace.files import write_json_atomic
from autoplace.planners.manual import lever_plans
from autoplace.planners.pipeline_dp import fsdp, hybrid_candidates, zero2

GNMT = dict(hidden=1024, vocab_size=32000, src_len=50, tgt_len=50, batch_size=128)
GNMT_CAP = 4693539840  # the suite's: 75% of what one H200 measured for one device
CONFS = {"expandable": "expandable_segments:True",
         "expandable+gc0.8": "expandable_segments:True,garbage_collection_threshold:0.8",
         "expandable+gc0.6": "expandable_segments:True,garbage_collection_threshold:0.6"}


def summary(r: Any) -> dict[str, Any]:
    return dict(ok=r.ok, ms=round(r.step_time_s * 1e3, 2) if r.ok else None,
                retries=r.allocator_retries,
                peak=[round(b / 2**30, 2) for b in r.peak_memory_bytes],
                reserved=round((r.reserved_peak_bytes or 0) / 2**30, 2),
                err=(r.error or "")[:400], loss=r.max_loss_rel_diff)


def main(out_dir: Path, deadline_s: float) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out_dir.mkdir(parents=True, exist_ok=True)
    res: list[dict[str, Any]] = []

    def rec(**kw: Any) -> None:
        res.append(kw)
        print(json.dumps(kw), flush=True)
        write_json_atomic(out_dir / "exp.json", res)

    base = Cluster.detect()
    t0 = time.perf_counter()
    wl = workloads.get("gnmt-4", **GNMT)
    g = capture_graph(wl)
    profile(g, ["cuda:0"], repeats=3, cache_dir="/tmp/autoplace-profile")
    cl = base.with_memory_cap(GNMT_CAP)
    pp = [p for p, _, _ in hybrid_candidates(g, cl) if p.parallel.pipeline == 2]
    for p in pp[:2]:
        for comp in (True, False):
            q = p.with_parallel(microbatches=2, schedule="1f1b", compile=comp)
            r = execute(wl, q, cluster=cl, steps=12, warmup=4, reference=False)
            rec(case="gnmt-pp2", compile=comp, groups=p.num_groups, **summary(r))
    plans = {"zero2": zero2(g, cl), "fsdp": fsdp(g, cl)}
    for rep in range(2):
        for name, plan in plans.items():
            for cname, conf in CONFS.items():
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
                r = execute(wl, plan, cluster=cl, steps=14, warmup=4, reference=False)
                rec(case=f"gnmt-{name}", conf=cname, rep=rep, **summary(r))
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    wl2 = workloads.get("gpt-1b")
    cl2 = base.with_memory_cap(16 * 2**30)
    plan = lever_plans(capture_graph(wl2), cl2)["fsdp+checkpoint-blocks+compile"]
    for cname, conf in CONFS.items():
        if time.perf_counter() - t0 > deadline_s:
            break
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
        r = execute(wl2, plan, cluster=cl2, steps=14, warmup=4, reference=False)
        rec(case="gpt1b-torchtitan", conf=cname, **summary(r))
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
