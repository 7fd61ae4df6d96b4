"""Graph neural network placer (Placeto, Addanki et al. 2019,
https://arxiv.org/abs/1906.08879; GDP, Zhou et al. 2019, https://arxiv.org/abs/1910.01578).

A torch-geometric encoder (GraphSAGE or GAT) embeds every group from its features, its
current device and whether it is the focused one. Messages flow both ways along every
edge, through separate convolutions for producers -> consumers and consumers ->
producers, so an op hears from its inputs and from the ops that read it. The encoder
never sees the padded size, so a trained policy places graphs it has never seen
(zero-shot) as long as the feature width and device count match.

Modes: ``oneshot`` (a device per group, GDP-style, plus the hybrid split) and
``incremental`` (Placeto: the device of the focused group, one group per env step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATConv, SAGEConv

from autoplace.errors import AutoplaceError

from .base import PlacementPolicy, PolicyOutput
from .heads import HybridHead, LeverHead, categorical, join_action

__all__ = ["GNNPolicy", "CONVS", "batched_edges"]

CONVS = ("sage", "gat")


def batched_edges(obs: dict[str, Tensor]) -> Tensor:
    """The valid edges of a batch of padded graphs as one graph of ``B * G`` nodes
    (sample ``b``'s group ``i`` is node ``b * G + i``): ``[2, E]`` source -> target."""
    b, g = obs["node_features"].shape[:2]
    offset = (torch.arange(b) * g).view(b, 1, 1)
    ei = (obs["edge_index"] + offset).transpose(0, 1).reshape(2, -1)
    return ei[:, obs["edge_mask"].reshape(-1)]


class GNNPolicy(PlacementPolicy):
    """Placeto / GDP placer over a torch-geometric encoder.

    Args:
        conv: ``"sage"`` (GraphSAGE, mean aggregation) or ``"gat"`` (graph attention).
        hidden: embedding width.
        layers: message-passing rounds.
        heads: attention heads (GAT only; averaged).
        **sizes: see :class:`~autoplace.policies.base.PlacementPolicy`.

    Shapes:
        node_features ``[B, G, F]`` (any ``G``) -> action ``[B, G + 3]`` in oneshot mode
        (``[B, 3G + 3]`` with both lever heads, see :class:`~.heads.LeverHead`), ``[B, 1]``
        in incremental mode.
    """

    name = "gnn"
    modes = ("oneshot", "incremental")

    def __init__(self, *, conv: str = "sage", hidden: int = 64, layers: int = 3,
                 heads: int = 4, **sizes) -> None:
        super().__init__(**sizes)
        if conv not in CONVS:
            raise AutoplaceError(f"unknown conv {conv!r}; valid: {', '.join(CONVS)}")
        self.config.update(conv=conv, hidden=hidden, layers=layers, heads=heads)
        d = self.num_devices

        def make() -> nn.Module:
            if conv == "sage":
                return SAGEConv(hidden, hidden)
            return GATConv(hidden, hidden, heads=heads, concat=False)

        self.inp = nn.Sequential(nn.Linear(self.num_features + d + 1, hidden), nn.LayerNorm(hidden))
        self.forward_convs = nn.ModuleList(make() for _ in range(layers))
        self.backward_convs = nn.ModuleList(make() for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.pool = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.Tanh())
        self.hybrid = HybridHead(hidden, self.hybrid_sizes)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, d))
        if self.lever_blocks > 1:  # only then: a policy without levers keeps its weights' keys
            self.levers = LeverHead(hidden, d, self.priority_levels, self.recompute_choices)

    def encode(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Node embeddings ``[B, G, H]`` and a graph summary ``[B, H]``."""
        x, mask = obs["node_features"], obs["node_mask"]
        b, g = x.shape[:2]
        placed = F.one_hot(obs["placement"].clamp(0, self.num_devices - 1), self.num_devices)
        focus = obs.get("focus", torch.zeros(b, g, dtype=torch.long)).unsqueeze(2)
        h = self.inp(torch.cat([x, placed.to(x.dtype), focus.to(x.dtype)], 2)).view(b * g, -1)
        edges = batched_edges(obs)
        reverse = edges.flip(0)
        for fwd, bwd, norm in zip(self.forward_convs, self.backward_convs, self.norms):
            h = h + F.relu(norm(fwd(h, edges) + bwd(h, reverse)))
        h = h.view(b, g, -1) * mask.unsqueeze(2)
        m = mask.unsqueeze(2).to(h.dtype)
        mean = h.sum(1) / m.sum(1).clamp(min=1.0)
        peak = h.masked_fill(~mask.unsqueeze(2), float("-inf")).amax(1).clamp(min=-1e4)
        return h, self.pool(torch.cat([mean, peak], 1))

    def forward(self, obs, action=None, latent=None, *, generator=None, greedy=False,
                hybrid=None):
        h, summary = self.encode(obs)
        mask = obs["node_mask"]
        if self.mode == "incremental":
            focus = obs["focus"].argmax(1)
            h_focus = h[torch.arange(h.shape[0]), focus]
            given = None if action is None else action[:, 0]
            a, lp, ent = categorical(self.head(torch.cat([h_focus, summary], 1)), given,
                                     generator=generator, greedy=greedy)
            return PolicyOutput(a.unsqueeze(1), lp, ent)
        devices, hybrid = self._split_action(action, hybrid)
        priority, recompute = self._lever_actions(action)
        hyb, lp_h, ent_h, condition = self.hybrid(summary, hybrid, generator=generator,
                                                  greedy=greedy)
        cond = condition.unsqueeze(1).expand(-1, h.shape[1], -1)
        dev, lp, ent = categorical(self.head(torch.cat([h, cond], 2)), devices, mask=mask,
                                   generator=generator, greedy=greedy)
        lp, ent = lp.sum(1) + lp_h, ent.sum(1) + ent_h
        if self.lever_blocks > 1:
            priority, recompute, lp_l, ent_l = self.levers(
                h, condition, dev, mask, priority, recompute, generator=generator, greedy=greedy)
            lp, ent = lp + lp_l, ent + ent_l
        return PolicyOutput(join_action(dev, priority, recompute, hyb), lp, ent,
                            hybrid_log_prob=lp_h, hybrid_entropy=ent_h)
