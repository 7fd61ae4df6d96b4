"""A tiny env that follows the PlacementEnv contract (docs/CONTRACTS.md) with a known optimum.

Groups of a ``random_dag`` are observed as padded arrays; the "step time" is
``1 + 0.5 * (groups off their target device) + 0.5 * (hybrid choices off target)``, so
exactly one plan (``TARGET`` devices, ``TARGET_HYBRID`` split) reaches 1.0.
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autoplace.graph import random_dag
from autoplace.grouping import coarsen, group_graph
from autoplace.plan import ParallelConfig, Plan

DATA, PIPELINE, MICROBATCHES = [1, 2], [1, 2], [1, 2, 4]


class ToyPlacementEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, *, num_ops: int = 24, num_groups: int = 6, max_groups: int = 8,
                 num_devices: int = 2, graph_seed: int = 0, target_seed: int = 1,
                 mode: str = "oneshot", step_sleep_s: float = 0.0) -> None:
        self.step_sleep_s = step_sleep_s
        self.graph = random_dag(num_ops, seed=graph_seed)
        self.groups = coarsen(self.graph, num_groups)
        self.num_groups = max(self.groups.values()) + 1
        self.max_groups, self.num_devices, self.mode = max_groups, num_devices, mode
        self.data_options, self.pipeline_options = DATA, PIPELINE
        self.microbatch_options = MICROBATCHES
        rng = np.random.default_rng(target_seed)
        self.target = rng.integers(0, num_devices, self.num_groups)
        self.target_hybrid = np.array([1, 0, 2])
        feats = self.graph.node_features()
        self.features = np.zeros((max_groups, feats.shape[1]), dtype=np.float32)
        for op, g in self.groups.items():
            self.features[g] += feats[self.graph.index[op]]
        gg = group_graph(self.graph, self.groups)
        self.edges = np.array(list(gg.edges), dtype=np.int64).reshape(-1, 2).T
        self.max_edges = max(max_groups * 4, self.edges.shape[1])
        obs = {
            "edge_index": spaces.Box(0, max_groups - 1, (2, self.max_edges), np.int64),
            "edge_mask": spaces.Box(0, 1, (self.max_edges,), np.int8),
            "node_features": spaces.Box(-np.inf, np.inf, (max_groups, feats.shape[1]), np.float32),
            "node_mask": spaces.Box(0, 1, (max_groups,), np.int8),
            "placement": spaces.Box(0, num_devices - 1, (max_groups,), np.int64),
        }
        if mode == "incremental":
            obs["focus"] = spaces.Box(0, 1, (max_groups,), np.int64)
            self.action_space = spaces.Discrete(num_devices)
        else:
            self.action_space = spaces.MultiDiscrete(
                [num_devices] * max_groups + [len(DATA), len(PIPELINE), len(MICROBATCHES)])
        self.observation_space = spaces.Dict(obs)

    def step_time(self, devices, hybrid) -> float:
        off = np.sum(np.asarray(devices)[: self.num_groups] != self.target)
        return 1.0 + 0.5 * off + 0.5 * np.sum(np.asarray(hybrid) != self.target_hybrid)

    def _obs(self):
        e = self.edges.shape[1]
        edge_index = np.zeros((2, self.max_edges), np.int64)
        edge_index[:, :e] = self.edges
        edge_mask = np.zeros(self.max_edges, np.int8)
        edge_mask[:e] = 1
        node_mask = np.zeros(self.max_groups, np.int8)
        node_mask[: self.num_groups] = 1
        obs = {"edge_index": edge_index, "edge_mask": edge_mask,
               "node_features": self.features.copy(), "node_mask": node_mask,
               "placement": self.placement.copy()}
        if self.mode == "incremental":
            obs["focus"] = np.eye(self.max_groups, dtype=np.int64)[self.focus]
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.placement = np.zeros(self.max_groups, np.int64)
        self.placement[: self.num_groups] = self.np_random.integers(
            0, self.num_devices, self.num_groups)
        self.focus = 0
        self.cost = np.sqrt(self.step_time(self.placement, self.target_hybrid))
        return self._obs(), {}

    def _info(self, devices, hybrid, step_time):
        par = ParallelConfig(data=DATA[hybrid[0]], pipeline=1, microbatches=MICROBATCHES[hybrid[2]])
        plan = Plan.from_groups(self.graph, self.groups, list(devices[: self.num_groups]),
                                parallel=par, planner="toy").with_predicted(
                                    {"step_time_s": step_time})
        return {"plan": plan, "step_time_s": step_time, "oom": False}

    def step(self, action):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        if self.mode == "incremental":
            self.placement[self.focus] = int(action)
            st = self.step_time(self.placement, self.target_hybrid)
            reward = self.cost - np.sqrt(st)
            self.cost = np.sqrt(st)
            self.focus += 1
            done = self.focus >= self.num_groups
            self.focus = min(self.focus, self.num_groups - 1)
            info = self._info(self.placement, self.target_hybrid, st)
            return self._obs(), float(reward), bool(done), False, info
        action = np.asarray(action)
        devices, hybrid = action[: self.max_groups], action[self.max_groups:]
        assert np.all(devices < self.num_devices) and np.all(devices >= 0)
        st = self.step_time(devices, hybrid)
        self.placement = devices.astype(np.int64).copy()
        self.placement[self.num_groups:] = 0
        return self._obs(), -float(np.sqrt(st)), True, False, self._info(devices, hybrid, st)
