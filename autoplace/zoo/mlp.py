"""A wide branchy MLP: many independent branches, so model-parallel placement pays.

Input projection, ``branches`` parallel stacks of ``depth`` Linear+GELU layers each,
their outputs concatenated (or summed), a linear head. Branches share nothing
until they are combined, so a planner can run them on different devices at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload, register
from autoplace.zoo._common import class_cross_entropy, fixed_generator, split_options, zoo_defaults

__all__ = [
    "BranchyMLP",
    "BranchyMLPConfig",
    "branchy_mlp_small",
    "branchy_mlp_workload",
    "linear_teacher_batch",
]


@dataclass(kw_only=True)
class BranchyMLPConfig:
    """Size of a branchy MLP."""

    in_dim: int = 64
    """Input features."""
    hidden: int = 128
    """Width of every hidden layer."""
    branches: int = 4
    """Number of parallel branches."""
    depth: int = 3
    """Linear+GELU layers per branch."""
    num_classes: int = 10
    """Output classes."""
    combine: str = "concat"
    """How branch outputs meet: ``"concat"`` or ``"sum"``."""

    def __post_init__(self) -> None:
        if self.combine not in ("concat", "sum"):
            raise AutoplaceError(
                f"BranchyMLPConfig: combine={self.combine!r}; valid: 'concat', 'sum'"
            )
        if self.branches < 1 or self.depth < 1:
            raise AutoplaceError(
                f"BranchyMLPConfig: branches={self.branches}, depth={self.depth}; need >= 1"
            )


def branchy_mlp_small() -> BranchyMLPConfig:
    """64 inputs, 4 branches of 3 layers of width 128, 10 classes."""
    return BranchyMLPConfig()


class Branch(nn.Module):
    """``depth`` x (Linear, GELU) at constant width."""

    def __init__(self, hidden: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.acts = nn.ModuleList(nn.GELU() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers, self.acts):
            x = act(layer(x))
        return x


class BranchyMLP(nn.Module):
    """Input projection, parallel branches, concat or sum, head.

    Shapes:
        ``[B, in_dim]`` float -> logits ``[B, num_classes]``.
    """

    def __init__(self, config: BranchyMLPConfig) -> None:
        super().__init__()
        h = config.hidden
        self.combine = config.combine
        self.proj = nn.Linear(config.in_dim, h)
        self.act = nn.GELU()
        self.branches = nn.ModuleList(Branch(h, config.depth) for _ in range(config.branches))
        head_in = h * config.branches if config.combine == "concat" else h
        self.head = nn.Linear(head_in, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.proj(x))
        outs = [branch(x) for branch in self.branches]
        y = torch.cat(outs, dim=-1) if self.combine == "concat" else torch.stack(outs).sum(0)
        return self.head(y)


def linear_teacher_batch(batch_size: int, device: Any, *, teacher: torch.Tensor):
    """``((x[B, in_dim],), labels[B])`` with ``labels = argmax(x @ teacher)``."""
    x = torch.randn(batch_size, teacher.shape[0], device="cpu")
    labels = (x @ teacher).argmax(dim=-1)
    return (x.to(device),), labels.to(device)


def branchy_mlp_workload(
    config: BranchyMLPConfig,
    *,
    batch_size: int = 16,
    lr: float = 1e-3,
    autocast_dtype: str | None = None,
    name: str = "branchy-mlp",
) -> Workload:
    """Classification of a fixed random linear teacher's labels with a branchy MLP."""
    teacher = torch.randn(
        config.in_dim, config.num_classes, generator=fixed_generator(4321), device="cpu"
    )
    return Workload(
        name=name,
        model=BranchyMLP(config),
        make_batch=partial(linear_teacher_batch, teacher=teacher),
        loss_fn=class_cross_entropy,
        batch_size=batch_size,
        autocast_dtype=autocast_dtype,
        lr=lr,
    )


@register(
    "branchy-mlp",
    "wide MLP with many independent parallel branches",
    **zoo_defaults(branchy_mlp_small(), batch_size=16),
)
def branchy_mlp(**options: Any) -> Workload:
    """Branchy MLP (options: the fields of :class:`BranchyMLPConfig`, batch_size, lr)."""
    config, rest = split_options("branchy-mlp", branchy_mlp_small(), options)
    return branchy_mlp_workload(config, **rest)
