from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from autoplace import planners
from autoplace.envs import PlacementEnv
from autoplace.graph import random_dag
from autoplace.plan import Plan
from autoplace.policies import batch_obs, make, train
from autoplace.policies.api import default_env_options
from autoplace.policies.checkpoint import load
from autoplace.policies.warm_start import heuristic_target, plan_to_action, warm_start
from autoplace.sim import simulate

POLICIES = ("seq2seq", "hierarchical", "gnn")
CLUSTER = "cpu-x4"


@pytest.fixture(scope="module")
def graph():
    return random_dag(40, seed=0)


def _env(graph) -> PlacementEnv:
    return PlacementEnv(graph=graph, cluster=CLUSTER,
                        **{**default_env_options(4), "max_groups": 8})


def _step_time(env, action) -> float:
    env.reset(seed=0)
    return env.step(np.asarray(action))[4]["step_time_s"]


def test_plans_convert_to_env_actions(graph):
    env = _env(graph)
    ddp = planners.get("ddp")(env.graph, env.cluster)
    action = plan_to_action(env, ddp)
    assert list(action[8:]) == [env.data_options.index(4), 0, 0]
    assert _step_time(env, action) == pytest.approx(simulate(env.graph, ddp, env.cluster)
                                                     .step_time_s, rel=1e-9)
    # an env plan converts back to the action that made it
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = np.concatenate([rng.integers(0, 4, 8), [0, 0, int(rng.integers(0, 4))]])
        a[env.num_groups:8] = 0
        env.reset(seed=0)
        plan = Plan.from_json(env.step(a)[4]["plan"])
        assert list(plan_to_action(env, plan)) == list(a)
    # a data degree the env does not offer is not expressible
    env3 = PlacementEnv(graph=graph, cluster=CLUSTER, max_groups=8, data_options=(1, 2))
    assert plan_to_action(env3, ddp) is None


def test_target_is_the_best_scored_candidate(graph):
    target = heuristic_target(_env(graph))
    assert target.candidates["hybrid-dp"] < target.candidates["single"]
    assert target.step_time_s == min(target.candidates.values())
    assert target.step_time_s <= target.candidates["hybrid-dp"]
    assert _step_time(_env(graph), target.action) == target.step_time_s


@pytest.mark.parametrize("name", POLICIES)
def test_greedy_plan_is_the_target_after_warm_start(graph, name):
    env = _env(graph)
    target = heuristic_target(env)
    torch.manual_seed(0)
    policy = make(name, env.observation_space, env.action_space, hidden=32)
    stats = warm_start(policy, [env], [target.action], steps=300, lr=1e-2)
    assert stats["matched"] and 0 < stats["steps"] <= 300
    obs, _ = env.reset(seed=0)
    with torch.no_grad():
        greedy = policy(batch_obs([obs]), greedy=True).action[0].numpy()
    g = env.num_groups
    assert list(greedy[:g]) == list(target.action[:g])
    assert list(greedy[8:]) == list(target.action[8:])
    assert _step_time(env, greedy) <= target.step_time_s * 1.01


@pytest.mark.parametrize("name", POLICIES)
def test_training_is_never_worse_than_the_best_heuristic(graph, name):
    best_heuristic_s = heuristic_target(_env(graph)).step_time_s
    r = train(graph, CLUSTER, policy=name, budget=3, max_groups=8, progress=False,
              batch_size=8, policy_options={"hidden": 16})
    assert r.warm_start["done"] and r.warm_start["matched"]
    (target,) = r.warm_start["targets"].values()
    assert target["step_time_s"] == best_heuristic_s
    assert r.best_step_time_s <= best_heuristic_s
    assert r.best_plan.predicted["step_time_s"] == r.best_step_time_s
    assert r.best_plan.planner["trainer"] in ("warm-start", "reinforce")


def test_without_warm_start_training_starts_from_scratch(graph):
    runs = [train(graph, CLUSTER, policy="gnn", budget=2, max_groups=8, progress=False,
                  batch_size=4, policy_options={"hidden": 16}, warm_start=warm)
            for warm in (False, False, True)]
    off, again, on = runs
    assert off.warm_start == {"done": False, "why": "warm_start=False"}
    assert off.best_plan.planner["trainer"] == "reinforce"
    assert off.history["reward_mean"] == again.history["reward_mean"]
    assert off.history["reward_mean"] != on.history["reward_mean"]


def test_a_resumed_run_does_not_redo_the_warm_start(graph, tmp_path, monkeypatch):
    opts = dict(policy="seq2seq", max_groups=8, progress=False, batch_size=4, out_dir=tmp_path,
                policy_options={"hidden": 16})
    first = train(graph, CLUSTER, budget=2, **opts)
    assert load(tmp_path / "checkpoint.pt")["warm_start"]["done"]

    def refuse(*args, **kwargs):
        raise AssertionError("warm start redone on resume")

    trainer = importlib.import_module("autoplace.policies.reinforce")
    monkeypatch.setattr(trainer, "warm_start", refuse)
    second = train(graph, CLUSTER, budget=3, resume=True, **opts)
    assert second.warm_start == first.warm_start
    assert second.best_step_time_s <= first.best_step_time_s
    assert second.history["reward_mean"][:2] == first.history["reward_mean"]


def test_on_gpus_training_offers_compile_and_the_warm_start_scores_it(graph, monkeypatch):
    """On a GPU cluster the env gets the compile lever (anneal's first win there) and every
    warm-start candidate is also scored compiled; on CPUs neither. (The compiled pieces'
    calls are free here: this small graph's pieces would not pay for them.)"""
    from autoplace.sim import compiled

    monkeypatch.setattr(compiled, "COMPILED_CALL_HOST_S", 0.0)
    env = PlacementEnv(graph=graph, cluster="h100x4",
                       **{**default_env_options(4, compile=True), "max_groups": 8})
    target = heuristic_target(env)
    eager = {k: v for k, v in target.candidates.items() if not k.endswith("+compile")}
    assert all(f"{k}+compile" in target.candidates for k in eager)
    assert target.source.endswith("+compile")  # compiled is faster on the simulator
    assert target.step_time_s < min(eager.values())
    assert target.action[env.action_layout.slices["compile"]][0] == 1
    r = train(graph, "h100x4", policy="gnn", budget=2, max_groups=8, progress=False,
              batch_size=4, policy_options={"hidden": 16})
    assert r.best_step_time_s <= target.step_time_s
    assert r.best_plan.parallel.compile
    cpu = train(graph, CLUSTER, policy="gnn", budget=1, max_groups=8, progress=False,
                batch_size=4, policy_options={"hidden": 16})
    (cpu_target,) = cpu.warm_start["targets"].values()
    assert not any(k.endswith("+compile") for k in cpu_target["candidates"])
    assert not cpu.best_plan.parallel.compile
