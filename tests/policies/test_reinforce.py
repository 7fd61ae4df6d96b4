from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from autoplace.errors import AutoplaceError
from autoplace.plan import Plan
from autoplace.policies import batch_obs, make, reinforce
from autoplace.policies.reinforce import parse_budget
from tests.helpers import ROOT
from tests.helpers.placement_toy import ToyPlacementEnv


def _setup(name, n_envs=16, **env_kw):
    envs = [ToyPlacementEnv(**env_kw) for _ in range(n_envs)]
    torch.manual_seed(0)
    return envs, make(name, envs[0].observation_space, envs[0].action_space, hidden=32)


def test_parse_budget():
    assert parse_budget(200) == ("updates", 200)
    assert parse_budget("200") == ("updates", 200)
    assert parse_budget("50u") == ("updates", 50)
    assert parse_budget("2000ep") == ("episodes", 2000)
    assert parse_budget("90s") == ("seconds", 90)
    assert parse_budget("5m") == ("seconds", 300)
    assert parse_budget("1.5h") == ("seconds", 5400)
    for bad in ("", "fast", "-3", "0", "5 parsecs"):
        with pytest.raises(AutoplaceError, match="2000ep"):
            parse_budget(bad)


@pytest.mark.parametrize("name,updates", [("seq2seq", 80), ("hierarchical", 120), ("gnn", 60)])
def test_finds_the_known_optimum(name, updates):
    envs, policy = _setup(name)
    result = reinforce(envs, policy, budget=updates, batch_size=16, seed=0, progress=False)
    assert result.best_step_time_s == 1.0  # the one optimal plan
    plan = result.best_plan
    assert isinstance(plan, Plan) and list(plan.placement) == list(envs[0].target)
    assert plan.parallel.data == 2 and plan.parallel.microbatches == 4
    assert plan.planner["name"] == name and plan.predicted == {"step_time_s": 1.0}
    # the policy itself learned it: its greedy plan is the optimum
    obs, _ = envs[0].reset(seed=0)
    greedy = policy(batch_obs([obs]), greedy=True).action[0].numpy()
    assert envs[0].step_time(greedy[:8], greedy[8:]) == 1.0
    assert result.history["reward_mean"][-1] > result.history["reward_mean"][0] + 0.5


def test_incremental_gnn_learns():
    envs, policy = _setup("gnn", n_envs=8, mode="incremental")
    result = reinforce(envs, policy, budget=60, batch_size=8, lr=1e-2, progress=False)
    assert result.best_step_time_s == 1.0
    # returns (score improvements over a random start) rise as the policy learns
    assert np.mean(result.history["reward_mean"][-10:]) > np.mean(
        result.history["reward_mean"][:10]) + 0.3


def test_budget_units_and_schedule():
    envs, policy = _setup("gnn", n_envs=4)
    r = reinforce(envs, policy, budget="40ep", batch_size=8, progress=False, lr=1e-2)
    assert r.updates == 5 and r.episodes == 40
    lrs = r.history["lr"]
    assert lrs[0] == pytest.approx(1e-2) and all(a > b for a, b in zip(lrs, lrs[1:]))
    r = reinforce(envs, policy, budget=3, batch_size=8, progress=False, lr_schedule="constant")
    assert r.history["lr"] == [3e-3] * 3
    t = time.perf_counter()
    r = reinforce(envs, policy, budget="1s", batch_size=4, progress=False)
    assert 1.0 <= r.elapsed_s < 5 and time.perf_counter() - t < 10 and r.updates >= 2
    with pytest.raises(AutoplaceError, match="constant, linear, cosine"):
        reinforce(envs, policy, budget=1, lr_schedule="step")


