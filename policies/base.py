"""What every placement policy shares: reading the env's spaces, batching observations,
and the one call that both samples plans and scores given ones.

A policy is an ``nn.Module`` whose ``forward(obs, action=None, latent=None, *,
generator=None, greedy=False)`` returns a :class:`PolicyOutput`. With ``action=None``
it samples (or, with ``greedy``, takes the most likely choice at every step); with an
action it recomputes that action's log-probability under the current parameters
(teacher forcing for autoregressive decoders). ``latent`` carries sampled choices the
env never sees (the hierarchical policy's grouping) so that log-probabilities can be
recomputed exactly.

Action layout (the env's, see docs/CONTRACTS.md): in ``oneshot`` mode ``[B, G + 3]``
(a device per padded group, then the data / pipeline / microbatch option indices);
in ``incremental`` mode ``[B, 1]`` (the device of the focused group). A policy built
with lever sizes (``priority_levels``, ``recompute_choices``: the env's ``levers``,
:mod:`autoplace.envs.levers`) also emits a priority and a recompute choice per group
after the devices, ``[B, 3G + 3]``; the plan-wide choices at the end (``hybrid_sizes``)
then include the env's compile entry when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor, nn

from autoplace.errors import AutoplaceError

__all__ = [
    "PolicyOutput", "PlacementPolicy", "describe_spaces", "batch_obs", "dense_adjacency",
    "neighbour_features", "masked_mean", "MODES",
]

MODES = ("oneshot", "incremental")


@dataclass
class PolicyOutput:
    """One batch of plans and their scores.

    Attributes:
        action: ``[B, A]`` int64 actions in the env's layout.
        log_prob: ``[B]`` log-probability of each action (sum over its parts).
        entropy: ``[B]`` sum of the entropies of the distributions sampled from.
        latent: extra sampled choices needed to recompute ``log_prob`` (may be empty).
        hybrid_log_prob: ``[B]`` the hybrid split's part of ``log_prob`` (None: no split).
        hybrid_entropy: ``[B]`` the hybrid split's part of ``entropy`` (None: no split).
    """

    action: Tensor
    log_prob: Tensor
    entropy: Tensor
    latent: dict[str, Tensor] = field(default_factory=dict)
    hybrid_log_prob: Tensor | None = None
    hybrid_entropy: Tensor | None = None


def describe_spaces(observation_space: Any, action_space: Any, *, priority_levels: int = 0,
                    recompute_choices: int = 0) -> dict[str, Any]:
    """Policy sizes from the env's (single, unbatched) spaces.

    Args:
        observation_space: the env's observation space.
        action_space: the env's action space.
        priority_levels: choices of the env's per-group priority entries (0: none).
        recompute_choices: choices of its per-group recompute entries (0: none). Both come
            from ``env.unwrapped.action_layout.policy_sizes()``.

    Returns:
        ``num_features``, ``num_devices``, ``max_groups``, ``hybrid_sizes``, ``mode``, and
        the lever sizes that are set.
    """
    try:
        max_groups, num_features = observation_space["node_features"].shape
    except (KeyError, TypeError, ValueError):
        raise AutoplaceError(
            "observation space must be a Dict with node_features [max_groups, F]; "
            f"got {observation_space}"
        ) from None
    levers = {k: int(v) for k, v in (("priority_levels", priority_levels),
                                     ("recompute_choices", recompute_choices)) if v}
    if isinstance(action_space, spaces.Discrete):
        if priority_levels or recompute_choices:
            raise AutoplaceError("lever sizes apply to oneshot (MultiDiscrete) actions; an "
                                 "incremental env places one group per step")
        return dict(num_features=int(num_features), num_devices=int(action_space.n),
                    max_groups=int(max_groups), hybrid_sizes=(), mode="incremental")
    if isinstance(action_space, spaces.MultiDiscrete):
        nvec = [int(n) for n in np.asarray(action_space.nvec).reshape(-1)]
        g = int(max_groups)
        blocks = [nvec[0]] + [n for n in (priority_levels, recompute_choices) if n]
        expected = [n for b in blocks for n in [b] * g]
        tail = nvec[len(expected):]
        if nvec[:len(expected)] != expected or len(tail) not in (0, 3, 4):
            raise AutoplaceError(
                f"MultiDiscrete action {nvec} does not match {g} groups with "
                f"priority_levels={priority_levels}, recompute_choices={recompute_choices} "
                "(expected a device per group, a priority and a recompute choice per group "
                "where those sizes are set, then 0, 3 or 4 plan-wide entries); an env with "
                "levers tells the sizes: env.unwrapped.action_layout.policy_sizes()"
            )
        return dict(num_features=int(num_features), num_devices=nvec[0], max_groups=g,
                    hybrid_sizes=tuple(tail), mode="oneshot", **levers)
    raise AutoplaceError(
        f"unsupported action space {action_space}; valid: MultiDiscrete (oneshot) or "
        "Discrete (incremental)"
    )


def batch_obs(obs: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Tensor]:
    """Env observations (one dict, a list of dicts, or an already batched dict) as tensors
    with a leading batch dimension: float features, bool masks, int64 indices."""
    if isinstance(obs, (list, tuple)):
        keys = obs[0].keys()
        stacked = {k: np.stack([np.asarray(o[k]) for o in obs]) for k in keys}
    else:
        stacked = {k: np.asarray(v) if not isinstance(v, Tensor) else v for k, v in obs.items()}
        if stacked["node_features"].ndim == 2:
            stacked = {k: v[None] for k, v in stacked.items()}
    out: dict[str, Tensor] = {}
    for k, v in stacked.items():
        t = torch.as_tensor(v)
        if k == "node_features":
            t = t.float()
        elif k.endswith("_mask"):
            t = t.bool()
        else:
            t = t.long()
        out[k] = t
    return out


class PlacementPolicy(nn.Module):
    """Base class: sizes, the hybrid action layout, and the saved config.

    Args:
        num_features: columns of ``node_features``.
        num_devices: devices a group can be placed on.
        max_groups: padded group count of the observation.
        hybrid_sizes: option counts of the data / pipeline / microbatch choices
            (empty when the env offers none, as in incremental mode), and of the compile
            choice where the env offers it.
        mode: ``oneshot`` (a device per group) or ``incremental`` (the focused group's).
        priority_levels: issue priority levels chosen per group (0: no priority head).
        recompute_choices: recompute choices per group (3: none / full / selective; 0: no
            recompute head). Both oneshot only.
    """

    #: registry name (see :func:`autoplace.policies.get`).
    name = "base"
    #: modes the policy supports.
    modes: tuple[str, ...] = ("oneshot",)

    def __init__(
        self,
        *,
        num_features: int,
        num_devices: int,
        max_groups: int,
        hybrid_sizes: tuple[int, ...] | list[int] = (),
        mode: str = "oneshot",
        priority_levels: int = 0,
        recompute_choices: int = 0,
    ) -> None:
        super().__init__()
        if mode not in self.modes:
            raise AutoplaceError(
                f"policy {self.name!r} does not support mode {mode!r}; valid: "
                f"{', '.join(self.modes)}" + (
                    " (use policy 'gnn' for incremental)" if mode == "incremental" else "")
            )
        if num_devices < 1:
            raise AutoplaceError(f"num_devices must be >= 1, got {num_devices}")
        if (priority_levels or recompute_choices) and mode != "oneshot":
            raise AutoplaceError(f"priority and recompute heads choose per group in oneshot "
                                 f"mode, not {mode!r}")
        for name, v in (("priority_levels", priority_levels),
                        ("recompute_choices", recompute_choices)):
            if not isinstance(v, int) or v < 0 or v == 1:
                raise AutoplaceError(f"{name} must be 0 (no head) or an integer >= 2, got {v!r}")
        self.num_features = int(num_features)
        self.num_devices = int(num_devices)
        self.max_groups = int(max_groups)
        self.hybrid_sizes = tuple(int(s) for s in hybrid_sizes)
        self.mode = mode
        self.priority_levels = int(priority_levels)
        self.recompute_choices = int(recompute_choices)
        self.config: dict[str, Any] = dict(
            num_features=self.num_features, num_devices=self.num_devices,
            max_groups=self.max_groups, hybrid_sizes=list(self.hybrid_sizes), mode=mode,
        )
        # only when set: a policy without levers saves the config it saved before them
        self.config.update({k: v for k, v in (("priority_levels", self.priority_levels),
                                               ("recompute_choices", self.recompute_choices))
                            if v})

    @classmethod
    def from_spaces(cls, observation_space: Any, action_space: Any, **options: Any):
        """Build a policy sized for an env's spaces (``options`` are the policy's own, and
        the lever sizes ``priority_levels`` / ``recompute_choices`` of an env with levers)."""
        levers = {k: options.pop(k) for k in ("priority_levels", "recompute_choices")
                  if k in options}
        return cls(**describe_spaces(observation_space, action_space, **levers), **options)

    @property
    def lever_blocks(self) -> int:
        """Per-group entries of an oneshot action: the device, and the lever choices."""
        return 1 + bool(self.priority_levels) + bool(self.recompute_choices)

    def _split_action(
        self, action: Tensor | None, hybrid: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(devices [B, G], hybrid [B, 3])`` parts of an oneshot action (None when absent);
        without an action, ``hybrid`` (a forced split) is returned as the second part."""
        if action is None:
            return None, hybrid
        g = (action.shape[1] - len(self.hybrid_sizes)) // self.lever_blocks
        return action[:, :g], (action[:, g * self.lever_blocks:] if self.hybrid_sizes else None)

    def _lever_actions(self, action: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """``(priority [B, G], recompute [B, G])`` parts of an oneshot action (None where the
        policy has no such head, or without an action)."""
        if action is None or self.lever_blocks == 1:
            return None, None
        g = (action.shape[1] - len(self.hybrid_sizes)) // self.lever_blocks
        parts = iter(range(1, self.lever_blocks))
        priority = action[:, next(parts) * g:][:, :g] if self.priority_levels else None
        recompute = action[:, next(parts) * g:][:, :g] if self.recompute_choices else None
        return priority, recompute

    def real_entries(self, node_mask: Tensor, width: int) -> Tensor:
        """``[B, width]`` bool: the entries of an oneshot action that mean something (those
        of real groups, and the plan-wide choices)."""
        tail = width - self.lever_blocks * node_mask.shape[1]
        return torch.cat([node_mask.bool()] * self.lever_blocks
                         + [torch.ones(node_mask.shape[0], tail, dtype=torch.bool)], 1)

    def imitation_latent(self, obs: dict[str, Tensor], action: Tensor) -> dict[str, Tensor]:
        """Latent choices under which ``action`` can be scored for imitation (behaviour
        cloning, :mod:`autoplace.policies.warm_start`); empty for policies without any."""
        return {}

    def extra_repr(self) -> str:
        return (f"features={self.num_features}, devices={self.num_devices}, "
                f"max_groups={self.max_groups}, hybrid={list(self.hybrid_sizes)}, "
                f"mode={self.mode}")

    def forward(
        self,
        obs: dict[str, Tensor],
        action: Tensor | None = None,
        latent: dict[str, Tensor] | None = None,
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        hybrid: Tensor | None = None,
    ) -> PolicyOutput:
        """Sample plans (``action=None``) or score ``action``.

        Args:
            obs: batched observation (:func:`batch_obs`).
            action: ``[B, A]`` actions to score; None to sample.
            latent: the latent choices that came with ``action`` (hierarchical grouping).
            generator: sampling generator.
            greedy: take the most likely choice at every step instead of sampling.
            hybrid: ``[B, 3]`` split to force while sampling the placement (oneshot);
                ``-1`` entries are sampled.
        """
        raise NotImplementedError


def dense_adjacency(obs: dict[str, Tensor]) -> Tensor:
    """``A[b, dst, src] = 1`` for every valid group edge ``src -> dst`` (``[B, G, G]``)."""
    x = obs["node_features"]
    b, g = x.shape[0], x.shape[1]
    ei, em = obs["edge_index"], obs["edge_mask"]
    adj = torch.zeros(b, g * g, dtype=x.dtype)
    flat = (ei[:, 1] * g + ei[:, 0]).clamp(0, g * g - 1)
    adj.scatter_add_(1, flat, em.to(x.dtype))
    return adj.view(b, g, g).clamp_(max=1.0)


def neighbour_features(obs: dict[str, Tensor]) -> Tensor:
    """Each group's features next to the mean features of its producers and consumers
    (``[B, G, 3F]``): the adjacency part of a group embedding."""
    x = obs["node_features"]
    adj = dense_adjacency(obs)
    deg_in = adj.sum(2, keepdim=True).clamp(min=1.0)
    deg_out = adj.sum(1).unsqueeze(2).clamp(min=1.0)
    from_producers = adj @ x / deg_in
    from_consumers = adj.transpose(1, 2) @ x / deg_out
    return torch.cat([x, from_producers, from_consumers], dim=2)


def masked_mean(h: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``h [B, L, H]`` over positions where ``mask [B, L]`` is true."""
    m = mask.unsqueeze(2).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1.0)
