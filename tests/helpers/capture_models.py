"""Tiny models for capture / cost / profile tests: one per tracing situation."""

from __future__ import annotations

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """Linear -> relu -> Linear with a skip connection, twice; fx traces it."""

    def __init__(self, dim: int = 16, hidden: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs):
            x = x + down(torch.relu(up(x)))
        return self.head(x)


class LSTMTagger(nn.Module):
    """Embedding -> 2-layer LSTM -> Linear."""

    def __init__(self, vocab: int = 100, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(tokens))
        return self.out(h)


class ConvNet(nn.Module):
    """Conv2d -> BatchNorm -> relu -> pool -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


class CausalAttention(nn.Module):
    """Shape-dependent Python (a mask built from ``x.shape``): fx fails, export works."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t).tril()
        if x.shape[-1] > 3:
            x = x * 2.0
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.matmul(q, k.transpose(1, 2)) / q.shape[-1] ** 0.5
        att = att.masked_fill(mask == 0, float("-inf")).softmax(-1)
        return self.proj(torch.matmul(att, v))


class DataDependent(nn.Module):
    """Control flow on tensor values: neither fx nor export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


class TiedLM(nn.Module):
    """Embedding whose weight the output layer shares."""

    def __init__(self, vocab: int = 50, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))
