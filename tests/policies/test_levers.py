"""Lever heads (per-group issue priority and recompute, plan-wide compile) of every policy:
sampling, scoring, REINFORCE, warm start, and checkpoints written before them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from autoplace.envs import PlacementEnv
from autoplace.envs.levers import Levers
from autoplace.errors import AutoplaceError
from autoplace.lowering import issue_order
from autoplace.plan import Plan
from autoplace.policies import batch_obs, describe_spaces, make, place, reinforce, train
from autoplace.policies import checkpoint as ckpt
from autoplace.policies.warm_start import order_priority, plan_to_action, warm_start
from tests.helpers.graphs import small_graph

ALL = ("priority", "recompute", "compile")
ASSETS = Path(__file__).parent / "assets"
POLICIES = ("seq2seq", "hierarchical", "gnn")


@pytest.fixture(scope="module")
def env():
    e = PlacementEnv(graph=small_graph(), cluster="cpu-x2", max_groups=8, levers=ALL,
                     data_options=(1, 2), microbatch_options=(1, 2))
    yield e
    e.close()


def _policy(name, env, **options):
    torch.manual_seed(0)
    return make(name, env.observation_space, env.action_space,
                **env.action_layout.policy_sizes(), hidden=16, **options)


@pytest.mark.parametrize("name", POLICIES)
def test_heads_sample_actions_of_the_space_and_score_them(env, name):
    policy = _policy(name, env)
    obs = batch_obs([env.reset(seed=0)[0]] * 6)
    out = policy(obs, generator=torch.Generator().manual_seed(1))
    assert out.action.shape == (6, len(env.action_space.nvec))
    for row in out.action.numpy():
        assert env.action_space.contains(row)
    again = policy(obs, out.action, out.latent)
    torch.testing.assert_close(again.log_prob, out.log_prob)
    # the lever entries are part of the log-probability, and their heads learn from it
    s = env.action_layout.slices
    changed = out.action.clone()
    changed[:, s["priority"].start] = (changed[:, s["priority"].start] + 1) % 4
    changed[:, s["recompute"].start] = (changed[:, s["recompute"].start] + 1) % 3
    other = policy(obs, changed, out.latent)
    assert not torch.allclose(other.log_prob, out.log_prob)
    other.log_prob.sum().backward()
    assert policy.levers.priority.weight.grad.abs().sum() > 0
    assert policy.levers.recompute.weight.grad.abs().sum() > 0
    # the plan-wide compile choice is the last plan-wide entry
    assert policy.hybrid_sizes == (2, 1, 2, 2)


def test_sizes_must_be_given_for_an_env_with_levers(env):
    with pytest.raises(AutoplaceError, match="action_layout.policy_sizes"):
        describe_spaces(env.observation_space, env.action_space)
    sizes = describe_spaces(env.observation_space, env.action_space,
                            **env.action_layout.policy_sizes())
    assert sizes["priority_levels"] == 4 and sizes["recompute_choices"] == 3


@pytest.mark.parametrize("name", POLICIES)
def test_checkpoints_written_before_levers_load(name, toy):
    policy, data = ckpt.load_policy(ASSETS / f"{name}-before-levers.pt")
    assert policy.lever_blocks == 1 and not hasattr(policy, "levers")
    assert policy.config == data["policy"]["config"]
    assert set(policy.state_dict()) == set(data["policy_state"])
    out = policy(batch_obs([toy.reset(seed=0)[0]]), greedy=True)
    assert toy.action_space.contains(out.action[0].numpy())


def test_teacher_levers_become_the_action(env):
    g = env.num_groups
    recompute = {i for i in range(g) if i % 3 == 1}
    selective = {i for i in range(g) if i % 3 == 2}
    plan = Plan.from_groups(env.graph, env.groups, [i % 2 for i in range(g)],
                            recompute=recompute, selective=selective)
    action = plan_to_action(env, plan)
    devices, split, levers = env.action_layout.decode(action, g)
    assert devices.tolist() == [i % 2 for i in range(g)] and split == (0, 0, 0)
    assert levers.recompute == tuple(1 if i in recompute else 2 if i in selective else 0
                                     for i in range(g))
    # priorities follow the teacher's issue order: a group issued earlier never gets a
    # higher level, and the levels span 0..3
    prio = order_priority(env, plan)
    first = {}
    for i, (_, op) in enumerate(issue_order(env.graph, plan)):
        first.setdefault(env.groups[op], i)
    ranked = sorted(range(g), key=first.__getitem__)
    assert [prio[x] for x in ranked] == sorted(prio) and set(prio) == {0, 1, 2, 3}
    assert levers.priority == prio


@pytest.mark.parametrize("name", POLICIES)
def test_warm_start_imitates_the_lever_choices(env, name):
    policy = _policy(name, env)
    g = env.num_groups
    target = env.action_layout.encode([i % 2 for i in range(g)], (1, 0, 1), Levers(
        priority=tuple(i % 4 for i in range(g)), recompute=tuple(i % 3 for i in range(g)),
        compile=True))
    stats = warm_start(policy, [env], [target], steps=300, lr=3e-2)
    assert stats["matched"], stats
    obs = batch_obs([env.reset(seed=0)[0]])
    greedy = policy(obs, greedy=True).action[0].numpy()
    real = policy.real_entries(obs["node_mask"], len(target))[0].numpy()
    assert np.array_equal(greedy[real], target[real])


def test_reinforce_trains_the_lever_heads_where_recompute_pays():
    """gpt-tiny on two CPUs, 3.5 MB each: everything on device 0 fits only recomputed."""
    env_opts = dict(workload="gpt-tiny", cluster="cpu-x2", max_groups=6,
                    levers=("priority", "recompute"), memory_cap=3_500_000)
    envs = [PlacementEnv(**env_opts) for _ in range(4)]
    policy = _policy("gnn", envs[0])
    before = {k: v.clone() for k, v in policy.levers.state_dict().items()}
    result = reinforce(envs, policy, budget=3, batch_size=4, progress=False, tensorboard=False,
                       warm_start=True, warm_start_steps=20)
    assert result.updates == 3 and np.isfinite(result.best_step_time_s)
    assert any(not torch.equal(before[k], v) for k, v in policy.levers.state_dict().items())
    plan = result.best_plan
    assert isinstance(plan, Plan) and not plan.predicted.get("oom", False)
    for e in envs:
        e.close()


def test_train_then_place_with_levers(tmp_path):
    """The checkpoint of a lever policy records the env's levers; place() rebuilds both."""
    res = train(small_graph(), "cpu-x2", policy="gnn", budget="2", out_dir=tmp_path, seed=0,
                max_groups=8, progress=False, batch_size=4, tensorboard=False,
                policy_options={"hidden": 16}, env_options={"levers": ALL})
    assert res.best_plan is not None
    data = ckpt.load(tmp_path / "checkpoint.pt")
    assert data["policy"]["config"]["priority_levels"] == 4
    assert data["extra"]["env_options"]["levers"] == list(ALL)
    plan = place(tmp_path / "checkpoint.pt", small_graph(), "cpu-x2", samples=4)
    # a pipeline's order is its schedule's: the env drops its priorities
    assert len(plan.priority) == (0 if plan.parallel.pipeline > 1 else
                                  max(plan.groups.values()) + 1)
