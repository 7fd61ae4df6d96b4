"""Apply a plan to this rank: the program, its data-parallel wrapper, its step function.

Device numbering follows :mod:`autoplace.plan`: replica ``r`` uses cluster devices
``r * k + local``. With ``pipeline = p > 1`` rank ``r * p + s`` runs stage ``s`` of
replica ``r``; with ``pipeline == 1`` rank ``r`` runs all ``k`` devices of replica
``r`` in one process (local placement).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplace.capture import model_output, program_inputs
from autoplace.cluster import Cluster
from autoplace.errors import PlanError
from autoplace.executor.data import allreduce_grads, sum_grads, wrap_data_parallel
from autoplace.executor.local import build_local, split_value
from autoplace.executor.offload import one_rank_mesh
from autoplace.executor.pieces import direct_children, piece
from autoplace.executor.pipeline import build_stage, example_values, make_schedule
from autoplace.executor.tensor_parallel import (
    data_mesh,
    device_mesh,
    prepare_program,
    rank_cluster_device,
    rank_layout,
)
from autoplace.lowering import Lowering, lower
from autoplace.plan import Plan
from autoplace.workloads import Workload

__all__ = ["ALLOCATOR_COUNTERS", "Built", "allocator_counts", "allocator_delta", "build_rank",
           "micro_batch_size"]


@dataclass
class Built:
    """What one rank trains.

    Attributes:
        model: the module whose parameters the optimizer updates.
        state_module: the module checkpoints save and load.
        step: ``(global_inputs, global_targets, region) -> loss`` (forward and backward),
            ``region`` a context manager factory (the workload's autocast) around the
            forward and the loss: a one-process program's backward runs outside it, as
            PyTorch's autocast recipe has it (autocast's cached weight copies then die with
            the backward of the ops that saved them instead of all at its end), but for a
            plan with selective checkpointing; a pipeline's schedule interleaves the two
            and runs wholly inside it.
        devices: this rank's devices.
        cluster_indices: their cluster device indices.
        has_loss: whether this rank computes a loss (pipeline: last stage only).
        info: facts for the run's report (``tensor_split``: the Linears this rank splits).
    """

    model: nn.Module
    state_module: nn.Module
    step: Callable[..., torch.Tensor]
    devices: list[torch.device]
    cluster_indices: list[int]
    has_loss: bool = True
    keep: list[Any] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def micro_batch_size(batch_size: int, plan: Plan) -> int:
    """Samples per microbatch per replica; raises PlanError when the batch does not split."""
    d, m = plan.parallel.data, plan.parallel.microbatches
    if batch_size % (d * m):
        raise PlanError(
            f"global batch {batch_size} does not split into {d} replicas x {m} microbatches "
            f"of equal size; use a batch size divisible by {d * m}"
        )
    return batch_size // (d * m)


def _replica_slice(t: Any, replica: int, replicas: int) -> Any:
    """This replica's share of a tensor along dim 0; any other input as it is."""
    return split_value(t, replicas)[replica]


def _gather_dtype(low: Lowering) -> torch.dtype | None:
    """FSDP2's gather dtype as the lowering decided it (None: parameters as they are)."""
    return getattr(torch, low.gather_dtype) if low.gather_dtype else None


