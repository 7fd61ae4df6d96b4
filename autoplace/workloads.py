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
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplace.errors import AutoplaceError, WorkloadError

__all__ = ["Workload", "check_trusted", "get", "is_zoo_name", "names", "register", "ZOO"]


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


def get(name: str, *, device: Any = None, seed: int = 0, trusted: bool = True,
        **options: Any) -> Workload:
    """Build a workload from a zoo name or ``package.module:factory``.

    Args:
        name: zoo name (see :func:`names`) or ``module:factory``.
        device: where parameters are created; ``"meta"`` builds without memory
            (for planning models too large for this machine).
        seed: torch seed the weights are initialised with (same in every process).
        trusted: whether ``name`` may import a module (``module:factory``). A caller that
            names the workload itself trusts it (the default); a name read from a file (a
            plan's ``model.spec``) is trusted only when :func:`check_trusted` allows it.
        **options: passed to the factory (for example ``batch_size``).

    Raises:
        WorkloadError: an unknown or malformed name, an option of the wrong type, an
            untrusted ``module:factory``, or the factory itself raising (the message
            names its module, function and exception).
    """
    _load_zoo()
    if not isinstance(name, str) or not name:
        raise WorkloadError(f"a workload is a zoo name or package.module:factory, got {name!r}")
    if name in ZOO:
        factory, defaults, _ = ZOO[name]
        _check_options(name, defaults, options)
    elif ":" in name:
        if not trusted:
            raise WorkloadError(untrusted_message(name, "this spec"))
        factory, defaults = _import_factory(name), {}
    else:
        raise WorkloadError(
            f"unknown workload {name!r}; valid: {', '.join(ZOO)}, or package.module:factory"
        )
    opts = {**defaults, **options}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            if device is not None:
                with torch.device(device):
                    wl = factory(**opts)
            else:
                wl = factory(**opts)
        except AutoplaceError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: report it as theirs
            raise WorkloadError(_factory_failed(name, factory, e)) from e
    if not isinstance(wl, Workload):
        raise WorkloadError(
            f"{name} returned {type(wl).__name__}, expected autoplace.Workload"
        )
    if not isinstance(wl.batch_size, int) or isinstance(wl.batch_size, bool) \
            or wl.batch_size < 1:
        raise WorkloadError(f"workload {name!r}: batch_size must be an integer >= 1, got "
                            f"{wl.batch_size!r}")
    if not wl.spec:
        wl.spec = {"spec": name, "options": dict(options)}
    wl.spec.setdefault("spec", name)
    wl.spec.setdefault("options", dict(options))
    if seed:
        wl.spec["seed"] = seed
    return wl


def is_zoo_name(spec: Any) -> bool:
    """Whether ``spec`` names a zoo workload (building it imports nothing else)."""
    _load_zoo()
    return isinstance(spec, str) and spec in ZOO


def untrusted_message(spec: str, source: str) -> str:
    """Why ``spec`` read from ``source`` is not built, and how to allow it."""
    module = spec.partition(":")[0]
    return (f"{source} names the model {spec!r}, which is not in the model zoo: building it "
            f"would import and run code from module {module!r}. Files are data and autoplace "
            "runs no code a file names on its own; if you trust it, name the same model on "
            f"the command line (--model {spec}) or pass --trust-model")


def check_trusted(spec: Any, *, source: str, user_model: str | None = None,
                  trust: bool = False) -> None:
    """Allow building ``spec``, read from ``source`` (a file), or raise :class:`WorkloadError`.

    A zoo name is always allowed; ``module:factory`` only when the user named that same
    spec (``user_model``, from ``--model``) or trusts the file (``trust``, ``--trust-model``).
    """
    if not isinstance(spec, str) or not spec:
        raise WorkloadError(f"{source} records no model spec (got {spec!r}); it cannot be "
                            "rebuilt")
    if user_model is not None and user_model != spec:
        raise WorkloadError(f"{source} was made for the model {spec!r}, not --model "
                            f"{user_model!r}")
    if is_zoo_name(spec) or trust or user_model == spec:
        return
    if ":" not in spec:
        raise WorkloadError(f"{source} names an unknown workload {spec!r}; valid: "
                            f"{', '.join(ZOO)}, or package.module:factory")
    raise WorkloadError(untrusted_message(spec, source))


_NUMBER = (int, float)


def _check_options(name: str, defaults: dict[str, Any], options: dict[str, Any]) -> None:
    """Zoo options have the type of their default (an integer stays an integer)."""
    for key, value in options.items():
        if key not in defaults:
            continue  # the factory names the valid options
        default = defaults[key]
        if isinstance(default, bool):
            ok, kind = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif isinstance(default, float):
            ok = isinstance(value, _NUMBER) and not isinstance(value, bool)
            kind = "a number"
        elif isinstance(default, str):
            ok, kind = isinstance(value, str), "a string"
        else:
            continue
        if not ok:
            raise WorkloadError(f"workload {name!r}: option {key} must be {kind}, got "
                                f"{value!r}")
    bs = options.get("batch_size")
    if bs is not None and (not isinstance(bs, int) or isinstance(bs, bool) or bs < 1):
        raise WorkloadError(f"workload {name!r}: batch_size must be an integer >= 1, got {bs!r}")


def _factory_failed(name: str, factory: Callable[..., Any], e: BaseException) -> str:
    """The user's factory raised: say whose code, where, and what."""
    where = f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', '?')}"
    frames = traceback.extract_tb(e.__traceback__)
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return (f"building workload {name!r} failed in its factory {where}{at}: "
            f"{type(e).__name__}: {e}")


_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def _import_factory(spec: str) -> Callable[..., Workload]:
    """The factory named ``module:attr``. A module not found on ``sys.path`` is looked for
    in the working directory too (``autoplace`` runs as a console script, whose path does
    not hold it; ``python -m`` and the executor's torchrun workers, started in the same
    directory, do), as uvicorn or gunicorn find an application."""
    if not _SPEC.fullmatch(spec):
        raise WorkloadError(
            f"{spec!r} is not a model: write a zoo name ({', '.join(ZOO)}) or "
            "package.module:factory (a module path, a colon, a function name)")
    mod_name, _, attr = spec.partition(":")
    try:
        mod = _import_module(mod_name)
    except ImportError as e:
        raise WorkloadError(f"cannot import workload module {mod_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise WorkloadError(_factory_failed(spec, _Named(mod_name), e)) from e
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise WorkloadError(f"module {mod_name!r} has no callable {attr!r} (from {spec!r})")
    return fn


class _Named:
    """A module standing in for a factory in :func:`_factory_failed` (its import raised)."""

    def __init__(self, module: str) -> None:
        self.__module__ = module
        self.__qualname__ = "<import>"


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
