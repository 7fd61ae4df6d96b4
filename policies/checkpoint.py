"""Trainer checkpoints: plain tensors and dicts, written atomically, read with
``torch.load(weights_only=True)``.

A checkpoint holds everything a run needs to continue exactly where it stopped: the
policy (registry name, config, weights), the optimizer, the moving-average baselines,
the random states of ``random``, numpy, torch and the sampling generator, the update /
episode counters, the history and the best plan seen (as JSON text).
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoplace.errors import AutoplaceError

from .registry import get

__all__ = ["CHECKPOINT_FORMAT", "save", "load", "rng_state", "set_rng_state", "load_policy"]

CHECKPOINT_FORMAT = "autoplace.policy-checkpoint/1"


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """The random states of python, numpy, torch and ``generator``, as plain data."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, torch.tensor(mt, dtype=torch.int64), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(cached)],
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    """Restore what :func:`rng_state` captured."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in mt.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])


def save(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plain tensors, dicts, lists, numbers, strings) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save({"format": CHECKPOINT_FORMAT, **payload}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save`; errors name the file and the problem."""
    what = (f"{path} is not an autoplace policy checkpoint (autoplace train writes "
            "DIR/checkpoint.pt)")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise AutoplaceError(f"no checkpoint at {path}") from None
    except OSError as e:
        raise AutoplaceError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if head[:2] != b"PK":  # torch.save writes a zip archive
        raise AutoplaceError(f"{what}: it is not a file torch.save wrote")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own advice (weights_only=False) would run the file's code: never taken
        raise AutoplaceError(f"{what}: it holds objects other than tensors and plain data, "
                             "which autoplace never loads (it reads checkpoints with "
                             "weights_only=True)") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise AutoplaceError(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                             ) from None
    if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
        raise AutoplaceError(what)
    return data


def load_policy(path_or_data: str | Path | dict[str, Any]):
    """Rebuild the policy saved in a checkpoint (eval mode). Returns ``(policy, data)``."""
    data = path_or_data if isinstance(path_or_data, dict) else load(path_or_data)
    spec = data.get("policy")
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str)
            and isinstance(spec.get("config"), dict) and isinstance(data.get("policy_state"), dict)):
        raise AutoplaceError("the checkpoint is malformed: it needs \"policy\" (name, config) "
                             "and \"policy_state\"")
    cls = get(spec["name"])
    try:
        policy = cls(**spec["config"])
        policy.load_state_dict(data["policy_state"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise AutoplaceError(f"the checkpoint's {spec['name']!r} policy cannot be rebuilt: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    policy.eval()
    return policy, data
