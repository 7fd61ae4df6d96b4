"""PlacementEnv with the simulator backend: Gymnasium API, observation contract, rewards."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import autoplace.envs  # noqa: F401  (registers the id)
from autoplace.envs import GROUP_FEATURES, PlacementEnv, obs_batch_to_pyg, obs_to_pyg
from autoplace.errors import AutoplaceError
from tests.helpers.graphs import skewed_cluster, small_graph

ID = "autoplace/Placement-v0"


@pytest.mark.parametrize("mode", ["oneshot", "incremental"])
def test_check_env_passes(graph, mode):
    env = gym.make(ID, graph=graph, cluster="cpu-x2", mode=mode, max_groups=8,
                   render_mode="ansi", initial_placement="random")
    check_env(env.unwrapped)
    env.close()


def test_observation_follows_the_contract(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=16, max_edges=50)
    obs, _ = env.reset(seed=0)
    assert list(obs) == ["edge_index", "edge_mask", "node_features", "node_mask", "placement"]
    assert list(env.observation_space.spaces) == list(obs)
    expect = {"edge_index": (np.int64, (2, 50)), "edge_mask": (np.int8, (50,)),
              "node_features": (np.float32, (16, len(GROUP_FEATURES))),
              "node_mask": (np.int8, (16,)), "placement": (np.int64, (16,))}
    for key, (dtype, shape) in expect.items():
        assert obs[key].dtype == dtype and obs[key].shape == shape, key
    assert obs in env.observation_space
    g = env.num_groups
    assert obs["node_mask"].sum() == g and obs["node_mask"][:g].all()
    assert not obs["node_features"][g:].any()
    e = int(obs["edge_mask"].sum())
    src, dst = obs["edge_index"][:, :e]
    assert (src < dst).all(), "groups are numbered in topological order"
    assert not obs["edge_index"][:, e:].any()

    inc = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=16, mode="incremental")
    obs, _ = inc.reset(seed=0)
    assert "focus" in obs and obs["focus"].dtype == np.int64 and obs["focus"][0] == 1


def test_oneshot_episode_is_one_step_with_full_info(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8)
    env.reset(seed=0)
    action = np.zeros(env.action_space.shape, dtype=np.int64)
    obs, reward, terminated, truncated, info = env.step(action)
    assert terminated is True and truncated is False and isinstance(reward, float)
    assert reward == pytest.approx(-1.0), "everything on one device is the normaliser"
    for key in ("step_time_s", "peak_memory_bytes", "oom", "backend", "measured", "plan",
                "error"):
        assert key in info
    assert info["backend"] == "sim" and info["measured"] is False and info["error"] is None
    assert info["plan"]["format"] == "autoplace.plan/1"
    assert info["step_time_s"] == pytest.approx(info["single_device_step_time_s"])
    action[: env.num_groups] = np.arange(env.num_groups) % 2
    obs, *_ = env.step(action)
    assert obs["placement"][: env.num_groups].tolist() == (np.arange(env.num_groups) % 2).tolist()


@pytest.mark.parametrize("reward", ["neg_sqrt", "improvement", "neg_time"])
def test_reward_kinds(graph, reward):
    env = PlacementEnv(graph=graph, cluster=skewed_cluster(), max_groups=8, reward=reward)
    env.reset(seed=0)
    action = np.ones(env.action_space.shape, dtype=np.int64)
    action[-3:] = 0
    _, r, *_, info = env.step(action)
    ratio = info["step_time_s"] / info["single_device_step_time_s"]
    assert ratio > 4, "all on the 8x slower device"
    expected = {"neg_sqrt": -math.sqrt(ratio), "improvement": 1 - ratio, "neg_time": -ratio}
    assert r == pytest.approx(expected[reward])


def test_out_of_memory_gets_the_failing_signal(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", memory_cap="1KB", max_groups=8,
                       fail_reward=-3.0)
    env.reset(seed=0)
    _, r, terminated, _, info = env.step(np.zeros(env.action_space.shape, dtype=np.int64))
    assert r == -3.0 and terminated is True
    assert info["oom"] is True and "out of memory" in info["error"]


def test_hybrid_split_maps_devices_and_rejects_bad_pipelines():
    graph = small_graph(60)
    env = PlacementEnv(graph=graph, cluster="cpu-x4", max_groups=8, data_options=(1, 2),
                       pipeline_options=(1, 2), microbatch_options=(1, 2))
    env.reset(seed=0)
    g, mg = env.num_groups, env.config.max_groups
    action = np.zeros(env.action_space.shape, dtype=np.int64)
    action[:g] = [3, 2, 1, 0, 3, 2, 1, 0][:g]
    action[mg:] = [1, 0, 0]  # dp=2: each replica has 2 local devices, device = entry % 2
    obs, r, _, _, info = env.step(action)
    assert info["plan"]["parallel"]["data"] == 2
    assert obs["placement"][:g].tolist() == [d % 2 for d in action[:g]]
    assert info["error"] is None and r > env.config.fail_reward

    action[:g] = [0] * (g // 2) + [1] * (g - g // 2)
    action[mg:] = [0, 1, 1]  # a 2-stage pipeline over a chain, 2 microbatches
    _, r, _, _, info = env.step(action)
    assert info["plan"]["parallel"]["pipeline"] == 2
    assert info["error"] is None, info["error"]

    action[mg:] = [0, 1, 0]  # 2 stages but 1 microbatch: invalid
    _, r, _, _, info = env.step(action)
    assert r == env.config.fail_reward and "microbatches" in info["error"]

    action[:g] = 0
    action[mg:] = [0, 1, 1]  # a pipeline whose placement leaves stage 1 empty
    _, r, _, _, info = env.step(action)
    assert r == env.config.fail_reward and "invalid plan" in info["error"]


def test_incremental_visits_each_group_and_rewards_telescope(graph):
    env = PlacementEnv(graph=graph, cluster=skewed_cluster(), max_groups=6,
                       mode="incremental", passes=2, initial_placement="random")
    obs, _ = env.reset(seed=3)
    g = env.num_groups
    start = env.unwrapped._score_of(env.backend.evaluate(env._plan(env._placement,
                                                                   env._parallel)))
    total, steps, terminated = 0.0, 0, False
    while not terminated:
        assert obs["focus"].argmax() == steps % g
        obs, r, terminated, truncated, info = env.step(0)
        assert truncated is False
        total += r
        steps += 1
    assert steps == 2 * g
    assert obs["placement"][:g].tolist() == [0] * g
    assert total == pytest.approx(info["score"] - start)
    assert info["score"] == pytest.approx(-1.0)


def test_reset_options_set_the_initial_placement(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=4, mode="incremental")
    obs, _ = env.reset(seed=0, options={"placement": [1, 0, 1, 0]})
    assert obs["placement"][:4].tolist() == [1, 0, 1, 0]
    with pytest.raises(AutoplaceError, match="devices in 0..1"):
        env.reset(options={"placement": [5, 0, 0, 0]})


def test_fresh_arrays_every_call(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8)
    a, _ = env.reset(seed=0)
    b, *_ = env.step(env.action_space.sample())
    for key in a:
        assert not np.shares_memory(a[key], b[key]), key


def test_obs_to_pyg_has_both_edge_directions(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=8, mode="incremental")
    obs, _ = env.reset(seed=0)
    data = obs_to_pyg(obs)
    e = int(obs["edge_mask"].sum())
    assert data.num_nodes == env.num_groups and data.x.shape == (env.num_groups,
                                                                  len(GROUP_FEATURES))
    assert data.edge_index.shape == (2, 2 * e)
    fwd = {tuple(x) for x in obs["edge_index"][:, :e].T.tolist()}
    both = {tuple(x) for x in data.edge_index.T.tolist()}
    assert both == fwd | {(v, u) for u, v in fwd}
    assert data.edge_type.sum() == e and data.focus[0] == 1.0

    obs2, *_ = env.step(1)
    batch = obs_batch_to_pyg([obs, obs2])
    assert batch.num_graphs == 2 and batch.x.shape[0] == 2 * env.num_groups
    assert int(batch.edge_index.max()) >= env.num_groups, "the second graph's index is offset"
    stacked = {k: np.stack([obs[k], obs2[k]]) for k in obs}
    assert torch.equal(obs_batch_to_pyg(stacked).edge_index, batch.edge_index)


def test_render_modes(graph):
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=4, render_mode="ansi")
    env.reset(seed=0)
    env.step(np.array([0, 1, 0, 1, 0, 0, 0]))
    text = env.render()
    assert "device" in text and "last step" in text and len(text.splitlines()) == 6
    env = PlacementEnv(graph=graph, cluster="cpu-x2", max_groups=4, render_mode="rgb_array")
    env.reset(seed=0)
    env.step(np.array([0, 1, 0, 1, 0, 0, 0]))
    img = env.render()
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    assert img.std() > 0, "a chart, not a blank image"


def test_errors_name_what_is_valid(graph):
    with pytest.raises(AutoplaceError, match="valid: .*max_groups"):
        PlacementEnv(graph=graph, max_grups=3)
    with pytest.raises(AutoplaceError, match="valid: oneshot, incremental"):
        PlacementEnv(graph=graph, mode="greedy")
    with pytest.raises(AutoplaceError, match="valid: sim, real"):
        PlacementEnv(graph=graph, backend="gpu")
    with pytest.raises(AutoplaceError, match=r"data_options .* 1..2"):
        PlacementEnv(graph=graph, data_options=(1, 4))
    with pytest.raises(AutoplaceError, match="raise max_edges"):
        PlacementEnv(graph=graph, max_groups=16, max_edges=2)


def test_zoo_workload_is_captured():
    pytest.importorskip("autoplace.zoo.gpt")
    env = gym.make(ID, workload="gpt-tiny", cluster="h100x2", backend="sim", mode="oneshot",
                   max_groups=64)
    obs, _ = env.reset(seed=0)
    assert 1 < env.unwrapped.num_groups <= 64
    _, r, *_, info = env.step(env.action_space.sample())
    assert info["error"] is None and -3 < r < 0
    assert env.unwrapped.graph.name
