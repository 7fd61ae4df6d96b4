"""Workloads: a model, a batch maker and a loss, plus the built-in model zoo.

A user's own workload is named ``package.module:factory``; the factory takes
keyword options and returns a :class:`Workload`. Zoo names are listed by
:func:`names`; :func:`get` resolves either kind and raises an error listing the
valid names when the name is unknown.

Contract the executor relies on: ``make_batch(batch_size, device)`` returns
``(inputs_tuple, targets)`` whose tensors have the batch on dim 0 and depend only
on the global torch RNG (the executor seeds it per step so every process and the
reference see the same data); ``loss_fn(output, targets)`` is a mean over the batch.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoplace.errors import AutoplaceError

__all__ = ["Workload", "get", "names", "register", "ZOO"]


@dataclass(kw_only=True)
class Workload:
    """A model with its data and loss.

    Attributes:
        name: label shown in reports.
        model: the model (weights initialised deterministically by :func:`get`).
        make_batch: ``(batch_size, device) -> (inputs_tuple, targets)``.
        loss_fn: ``(model_output, targets) -> scalar`` mean over the batch.
        batch_size: global batch size of one training step.
        spec: how to rebuild it: ``{"spec": name, "options": {...}}``.
        autocast_dtype: dtype for ``torch.autocast`` on GPUs (``"bfloat16"``) or None.
        lr: learning rate of the AdamW optimizer the executor uses.
    """

    name: str
    model: nn.Module
    make_batch: Callable[[int, Any], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    batch_size: int
    spec: dict[str, Any] = field(default_factory=dict)
    autocast_dtype: str | None = None
    lr: float = 1e-3

    def example_inputs(self, batch_size: int | None = None, device: Any = "cpu"):
        """One batch's inputs (a tuple), seeded so it is the same every call."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            inputs, _ = self.make_batch(batch_size or self.batch_size, device)
        return inputs


#: name -> (factory, default options, one-line description); filled by :func:`register`.
ZOO: dict[str, tuple[Callable[..., Workload], dict[str, Any], str]] = {}


def register(name: str, description: str = "", **defaults: Any):
    """Decorator adding a factory to the zoo under ``name`` with default options."""

    def deco(fn: Callable[..., Workload]) -> Callable[..., Workload]:
        ZOO[name] = (fn, defaults, description or (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


def names() -> list[str]:
    """Zoo workload names."""
    _load_zoo()
    return list(ZOO)


def get(name: str, *, device: Any = None, seed: int = 0, **options: Any) -> Workload:
    """Build a workload from a zoo name or ``package.module:factory``.

    Args:
        name: zoo name (see :func:`names`) or ``module:factory``.
        device: where parameters are created; ``"meta"`` builds without memory
            (for planning models too large for this machine).
        seed: torch seed the weights are initialised with (same in every process).
        **options: passed to the factory (for example ``batch_size``).
    """
    _load_zoo()
    if ":" in name:
        factory, defaults = _import_factory(name), {}
    elif name in ZOO:
        factory, defaults, _ = ZOO[name]
    else:
        raise AutoplaceError(
            f"unknown workload {name!r}; valid: {', '.join(ZOO)}, or package.module:factory"
        )
    opts = {**defaults, **options}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device is not None:
            with torch.device(device):
                wl = factory(**opts)
        else:
            wl = factory(**opts)
    if not isinstance(wl, Workload):
        raise AutoplaceError(
            f"{name} returned {type(wl).__name__}, expected autoplace.Workload"
        )
    if not wl.spec:
        wl.spec = {"spec": name, "options": dict(options)}
    wl.spec.setdefault("spec", name)
    wl.spec.setdefault("options", dict(options))
    if seed:
        wl.spec["seed"] = seed
    return wl


def _import_factory(spec: str) -> Callable[..., Workload]:
    """The factory named ``module:attr``. A module not found on ``sys.path`` is looked for
    in the working directory too (``autoplace`` runs as a console script, whose path does
    not hold it; ``python -m`` and the executor's torchrun workers, started in the same
    directory, do), as uvicorn or gunicorn find an application."""
    mod_name, _, attr = spec.partition(":")
    try:
        mod = _import_module(mod_name)
    except ImportError as e:
        raise AutoplaceError(f"cannot import workload module {mod_name!r}: {e}") from None
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise AutoplaceError(f"module {mod_name!r} has no callable {attr!r} (from {spec!r})")
    return fn


def _import_module(mod_name: str) -> Any:
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        top = mod_name.split(".")[0]
        cwd = os.getcwd()
        if e.name != top or any(os.path.abspath(p or ".") == cwd for p in sys.path):
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(mod_name)


def _load_zoo() -> None:
    if not ZOO:
        importlib.import_module("autoplace.zoo")
