"""Hierarchical planner (Mirhoseini et al., "A Hierarchical Model for Device Placement",
ICLR 2018, https://openreview.net/forum?id=Hkc-TeZ0W).

A feed-forward grouper assigns every op (here: every group of the observation) to one
of ``num_groups`` groups; a seq2seq placer (:class:`~.seq2seq.Seq2SeqCore`) places the
groups; an op's device is its group's. Both are trained jointly by REINFORCE: the
log-probability of a sample is the grouper's plus the placer's. The grouping is a
latent choice (the env only sees devices), returned in ``PolicyOutput.latent`` so the
trainer can recompute log-probabilities exactly.

The grouper starts near contiguous segments of the topological order (a prior with a
learnable strength is added to its logits) rather than uniform, so the placer learns from
the first updates. A group's embedding is the paper's: the mean features of its members (op kinds, sizes,
times), its size, and its adjacency to the other groups (edge counts in and out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import PlacementPolicy, PolicyOutput, dense_adjacency, neighbour_features
from .heads import HybridHead, LeverHead, categorical, join_action
from .seq2seq import Seq2SeqCore

__all__ = ["HierarchicalPolicy"]


class HierarchicalPolicy(PlacementPolicy):
    """Mirhoseini et al. 2018: feed-forward grouper + seq2seq placer, trained jointly.

    Args:
        num_groups: groups the grouper forms (capped at ``max_groups``).
        hidden: width of the grouper and the placer.
        **sizes: see :class:`~autoplace.policies.base.PlacementPolicy`.

    Shapes:
        ``latent["grouping"]``: ``[B, max_groups]`` group of every observed group.
    """

    name = "hierarchical"

    def __init__(self, *, num_groups: int = 16, hidden: int = 64, **sizes) -> None:
        super().__init__(**sizes)
        k = max(1, min(int(num_groups), self.max_groups))
        self.num_groups = k
        self.config.update(num_groups=k, hidden=hidden)
        f = self.num_features
        self.grouper = nn.Sequential(nn.Linear(3 * f, hidden), nn.ReLU(),
                                     nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, k))
        # start from contiguous topological segments (as coarsen does): a prior the
        # grouper's logits are added to, with a learnable strength
        self.prior_strength = nn.Parameter(torch.tensor(3.0))
        self.group_embed = nn.Sequential(nn.Linear(f + 1 + 2 * k, hidden), nn.Tanh())
        self.core = Seq2SeqCore(hidden, hidden, self.num_devices)
        self.hybrid = HybridHead(hidden, self.hybrid_sizes)
        if self.lever_blocks > 1:  # per observed group: its features and its group's state
            self.lever_in = nn.Sequential(nn.Linear(3 * f, hidden), nn.Tanh())
            self.levers = LeverHead(hidden, self.num_devices, self.priority_levels,
                                    self.recompute_choices)

    def _prior(self, mask):
        """``[B, G, K]``: minus the distance, in group widths, from each op's position in
        topological order to each group's centre."""
        k = self.num_groups
        n = mask.sum(1, keepdim=True).clamp(min=1).to(torch.float32)
        pos = (torch.arange(mask.shape[1], dtype=torch.float32) + 0.5) / n  # [B, G]
        centre = (torch.arange(k, dtype=torch.float32) + 0.5) / k
        return -k * (pos.unsqueeze(2) - centre).abs()

    def imitation_latent(self, obs, action):
        """A grouping that can carry ``action``: each group's members share one device.

        A group is the prior's contiguous segment where that keeps one device per group;
        otherwise the nearest group whose members are on the action's device (or empty).
        """
        mask = obs["node_mask"]
        devices, _ = self._split_action(action)
        k = self.num_groups
        grouping = torch.zeros_like(devices)
        for b in range(devices.shape[0]):
            n = max(int(mask[b].sum()), 1)
            owner: dict[int, int] = {}
            for i in range(devices.shape[1]):
                if not bool(mask[b, i]):
                    continue
                device = int(devices[b, i])
                segment = min(int((i + 0.5) / n * k), k - 1)
                free = [j for j in range(k) if owner.get(j, device) == device]
                j = min(free, key=lambda j: abs(j - segment)) if free else segment
                owner[j] = device
                grouping[b, i] = j
        return {"grouping": grouping}

    def forward(self, obs, action=None, latent=None, *, generator=None, greedy=False,
                hybrid=None):
        x, mask = obs["node_features"], obs["node_mask"]
        devices, hybrid = self._split_action(action, hybrid)
        given = None if latent is None else latent.get("grouping")
        logits = self.grouper(neighbour_features(obs)) + self.prior_strength * self._prior(mask)
        grouping, lp_g, ent_g = categorical(logits, given,
                                            mask=mask, generator=generator, greedy=greedy)
        # group embeddings from the sampled grouping
        member = F.one_hot(grouping, self.num_groups).to(x.dtype) * mask.unsqueeze(2)
        count = member.sum(1)  # [B, K]
        nonempty = count > 0
        mean_x = member.transpose(1, 2) @ x / count.clamp(min=1.0).unsqueeze(2)
        between = member.transpose(1, 2) @ dense_adjacency(obs) @ member  # [B, K dst, K src]
        between = between * (1 - torch.eye(self.num_groups, dtype=x.dtype))
        feats = torch.cat([mean_x, torch.log1p(count).unsqueeze(2), torch.log1p(between),
                           torch.log1p(between.transpose(1, 2))], dim=2)
        states, summary = self.core.encode(self.group_embed(feats), nonempty)
        hyb, lp_h, ent_h, condition = self.hybrid(summary, hybrid, generator=generator,
                                                  greedy=greedy)
        group_devices = None
        if devices is not None:  # every member of a group carries the group's device
            group_devices = torch.zeros(x.shape[0], self.num_groups, dtype=torch.long)
            group_devices.scatter_reduce_(1, grouping, devices.masked_fill(~mask, 0), "amax",
                                          include_self=True)
        group_devices, lp_p, ent_p = self.core.decode(states, nonempty, condition, group_devices,
                                                      generator=generator, greedy=greedy)
        op_devices = group_devices.gather(1, grouping).masked_fill(~mask, 0)
        lp, ent = lp_g.sum(1) + lp_p + lp_h, ent_g.sum(1) + ent_p + ent_h
        priority, recompute = self._lever_actions(action)
        if self.lever_blocks > 1:
            own = states.gather(1, grouping.unsqueeze(2).expand(-1, -1, states.shape[2]))
            priority, recompute, lp_l, ent_l = self.levers(
                own + self.lever_in(neighbour_features(obs)), condition, op_devices, mask,
                priority, recompute, generator=generator, greedy=greedy)
            lp, ent = lp + lp_l, ent + ent_l
        return PolicyOutput(join_action(op_devices, priority, recompute, hyb), lp, ent,
                            {"grouping": grouping}, hybrid_log_prob=lp_h, hybrid_entropy=ent_h)
