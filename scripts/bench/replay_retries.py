"""What the simulator's allocator-retry charge (``autoplace.sim.allocator``) does to the
stored suites' capped scenarios, on their stored simulated times and peaks.

``replay_suite.py`` cannot rebuild every plan the suites measured (hybrid-dp's ZeRO-2 plan
is chosen by the simulator, which now prices it otherwise), so this script takes each
measured plan's stored simulated step and peak and adds what ``allocator_retry_s``
charges: a sharded data-parallel plan (``dp=N/fsdp`` or ``/zero2``, not offloaded) whose
stored peak fits the cap but whose peak plus FSDP2's side pools (``side_pool_bytes`` of
the scenario's model) does not. Per scenario: Kendall tau and median error, before and
after. The retry's cost per byte was fitted on gpt-1b's runs; GNMT-4's are held out.

    python scripts/bench/replay_retries.py OUT.json SUITE_DIR...
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_plans import kendall_tau, scenario

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.executor.runner import capture_graph
from autoplace.files import write_json_atomic
from autoplace.planners.pipeline_dp import zero2
from autoplace.sim.allocator import retry_charge_s, side_pool_bytes
from autoplace.sim.model import graph_arrays


def pools_of(name: str, cache: dict[str, float]) -> float:
    """FSDP2's side pools of a scenario's model on two ranks (units by blocks)."""
    if name not in cache:
        sc = scenario(name)
        g = capture_graph(workloads.get(sc["model"], **sc["options"]))
        cache[name] = side_pool_bytes(graph_arrays(g), zero2(g, preset("h200x2")))
    return cache[name]


def sharded(parallel: str) -> bool:
    return parallel.startswith("dp=") and ("/fsdp" in parallel or "/zero2" in parallel) \
        and "offload" not in parallel


def replay(suite: Path, cache: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for sc in json.loads(suite.read_text())["scenarios"]:
        cap = sc.get("memory_cap_bytes")
        if not cap:
            continue
        pools = pools_of(sc["name"], cache)
        seen, old, new, meas = set(), [], [], []
        for p in sc["plans"]:
            m = p.get("measured_step_time_s")
            key = (p["parallel"], round(p["sim_step_time_s"], 6))
            if not m or key in seen:  # identical plans once
                continue
            seen.add(key)
            s = p["sim_step_time_s"]
            peak = max(p["sim_peak_memory_bytes"])
            extra = retry_charge_s(peak, cap, pools) if sharded(p["parallel"]) else 0.0
            old.append(s)
            new.append(s + extra)
            meas.append(m)
        err = [statistics.median(abs(x - m) / m for x, m in zip(xs, meas)) for xs in (old, new)]
        out.append({"suite": suite.parent.name, "scenario": sc["name"], "plans": len(meas),
                    "pools_gib": round(pools / 2**30, 3),
                    "tau_before": kendall_tau(old, meas), "tau_after": kendall_tau(new, meas),
                    "median_error_before": round(err[0], 4),
                    "median_error_after": round(err[1], 4)})
        r = out[-1]
        print(f"{r['suite']:52s} {r['scenario']:13s} {r['plans']:3d} plans  tau "
              f"{r['tau_before']:.2f} -> {r['tau_after']:.2f}  median error "
              f"{r['median_error_before']:.3f} -> {r['median_error_after']:.3f}", flush=True)
    return out


def main(out: Path, suites: list[Path]) -> None:
    cache: dict[str, float] = {}
    rows = [r for s in suites for r in replay(s / "suite.json", cache)]
    write_json_atomic(out, rows)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])
