from __future__ import annotations

import numpy as np
import pytest
import torch

from autoplace.errors import AutoplaceError
from autoplace.policies import (
    GNNPolicy,
    batch_obs,
    describe_spaces,
    get,
    make,
    names,
)
from tests.helpers.placement_toy import ToyPlacementEnv

POLICIES = ["seq2seq", "hierarchical", "gnn"]


def _policy(name: str, env, **options):
    torch.manual_seed(0)
    return make(name, env.observation_space, env.action_space, hidden=32, **options)


def _sample(policy, env, n=32, seed=0, greedy=False):
    obs, _ = env.reset(seed=0)
    batch = batch_obs([obs] * n)
    with torch.no_grad():
        out = policy(batch, generator=torch.Generator().manual_seed(seed), greedy=greedy)
    return batch, out


def test_registry_lists_names():
    assert names() == POLICIES
    assert get("gnn") is GNNPolicy
    with pytest.raises(AutoplaceError, match="valid: seq2seq, hierarchical, gnn"):
        get("transformer")


def test_describe_spaces(toy):
    sizes = describe_spaces(toy.observation_space, toy.action_space)
    assert sizes == dict(num_features=21, num_devices=2, max_groups=8, hybrid_sizes=(2, 2, 3),
                         mode="oneshot")
    inc = ToyPlacementEnv(mode="incremental")
    assert describe_spaces(inc.observation_space, inc.action_space)["mode"] == "incremental"


@pytest.mark.parametrize("name", ["seq2seq", "hierarchical"])
def test_incremental_needs_gnn(name):
    env = ToyPlacementEnv(mode="incremental")
    with pytest.raises(AutoplaceError, match="use policy 'gnn'"):
        _policy(name, env)


@pytest.mark.parametrize("name", POLICIES)
def test_sampled_actions_are_valid(name, toy):
    policy = _policy(name, toy)
    _, out = _sample(policy, toy)
    act = out.action.numpy()
    assert act.shape == (32, 8 + 3)
    assert (act[:, :6] >= 0).all() and (act[:, :6] < 2).all()
    assert (act[:, 6:8] == 0).all()  # padded groups
    assert ((act[:, 8:] >= 0) & (act[:, 8:] < np.array([2, 2, 3]))).all()
    assert all(toy.action_space.contains(a) for a in act)
    assert len({tuple(a) for a in act}) > 5  # it samples, not one fixed plan
    _, reward, terminated, _, info = toy.step(act[0])
    assert terminated and np.isfinite(reward) and info["plan"] is not None


