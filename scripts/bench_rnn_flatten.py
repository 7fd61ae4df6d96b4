"""One-process placements of an LSTM model with and without re-flattened cuDNN weights.

``executor.local.place_parameters`` moves parameters one at a time and then re-packs each
moved LSTM's weights into one flat buffer (``reflatten_rnns``); before it did, cuDNN
warned that the weights "need to be compacted at every call" and copied them at every
forward. This script measures what that costs: for each plan (the suite's two halves,
critical-path and m-SCT placements of the workload), both ways ("reflatten" and
"as-before", the latter with ``reflatten_rnns`` replaced by a no-op), in interleaved
rounds, each run in this process with :func:`autoplace.executor.execute`: median step
time, peak allocated memory per device, allocator retries, and how many compaction
warnings the timed steps raised.

    python scripts/bench_rnn_flatten.py --cap-bytes 4694202624 --out flatten.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="gnmt4-capped", help="a bench_plans.py scenario")
    ap.add_argument("--cap-bytes", type=int, default=None,
                    help="memory cap per GPU (default: none; the suite's gnmt4-capped ran "
                         "at 4694202624 on 2x H200)")
    ap.add_argument("--planners", default="two-halves,critical-path,m-sct")
    ap.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="result JSON")
    a = ap.parse_args(argv)

    import statistics

    import bench_plans as bp
    import torch

    from autoplace import planners, workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import Cluster
    from autoplace.executor import execute
    from autoplace.executor import local as local_mod

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("error: needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    sc = bp.SCENARIOS[a.scenario]
    cluster = Cluster.detect().subset([0, 1])
    if a.cap_bytes:
        cluster = cluster.with_memory_cap(a.cap_bytes)
    graph = capture_workload(workloads.get(sc["model"], device="meta", **sc["options"]))
    hand = dict(bp.hand_written(graph, cluster))
    plans = {}
    for name in a.planners.split(","):
        plans[name] = hand[name] if name in hand else planners.get(name)(graph, cluster)
    real = local_mod.reflatten_rnns
    runs = []
    for rnd in range(a.rounds):
        for name, plan in plans.items():
            for way in ("reflatten", "as-before") if rnd % 2 == 0 else ("as-before", "reflatten"):
                local_mod.reflatten_rnns = real if way == "reflatten" else (lambda mods: 0)
                wl = workloads.get(sc["model"], **sc["options"])
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    r = execute(wl, plan, cluster=cluster, steps=a.steps, warmup=a.warmup,
                                reference=False)
                local_mod.reflatten_rnns = real
                compactions = sum("contiguous chunk" in str(w.message) for w in caught)
                runs.append({"round": rnd, "plan": name, "way": way, "ok": r.ok,
                             "step_time_s": r.step_time_s if r.ok else None,
                             "peak_memory_bytes": r.peak_memory_bytes,
                             "alloc_retries": r.allocator_retries,
                             "compaction_warnings": compactions, "error": r.error})
                print(f"round {rnd} {name:14s} {way:10s} "
                      + (f"{r.step_time_s * 1e3:7.2f} ms peak "
                         f"{[round(b / 2**30, 2) for b in r.peak_memory_bytes]} GiB "
                         f"retries {r.allocator_retries} warnings {compactions}"
                         if r.ok else f"failed: {r.error}"), flush=True)
                torch.cuda.empty_cache()
    summary = {}
    for name in plans:
        for way in ("reflatten", "as-before"):
            rs = [r for r in runs if r["plan"] == name and r["way"] == way and r["ok"]]
            if rs:
                ts = [r["step_time_s"] for r in rs]
                summary[f"{name}/{way}"] = {
                    "step_time_s": statistics.median(ts), "spread_s": [min(ts), max(ts)],
                    "peak_memory_bytes": [max(r["peak_memory_bytes"][i] for r in rs)
                                          for i in range(len(rs[0]["peak_memory_bytes"]))],
                    "alloc_retries": sum(r["alloc_retries"] for r in rs),
                    "compaction_warnings": sum(r["compaction_warnings"] for r in rs)}
    for k, v in summary.items():
        print(f"{k:28s} {v['step_time_s'] * 1e3:7.2f} ms "
              f"({v['spread_s'][0] * 1e3:.2f}..{v['spread_s'][1] * 1e3:.2f}) peak "
              f"{[round(b / 2**30, 2) for b in v['peak_memory_bytes']]} GiB "
              f"retries {v['alloc_retries']} warnings {v['compaction_warnings']}")
    result = {"card": torch.cuda.get_device_name(0), "torch_version": torch.__version__,
              "date": datetime.date.today().isoformat(), "scenario": a.scenario,
              "memory_cap_bytes": a.cap_bytes, "steps": a.steps, "warmup": a.warmup,
              "runs": runs, "summary": summary}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
