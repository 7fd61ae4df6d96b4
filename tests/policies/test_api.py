from __future__ import annotations

import pytest

from autoplace.errors import AutoplaceError
from autoplace.graph import random_dag
from autoplace.plan import Plan

pytest.importorskip("autoplace.envs")

from autoplace.policies import TrainResult, place, train  # noqa: E402


def test_train_writes_its_outputs_and_resumes(tmp_path):
    seen: list[tuple[int, dict]] = []
    r = train("gpt-tiny", "h100x2", policy="seq2seq", budget=4, out_dir=tmp_path, seed=1,
              max_groups=8, progress=False, batch_size=4, policy_options={"hidden": 16},
              on_update=lambda update, row: seen.append((update, row)))
    assert isinstance(r, TrainResult) and r.checkpoint_path == tmp_path / "checkpoint.pt"
    # on_update sees update 0 (the untrained policy's samples, kept in start_samples), then 1-4
    assert [u for u, _ in seen] == [0, 1, 2, 3, 4]
    assert 0 < r.start_samples["sample_best_step_s"] <= r.start_samples["sample_mean_step_s"]
    assert seen[0][1]["sample_mean_step_s"] == r.start_samples["sample_mean_step_s"]
    assert seen[-1][1]["best_step_time_s"] == r.history["best_step_time_s"][-1]
    for name in ("checkpoint.pt", "best_plan.json", "curve.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert list((tmp_path / "tb").iterdir())
    plan = Plan.load(tmp_path / "best_plan.json")
    assert plan.predicted["step_time_s"] == r.best_step_time_s < float("inf")
    assert plan.planner["name"] == "seq2seq" and plan.num_groups <= 8
    assert len(r.history["reward_mean"]) == 4
    # resume with a larger budget continues the same run
    r2 = train("gpt-tiny", "h100x2", policy="seq2seq", budget=6, out_dir=tmp_path, seed=1,
               max_groups=8, progress=False, batch_size=4, policy_options={"hidden": 16},
               resume=True, on_update=lambda update, row: seen.append((update, row)))
    assert r2.history["reward_mean"][:4] == r.history["reward_mean"]
    assert [u for u, _ in seen[5:]] == [5, 6] and r2.start_samples == {}  # no untrained start
    assert len(r2.history["reward_mean"]) == 6 and r2.best_step_time_s <= r.best_step_time_s


def test_place_an_unseen_graph_zero_shot(tmp_path):
    family = [random_dag(n, seed=s) for n, s in ((30, 0), (50, 1), (40, 2))]
    r = train(family, "h100x2", policy="gnn", budget=3, out_dir=tmp_path, max_groups=12,
              progress=False, batch_size=6, policy_options={"hidden": 16})
    assert len(r.best_plans) == 3
    unseen = random_dag(45, seed=9)
    plan = place(tmp_path / "checkpoint.pt", unseen, "h100x2", samples=8)
    assert plan.planner["search_time_s"] < 1.0
    plan.validate(unseen)
    assert plan.planner["name"] == "policy:gnn" and plan.predicted["step_time_s"] > 0
    with pytest.raises(AutoplaceError, match="trained for 2 devices"):
        place(tmp_path / "checkpoint.pt", unseen, "h100x4")
    with pytest.raises(AutoplaceError, match="no checkpoint"):
        place(tmp_path / "missing.pt", unseen, "h100x2")


def test_incremental_training_and_placement(tmp_path):
    graph = random_dag(30, seed=4)
    r = train(graph, "h100x2", policy="gnn", mode="incremental", budget=2, out_dir=tmp_path,
              max_groups=6, progress=False, batch_size=2, policy_options={"hidden": 16})
    assert r.best_plan is not None and len(r.history["reward_mean"]) == 2
    plan = place(tmp_path / "checkpoint.pt", random_dag(35, seed=5), "h100x2", samples=2)
    assert plan.num_groups <= 6 and plan.planner["name"] == "policy:gnn"
    with pytest.raises(AutoplaceError, match="use policy 'gnn'"):
        train(graph, "h100x2", policy="seq2seq", mode="incremental", budget=1,
              max_groups=6, progress=False)


def test_max_groups_defaults_to_the_graphs_auto_count():
    from autoplace import workloads
    from autoplace.capture import capture_workload
    from autoplace.grouping import auto_group_count

    graph = capture_workload(workloads.get("branchy-mlp", device="meta"))
    want = auto_group_count(graph)
    r = train(graph, "h100x2", policy="gnn", budget=1, progress=False, batch_size=2,
              policy_options={"hidden": 8})
    assert r.best_plan.num_groups <= want
    from autoplace.policies import api

    assert api._auto_groups(graph) == want == api._auto_groups("branchy-mlp")
    with pytest.raises(AutoplaceError, match="positive number or 'auto'"):
        train(graph, "h100x2", budget=1, progress=False, max_groups=0)