def build_rank(workload: Workload, graph, plan: Plan, cluster: Cluster, rank: int,
               micro: int) -> Built:
    """Build this rank's part of ``plan`` (``graph.module`` captured at ``micro`` samples)."""
    par = plan.parallel
    gm = graph.module
    if gm is None:
        raise PlanError("the captured graph has no fx module to execute")
    k = plan.devices_per_replica
    distributed = dist.is_available() and dist.is_initialized()
    low = lower(graph, plan, cluster, validated=True,  # by run_here, on the whole batch
                device_type=torch.device(cluster.devices[plan.replica_devices(0)[0]].name).type)
    replica, stage, _ = rank_layout(plan, rank)
    tp = par.tensor > 1
    info: dict[str, Any] = {}
    mesh = None  # dims dp (or dp_replicate, dp_shard), pp, tp, as the plan uses them
    if distributed and (tp or (par.data > 1 and (par.shard != "none" or par.pipeline > 1))):
        mesh = device_mesh(plan, cluster.devices[rank_cluster_device(plan, rank)].name
                           .split(":")[0])
    if par.pipeline == 1:
        idx = [rank_cluster_device(plan, rank)] if tp else plan.replica_devices(replica)
        devices = [torch.device(cluster.devices[i].name) for i in idx]
        if par.shard != "none" and k > 1:
            raise PlanError(
                f"parallel.shard={par.shard!r} with a replica spread over {k} devices in one "
                "process is not supported: FSDP2 keeps one device per rank; use shard='none' "
                "(DDP) or a pipeline"
            )
        if tp:
            _need_group(distributed, plan)
            info["tensor_split"] = prepare_program(gm, graph, low.tensor, mesh["tp"])
        program = build_local(gm, plan, devices, workload.loss_fn,
                              order=list(low.order),
                              graphs=True if par.graphs else None,
                              cuts=low.piece_cuts(graph) if par.shard != "none" else None)
        model: nn.Module = program
        # a replica over several devices: DDP would all-reduce buckets on each of them,
        # but a NCCL process group serves one device per process; reduce on the first.
        # Tensor-parallel parameters (DTensors) are reduced the same way over ``dp``
        manual = par.data > 1 and (k > 1 or (tp and par.shard == "none"))
        if par.data > 1 and not manual:
            model = wrap_data_parallel(program, low.module_units(graph), par.shard,
                                       mesh=data_mesh(mesh, plan) if mesh is not None else None,
                                       device=devices[0], param_dtype=_gather_dtype(low),
                                       offload=par.offload)
        elif par.offload:  # FSDP2 on one rank, its shards on the host (executor/offload.py)
            model = wrap_data_parallel(program, low.module_units(graph), par.shard,
                                       mesh=one_rank_mesh(devices[0]), device=devices[0],
                                       param_dtype=_gather_dtype(low), offload=True)
        dp_group = mesh["dp"].get_group() if manual and tp else None
        # a selective checkpoint's recompute must issue the ops its forward issued: with the
        # backward outside autocast, the region's cache is gone and the recompute casts a
        # weight that a later microbatch's forward had found cached ("aten._to_copy ...
        # encountered during backward but not found in storage"); there the backward stays
        # inside the region, the copies held to its end
        whole_step = bool(plan.selective)
        params = [q for q in program.parameters() if q.requires_grad] if manual else []

        def step(inputs, targets, region=contextlib.nullcontext):
            xs = tuple(_replica_slice(x, replica, par.data) for x in inputs)
            y = _replica_slice(targets, replica, par.data)
            with region():  # autocast around the forward and the loss
                loss = model(xs, y)
                if whole_step:
                    loss.backward()
            if not whole_step:
                loss.backward()
            if manual:
                allreduce_grads(params, dp_group, device=devices[0])
            return loss

        return Built(model=model, state_module=gm if par.data == 1 and not tp else model,
                     step=step, devices=devices, cluster_indices=idx, info=info)

    # pipeline: one stage per rank (per tensor rank with tensor parallel)
    p = par.pipeline
    cidx = rank_cluster_device(plan, rank)
    device = torch.device(cluster.devices[cidx].name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ex_inputs, _ = workload.make_batch(micro, "cpu")
    values = example_values(gm, ex_inputs, device, workload.autocast_dtype)
    if tp:  # after example_values: the fake run sees the program whole
        _need_group(distributed, plan)
        info["tensor_split"] = prepare_program(
            gm, graph, low.tensor, mesh["tp"], {op for op, s in low.stage_of.items() if s == stage})
    stage_mod = build_stage(gm, plan, stage, ex_inputs, device, values).to(device)
    mode = low.stage_recompute[stage]
    if mode or par.compile:  # the stage whole: under a checkpoint, and/or compiled
        stage_mod = piece(stage_mod, mode, par.compile, f"pipeline stage {stage}")
    if not par.compile:  # a compiled stage is torch.compile's to trace as it is
        direct_children(stage_mod)
    group = dp_group = None
    model = stage_mod
    if mesh is not None:
        group = mesh["pp"].get_group()
        if par.data > 1 and par.shard == "none":
            dp_group = mesh["dp"].get_group()
        if par.shard != "none":
            model = wrap_data_parallel(stage_mod, low.module_units(graph), par.shard,
                                       mesh=data_mesh(mesh, plan), device=device,
                                       param_dtype=_gather_dtype(low))
    elif not distributed:
        raise PlanError("a pipeline plan must run under torchrun (one process per stage)")
    manual_dp = par.data > 1 and par.shard == "none"
    params = [q for q in model.parameters() if q.requires_grad]
    tied = _tie_groups(gm, plan, rank, low.tied)
    loss_fn = workload.loss_fn

    def stage_loss(output, target):  # on what the model returns, as the workload wrote it
        return loss_fn(model_output(gm, output), target)

    schedule = make_schedule(model, stage, p, device, par.microbatches, par.schedule,
                             stage_loss, group=group)
    last = stage == p - 1

    def pp_step(inputs, targets, region=contextlib.nullcontext):
        with region():  # the schedule interleaves forwards and backwards: all of it
            return _pp_step(inputs, targets)

    def _pp_step(inputs, targets):
        # stage 0's placeholders: the captured graph's tensor inputs (others are constants)
        xs = tuple(_replica_slice(x, replica, par.data).to(device)
                   for x in program_inputs(gm, inputs) if isinstance(x, torch.Tensor))
        y = _replica_slice(targets, replica, par.data).to(device)
        loss = torch.zeros((), device=device)
        # the step's loss is the microbatches' losses: the last stage neither keeps each
        # microbatch's output to its step's end nor concatenates them (``return_outputs``)
        if stage == 0:
            schedule.step(*xs, return_outputs=False)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses, return_outputs=False)
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            schedule.step(return_outputs=False)
        if manual_dp:
            allreduce_grads(params, dp_group)
        for tie_group, tie_params in tied:
            sum_grads(tie_params, tie_group)
        return loss

    return Built(model=model, state_module=model, step=pp_step, devices=[device],
                 cluster_indices=[cidx], has_loss=last, keep=[schedule], info=info)


