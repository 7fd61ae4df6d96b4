"""bench_env_levers.py end to end (tiny budget, as a subprocess), and its --merge."""

from __future__ import annotations

import json

from tests.helpers import BENCH, ROOT
from tests.helpers.cli_process import run_script


def test_script_quick_and_merge(tmp_path):
    part = tmp_path / "part"
    run = run_script(BENCH / "bench_env_levers.py", "--quick",
                     "--out", str(part), cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads((part / "env_levers.json").read_text())
    assert [r["arm"] for r in data["rows"]] == ["plain", "levers"]
    sc = data["scenarios"]["gnmt-4"]
    assert sc["best_heuristic_step_time_s"] > 0 and sc["heuristics"]["single"]["step_time_s"] \
        is None  # the cap is below what one device needs
    for r in data["rows"]:  # every row re-simulated; no plan beats the lower bound of zero
        assert r["step_time_s"] is None or r["step_time_s"] > 0
    merged = tmp_path / "merged"
    run = run_script(BENCH / "bench_env_levers.py", "--merge",
                     str(part / "env_levers.json"), "--out", str(merged), cwd=ROOT,
                     timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    again = json.loads((merged / "env_levers.json").read_text())
    assert again["rows"] == data["rows"]
    table = (merged / "env_levers.md").read_text()
    assert "| gnmt-4 (batch 256) |" in table and "| levers |" in table
    assert json.loads((merged / "run.json").read_text())["summary"]
