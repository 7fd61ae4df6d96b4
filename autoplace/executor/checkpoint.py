"""Checkpoints of model + optimizer + step, saved atomically, resumed exactly.

One process: ``checkpoint_dir/checkpoint.pt`` written with ``torch.save`` to a temp
file and renamed over the old one; read with ``weights_only=True``. Several
processes: ``torch.distributed.checkpoint`` into ``step-N.tmp``, renamed to
``step-N`` by rank 0 once every rank has written, then ``latest`` (a text file
naming it) is replaced atomically; older steps are removed. A run killed mid-save
leaves the previous checkpoint intact. No RNG state is needed: every step's data
is drawn from ``torch.manual_seed(seed + step)``.

Tensor-parallel parameters are DTensors: ``torch.distributed.checkpoint`` writes each
rank's shard. A fused column whose rows the plan regrouped by rank
(:func:`autoplace.executor.tensor_parallel.regroup_columns`) is stored in that order, so
the checkpoint records the layout (``tensor_layout.json`` beside the shards) and a run
resuming it under another layout is refused.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplace.errors import AutoplaceError

__all__ = ["checkpoint_step", "load_checkpoint", "require_resumable", "save_checkpoint",
           "tensor_layout"]

#: the file in a step folder naming the regrouped tensor-parallel columns
LAYOUT_FILE = "tensor_layout.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _optimizers(optimizer: Any) -> Any:
    """What ``torch.distributed.checkpoint.state_dict`` takes: the optimizer, or none for a
    rank without parameters (``runner.NoParameters``). Under ZeRO-1
    (``ZeroRedundancyOptimizer``) the rank's own AdamW over its share of the parameters:
    each rank saves and loads the state of its share, under those parameters' names (the
    shares are the same again when the plan is)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else ()


def _options(model: nn.Module) -> Any:
    """State-dict options: strict, except for a rank whose part holds no tensors at all
    (``get_state_dict`` refuses an empty model state otherwise)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=any(True for _ in (*model.parameters(), *model.buffers())))


def tensor_layout(model: nn.Module) -> dict[str, list[int]]:
    """Modules of ``model`` whose rows a tensor-parallel plan stores regrouped by rank:
    ``{module path: [degree, outer, mid, inner]}`` (empty without any)."""
    return {name: list(m.autoplace_regroup) for name, m in model.named_modules()
            if hasattr(m, "autoplace_regroup")}


def _check_layout(folder: Path, model: nn.Module) -> None:
    path = folder / LAYOUT_FILE
    saved = json.loads(path.read_text()) if path.exists() else {}
    now = tensor_layout(model)
    if saved != now:
        raise AutoplaceError(
            f"{folder} was saved with tensor-parallel columns regrouped as {saved or 'none'}, "
            f"and this plan lays them out as {now or 'none'}: resume it under the plan "
            "(parallel.tensor) it was saved with")


def save_checkpoint(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    step: int) -> None:
    """Save the state after ``step`` steps (``step`` = number of steps done)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not _distributed():
        path = directory / "checkpoint.pt"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".checkpoint.", suffix=".tmp")
        os.close(fd)
        try:
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, _optimizers(optimizer), options=_options(model))
    tmp = directory / f"step-{step}.tmp"
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        layout = tensor_layout(model)
        if layout:
            _atomic_write_text(tmp / LAYOUT_FILE, json.dumps(layout, sort_keys=True))
        final = directory / f"step-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(directory / "latest", final.name)
        for old in directory.glob("step-*"):
            if old.name != final.name and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def checkpoint_step(directory: str | Path) -> int | None:
    """The steps done by the checkpoint in ``directory`` (None: it holds none), read
    without loading the model: ``latest`` of a multi-process run, else ``checkpoint.pt``.

    Raises:
        AutoplaceError: the folder holds something that is not a readable checkpoint.
    """
    directory = Path(directory)
    latest = directory / "latest"
    if latest.exists():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise AutoplaceError(f"{latest}: cannot read it: {e}") from None
        prefix, _, number = name.partition("-")
        if prefix != "step" or not number.isdigit() or not (directory / name).is_dir():
            raise AutoplaceError(f"{latest} names {name[:60]!r}, not a step-N folder of "
                                 f"{directory}: not a checkpoint autoplace wrote")
        return int(number)
    single = directory / "checkpoint.pt"
    if single.exists():
        try:
            state = torch.load(single, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same error
            raise AutoplaceError(f"{single} is not a checkpoint autoplace can read "
                                 f"({type(e).__name__})") from None
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise AutoplaceError(f"{single} is not a checkpoint autoplace wrote (no step)")
        return step
    return None


def require_resumable(directory: str | Path, resume: bool, steps: int | None = None) -> int:
    """The step a run with this checkpoint folder starts at; an existing checkpoint is
    resumed or refused, never overwritten.

    Raises:
        AutoplaceError: ``directory`` holds a checkpoint and ``resume`` is False, or it
            already holds ``steps`` steps or more.
    """
    step = checkpoint_step(directory)
    if step is None:
        return 0
    if not resume:
        raise AutoplaceError(
            f"{directory} holds a checkpoint at step {step}: pass --resume to continue from "
            "it, or name an empty --checkpoint-dir (autoplace never overwrites a checkpoint)")
    if steps is not None and step >= steps:
        raise AutoplaceError(f"the checkpoint in {directory} is at step {step}, and --steps "
                             f"is {steps}: nothing is left to run; raise --steps")
    return step


def load_checkpoint(directory: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> int:
    """Restore the latest checkpoint in ``directory``; returns the steps it had done (0: none)."""
    directory = Path(directory)
    if not _distributed():
        path = directory / "checkpoint.pt"
        if not path.exists():
            return 0
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        return int(state["step"])
    latest = directory / "latest"
    if not latest.exists():
        return 0
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    name = latest.read_text().strip()
    _check_layout(directory / name, model)
    msd, osd = get_state_dict(model, _optimizers(optimizer), options=_options(model))
    groups = copy.deepcopy(osd.get("param_groups"))
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(directory / name))
    if groups is not None:  # DCP does not round-trip tuples (AdamW's betas); same hyperparameters
        state["optim"]["param_groups"] = groups
    if state["model"]:  # a rank without tensors has nothing to restore
        set_state_dict(model, _optimizers(optimizer), options=_options(model),
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(name.split("-", 1)[1])
