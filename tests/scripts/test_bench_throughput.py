"""bench_sim.py and bench_env.py, the simulator's and the environment's throughput, end to end
on a small random graph (as subprocesses)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import BENCH, ROOT
from tests.helpers.cli_process import run_script


@pytest.mark.slow
def test_bench_sim_runs_and_writes_its_run(tmp_path):
    out = run_script(BENCH / "bench_sim.py", "--ops", "60", "--plans", "20",
                     "--scalar-plans", "5", "--repeats", "1", "--out", str(tmp_path),
                     cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "plans/s" in out.stdout and "max rel diff to batch 0.0e+00" in out.stdout
    row = json.loads((tmp_path / "sim-throughput.json").read_text())
    assert row["ops"] == 60 and row["batch_plans_per_s"] > 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["tag"] == "sim-throughput" and "60-op graph" in run["summary"]


def test_bench_env_runs(tmp_path):
    pytest.importorskip("autoplace.envs")
    out = run_script(BENCH / "bench_env.py", "--ops", "50",
                     "--max-groups", "8", "--steps", "5", "--out", str(tmp_path),
                     cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "steps/s" in out.stdout and "incremental" in out.stdout
    rates = json.loads((tmp_path / "env-steps.json").read_text())["sim"]
    assert rates["oneshot"]["steps_per_s"] > 0 and rates["incremental"]["steps_per_s"] > 0
    assert json.loads((tmp_path / "run.json").read_text())["tag"] == "env-steps"
