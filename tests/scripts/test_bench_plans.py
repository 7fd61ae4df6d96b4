"""scripts/bench/bench_plans.py end to end on two CPU devices (gloo): the smallest scenario."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import BENCH


def test_bench_plans_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(BENCH / "bench_plans.py"), "--cpu", "--scenarios",
           "tiny", "--steps", "3", "--warmup", "1", "--reps", "2", "--auto-budget", "8s",
           "--policy-budget", "2s", "--links", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads((tmp_path / "suite.json").read_text())
    assert {"card", "driver", "torch_version", "date", "scenarios"} <= out.keys()
    # simulated with measured copy and collective speeds (gloo here)
    assert out["links"]["collective_bandwidth"] > 0 and out["links"]["bandwidth"][0][1] > 0
    (sc,) = out["scenarios"]
    assert {"auto_vs_best_manual", "auto_vs_lower_bound", "sim_error_median",
            "kendall_tau", "kendall_tau_beyond_spread", "pairs_beyond_spread",
            "wall_s"} <= sc.keys()
    rows = {r["planner"]: r for r in sc["plans"]}
    # every hand-written option and every planner has a row; one- and multi-process
    # plans were executed (DDP and the pipelines run in the pool's job)
    for name in ("single", "two-halves", "ddp", "fsdp", "pipeline-gpipe", "pipeline-1f1b",
                 "expert", "hash", "critical-path", "m-etf", "m-sct", "hybrid-dp", "auto"):
        assert name in rows, name
        assert rows[name]["measured_step_time_s"] > 0, (name, rows[name]["error"])
    # two repetitions each: auto's run of a plan counts as its first
    assert all(len(r["rep_medians_s"]) == 2 for r in rows.values() if not r["error"])
    assert sc["auto_vs_best_manual"] > 0 and sc["auto_vs_lower_bound"] > 0
    # the allocator's counters are CUDA's: on CPU no retries, no reserved memory, per run
    assert all(r["alloc_retries"] == [0] * len(r["rep_medians_s"]) and
               r["reserved_peak_bytes"] is None for r in rows.values() if not r["error"])
    md = (tmp_path / "suite.md").read_text()
    assert "tiny" in md
    # the figure: every plan measured, and simulated against measured
    png = (tmp_path / "suite.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10000
    assert f"]({png.name})" in md
    # a run folder: where it ran, and what it is
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["card"] == "cpu" and env["gpus"] == 2
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["tag"] == "suite" and run["scenarios"] == ["tiny"] and run["kind"] == "suite"


def test_tau_beyond_spread_counts_only_pairs_the_measurement_separates():
    import bench_plans as bp

    def row(parallel, m, lo, hi, sim):
        return {"parallel": parallel, "measured_step_time_s": m, "spread_s": [lo, hi],
                "sim_step_time_s": sim, "oom_measured": False}

    rows = [row("a", 1.0, 0.95, 1.05, 1.0),
            row("b", 1.02, 1.0, 1.04, 0.9),   # overlaps a: its flipped order is not counted
            row("c", 2.0, 1.9, 2.1, 2.5),     # above both: concordant twice
            row("d", 3.0, 2.9, 3.1, 1.5),     # above all, simulated below c: discordant with c
            row("c", 2.0, 1.9, 2.1, 2.5)]     # the same plan credited to another planner
    tau, pairs = bp.tau_beyond_spread(rows)
    # separated pairs: a-c, a-d, b-c, b-d, c-d; concordant a-c, a-d, b-c, b-d; discordant c-d
    assert pairs == 5 and tau == (4 - 1) / 5
    assert bp.tau_beyond_spread(rows[:2]) == (None, 0)


def test_a_plan_that_hit_its_cap_says_so_in_the_table():
    import bench_plans as bp

    assert bp.retried({"alloc_retries": [0, 0]}) == ""
    assert bp.retried({"alloc_retries": [15, 12]}) == " (cap hit: 27 allocator retries)"
    assert bp.retried({}) == ""  # results stored before the counters existed


def test_hf_scenarios_name_the_module_they_are_given():
    """The hf-* scenarios' workloads come from --hf-module; without it they are refused."""
    import bench_plans as bp

    assert bp.scenario("hf-t5", "mymodels")["model"] == "mymodels:t5"
    assert bp.scenario("tiny")["model"] == "gpt-tiny"
    with pytest.raises(SystemExit, match="--hf-module"):
        bp.scenario("hf-gpt2")
    with pytest.raises(SystemExit, match="valid: gpt1b-16GB"):
        bp.scenario("no-such")