def _need_group(distributed: bool, plan: Plan) -> None:
    if not distributed:
        raise PlanError(f"a tensor-parallel plan (parallel.tensor={plan.parallel.tensor}) must "
                        "run under torchrun (one process per tensor rank)")


def _tie_groups(gm, plan: Plan, rank: int, ties: dict[str, list[int]]
                ) -> list[tuple[Any, list[nn.Parameter]]]:
    """This rank's parameters that other stages of its replica use too, with the process
    group of those stages' ranks: ``[(group, params)]`` (``ties``: the lowering's tied
    parameters; every rank creates every group, in one order, as ``new_group`` requires)."""
    if not ties:  # (a sharded pipeline with ties never gets here: the lowering refuses it)
        return []
    par = plan.parallel
    named = dict(gm.named_parameters())
    p, t = par.pipeline, par.tensor
    out = []
    for stages in sorted({tuple(s) for s in ties.values()}):
        members = [named[n] for n, s in sorted(ties.items()) if tuple(s) == stages]
        for replica in range(par.data):
            for j in range(t):  # a tensor rank's copies, on its peers of the other stages
                ranks = [(replica * p + s) * t + j for s in stages]
                group = dist.new_group(ranks)
                if rank in ranks:
                    out.append((group, members))
    return out


#: the allocator's ``expandable_segments`` as :func:`cap_allocator` last set it in this
#: process (off is the allocator's default without ``PYTORCH_CUDA_ALLOC_CONF``)
_EXPANDABLE = False


def cap_allocator(cluster: Cluster | None) -> bool:
    """Expandable CUDA allocator segments while ``cluster`` caps memory (None: back off).

    Under a cap the caching allocator's fixed-size segments fragment: on 2x H200 (suite
    ``2026-11-27-h200x2-s19b``) the same FSDP2 plan of gpt-1b measured 144-162 ms under a
    16 GiB cap against 99-101 ms without one, and a GNMT-4 FSDP2 plan that fit its 4.4 GiB
    cap in one run ran out of memory in the next with 245 MiB reserved but unallocated.
    Segments that grow in place (``expandable_segments``) avoid both. Left alone where the
    user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF``) or without CUDA. Changes
    the setting (emptying the cache first) only when it differs from the current one.
    Returns whether it is on now.
    """
    global _EXPANDABLE
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or not torch.cuda.is_available():
        return False
    on = cluster is not None and any(d.memory_cap_bytes is not None for d in cluster.devices)
    if on != _EXPANDABLE:
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
            or torch.cuda.memory._set_allocator_settings
        torch.cuda.empty_cache()
        setter(f"expandable_segments:{on}")
        _EXPANDABLE = on
    return on


