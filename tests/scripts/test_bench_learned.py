"""bench_learned.py end to end on its smoke-test row (tiny budgets, as a subprocess)."""

from __future__ import annotations

import json
import math

from tests.helpers import BENCH, ROOT
from tests.helpers.cli_process import run_script


def test_bench_learned_quick(tmp_path):
    # one second per trained planner: the table and its sources are checked, not how far
    # training gets
    run = run_script(BENCH / "bench_learned.py", "--quick",
                     "--seconds", "1", "--out", str(tmp_path), cwd=ROOT,
                     timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads((tmp_path / "learned.json").read_text())
    (row,) = data["rows"]
    assert row["best_heuristic"] in row["heuristics"] and row["hybrid_dp_ratio"] > 0
    for kind in ("seconds", "episodes"):
        per = row["budgets"][kind]
        assert set(per) == {"seq2seq", "hierarchical", "gnn", "pretrained",
                            "pretrained+finetune"}
        for name, v in per.items():
            assert len(v["ratios"]) == 1 and math.isfinite(v["mean"]), name
            assert v["min"] <= v["mean"] <= v["max"]
    # where each trained planner's best plan came from: the warm start or REINFORCE
    assert all(u["budgets"]["episodes"][n]["source"] in ("warm-start", "reinforce")
               for u in data["units"] for n in ("seq2seq", "gnn"))
    assert row["zero_shot_time_s"]["max"] < 5.0
    table = (tmp_path / "learned.md").read_text()
    # the two budgets' tables, where REINFORCE starts and ends, and the zero-shot table
    assert "## Main table" in table and table.count("| gnmt-2-small |") == 4
    assert "seq2seq start -> end" in table
    unit = data["units"][0]["budgets"]["seconds"]
    assert all(unit[n]["step_time_s"] <= unit[n]["start_step_time_s"] * (1 + 1e-9)
               for n in ("seq2seq", "hierarchical", "gnn", "pretrained+finetune"))
    assert (tmp_path / "learned.png").stat().st_size > 5000
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["tag"] == "learned" and run_json["summary"]
