"""bench_real_finetune.py --smoke end to end (gpt-tiny on one CPU device, as a subprocess)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import BENCH, ROOT
from tests.helpers.cli_process import run_script

pytest.importorskip("autoplace.executor")


def test_smoke_measures_both_policies_and_the_heuristics(tmp_path):
    run = run_script(BENCH / "bench_real_finetune.py", "--smoke",
                     "--out", str(tmp_path), cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "real_finetune.json").read_text())
    (row,) = data["rows"]
    assert row["scenario"] == "gpt-tiny:none" and row["levers"] == ["recompute"]
    measured = row["measured"]
    assert {"sim-trained", "fine-tuned"} <= set(measured)
    heuristics = [k for k in measured if k.startswith("heuristic:")]
    assert len(heuristics) == 2 and row["best_heuristic"] in heuristics
    for name, m in measured.items():  # every plan measured in both interleaved rounds
        assert len(m["step_times_s"]) == 2 and m["min_s"] <= m["median_s"] <= m["max_s"], name
    assert row["fine_tuned_over_sim_trained"] == pytest.approx(
        measured["fine-tuned"]["median_s"] / measured["sim-trained"]["median_s"])
    stages = row["fine_tune"]["stages"]
    assert stages["switch"]["ratios"] and stages["faster"] in ("sim", "real")
    assert row["fine_tune"]["best_step_time_s"] == stages["best"]["measured_step_time_s"]
    for part in ("sim-only", "fine-tuned"):  # each training run's folder beside the table
        assert (tmp_path / "gpt-tiny-none" / part / "best_plan.json").exists()
    assert (tmp_path / "gpt-tiny-none" / "fine-tuned" / "finetune.json").exists()
    table = (tmp_path / "real_finetune.md").read_text()
    assert "| gpt-tiny:none |" in table and "measured/simulated at the switch" in table
    assert json.loads((tmp_path / "run.json").read_text())["summary"]
    assert json.loads((tmp_path / "env.json").read_text())["card"] == "cpu"
