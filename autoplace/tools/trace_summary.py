"""Where a step's time went, from the Chrome traces ``autoplace run --trace DIR`` writes.

For each trace (one per rank) and each GPU stream of it: the time its kernels were
busy per step, split into collectives (NCCL), copies and compute; how much of the
collectives' time overlapped compute on the same device; the GPU's idle time; and the
kernels and host operations that took longest. A CPU-only trace reports host
operations only.

    autoplace trace-summary runs/trace/trace-rank0.json [more traces]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from autoplace.files import write_json_atomic


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of a) ∩ (union of b)."""
    return _union(a) + _union(b) - _union(a + b)


def kind(ev: dict) -> str:
    name = ev.get("name", "").lower()
    if "nccl" in name:
        return "collective"
    if ev.get("cat") in ("gpu_memcpy", "gpu_memset") or "memcpy" in name or "memset" in name:
        return "copy"
    return "compute"


def summarize(path: Path, top: int = 12) -> dict:
    events = json.loads(path.read_text()).get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and e.get("name", "").startswith("autoplace step")]
    gpu = [e for e in events if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    if not spans:
        raise SystemExit(f"{path}: no 'autoplace step' spans: not a trace of `autoplace run "
                         f"--trace` (or it recorded no steps)")
    steps = len(spans)
    wall = sum(s["dur"] for s in spans) / steps
    out: dict = {"trace": str(path), "steps": steps, "step_ms": wall / 1e3, "devices": {}}
    by_dev: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        by_dev[int(e.get("args", {}).get("device", e.get("pid", 0)))].append(e)
    for dev, evs in sorted(by_dev.items()):
        iv: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in evs:
            iv[kind(e)].append((e["ts"], e["ts"] + e["dur"]))
        allv = [x for v in iv.values() for x in v]
        coll, comp = iv.get("collective", []), iv.get("compute", [])
        busy = _union(allv)
        out["devices"][dev] = {
            "busy_ms": busy / steps / 1e3,
            "idle_ms": max(0.0, wall - busy / steps) / 1e3,
            "compute_ms": _union(comp) / steps / 1e3,
            "collective_ms": _union(coll) / steps / 1e3,
            "collective_overlapped_ms": _intersect(coll, comp) / steps / 1e3,
            "copy_ms": _union(iv.get("copy", [])) / steps / 1e3,
            "streams": len({e.get("tid") for e in evs}),
        }
        tot: dict[str, float] = defaultdict(float)
        for e in evs:
            tot[e["name"][:90]] += e["dur"]
        out["devices"][dev]["top_kernels_ms"] = [
            (n, t / steps / 1e3) for n, t in sorted(tot.items(), key=lambda x: -x[1])[:top]]
    incl_time: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in host:
        incl_time[e["name"][:90]] += e["dur"]
        count[e["name"][:90]] += 1
    out["top_host_ops_ms"] = [(n, t / steps / 1e3, count[n] // steps)
                              for n, t in sorted(incl_time.items(), key=lambda x: -x[1])[:top]]
    return out


def render(s: dict) -> str:
    lines = [f"{s['trace']}: {s['steps']} steps, {s['step_ms']:.2f} ms a step (traced)"]
    for dev, d in s["devices"].items():
        lines.append(
            f"  GPU {dev}: busy {d['busy_ms']:.2f} ms, idle {d['idle_ms']:.2f} ms; compute "
            f"{d['compute_ms']:.2f}, collectives {d['collective_ms']:.2f} (overlapping "
            f"compute {d['collective_overlapped_ms']:.2f}), copies {d['copy_ms']:.2f}; "
            f"{d['streams']} streams")
        for n, t in d["top_kernels_ms"]:
            lines.append(f"      {t:8.3f} ms  {n}")
    lines.append("  host ops (inclusive ms a step, calls a step):")
    for n, t, c in s["top_host_ops_ms"]:
        lines.append(f"      {t:8.3f} ms  {c:5d}x  {n}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=12, help="kernels and host ops listed")
    p.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    args = p.parse_args(argv)
    summaries = []
    for t in args.traces:
        if not t.is_file():
            print(f"error: {t}: no such trace file", file=sys.stderr)
            return 2
        summaries.append(summarize(t, args.top))
        print(render(summaries[-1]))
    if args.json:
        write_json_atomic(args.json, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
