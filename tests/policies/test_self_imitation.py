"""REINFORCE after a warm start keeps the policy on the best plan it knows (self-imitation):
without the term, batches whose sampled plans are all the imitated one carry no advantage
and the entropy bonuses alone walk the policy off it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.envs import PlacementEnv
from autoplace.policies import batch_obs, make, reinforce
from autoplace.policies.api import default_env_options


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get("gpt-tiny", device="meta"))


def _greedy_step_s(policy, env) -> float:
    obs, _ = env.reset(seed=0)
    with torch.no_grad():
        action = policy(batch_obs([obs]), greedy=True).action[0].numpy()
    env.reset(seed=0)
    return env.step(np.asarray(action))[4]["step_time_s"]


def _train(graph, coef: float):
    envs = [PlacementEnv(graph=graph, cluster="cpu-x2",
                         **{**default_env_options(2), "max_groups": 8}) for _ in range(8)]
    torch.manual_seed(0)
    policy = make("gnn", envs[0].observation_space, envs[0].action_space, hidden=16)
    result = reinforce(envs, policy, budget=25, batch_size=8, seed=0, progress=False,
                       tensorboard=False, self_imitation_coef=coef)
    return policy, envs[0], result


def test_the_policy_stays_on_its_best_plan(graph):
    policy, env, result = _train(graph, 0.3)  # the default
    (target,) = result.warm_start["targets"].values()
    (best,) = result.best.values()
    assert best["action"] is not None and best["step_time_s"] <= target["step_time_s"]
    assert _greedy_step_s(policy, env) == pytest.approx(best["step_time_s"], rel=1e-9)
    assert len(result.history["sample_mean_step_s"]) == 25


def test_without_it_the_policy_walks_off_the_imitated_plan(graph):
    policy, env, result = _train(graph, 0.0)
    (best,) = result.best.values()
    assert _greedy_step_s(policy, env) > best["step_time_s"] * 1.05
