"""The peak memory of one training step on the CPU, measured tensor storage by storage.

:func:`measure_step` builds the executor's own one-device program for a plan
(``executor.build.build_rank``) with the workload's AdamW, runs one step (the optimizer's
state is made there) and measures the second: under :class:`LiveStorages` every storage an
op makes is counted until it dies, whoever holds it (autograd's saved tensors too), so
the peak and what was alive at it are exact at op granularity. Autocast, where asked, is
a CPU region with its cast cache on that the program's step opens as the executor's loop
does on GPUs (around the forward and the loss; the whole step for a plan with selective
checkpointing). Used by ``scripts/bench/step_memory.py`` and the simulator's tests, to
set the simulated peak beside a measured one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplace.executor import build
from autoplace.executor.runner import global_batch, workload_optimizer

__all__ = ["LiveStorages", "measure_step"]


class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages made under the mode and still alive, op by op (a
    storage dies when its last tensor does, whoever holds it), their peak (``peak``) and
    what was alive there (``at_peak``: the op, and ``(bytes, "dtype op shape")`` of each
    live storage, largest first). ``known``: storages made before, not counted."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        for t in known:
            s = t.untyped_storage()
            self.live[s._cdata] = (StorageWeakRef(s), 0, "before")
        self.total = self.peak = 0
        self.at_peak: tuple[str, list[tuple[int, str]]] = ("", [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for k in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(k)[1]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live:
                s = t.untyped_storage()
                what = f"{t.dtype} {func.__name__} {list(t.shape)}"
                self.live[s._cdata] = (StorageWeakRef(s), s.nbytes(), what)
                self.total += s.nbytes()
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = (func.__name__, sorted(((n, w) for _, n, w in self.live.values()
                                                   if n), reverse=True))
        return out


def measure_step(wl: Any, graph: Any, plan: Any, cluster: Any, autocast: str | None,
                 *, optimizer: bool = True) -> dict[str, Any]:
    """The second step's measured peak of ``plan`` (one device) on the CPU:
    ``measured_bytes`` (parameters, optimizer state and batch, ``static_bytes``, plus the
    most the step holds at once), ``peak_op`` and ``alive_at_peak`` (see
    :class:`LiveStorages`). ``optimizer=False``: the forward and backward alone (the CPU's
    foreach AdamW makes temporaries the GPUs' fused one does not)."""
    microbatch = wl.batch_size // plan.parallel.microbatches
    built = build.build_rank(wl, graph, plan, cluster, 0, microbatch)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = workload_optimizer(params, wl, built.devices[0])
    region = (lambda: torch.autocast("cpu", dtype=getattr(torch, autocast))) if autocast \
        else contextlib.nullcontext
    for step in range(2):
        inputs, targets = global_batch(wl, step, 0)
        before = [*params, *inputs, targets,
                  *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
        mode = LiveStorages(before)
        with mode:
            built.step(inputs, targets, region)
            if optimizer:
                opt.step()
                opt.zero_grad(set_to_none=True)
        if not optimizer:
            opt.step()
            opt.zero_grad(set_to_none=True)
    static = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                  for t in before}.values())
    return {"measured_bytes": static + mode.peak, "static_bytes": static,
            "peak_op": mode.at_peak[0], "alive_at_peak": mode.at_peak[1]}
