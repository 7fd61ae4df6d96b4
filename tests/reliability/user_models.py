"""Users' workload factories the reliability tests build by ``module:factory``."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.workloads import Workload


def _batch(batch_size, device, *, features):
    x = torch.randn(batch_size, features)
    return (x.to(device),), x.sum(dim=1, keepdim=True).to(device)


def raising(width: int = 4) -> Workload:
    """A factory with a bug of its own."""
    raise ValueError(f"width {width} is not supported by this model")


def always_nan(features: int = 4, batch_size: int = 4) -> Workload:
    """Linear regression whose loss is NaN at every step."""
    return Workload(
        name="always-nan",
        model=nn.Linear(features, 1),
        make_batch=partial(_batch, features=features),
        loss_fn=lambda out, y: F.mse_loss(out, y) * float("nan"),
        batch_size=batch_size,
    )
