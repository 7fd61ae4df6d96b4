"""ResNet-50-style CNN: bottleneck blocks with BatchNorm and a width multiplier.

He et al., "Deep Residual Learning for Image Recognition", 2015
(https://arxiv.org/abs/1512.03385). The layout follows torchvision's ``resnet50``
(stride on the 3x3 convolution): at ``width=1`` and 1000 classes the parameter
count is torchvision's 25,557,032.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload, register
from autoplace.zoo._common import (
    image_workload,
    split_options,
    zoo_defaults,
)

__all__ = [
    "Bottleneck",
    "ResNet",
    "ResNetConfig",
    "resnet50_full",
    "resnet50_small",
    "resnet_workload",
]


@dataclass(kw_only=True)
class ResNetConfig:
    """Size of a bottleneck ResNet."""

    image_size: int = 64
    """Input height and width (the paper uses 224)."""
    width: float = 0.25
    """Multiplier on every channel count (1.0 = the paper: 64 channels after the stem)."""
    blocks: tuple[int, ...] = (3, 4, 6, 3)
    """Bottleneck blocks per stage (ResNet-50: 3, 4, 6, 3)."""
    num_classes: int = 10
    """Number of output classes."""

    def __post_init__(self) -> None:
        self.blocks = tuple(int(b) for b in self.blocks)
        if self.width <= 0 or not self.blocks or min(self.blocks) < 1:
            raise AutoplaceError(
                f"ResNetConfig: width={self.width}, blocks={self.blocks}; need width > 0 "
                "and at least one block per stage"
            )


def resnet50_small() -> ResNetConfig:
    """64x64 images, width 0.25, 10 classes: fast on a CPU."""
    return ResNetConfig()


def resnet50_full() -> ResNetConfig:
    """224x224 images, full width, 1000 classes (25.6M parameters)."""
    return ResNetConfig(image_size=224, width=1.0, num_classes=1000)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand (x4), plus the (projected) input.

    Shapes:
        ``[B, cin, H, W]`` -> ``[B, 4*planes, H/stride, W/stride]``.
    """

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu3 = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu3(out + identity)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), bottleneck stages, pool, linear.

    Shapes:
        images ``[B, 3, image_size, image_size]`` -> logits ``[B, num_classes]``.
    """

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        base = max(1, round(64 * config.width))
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        cin = base
        for i, n in enumerate(config.blocks):
            planes = base * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, planes, stride=2 if (i > 0 and j == 0) else 1))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stages(self.stem(images)))
        return self.fc(torch.flatten(x, 1))


def resnet_workload(
    config: ResNetConfig,
    *,
    batch_size: int = 8,
    lr: float = 1e-3,
    autocast_dtype: str | None = None,
    name: str = "resnet50",
) -> Workload:
    """Image classification with a bottleneck ResNet on synthetic images."""
    return image_workload(name, ResNet(config), image_size=config.image_size,
                          num_classes=config.num_classes, batch_size=batch_size, lr=lr,
                          autocast_dtype=autocast_dtype)


@register(
    "resnet50",
    "ResNet-50-style CNN with BatchNorm (full size: image_size=224, width=1.0, num_classes=1000)",
    **zoo_defaults(resnet50_small(), batch_size=8),
)
def resnet50(**options: Any) -> Workload:
    """ResNet-50-style CNN (options: the fields of :class:`ResNetConfig`, batch_size, lr)."""
    config, rest = split_options("resnet50", resnet50_small(), options)
    return resnet_workload(config, **rest)