def apply_memory_caps(devices: list[torch.device], cluster: Cluster, indices: list[int]) -> None:
    """Cap each GPU's allocator at its cluster device's ``memory_cap_bytes``."""
    for d, i in zip(devices, indices):
        cap = cluster.devices[i].memory_cap_bytes
        if cap is not None and d.type == "cuda":
            total = torch.cuda.get_device_properties(d).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), d)


def reset_memory_caps(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        if d.index is None or d.index < torch.cuda.device_count():
            torch.cuda.set_per_process_memory_fraction(1.0, d)


#: ``torch.cuda.memory_stats`` counters :func:`allocator_counts` reads, by the name a
#: report gives them: the allocator's retries after a failed allocation (each frees every
#: cached block, synchronising the device first), and its ``cudaMalloc`` / ``cudaFree``
#: calls (segments mapped / unmapped with expandable segments).
ALLOCATOR_COUNTERS = {"alloc_retries": "num_alloc_retries",
                      "device_allocs": "num_device_alloc",
                      "device_frees": "num_device_free"}


def allocator_counts(built: Built) -> dict[int, dict[str, int]]:
    """The caching allocator's cumulative counters per CUDA device of this rank (keyed by
    cluster device index; CPU devices are left out). Two snapshots' difference
    (:func:`allocator_delta`) is what a span of steps cost the allocator: under a memory
    cap, retries during the timed steps mean the plan runs at the cap and pays for it
    (a retry frees the cache and synchronises the device)."""
    out: dict[int, dict[str, int]] = {}
    for d, i in zip(built.devices, built.cluster_indices):
        if d.type == "cuda":
            stats = torch.cuda.memory_stats(d)
            out[i] = {k: int(stats.get(v, 0)) for k, v in ALLOCATOR_COUNTERS.items()}
    return out


def allocator_delta(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]],
                    built: Built) -> dict[int, dict[str, int]]:
    """``after - before`` per device and counter, with each device's peak reserved memory."""
    out: dict[int, dict[str, int]] = {}
    for d, i in zip(built.devices, built.cluster_indices):
        if i in after:
            out[i] = {k: after[i][k] - before.get(i, {}).get(k, 0) for k in after[i]}
            out[i]["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved(d))
    return out


def gather_results(built: Built, losses: list[torch.Tensor], times: list[float],
                   plan: Plan, distributed: bool = True,
                   allocator: dict[int, dict[str, int]] | None = None,
                   ) -> tuple[list[float], list[float], list[int], dict[int, dict[str, int]]]:
    """(loss per step, step time per step (max over ranks), peak memory per cluster device,
    ``allocator`` (this rank's :func:`allocator_delta`) of every rank merged).

    ``distributed=False``: this process ran the whole plan; gather nothing.
    """
    peaks = {i: (torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0)
             for d, i in zip(built.devices, built.cluster_indices)}
    allocator = dict(allocator or {})
    loss_t = (torch.stack(losses) if losses else torch.zeros(0)).to(built.devices[0])
    if not distributed or not (dist.is_available() and dist.is_initialized()):
        return (loss_t.cpu().tolist(), times,
                [peaks.get(i, 0) for i in range(plan.num_devices)], allocator)
    if not built.has_loss:
        loss_t = torch.zeros_like(loss_t)
    dist.all_reduce(loss_t)
    loss_t = loss_t / (plan.parallel.data * plan.parallel.tensor)  # every tensor rank has it
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times, peaks, allocator))
    step_times = [max(t[i] for t, _, _ in gathered) for i in range(len(times))]
    all_peaks: dict[int, int] = {}
    for _, pk, al in gathered:
        all_peaks.update(pk)
        allocator.update(al)
    return (loss_t.cpu().tolist(), step_times,
            [all_peaks.get(i, 0) for i in range(plan.num_devices)], allocator)
