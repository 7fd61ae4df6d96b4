"""PlacementEnv under gymnasium.make_vec, synchronous and asynchronous."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import autoplace.envs  # noqa: F401  (registers the id)
from autoplace.envs import obs_batch_to_pyg
from tests.helpers.graphs import small_graph


@pytest.mark.parametrize("vectorization_mode", ["sync", "async"])
@pytest.mark.parametrize("mode", ["oneshot", "incremental"])
def test_make_vec(vectorization_mode, mode):
    envs = gym.make_vec("autoplace/Placement-v0", num_envs=2,
                        vectorization_mode=vectorization_mode, graph=small_graph(30),
                        cluster="cpu-x2", mode=mode, max_groups=6)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs["node_features"].shape[0] == 2 and obs["placement"].dtype == np.int64
        envs.action_space.seed(0)
        stepped = 0
        for _ in range(4):  # oneshot: every other call is the autoreset of a finished episode
            obs, reward, terminated, truncated, info = envs.step(envs.action_space.sample())
            assert reward.shape == (2,) and terminated.dtype == bool
            assert obs in envs.observation_space
            if "step_time_s" in info:
                stepped += 1
                assert info["_step_time_s"].all() and (info["step_time_s"] > 0).all()
                assert info["plan"]["placement"].shape == (2,)
        assert stepped >= 2
        batch = obs_batch_to_pyg(obs)
        assert batch.num_graphs == 2
    finally:
        envs.close()
