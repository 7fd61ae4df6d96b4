"""Initial weights shared through a file, so each process need not initialise the model again.

A torchrun job builds the workload in every process. Initialising a large model on
the CPU is slow (gpt-1b: about 16 s on one core, and torchrun gives each rank one),
so a driver that runs many plans of one workload (``scripts/bench/bench_plans.py``) saves
the initial parameters and buffers once with :func:`save_weights` and passes the file
as ``RunOptions.weights_file``; each process builds the model on the meta device and
fills it from the file (:func:`load_workload`: memory-mapped copy-on-write, read with
``weights_only=True``). The weights are exactly those of a normal build with the same
seed, so losses do not change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload

__all__ = ["save_weights", "load_workload", "WEIGHTS_FORMAT"]

WEIGHTS_FORMAT = "autoplace.weights/1"


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def save_weights(model: nn.Module, path: str | Path) -> Path:
    """Write every parameter and buffer of ``model`` (written whole, or not at all)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu() for k, v in _named_tensors(model).items()}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"format": WEIGHTS_FORMAT, "tensors": tensors}, tmp)
    os.replace(tmp, path)
    return path


def _meta_leftovers(model: nn.Module) -> list[str]:
    """Tensor attributes still on meta that are neither parameters nor buffers."""
    bad = []
    for mod_name, mod in model.named_modules():
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                bad.append(f"{mod_name}.{k}" if mod_name else k)
    return bad


def load_workload(spec: dict[str, Any], path: str | Path, *, trusted: bool = True) -> Workload:
    """Build ``spec``'s workload with its initial weights read from ``path``
    (``trusted``: as :func:`autoplace.workloads.get`).

    Raises:
        AutoplaceError: the file is not a weights file, or does not match the model
            (names or shapes), or the model keeps tensors the file cannot hold.
    """
    from autoplace import workloads

    wl = workloads.get(spec["spec"], device="meta", seed=spec.get("seed", 0), trusted=trusted,
                       **spec.get("options", {}))
    try:
        data = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error
        raise AutoplaceError(f"cannot read weights file {path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != WEIGHTS_FORMAT:
        raise AutoplaceError(f"{path} is not an autoplace weights file ({WEIGHTS_FORMAT})")
    saved = data["tensors"]
    named = _named_tensors(wl.model)
    if set(named) != set(saved):
        diff = sorted(set(named) ^ set(saved))
        raise AutoplaceError(f"weights file {path} does not match {spec['spec']}: "
                             f"{len(diff)} names differ, e.g. {diff[:3]}")
    bad = [n for n, t in named.items() if saved[n].shape != t.shape]
    if bad:
        raise AutoplaceError(f"weights file {path}: {bad[0]} has shape "
                             f"{tuple(saved[bad[0]].shape)}, the model {tuple(named[bad[0]].shape)}")
    # the model's tensors become the (copy-on-write) mapped file's: no new memory is
    # touched here, which on a large model costs more than reading the file
    new: dict[int, nn.Parameter] = {}  # one Parameter per original, so ties stay tied
    for mod_name, mod in wl.model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for k, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(saved[prefix + k], requires_grad=p.requires_grad)
                mod._parameters[k] = new[id(p)]
        for k, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[k] = saved[prefix + k]
    leftover = _meta_leftovers(wl.model)
    if leftover:
        raise AutoplaceError(f"{spec['spec']} keeps tensors outside its parameters and buffers "
                             f"({leftover[:3]}); build it normally instead")
    return wl
