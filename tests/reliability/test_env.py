"""The environment takes only actions in its action space, and ranks every valid plan
above every failing one."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from autoplace.envs import InvalidActionError, PlacementEnv
from tests.helpers.graphs import skewed_cluster, small_graph


@pytest.fixture(scope="module")
def graph():
    return small_graph(40)


def _env(graph, **kw) -> PlacementEnv:
    return PlacementEnv(graph=graph, cluster="cpu-x4", max_groups=8, data_options=(1, 2),
                        pipeline_options=(1, 2), microbatch_options=(1, 2), **kw)


def test_actions_outside_the_space_raise(graph):
    env = _env(graph)
    env.reset(seed=0)
    ok = np.zeros(env.action_space.shape, dtype=np.int64)
    env.step(ok)
    bad_device = ok.copy()
    bad_device[0] = 4
    for action, match in ((bad_device, r"action\[0\] = 4 is out of range.*0\.\.3"),
                          (ok[:-1], "shape"), (np.append(ok, 0), "shape"),
                          (ok.astype(np.float64), "integers"), (-ok - 1, "out of range")):
        with pytest.raises(InvalidActionError, match=match):
            env.step(action)
    with pytest.raises(ValueError):  # Gymnasium's convention
        env.step(bad_device)
    inc = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, mode="incremental")
    inc.reset(seed=0)
    for action in (2, -1, 1.0, True):
        with pytest.raises(InvalidActionError):
            inc.step(action)
    inc.step(1)


def test_every_valid_plan_scores_above_every_failing_one(graph):
    """Random valid plans (>= 200) on a cluster with a slow device, under a memory cap that
    some plans exceed: the worst valid reward is above the failing signal."""
    env = PlacementEnv(graph=small_graph(40), cluster=skewed_cluster(), max_groups=8,
                       data_options=(1, 2), pipeline_options=(1, 2),
                       microbatch_options=(1, 2))
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    valid, failed = [], []
    for _ in range(400):
        action = env.action_space.sample()
        action[:] = rng.integers(0, env.action_space.nvec)
        _, reward, *_, info = env.step(action)
        (failed if info["error"] else valid).append((reward, info["step_time_s"]))
    assert len(valid) >= 200 and failed
    fail = env.config.fail_reward
    assert {r for r, _ in failed} == {fail}
    assert min(r for r, _ in valid) > fail and min(r for r, _ in valid) >= env.score_floor
    slow = max(valid, key=lambda x: x[1])
    assert slow[1] / env.single_device_step_time_s > 4, "plans slower than the old -2 are in"


def test_the_floor_and_the_failing_signal(graph):
    for reward, floor in (("neg_sqrt", -10.0), ("improvement", -99.0), ("neg_time", -100.0)):
        env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, reward=reward)
        assert env.score_floor == floor and env.config.fail_reward == floor - 1
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, fail_reward=-3.0)
    assert env.config.fail_reward == -3.0 and env.score_floor == -2.0
    oom = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, memory_cap="1KB")
    oom.reset(seed=0)
    _, r, *_, info = oom.step(np.zeros(oom.action_space.shape, dtype=np.int64))
    assert info["oom"] and r == oom.config.fail_reward < oom.score_floor


@pytest.mark.parametrize("mode", ["oneshot", "incremental"])
def test_check_env_still_passes(graph, mode):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, mode=mode)
    check_env(env)
