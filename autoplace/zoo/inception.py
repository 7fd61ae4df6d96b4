"""Inception-v3-style CNN (no auxiliary head), with a width multiplier.

Szegedy et al., "Rethinking the Inception Architecture for Computer Vision", 2015
(https://arxiv.org/abs/1512.00567). The module layout follows torchvision's
``inception_v3``: at ``width=1`` and 1000 classes the parameter count equals
torchvision's without the auxiliary classifier (23,834,568). Branches of each
Inception module are independent until their concatenation, which is what makes
this a classic model-parallel placement workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload, register
from autoplace.zoo._common import (
    image_workload,
    split_options,
    zoo_defaults,
)

__all__ = [
    "InceptionConfig",
    "InceptionV3",
    "inception_full",
    "inception_small",
    "inception_workload",
]


@dataclass(kw_only=True)
class InceptionConfig:
    """Size of an Inception-v3-style network."""

    image_size: int = 75
    """Input height and width (at least 75; the paper uses 299)."""
    width: float = 0.25
    """Multiplier on every layer's channel count (1.0 = the paper)."""
    num_classes: int = 10
    """Number of output classes."""

    def __post_init__(self) -> None:
        if self.image_size < 75:
            raise AutoplaceError(f"InceptionConfig: image_size={self.image_size}; need >= 75")
        if self.width <= 0:
            raise AutoplaceError(f"InceptionConfig: width={self.width}; need > 0")


def inception_small() -> InceptionConfig:
    """75x75 images, width 0.25, 10 classes: fast on a CPU."""
    return InceptionConfig()


def inception_full() -> InceptionConfig:
    """299x299 images, full width, 1000 classes (~23.8M parameters)."""
    return InceptionConfig(image_size=299, width=1.0, num_classes=1000)


class ConvBN(nn.Module):
    """Conv2d (no bias), BatchNorm (eps 1e-3), ReLU."""

    def __init__(self, cin: int, cout: int, kernel: Any, **kwargs: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """35x35 module: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin: int, pool: int, c) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(64), 1)
        self.b5_1 = ConvBN(cin, c(48), 1)
        self.b5_2 = ConvBN(c(48), c(64), 5, padding=2)
        self.b3_1 = ConvBN(cin, c(64), 1)
        self.b3_2 = ConvBN(c(64), c(96), 3, padding=1)
        self.b3_3 = ConvBN(c(96), c(96), 3, padding=1)
        self.bp = ConvBN(cin, c(pool), 1)
        self.out_channels = c(64) + c(64) + c(96) + c(pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b5 = self.b5_2(self.b5_1(x))
        b3 = self.b3_3(self.b3_2(self.b3_1(x)))
        bp = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), b5, b3, bp], dim=1)


class InceptionB(nn.Module):
    """Grid reduction 35 -> 17: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c) -> None:
        super().__init__()
        self.b3 = ConvBN(cin, c(384), 3, stride=2)
        self.b3d_1 = ConvBN(cin, c(64), 1)
        self.b3d_2 = ConvBN(c(64), c(96), 3, padding=1)
        self.b3d_3 = ConvBN(c(96), c(96), 3, stride=2)
        self.out_channels = c(384) + c(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3d = self.b3d_3(self.b3d_2(self.b3d_1(x)))
        return torch.cat([self.b3(x), b3d, F.max_pool2d(x, 3, stride=2)], dim=1)


class InceptionC(nn.Module):
    """17x17 module with factorised 7x7: 1x1 | 1x7-7x1 | (7x1-1x7) x2 | avgpool-1x1."""

    def __init__(self, cin: int, c7: int, c) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(192), 1)
        self.b7_1 = ConvBN(cin, c(c7), 1)
        self.b7_2 = ConvBN(c(c7), c(c7), (1, 7), padding=(0, 3))
        self.b7_3 = ConvBN(c(c7), c(192), (7, 1), padding=(3, 0))
        self.b7d_1 = ConvBN(cin, c(c7), 1)
        self.b7d_2 = ConvBN(c(c7), c(c7), (7, 1), padding=(3, 0))
        self.b7d_3 = ConvBN(c(c7), c(c7), (1, 7), padding=(0, 3))
        self.b7d_4 = ConvBN(c(c7), c(c7), (7, 1), padding=(3, 0))
        self.b7d_5 = ConvBN(c(c7), c(192), (1, 7), padding=(0, 3))
        self.bp = ConvBN(cin, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b7 = self.b7_3(self.b7_2(self.b7_1(x)))
        b7d = self.b7d_5(self.b7d_4(self.b7d_3(self.b7d_2(self.b7d_1(x)))))
        bp = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), b7, b7d, bp], dim=1)


