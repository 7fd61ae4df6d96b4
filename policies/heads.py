"""Heads shared by every policy: a masked categorical choice, the hybrid-split head and the
per-group lever head (issue priority, recompute).

:func:`categorical` is the single place where a policy samples: with ``action`` given it
scores that action, otherwise it draws one with the trainer's ``torch.Generator`` (or
takes the argmax when ``greedy``), so sampled and recomputed log-probabilities come from
the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["categorical", "HybridHead", "LeverHead", "join_action"]


def categorical(
    logits: Tensor,
    action: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample (or score) one choice per row of ``logits [..., K]``.

    Args:
        logits: unnormalised scores.
        action: ``[...]`` choices to score instead of sampling.
        mask: ``[...]`` bool; where false the choice is forced to 0 and contributes no
            log-probability or entropy (padded groups).
        generator: the trainer's generator (reproducible sampling).
        greedy: take the most likely choice instead of sampling.

    Returns:
        ``(action [...], log_prob [...], entropy [...])``.
    """
    logp_all = F.log_softmax(logits, dim=-1)
    if action is None:
        if greedy:
            action = logp_all.argmax(-1)
        else:
            flat = logp_all.detach().exp().reshape(-1, logits.shape[-1])
            action = torch.multinomial(flat, 1, generator=generator).view(logits.shape[:-1])
    if mask is not None:
        action = action.masked_fill(~mask, 0)
    log_prob = logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if mask is not None:
        log_prob = log_prob * mask
        entropy = entropy * mask
    return action, log_prob, entropy


class HybridHead(nn.Module):
    """Chooses the hybrid split (data-parallel degree, pipeline stages, microbatches).

    The three choices are made in that order, each conditioned on the graph summary
    and the choices before it; the head returns an embedding of the whole choice so
    the placement decoder can condition on it (a pipeline split wants a chain placement,
    data parallelism fewer devices per replica).

    Args:
        hidden: width of the graph summary and of the returned embedding.
        sizes: option count of each choice (the env's last three action entries);
            empty for none, in which case the head returns the summary unchanged.

    Shapes:
        summary ``[B, hidden]``, action ``[B, len(sizes)]`` -> action, log_prob ``[B]``,
        entropy ``[B]``, embedding ``[B, hidden]``. An action entry of ``-1`` is sampled
        (a split forced in some rows only; see ``ReinforceConfig.split_explore``).
    """

    def __init__(self, hidden: int, sizes: tuple[int, ...] | list[int]) -> None:
        super().__init__()
        self.sizes = tuple(int(s) for s in sizes)
        self.trunk = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.logits = nn.ModuleList(nn.Linear(hidden, s) for s in self.sizes)
        self.embed = nn.ModuleList(nn.Embedding(s, hidden) for s in self.sizes)

    def forward(
        self,
        summary: Tensor,
        action: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b = summary.shape[0]
        h = self.trunk(summary)
        chosen, log_prob, entropy = [], summary.new_zeros(b), summary.new_zeros(b)
        for i, (head, emb) in enumerate(zip(self.logits, self.embed)):
            given = None if action is None else action[:, i]
            logits = head(h)
            if given is not None and bool((given < 0).any()):  # -1: sample this row's choice
                drawn, _, _ = categorical(logits, generator=generator, greedy=greedy)
                given = torch.where(given < 0, drawn, given)
            a, lp, ent = categorical(logits, given, generator=generator, greedy=greedy)
            chosen.append(a)
            log_prob = log_prob + lp
            entropy = entropy + ent
            h = torch.tanh(h + emb(a))
        act = torch.stack(chosen, 1) if chosen else summary.new_zeros(b, 0, dtype=torch.long)
        return act, log_prob, entropy, h

    def extra_repr(self) -> str:
        return f"sizes={list(self.sizes)}"


class LeverHead(nn.Module):
    """Chooses, per group, its recompute mode and its issue priority.

    Each group's choice reads its embedding, the embedding of the device it was given and
    the plan-wide choice (the hybrid head's embedding): recompute pays where a device is
    short of memory, a priority where a device holds groups of several branches. The
    recompute choice is made first and conditions the priority. Its log-probability and
    entropy add to the placement's, so one REINFORCE trains them together.

    Args:
        hidden: width of the group embeddings and the condition.
        num_devices: device choices (embedded).
        priority_levels: priority choices (0: none).
        recompute_choices: recompute choices (0: none).

    Shapes:
        h ``[B, G, hidden]``, condition ``[B, hidden]``, devices ``[B, G]``, mask ``[B, G]``,
        optional priority / recompute ``[B, G]`` -> priority ``[B, G]`` or None, recompute
        ``[B, G]`` or None, log_prob ``[B]``, entropy ``[B]``.
    """

    def __init__(self, hidden: int, num_devices: int, priority_levels: int = 0,
                 recompute_choices: int = 0) -> None:
        super().__init__()
        self.sizes = (int(priority_levels), int(recompute_choices))
        self.device_embed = nn.Embedding(num_devices, hidden)
        self.trunk = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh())
        self.recompute = nn.Linear(hidden, recompute_choices) if recompute_choices else None
        self.recompute_embed = nn.Embedding(recompute_choices, hidden) \
            if recompute_choices else None
        self.priority = nn.Linear(hidden, priority_levels) if priority_levels else None

    def forward(
        self,
        h: Tensor,
        condition: Tensor,
        devices: Tensor,
        mask: Tensor,
        priority: Tensor | None = None,
        recompute: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor]:
        cond = condition.unsqueeze(1).expand(-1, h.shape[1], -1)
        z = self.trunk(torch.cat([h + self.device_embed(devices), cond], 2))
        log_prob = h.new_zeros(h.shape[0])
        entropy = h.new_zeros(h.shape[0])
        if self.recompute is not None:
            recompute, lp, ent = categorical(self.recompute(z), recompute, mask=mask,
                                             generator=generator, greedy=greedy)
            log_prob, entropy = log_prob + lp.sum(1), entropy + ent.sum(1)
            z = torch.tanh(z + self.recompute_embed(recompute))
        if self.priority is not None:
            priority, lp, ent = categorical(self.priority(z), priority, mask=mask,
                                            generator=generator, greedy=greedy)
            log_prob, entropy = log_prob + lp.sum(1), entropy + ent.sum(1)
        return priority, recompute, log_prob, entropy

    def extra_repr(self) -> str:
        return f"priority_levels={self.sizes[0]}, recompute_choices={self.sizes[1]}"


def join_action(devices: Tensor, priority: Tensor | None, recompute: Tensor | None,
                hybrid: Tensor) -> Tensor:
    """An oneshot action in the env's layout: devices, priorities, recompute choices (those
    present), then the plan-wide choices."""
    return torch.cat([t for t in (devices, priority, recompute, hybrid) if t is not None], 1)