def test_outputs_and_checkpoint_format(tmp_path):
    envs, policy = _setup("seq2seq", n_envs=4)
    r = reinforce(envs, policy, budget=6, batch_size=8, out_dir=tmp_path, checkpoint_every=2,
                  progress=True)
    assert r.checkpoint_path == tmp_path / "checkpoint.pt"
    data = torch.load(r.checkpoint_path, weights_only=True)
    assert data["update"] == 6 and data["episodes"] == 48
    assert data["policy"]["name"] == "seq2seq" and data["policy"]["config"]["hidden"] == 32
    assert len(data["history"]["reward_mean"]) == 6
    plan = Plan.load(tmp_path / "best_plan.json")
    assert plan.predicted["step_time_s"] == r.best_step_time_s
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_multiple_graphs_have_their_own_best(tmp_path):
    envs = [ToyPlacementEnv(graph_seed=s, target_seed=s) for s in (0, 1) for _ in range(4)]
    torch.manual_seed(0)
    policy = make("gnn", envs[0].observation_space, envs[0].action_space, hidden=32)
    r = reinforce(envs, policy, budget=4, batch_size=8, out_dir=tmp_path, progress=False)
    assert len(r.best) == 2
    assert len(json.loads((tmp_path / "best_plans.json").read_text())) == 2


class _Crash(Exception):
    pass


def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path):
    envs, policy = _setup("hierarchical", n_envs=4)
    full = reinforce(envs, policy, budget=10, batch_size=8, seed=5, progress=False,
                     out_dir=tmp_path / "full", checkpoint_every=3)

    envs, policy = _setup("hierarchical", n_envs=4)
    calls = {"n": 0}
    step = envs[0].step

    def crashing_step(action):
        calls["n"] += 1
        if calls["n"] == 15:  # env 0 steps twice per update: update 8, after checkpoint 6
            raise _Crash
        return step(action)

    envs[0].step = crashing_step
    with pytest.raises(_Crash):
        reinforce(envs, policy, budget=10, batch_size=8, seed=5, progress=False,
                  out_dir=tmp_path / "cut", checkpoint_every=3)
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["update"] == 6
    envs, policy = _setup("hierarchical", n_envs=4)
    resumed = reinforce(envs, policy, budget=10, batch_size=8, seed=5, progress=False,
                        out_dir=tmp_path / "cut", checkpoint_every=3, resume=True)
    assert resumed.history["reward_mean"] == full.history["reward_mean"]
    assert resumed.history["loss"] == full.history["loss"]
    assert resumed.best == full.best


def test_resume_rejects_another_policy(tmp_path):
    envs, policy = _setup("gnn", n_envs=2)
    reinforce(envs, policy, budget=1, batch_size=2, out_dir=tmp_path, progress=False)
    _, other = _setup("seq2seq", n_envs=1)
    with pytest.raises(AutoplaceError, match="holds a 'gnn' policy"):
        reinforce(envs, other, budget=2, batch_size=2, out_dir=tmp_path, resume=True,
                  progress=False)


def _run(out_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.train_toy", str(out_dir),
                             "seq2seq", "24", *extra], cwd=ROOT, env={**os.environ,
                            "OMP_NUM_THREADS": "1"})


def test_resume_after_sigkill_reaches_the_same_best_plan(tmp_path):
    ref = _run(tmp_path / "ref")
    cut = _run(tmp_path / "cut")
    ckpt = tmp_path / "cut" / "checkpoint.pt"
    deadline = time.monotonic() + 120
    while not ckpt.exists() and cut.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert cut.poll() is None, "the run finished before it could be killed"
    os.kill(cut.pid, signal.SIGKILL)
    assert cut.wait() == -signal.SIGKILL
    killed_at = torch.load(ckpt, weights_only=True)["update"]
    assert 2 <= killed_at < 24
    assert not (tmp_path / "cut" / "best_plan.json").exists()
    assert _run(tmp_path / "cut", "--resume").wait() == 0
    assert ref.wait() == 0
    a = torch.load(tmp_path / "ref" / "checkpoint.pt", weights_only=True)
    b = torch.load(ckpt, weights_only=True)
    assert b["update"] == 24 and a["history"]["reward_mean"] == b["history"]["reward_mean"]
    assert a["best"] == b["best"]
    for k, v in a["policy_state"].items():
        assert torch.equal(v, b["policy_state"][k]), k
    assert (tmp_path / "ref" / "best_plan.json").read_text() == (
        tmp_path / "cut" / "best_plan.json").read_text()
