"""PlacementEnv with structure-aware groups (``grouping="branch"``) and its valid splits."""

from __future__ import annotations

import numpy as np

from autoplace.envs import PlacementEnv
from autoplace.plan import Plan
from tests.helpers.graphs import branches


def test_branch_grouping_places_parallel_branches_apart():
    graph = branches(2, 6, interleave=True)
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=4, grouping="branch")
    g = env.num_groups
    b0 = {env.groups[f"b0_{i}"] for i in range(6)}
    b1 = {env.groups[f"b1_{i}"] for i in range(6)}
    assert not b0 & b1
    env.reset(seed=0)
    action = np.zeros(env.action_space.shape, dtype=np.int64)
    for gid in b1:
        action[gid] = 1  # branch 1 on device 1, the rest on device 0
    _, _, _, _, info = env.step(action)
    assert info["error"] is None and np.isfinite(info["step_time_s"])
    plan = Plan.from_json(info["plan"])
    assert {plan.device_of(f"b1_{i}") for i in range(6)} == {1}
    assert {plan.device_of(f"b0_{i}") for i in range(6)} == {0}
    assert g <= 4


def test_pipeline_over_non_interval_groups_gives_valid_plans():
    graph = branches(3, 5, interleave=True)
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, grouping="branch",
                       pipeline_options=(1, 2), microbatch_options=(2, 4))
    assert not env._interval_groups
    rng = np.random.default_rng(0)
    mg = env.config.max_groups
    valid = 0
    for _ in range(40):
        env.reset(seed=0)
        action = np.concatenate([rng.integers(0, 2, mg), [0, 1, rng.integers(0, 2)]])
        _, _, _, _, info = env.step(action)
        plan = Plan.from_json(info["plan"])
        assert plan.parallel.pipeline == 2
        if info["error"] is None:
            plan.validate(graph)  # stages are a chain in program order
            assert np.isfinite(info["step_time_s"])
            valid += 1
    assert valid > 0
    # the cache tells different stage assignments apart
    times = set()
    for cut in range(1, mg):
        env.reset(seed=0)
        _, _, _, _, info = env.step(np.concatenate([[0] * cut + [1] * (mg - cut), [0, 1, 0]]))
        if info["error"] is None:
            times.add(round(info["step_time_s"], 12))
    assert len(times) > 1


def test_valid_splits():
    graph = branches(2, 3)
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8,
                       data_options=(1, 2), pipeline_options=(1, 2),
                       microbatch_options=(1, 2, 4, 8))
    splits = env.valid_splits()
    assert len(splits) == 11  # dp1: 4 + 3 with pipeline 2; dp2: 4; dp2 x pp2 needs 4 devices
    assert (1, 1, 1) not in splits and (0, 1, 0) not in splits and (0, 1, 1) in splits
    for i, j, k in splits:
        env.reset(seed=0)
        action = np.concatenate([[0] * 4 + [1] * 4, [i, j, k]])
        _, _, _, _, info = env.step(action)
        assert not (info["error"] or "").startswith("a ")  # no split-level error
