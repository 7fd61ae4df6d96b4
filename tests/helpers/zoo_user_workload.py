"""A user-defined workload factory, loaded by tests as ``tests.helpers.zoo_user_workload:tiny_regression``."""

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

    from tests.helpers.capture_models import DataDependent

    model = DataDependent()
    features = model.fc.in_features if hasattr(model, "fc") else 8
    return Workload(
        name="untraceable",
        model=model,
        make_batch=partial(_batch, features=features),
        loss_fn=lambda out, y: out.float().mean(),
        batch_size=batch_size,
    )


#: what :func:`leaky_regression`'s loss keeps, per process
KEPT: list[torch.Tensor] = []


def leaky_regression(features: int = 4, batch_size: int = 3,
                     leak_bytes: int = 0) -> Workload:
    """:func:`tiny_regression` whose loss, at its first call on a GPU in a process, keeps a
    ``leak_bytes`` tensor there for good: a model that holds memory after its run."""
    from functools import partial

    def loss(out, y):
        if out.device.type == "cuda" and leak_bytes and not KEPT:
            KEPT.append(torch.empty(leak_bytes, dtype=torch.uint8, device=out.device))
        return F.mse_loss(out, y)

    return Workload(
        name="leaky-regression",
        model=nn.Linear(features, 1),
        make_batch=partial(_batch, features=features),
        loss_fn=loss,
        batch_size=batch_size,
    )
