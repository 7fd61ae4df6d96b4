"""The main job of the README's first command, on a one-device cluster (a machine with one
GPU): every planner's plan is the whole model on that device, so each distinct plan is
executed once and the planners that found it share the measurement."""

from __future__ import annotations

import pytest

from autoplace.demo import run_demo
from autoplace.search.auto import signature


@pytest.mark.slow
def test_demo_on_one_device_runs_each_distinct_plan_once(tmp_path, capsys):
    rows = run_demo("gpt-tiny", "cpu-x1", out_dir=tmp_path, budget="2ep", steps=3)
    measured = [r for r in rows if r.get("measured_step_time_s")]
    assert len(measured) >= 3  # the policy's plan, the top baselines and single
    sigs = {}
    for r in measured:
        sigs.setdefault(signature(r["plan"]), []).append(r)
    for same in sigs.values():  # one run each: one report file, one figure shared
        assert sum(1 for r in same if not r.get("same_plan_as")) == 1
        assert len({r["measured_step_time_s"] for r in same}) == 1
    shared = [r for r in measured if r.get("same_plan_as")]
    assert shared, "on one device the planners' plans coincide"
    assert len(list(tmp_path.glob("report-*.json"))) == len(sigs)
    out = capsys.readouterr().out
    assert f"{shared[0]['planner']}: the same plan as {shared[0]['same_plan_as']}" in out
    assert all(r["max_loss_rel_diff"] < 1e-5 for r in measured)
    assert (tmp_path / "best_plan.json").exists() and (tmp_path / "compare.png").exists()
