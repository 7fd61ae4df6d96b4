"""The real backend on 2 GPUs: a storm of out-of-memory plans under a cap, then a valid one."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

import autoplace.envs  # noqa: F401  (registers the id)
from autoplace.cluster import Cluster
from autoplace.plan import Plan

pytestmark = pytest.mark.gpu

ID = "autoplace/Placement-v0"
OPTS = dict(workload="gpt-small", backend="real", max_groups=8, steps=8, warmup=3,
            workload_options={"batch_size": 64})
MiB = 2**20


def _action(env, placement: list[int]) -> np.ndarray:
    a = np.zeros(env.action_space.shape, dtype=np.int64)
    a[: len(placement)] = placement
    return a


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_oom_storm_then_valid_step():
    from autoplace import workloads
    from autoplace.executor import execute

    cluster = Cluster.detect().subset([0, 1])
    # uncapped: the peak of one device holding everything, and of the best 2-way split
    free = gym.make(ID, cluster=cluster, **OPTS)
    free.reset(seed=0)
    g = free.unwrapped.num_groups
    single = free.step(_action(free, [0] * g))[-1]
    assert single["error"] is None, single["error"]
    splits = {}
    for cut in range(1, g):
        info = free.step(_action(free, [0] * cut + [1] * (g - cut)))[-1]
        if info["error"] is None:
            splits[cut] = max(info["peak_memory_bytes"])
    free.close()
    cut = min(splits, key=splits.get)
    peak_single, peak_split = max(single["peak_memory_bytes"]), splits[cut]
    assert peak_single > 1.3 * peak_split, (peak_single, peak_split)
    cap = (peak_single + peak_split) // 2

    env = gym.make(ID, cluster=cluster, memory_cap=cap, **OPTS)
    env.reset(seed=0)
    levels = []
    for i in range(100):  # alternately everything on GPU 0 and on GPU 1
        obs, reward, terminated, truncated, info = env.step(_action(env, [i % 2] * g))
        assert obs in env.observation_space and terminated is True and truncated is False
        assert info["oom"] is True and reward == env.unwrapped.config.fail_reward, info["error"]
        levels.append(np.array([info["allocated_bytes"], info["reserved_bytes"]]))
    # the start level: once both GPUs were used (a first use keeps a fixed workspace, ~33 MiB
    # seen on H200); after that nothing leaks and nothing stays cached, OOM after OOM
    start = levels[1]
    print(f"memory after OOM steps (allocated, reserved per GPU): {start.tolist()}")
    for i, level in enumerate(levels[2:], start=2):
        assert (level <= start + MiB).all(), (i, level.tolist(), start.tolist())
    assert (levels[-1] == start).all()
    assert env.unwrapped.backend.worker.restarts == 0, "OOMs are results, not crashes"

    obs, reward, _, _, info = env.step(_action(env, [0] * cut + [1] * (g - cut)))
    assert info["error"] is None and info["measured"] is True, info["error"]
    assert reward > env.unwrapped.config.fail_reward
    assert max(info["peak_memory_bytes"]) <= cap
    env_time = info["step_time_s"]
    plan = Plan.from_json(info["plan"])
    capped = env.unwrapped.cluster
    env.close()

    workload = workloads.get("gpt-small", **OPTS["workload_options"])
    report = execute(workload, plan, cluster=capped, steps=OPTS["steps"],
                     warmup=OPTS["warmup"], reference=False)
    assert report.error is None, report.error
    print(f"cap {cap / MiB:.0f} MiB (single {peak_single / MiB:.0f}, split {peak_split / MiB:.0f});"
          f" step: env {env_time * 1e3:.2f} ms, executor {report.step_time_s * 1e3:.2f} ms")
    assert 0.67 < env_time / report.step_time_s < 1.5, (env_time, report.step_time_s)