@pytest.mark.parametrize("name", POLICIES)
def test_log_prob_of_given_actions_matches_sampled(name, toy):
    policy = _policy(name, toy)
    batch, out = _sample(policy, toy)
    again = policy(batch, out.action, out.latent or None)
    torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.entropy, out.entropy, atol=1e-5, rtol=1e-5)
    assert (out.log_prob < 0).all()
    # every parameter takes part in the log-probability
    (-again.log_prob.mean() - again.entropy.mean()).backward()
    missing = [n for n, p in policy.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize("name", POLICIES)
def test_padded_entries_are_ignored(name, toy):
    policy = _policy(name, toy)
    batch, out = _sample(policy, toy, n=8)
    noisy = out.action.clone()
    noisy[:, 6:8] = 1  # padded groups
    lp = policy(batch, noisy, out.latent or None).log_prob
    torch.testing.assert_close(lp, out.log_prob, atol=1e-5, rtol=1e-5)
    flipped = out.action.clone()
    flipped[:, 0] = 1 - flipped[:, 0]  # a real group
    assert not torch.allclose(policy(batch, flipped, out.latent or None).log_prob, out.log_prob)


@pytest.mark.parametrize("name", POLICIES)
def test_sampling_follows_the_generator(name, toy):
    policy = _policy(name, toy)
    a = _sample(policy, toy, seed=1)[1].action
    b = _sample(policy, toy, seed=1)[1].action
    c = _sample(policy, toy, seed=2)[1].action
    assert torch.equal(a, b) and not torch.equal(a, c)
    g1 = _sample(policy, toy, seed=1, greedy=True)[1].action
    g2 = _sample(policy, toy, seed=2, greedy=True)[1].action
    assert torch.equal(g1, g2) and (g1 == g1[0]).all()


@pytest.mark.parametrize("conv", ["sage", "gat"])
def test_gnn_places_graphs_of_any_size(conv, toy):
    policy = _policy("gnn", toy, conv=conv)
    other = ToyPlacementEnv(num_ops=60, num_groups=14, max_groups=16, graph_seed=5)
    with pytest.raises(AutoplaceError):
        _policy("gnn", toy, conv="gcn")
    # sized for 8 padded groups, it places a 14-group graph padded to 16
    obs, _ = other.reset(seed=0)
    out = policy(batch_obs([obs] * 4), generator=torch.Generator().manual_seed(0))
    devices = out.action[:, :16].numpy()
    assert (devices[:, 14:] == 0).all() and (devices < 2).all()
    again = policy(batch_obs([obs] * 4), out.action)
    torch.testing.assert_close(again.log_prob, out.log_prob)


@pytest.mark.parametrize("conv", ["sage", "gat"])
def test_gnn_incremental_mode(conv):
    env = ToyPlacementEnv(mode="incremental")
    policy = _policy("gnn", env, conv=conv)
    obs, _ = env.reset(seed=0)
    out = policy(batch_obs([obs] * 5), generator=torch.Generator().manual_seed(0))
    assert out.action.shape == (5, 1) and ((out.action >= 0) & (out.action < 2)).all()
    torch.testing.assert_close(policy(batch_obs([obs] * 5), out.action).log_prob, out.log_prob)
    # the focused group changes the decision's inputs
    obs2 = dict(obs, focus=np.roll(obs["focus"], 1))
    logits = [policy(batch_obs([o]), torch.zeros(1, 1, dtype=torch.long)).log_prob
              for o in (obs, obs2)]
    assert not torch.allclose(logits[0], logits[1])


def test_hierarchical_grouping_is_latent(toy):
    policy = _policy("hierarchical", toy, num_groups=4)
    batch, out = _sample(policy, toy)
    grouping = out.latent["grouping"]
    assert grouping.shape == (32, 8) and (grouping < 4).all() and (grouping[:, 6:] == 0).all()
    devices = out.action[:, :6]
    for row in range(32):  # members of a group share its device
        for g in grouping[row, :6].unique():
            assert devices[row][grouping[row, :6] == g].unique().numel() == 1
    other = torch.randint(0, 4, grouping.shape, generator=torch.Generator().manual_seed(9))
    assert not torch.allclose(policy(batch, out.action, {"grouping": other}).log_prob,
                              out.log_prob)


@pytest.mark.parametrize("name", POLICIES)
def test_policies_drive_the_placement_env(name):
    envs = pytest.importorskip("autoplace.envs")
    from autoplace.graph import random_dag

    env = envs.PlacementEnv(graph=random_dag(40, seed=2), cluster="h100x4", max_groups=12,
                            data_options=(1, 2, 4), pipeline_options=(1, 2),
                            microbatch_options=(1, 2, 4))
    policy = _policy(name, env)
    _, out = _sample(policy, env, n=8)
    for a in out.action.numpy():
        assert env.action_space.contains(a)
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step(a)
        assert terminated and np.isfinite(reward) and "plan" in info


@pytest.mark.parametrize("name", POLICIES)
def test_a_forced_hybrid_split_is_kept(name, toy):
    policy = _policy(name, toy)
    obs, _ = toy.reset(seed=0)
    split = torch.tensor([[1, 0, 2]] * 4)
    out = policy(batch_obs([obs] * 4), generator=torch.Generator().manual_seed(0), hybrid=split)
    assert torch.equal(out.action[:, 8:], split)
    torch.testing.assert_close(policy(batch_obs([obs] * 4), out.action, out.latent or None
                                      ).log_prob, out.log_prob, atol=1e-5, rtol=1e-5)
