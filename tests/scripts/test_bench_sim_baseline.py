"""bench_sim.py --baseline: the package at a git revision times the same plans in a worker,
interleaved with this one's timings (as a subprocess, on a small random graph)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.helpers import BENCH, ROOT
from tests.helpers.cli_process import run_script


@pytest.mark.slow
def test_bench_sim_times_a_baseline_revision(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    out = run_script(
        BENCH / "bench_sim.py", "--ops", "40", "--plans", "8", "--devices", "2",
        "--families", "round-robin", "random", "--scalar-plans", "2", "--repeats", "2",
        "--baseline", "HEAD", "--out", str(tmp_path), cwd=ROOT, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("baseline") == 2
    result = json.loads((tmp_path / "sim-throughput.json").read_text())
    assert result["baseline_commit"] == head.stdout.strip()
    for row in result["rows"]:
        assert len(row["batch_plans_per_s_runs"]) == len(row["baseline_plans_per_s_runs"]) == 2
        assert row["baseline_plans_per_s"] == max(row["baseline_plans_per_s_runs"]) > 0
        assert math.isfinite(row["baseline_vs_batch_max_rel_diff"])
    assert f"at {head.stdout[:7]})" in json.loads((tmp_path / "run.json").read_text())["summary"]