class InceptionD(nn.Module):
    """Grid reduction 17 -> 8: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c) -> None:
        super().__init__()
        self.b3_1 = ConvBN(cin, c(192), 1)
        self.b3_2 = ConvBN(c(192), c(320), 3, stride=2)
        self.b7_1 = ConvBN(cin, c(192), 1)
        self.b7_2 = ConvBN(c(192), c(192), (1, 7), padding=(0, 3))
        self.b7_3 = ConvBN(c(192), c(192), (7, 1), padding=(3, 0))
        self.b7_4 = ConvBN(c(192), c(192), 3, stride=2)
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3_2(self.b3_1(x))
        b7 = self.b7_4(self.b7_3(self.b7_2(self.b7_1(x))))
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], dim=1)


class InceptionE(nn.Module):
    """8x8 module with split 1x3/3x1 outputs: 1x1 | 1x1-(1x3,3x1) | 1x1-3x3-(1x3,3x1) | pool."""

    def __init__(self, cin: int, c) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(320), 1)
        self.b3_1 = ConvBN(cin, c(384), 1)
        self.b3_2a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3_2b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.b3d_1 = ConvBN(cin, c(448), 1)
        self.b3d_2 = ConvBN(c(448), c(384), 3, padding=1)
        self.b3d_3a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.b3d_3b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.bp = ConvBN(cin, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3_1(x)
        b3d = self.b3d_2(self.b3d_1(x))
        bp = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat(
            [self.b1(x), self.b3_2a(b3), self.b3_2b(b3), self.b3d_3a(b3d), self.b3d_3b(b3d), bp],
            dim=1,
        )


class InceptionV3(nn.Module):
    """Stem, 3x InceptionA, B, 4x InceptionC, D, 2x InceptionE, pool, linear.

    Shapes:
        images ``[B, 3, image_size, image_size]`` -> logits ``[B, num_classes]``.
    """

    def __init__(self, config: InceptionConfig) -> None:
        super().__init__()

        def c(n: int) -> int:
            return max(1, round(n * config.width))

        self.stem = nn.Sequential(
            ConvBN(3, c(32), 3, stride=2),
            ConvBN(c(32), c(32), 3),
            ConvBN(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(c(64), c(80), 1),
            ConvBN(c(80), c(192), 3),
            nn.MaxPool2d(3, stride=2),
        )
        blocks: list[nn.Module] = []
        cin = c(192)
        for pool in (32, 64, 64):
            blocks.append(InceptionA(cin, pool, c))
            cin = blocks[-1].out_channels
        blocks.append(InceptionB(cin, c))
        cin = blocks[-1].out_channels
        for c7 in (128, 160, 160, 192):
            blocks.append(InceptionC(cin, c7, c))
            cin = blocks[-1].out_channels
        blocks.append(InceptionD(cin, c))
        cin = blocks[-1].out_channels
        for _ in range(2):
            blocks.append(InceptionE(cin, c))
            cin = blocks[-1].out_channels
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(images)))
        return self.fc(torch.flatten(x, 1))


def inception_workload(
    config: InceptionConfig,
    *,
    batch_size: int = 4,
    lr: float = 1e-3,
    autocast_dtype: str | None = None,
    name: str = "inception-v3",
) -> Workload:
    """Image classification with an Inception-v3-style network on synthetic images."""
    return image_workload(name, InceptionV3(config), image_size=config.image_size,
                          num_classes=config.num_classes, batch_size=batch_size, lr=lr,
                          autocast_dtype=autocast_dtype)


@register(
    "inception-v3",
    "Inception-v3-style CNN, no aux head (full size: image_size=299, width=1.0, num_classes=1000)",
    **zoo_defaults(inception_small(), batch_size=4),
)
def inception_v3(**options: Any) -> Workload:
    """Inception-v3-style CNN (options: the fields of :class:`InceptionConfig`, batch_size, lr)."""
    config, rest = split_options("inception-v3", inception_small(), options)
    return inception_workload(config, **rest)
