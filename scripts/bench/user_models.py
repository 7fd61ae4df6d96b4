"""Models as a user outside the zoo writes them: ``module:factory`` workloads for the benchmarks.

Neither is in :mod:`autoplace.zoo` and neither uses autoplace beyond the
:class:`~autoplace.workloads.Workload` it returns, so the simulator sees them as it sees a
user's model: ops it has no calibration for, costs estimated or profiled on the card.

- ``residual_mlp``: a deep residual MLP of hundreds of small ops (each block a layer norm,
  two linears, a GELU and the residual add: about 1,000 forward ops at the default 200
  blocks), launch-bound on a GPU.
- ``unet``: a small U-Net (convolution + batch norm + ReLU stages, max-pool down,
  transposed-convolution up, skip connections concatenated), per-pixel classification.

Named ``user_models:residual_mlp`` with ``scripts/bench`` on ``sys.path`` (the benchmark
scripts run from there, as do their worker processes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.workloads import Workload


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, features: int, width: int, hidden: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(_Block(width, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def residual_mlp(blocks: int = 200, width: int = 512, hidden: int = 1024, features: int = 256,
                 classes: int = 100, batch_size: int = 256, lr: float = 1e-3,
                 autocast_dtype: str | None = "bfloat16") -> Workload:
    """A residual MLP of ``blocks`` blocks (five forward ops each) on random features."""
    def make_batch(bs, device):
        return ((torch.randn(bs, features, device=device),),
                torch.randint(0, classes, (bs,), device=device))

    return Workload(name="residual-mlp", model=ResidualMLP(features, width, hidden, blocks,
                                                           classes),
                    make_batch=make_batch, loss_fn=lambda out, y: F.cross_entropy(out.float(), y),
                    batch_size=batch_size, lr=lr, autocast_dtype=autocast_dtype)


def _conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=False),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=False))


class UNet(nn.Module):
    def __init__(self, channels: int, base: int, depth: int, classes: int) -> None:
        super().__init__()
        widths = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList(_conv(c_in, c_out) for c_in, c_out
                                  in zip([channels] + widths[:-2], widths[:-1]))
        self.bottom = _conv(widths[-2], widths[-1])
        self.lift = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                  for i in reversed(range(depth)))
        self.up = nn.ModuleList(_conv(2 * widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for lift, stage, skip in zip(self.lift, self.up, reversed(skips)):
            x = stage(torch.cat([lift(x), skip], dim=1))
        return self.head(x)


def unet(size: int = 64, channels: int = 3, base: int = 16, depth: int = 3, classes: int = 4,
         batch_size: int = 16, lr: float = 1e-3, autocast_dtype: str | None = "bfloat16"
         ) -> Workload:
    """A U-Net of ``depth`` levels segmenting random ``size`` x ``size`` images."""
    def make_batch(bs, device):
        return ((torch.randn(bs, channels, size, size, device=device),),
                torch.randint(0, classes, (bs, size, size), device=device))

    return Workload(name="unet", model=UNet(channels, base, depth, classes),
                    make_batch=make_batch, loss_fn=lambda out, y: F.cross_entropy(out.float(), y),
                    batch_size=batch_size, lr=lr, autocast_dtype=autocast_dtype)
