"""Seq2seq placer (Mirhoseini et al., "Device Placement Optimization with Reinforcement
Learning", ICML 2017, https://arxiv.org/abs/1706.04972).

Groups are read in topological order (the env numbers them so) by a bidirectional
LSTM; an LSTM decoder with attention over the encoder states emits a device per group,
the previous group's device fed back as input. Each group's embedding combines its op
kind mix, sizes and times (the obs features) with the mean features of its producers
and consumers (adjacency). The hybrid split is chosen first, from the encoder summary,
and conditions the decoder's initial state.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import PlacementPolicy, PolicyOutput, masked_mean, neighbour_features
from .heads import HybridHead, LeverHead, categorical, join_action

__all__ = ["Seq2SeqCore", "Seq2SeqPolicy"]


class Seq2SeqCore(nn.Module):
    """Bidirectional LSTM encoder and attention LSTM decoder: one device per position.

    Args:
        in_dim: width of the input embeddings.
        hidden: LSTM width.
        num_devices: choices per position.

    Shapes:
        ``encode``: x ``[B, L, in_dim]``, mask ``[B, L]`` -> states ``[B, L, hidden]``,
        summary ``[B, hidden]``. ``decode``: states, mask, condition ``[B, hidden]``,
        optional devices ``[B, L]`` -> devices ``[B, L]``, log_prob ``[B]``, entropy ``[B]``.
    """

    def __init__(self, in_dim: int, hidden: int, num_devices: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.num_devices = num_devices
        self.encoder = nn.LSTM(in_dim, hidden, batch_first=True, bidirectional=True)
        self.enc_proj = nn.Linear(2 * hidden, hidden)
        self.device_embed = nn.Embedding(num_devices + 1, hidden)  # last row: start token
        self.decoder = nn.LSTM(2 * hidden, hidden, batch_first=True)
        self.init_state = nn.Linear(hidden, 2 * hidden)
        self.attn = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, num_devices))

    def encode(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        x = x * mask.unsqueeze(2)
        states, _ = self.encoder(x)
        states = torch.tanh(self.enc_proj(states))
        return states, masked_mean(states, mask)

    def _logits(self, dec: Tensor, states: Tensor, mask: Tensor) -> Tensor:
        """Device logits from decoder outputs ``[B, T, H]`` attending over ``states``."""
        scores = self.attn(dec) @ states.transpose(1, 2)  # [B, T, L]
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        context = torch.softmax(scores, dim=2) @ states
        return self.out(torch.cat([dec, context], dim=2))

    def decode(
        self,
        states: Tensor,
        mask: Tensor,
        condition: Tensor,
        devices: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, length, _ = states.shape
        h0, c0 = torch.tanh(self.init_state(condition)).unsqueeze(0).chunk(2, dim=2)
        start = torch.full((b, 1), self.num_devices, dtype=torch.long)
        if devices is not None:  # teacher forcing: the whole sequence in one LSTM call
            devices = devices.masked_fill(~mask, 0)
            prev = torch.cat([start, devices[:, :-1]], dim=1)
            dec, _ = self.decoder(torch.cat([states, self.device_embed(prev)], 2), (h0, c0))
            _, lp, ent = categorical(self._logits(dec, states, mask), devices, mask=mask)
            return devices, lp.sum(1), ent.sum(1)
        chosen, log_prob, entropy = [], states.new_zeros(b), states.new_zeros(b)
        prev, state = start[:, 0], (h0.contiguous(), c0.contiguous())
        for t in range(length):
            inp = torch.cat([states[:, t], self.device_embed(prev)], 1).unsqueeze(1)
            dec, state = self.decoder(inp, state)
            a, lp, ent = categorical(self._logits(dec, states, mask)[:, 0], mask=mask[:, t],
                                     generator=generator, greedy=greedy)
            chosen.append(a)
            log_prob, entropy, prev = log_prob + lp, entropy + ent, a
        return torch.stack(chosen, 1), log_prob, entropy


class Seq2SeqPolicy(PlacementPolicy):
    """Mirhoseini et al. 2017: LSTM encoder over groups, attention decoder over devices.

    Args:
        hidden: LSTM and embedding width.
        **sizes: see :class:`~autoplace.policies.base.PlacementPolicy`.
    """

    name = "seq2seq"

    def __init__(self, *, hidden: int = 64, **sizes) -> None:
        super().__init__(**sizes)
        self.config["hidden"] = hidden
        self.embed = nn.Sequential(nn.Linear(3 * self.num_features, hidden), nn.Tanh())
        self.core = Seq2SeqCore(hidden, hidden, self.num_devices)
        self.hybrid = HybridHead(hidden, self.hybrid_sizes)
        if self.lever_blocks > 1:  # only then: a policy without levers keeps its weights' keys
            self.levers = LeverHead(hidden, self.num_devices, self.priority_levels,
                                    self.recompute_choices)

    def forward(self, obs, action=None, latent=None, *, generator=None, greedy=False,
                hybrid=None):
        mask = obs["node_mask"]
        devices, hybrid = self._split_action(action, hybrid)
        states, summary = self.core.encode(self.embed(neighbour_features(obs)), mask)
        hyb, lp_h, ent_h, condition = self.hybrid(summary, hybrid, generator=generator,
                                                  greedy=greedy)
        dev, lp_d, ent_d = self.core.decode(states, mask, condition, devices,
                                            generator=generator, greedy=greedy)
        priority, recompute = self._lever_actions(action)
        lp, ent = lp_d + lp_h, ent_d + ent_h
        if self.lever_blocks > 1:  # per group, from its encoder state and its device
            priority, recompute, lp_l, ent_l = self.levers(
                states, condition, dev, mask, priority, recompute, generator=generator,
                greedy=greedy)
            lp, ent = lp + lp_l, ent + ent_l
        return PolicyOutput(join_action(dev, priority, recompute, hyb), lp, ent,
                            hybrid_log_prob=lp_h, hybrid_entropy=ent_h)
