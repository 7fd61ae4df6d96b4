"""A user-defined workload factory, loaded by tests as ``assets.zoo_user_workload:tiny_regression``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.workloads import Workload


def _batch(batch_size, device, *, features):
    x = torch.randn(batch_size, features, device="cpu")
    return (x.to(device),), x.sum(dim=1, keepdim=True).to(device)


def tiny_regression(features: int = 4, batch_size: int = 3) -> Workload:
    """Linear regression of the sum of the inputs."""
    from functools import partial

    return Workload(
        name="tiny-regression",
        model=nn.Linear(features, 1),
        make_batch=partial(_batch, features=features),
        loss_fn=F.mse_loss,
        batch_size=batch_size,
    )


def untraceable(batch_size: int = 3) -> Workload:
    """A model with data-dependent control flow: neither fx nor export can capture it."""
    from functools import partial

    from assets.capture_models import DataDependent

    model = DataDependent()
    features = model.fc.in_features if hasattr(model, "fc") else 8
    return Workload(
        name="untraceable",
        model=model,
        make_batch=partial(_batch, features=features),
        loss_fn=lambda out, y: out.float().mean(),
        batch_size=batch_size,
    )
