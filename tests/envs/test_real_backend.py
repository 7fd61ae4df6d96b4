"""The real backend on CPU devices: a measuring worker that survives OOM, kills and hangs."""

from __future__ import annotations

import os
import signal

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import autoplace.envs  # noqa: F401  (registers the id)

pytest.importorskip("autoplace.executor")
pytest.importorskip("autoplace.zoo.gpt")

ID = "autoplace/Placement-v0"
TINY = dict(workload="gpt-tiny", cluster="cpu-x2", backend="real", max_groups=4, steps=2,
            warmup=1, worker_threads=1, workload_options={"batch_size": 2})


@pytest.mark.parametrize("mode", ["oneshot", "incremental"])
def test_check_env_passes_on_cpu(mode):
    env = gym.make(ID, mode=mode, **TINY)
    try:
        assert env.unwrapped.spec.nondeterministic is True, "measured times vary"
        check_env(env.unwrapped, skip_render_check=True)
        env.reset(seed=1)
        _, _, _, _, info = env.step(env.action_space.sample())
        assert info["backend"] == "real" and info["measured"] is True, info["error"]
        assert info["step_time_s"] > 0 and len(info["peak_memory_bytes"]) == 2
    finally:
        env.close()


def _valid_step(env, action) -> dict:
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs in env.observation_space
    assert info["error"] is None and info["measured"] is True, info["error"]
    assert np.isfinite(reward) and reward < 0  # CPU timings in CI are noisy: no tighter bound
    return info


def test_worker_survives_oom_kill_and_hang():
    env = gym.make(ID, **TINY)
    try:
        env.reset(seed=0)
        backend = env.unwrapped.backend
        action = np.zeros(env.action_space.shape, dtype=np.int64)
        action[1] = 1
        _valid_step(env, action)
        pid = backend.worker_pid
        assert pid is not None and pid != os.getpid()

        backend.inject = "oom"  # the worker raises torch.OutOfMemoryError
        _, reward, terminated, _, info = env.step(action)
        assert reward == env.unwrapped.config.fail_reward and terminated is True
        assert info["oom"] is True and "out of memory" in info["error"]
        assert backend.worker_pid == pid, "an OOM is a result, not a crash"
        _valid_step(env, action)

        os.kill(pid, signal.SIGKILL)
        info = _valid_step(env, action)  # the dead worker is restarted, the plan retried
        assert backend.worker_pid not in (None, pid) and backend.worker.restarts == 1

        backend.timeout_s, pid = 2.0, backend.worker_pid
        backend.inject = "hang"
        _, reward, _, _, info = env.step(action)
        assert reward == env.unwrapped.config.fail_reward and "did not answer" in info["error"]
        backend.timeout_s = 300.0
        _valid_step(env, action)
        assert backend.worker_pid != pid and backend.worker.restarts == 2
    finally:
        env.close()
    assert backend.worker_pid is None
