"""scripts/bench/bench_plans.py end to end on two CPU devices (gloo): the smallest scenario."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import BENCH
from tests.helpers.cli_process import run_script


def test_bench_plans_cpu_smoke(tmp_path):
    proc = run_script(BENCH / "bench_plans.py", "--cpu", "--scenarios", "tiny", "--steps", "3",
                      "--warmup", "1", "--reps", "2", "--auto-budget", "4s", "--policy-budget",
                      "1up", "--links", "--memory", "--out", str(tmp_path), timeout=600)
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
    # the allocator's counters and record (--memory) are CUDA's: on CPU no retries, no
    # reserved memory, no record, per run
    assert all(r["alloc_retries"] == [0] * len(r["rep_medians_s"]) and
               r["reserved_peak_bytes"] is None and r["memory_record"] is None
               for r in rows.values() if not r["error"])
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


def _render(tmp_path, scenarios) -> str:
    """``bench_plans.py --render`` of a stored suite holding ``scenarios``: its table."""
    suite = {"card": "cpu", "driver": "-", "torch_version": "x", "date": "2026-01-01",
             "num_devices": 2, "steps": 3, "warmup": 1, "reps": 2, "scenarios": scenarios}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    run = run_script(BENCH / "bench_plans.py", "--render", str(path), timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return (tmp_path / "suite.md").read_text()


def _row(planner, parallel, m, lo, hi, sim, **extra):
    return {"planner": planner, "parallel": parallel, "manual": False, "executed": True,
            "measured_step_time_s": m, "spread_s": [lo, hi], "sim_step_time_s": sim,
            "oom_measured": False, "peak_memory_bytes": None, "sim_peak_memory_bytes": None,
            "search_time_s": 0.1, "same_plan_as": [], **extra}


def test_the_table_ranks_only_pairs_the_measurement_separates(tmp_path):
    """Kendall tau beyond the spread: pairs whose repetitions overlap are not counted."""
    rows = [_row("p1", "a", 1.0, 0.95, 1.05, 1.0),
            _row("p2", "b", 1.02, 1.0, 1.04, 0.9),  # overlaps a: its flipped order not counted
            _row("p3", "c", 2.0, 1.9, 2.1, 2.5),    # above both: concordant twice
            _row("p4", "d", 3.0, 2.9, 3.1, 1.5),    # above all, simulated below c: discordant
            _row("p5", "c", 2.0, 1.9, 2.1, 2.5)]    # the same plan credited to another planner
    md = _render(tmp_path, [{"name": "five", "model": "m", "memory_cap_bytes": None,
                             "plans": rows},
                            {"name": "two", "model": "m", "memory_cap_bytes": None,
                             "plans": rows[:2]}])
    # separated pairs: a-c, a-d, b-c, b-d, c-d; concordant a-c, a-d, b-c, b-d; discordant c-d
    assert "over the 5 pairs of plans whose repetitions do not overlap: 0.60)" in md
    assert "over the 0 pairs of plans whose repetitions do not overlap: n/a)" in md


def test_a_plan_that_hit_its_cap_says_so_in_the_table(tmp_path):
    rows = [_row("hit", "a", 1.0, 1.0, 1.0, 1.0, alloc_retries=[15, 12],
                 peak_memory_bytes=[2**30, 2**30]),
            _row("clean", "b", 2.0, 2.0, 2.0, 2.0, alloc_retries=[0, 0]),
            _row("older", "c", 3.0, 3.0, 3.0, 3.0)]  # stored before the counters existed
    md = _render(tmp_path, [{"name": "s", "model": "m", "memory_cap_bytes": None,
                             "plans": rows}])
    assert md.count("allocator retries") == 1
    assert "| 1.0 / 1.0 (cap hit: 27 allocator retries) |" in md


def test_hf_scenarios_need_the_module_of_their_models(tmp_path):
    """The hf-* scenarios' workloads come from --hf-module: without it the run is refused
    before it starts, as is an unknown scenario (the message lists the valid ones)."""
    def run(*args):
        return run_script(BENCH / "bench_plans.py", "--cpu", "--out", str(tmp_path), *args,
                          timeout=120)

    refused = run("--scenarios", "hf-gpt2")
    assert refused.returncode != 0 and "--hf-module" in refused.stderr
    unknown = run("--scenarios", "no-such")
    assert unknown.returncode != 0 and "valid: gpt1b-16GB" in unknown.stderr
    assert not (tmp_path / "suite.json").exists()



def test_a_compiled_plan_runs_under_a_longer_limit():
    """A compiled plan's first run compiles each kind of piece: the suite gives it
    COMPILED_RUN_LIMIT_S, the others RUN_LIMIT_S, and auto's own limit where it gives one."""
    code = """
import json
import bench_plans as bp
from autoplace import workloads
from autoplace.cluster import preset
from autoplace.executor.runner import capture_graph
from autoplace.planners.pipeline_dp import ddp
plan = ddp(capture_graph(workloads.get("gpt-tiny")), preset("cpu-x2"))
compiled = plan.with_parallel(compile=True)
print(json.dumps([bp.RUN_LIMIT_S, bp.COMPILED_RUN_LIMIT_S, bp.run_limit(plan),
                  bp.run_limit(compiled), bp.run_limit(plan, 75.0),
                  bp.run_limit(compiled, 75.0)]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=BENCH, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plain, slow, got_plain, got_compiled, given, given_compiled = json.loads(
        out.stdout.splitlines()[-1])
    assert slow > plain and (got_plain, got_compiled) == (plain, slow)
    assert given == given_compiled == 75.0
