"""What a run trains on, cached per process: the workload's captured graph and the
batches of its steps.

A benchmark's pool job runs plan after plan of one workload in one process: each run's
model is new, but its fx capture and the batches of its steps are the same, so they are
kept (:func:`capture_graph`, :func:`global_batch`). Both are also importable from
:mod:`autoplace.executor.runner`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autoplace.capture import capture_workload
from autoplace.workloads import Workload

__all__ = ["capture_graph", "global_batch"]

#: fx captures of earlier runs in this process, without their models, by
#: (workload spec, batch size, autocast dtype): a pool job runs many plans of one
#: workload, each on a model of its own, and capturing inception-v3 costs about 0.5 s
_CAPTURES: dict[str, tuple[Any, Any, tuple]] = {}


def _architecture(model: nn.Module) -> tuple:
    """Every parameter's and buffer's name, shape and dtype."""
    return tuple((n, tuple(t.shape), t.dtype) for n, t in
                 (*model.named_parameters(), *model.named_buffers()))


def capture_graph(workload: Workload, batch_size: int | None = None):
    """The workload's OpGraph (``graph.module`` is the fx program) at ``batch_size``.

    A workload with a ``spec`` that was captured before in this process by torch.fx, at
    the same batch size, with a model of the same parameters and buffers, is not traced
    again: the earlier graph is bound to this model (a new ``fx.GraphModule`` of this
    model over a copy of the earlier fx graph; op names, shapes and costs shared).
    """
    bs = int(batch_size or workload.batch_size)
    arch = {k: v for k, v in workload.spec.items() if k != "seed"}  # seeds: same graph
    key = json.dumps([arch, bs, workload.autocast_dtype], sort_keys=True,
                     default=str) if workload.spec else None
    hit = _CAPTURES.get(key) if key else None
    if hit is not None and hit[2] == _architecture(workload.model):
        template, fx_graph, _ = hit
        graph = copy.copy(template)
        graph.module = fx.GraphModule(workload.model, copy.deepcopy(fx_graph))
        return graph
    graph = capture_workload(workload, batch_size=batch_size)
    if key and graph.capture_method == "fx":
        template = copy.copy(graph)
        template.module = None  # holds no model: its memory goes with the run
        _CAPTURES[key] = (template, copy.deepcopy(graph.module.graph),
                          _architecture(workload.model))
    return graph


#: recent CPU batches by (workload spec, batch size, seed + step): a pool job trains
#: plan after plan on the same steps' batches, and drawing one of inception-v3's
#: (32 images of 299x299) takes 40-110 ms, as long as a step
_BATCHES: dict[str, tuple] = {}
_BATCH_CACHE_BYTES = 2 << 30


def global_batch(workload: Workload, step: int, seed: int, batch_size: int | None = None,
                 pin: bool = False):
    """The CPU batch of ``step``: ``(inputs_tuple, targets)``.

    Drawn after ``torch.manual_seed(seed + step)``; for a workload with a ``spec`` the
    batch is kept (up to 2 GiB of batches, oldest dropped first) and handed out again,
    so its tensors must not be changed in place (the executors copy them to devices).

    ``pin`` (with CUDA present): the tensors are in page-locked memory, so that their
    copies to a GPU are asynchronous. A copy from pageable memory first waits for every
    kernel queued on the GPU's stream: in a one-process placement each microbatch's
    inputs and targets, copied while the devices still work on the one before, stalled
    the issuing thread until the GPU drained (a 34 MB Inception-v3 batch waited 29 ms
    behind 25 ms of queued work on an H200, pinned 0.13 ms).
    """
    bs = int(batch_size or workload.batch_size)
    pin = pin and torch.cuda.is_available()
    key = json.dumps([workload.spec, bs, seed + step, pin], sort_keys=True,
                     default=str) if workload.spec else None
    if key is not None and key in _BATCHES:
        _BATCHES[key] = _BATCHES.pop(key)  # most recently used last
        return _BATCHES[key]
    torch.manual_seed(seed + step)
    batch = workload.make_batch(bs, "cpu")
    if pin:
        inputs, targets = batch
        batch = (tuple(x.pin_memory() if isinstance(x, torch.Tensor) else x for x in inputs),
                 targets.pin_memory())
    if key is not None:
        _BATCHES[key] = batch
        size = lambda b: sum(t.numel() * t.element_size()  # noqa: E731
                             for t in pytree.tree_leaves(b) if isinstance(t, torch.Tensor))
        while sum(size(b) for b in _BATCHES.values()) > _BATCH_CACHE_BYTES and len(_BATCHES) > 1:
            _BATCHES.pop(next(iter(_BATCHES)))
    return batch
