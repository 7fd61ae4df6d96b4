"""Stratified exploration of the hybrid split (``ReinforceConfig.split_explore``)."""

from __future__ import annotations

import torch

from autoplace.policies import batch_obs, make, reinforce
from autoplace.policies.reinforce import ReinforceConfig, _forced_splits
from tests.helpers.placement_toy import ToyPlacementEnv


def _setup(name="gnn", n_envs=4):
    envs = [ToyPlacementEnv() for _ in range(n_envs)]
    torch.manual_seed(0)
    return envs, make(name, envs[0].observation_space, envs[0].action_space, hidden=32)


def test_forced_splits_cycle_through_every_split():
    envs, policy = _setup()
    cfg = ReinforceConfig(batch_size=16, split_explore=0.5)
    seen = set()
    for update in range(3):
        forced = _forced_splits(envs, policy, cfg, update, update * 16)
        assert sorted(forced) == list(range(8, 16))  # the second half of the batch
        seen |= set(forced.values())
    assert len(seen) == 2 * 2 * 3  # every combination of the toy's options
    assert _forced_splits(envs, policy, ReinforceConfig(split_explore=0.0), 0, 0) == {}


def test_partially_forced_split_is_kept_and_scored():
    envs, policy = _setup("seq2seq")
    obs, _ = envs[0].reset(seed=0)
    hybrid = torch.tensor([[1, 0, 2], [-1, -1, -1], [0, 1, 1], [-1, -1, -1]])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = policy(batch_obs([obs] * 4), generator=gen, hybrid=hybrid)
        again = policy(batch_obs([obs] * 4), out.action)
    g = out.action.shape[1] - 3
    assert out.action[0, g:].tolist() == [1, 0, 2] and out.action[2, g:].tolist() == [0, 1, 1]
    assert (out.action[:, g:] >= 0).all()
    torch.testing.assert_close(out.log_prob, again.log_prob)
    torch.testing.assert_close(out.hybrid_log_prob, again.hybrid_log_prob)


def test_forced_episodes_do_not_train_the_split_head():
    """With every split forced, no entropy bonus and no self-imitation (which trains the whole
    action of the best plan, its split too), the split head's logits get no gradient (the
    placement still learns, conditioned on the forced split)."""
    envs, policy = _setup("gnn")
    before = [p.detach().clone() for p in policy.hybrid.logits.parameters()]
    placement_before = [p.detach().clone() for p in policy.head.parameters()]
    reinforce(envs, policy, budget=5, batch_size=8, seed=0, progress=False,
              split_explore=1.0, entropy_coef=0.0, hybrid_entropy_coef=0.0,
              self_imitation_coef=0.0)
    for a, b in zip(before, policy.hybrid.logits.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    assert any(not torch.equal(a, b.detach())
               for a, b in zip(placement_before, policy.head.parameters()))


def test_split_head_keeps_exploring():
    """The split head is still trained on-policy and does not collapse within a short run."""
    envs, policy = _setup("gnn")
    result = reinforce(envs, policy, budget=30, batch_size=16, seed=0, progress=False)
    assert result.best_step_time_s < 3.0
    obs, _ = envs[0].reset(seed=0)
    with torch.no_grad():
        out = policy(batch_obs([obs] * 64), generator=torch.Generator().manual_seed(1))
    assert out.hybrid_entropy.mean() > 0.1
