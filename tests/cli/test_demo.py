"""The main job of the README's first command, on a one-device cluster (a machine with one
GPU): every planner's plan is the whole model on that device, so each distinct plan is
executed once and the planners that found it share the measurement."""

from __future__ import annotations

import json

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
    assert (tmp_path / "policy_learning.png").exists()  # the policy's learning curve
    learning = json.loads((tmp_path / "policy_learning.json").read_text())
    assert len(learning["history"]["sample_mean_step_s"]) >= 1


def test_the_policy_learning_is_printed_and_drawn(tmp_path, capsys):
    """The demo's policy row: the pre-trained GNN's samples before training, then per update
    (printed as it trains), the summary lines and the learning curve."""
    from autoplace import workloads
    from autoplace.capture import capture_workload
    from autoplace.demo import LivePrinter, plot_learning, progress_lines
    from autoplace.policies.pretrained import finetune_pretrained

    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    tuned = finetune_pretrained(graph, "cpu-x2", budget="4", seed=0, batch_size=4,
                                on_update=LivePrinter("4"))
    live = capsys.readouterr().err
    assert "before training on this graph: sampled plans mean" in live
    assert "policy: update 1 (" in live
    start = tuned.start_samples
    assert 0 < start["sample_best_step_s"] <= start["sample_mean_step_s"] < float("inf")
    assert len(tuned.history["sample_mean_step_s"]) == 4
    lines = progress_lines(tuned.history, tuned.zero_shot_step_time_s, tuned.warm_start, start)
    assert lines[1].startswith("  policy: before training on this graph")
    assert "warm start imitates" in lines[2] and "update 4 (" in lines[-2]
    assert "ms before training -> " in lines[-1]
    plot_learning(tuned.history, tmp_path / "learning.png", zero_shot_s=tuned.step_time_s,
                  heuristic_s=tuned.step_time_s, start=start, title="gpt-tiny")
    assert (tmp_path / "learning.png").stat().st_size > 1000
