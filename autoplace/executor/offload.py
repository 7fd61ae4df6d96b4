"""Offloaded plans (``parallel.offload``): FSDP2's ``CPUOffloadPolicy`` on every unit.

Each rank's parameter shards, their gradients and the AdamW state live in host memory;
FSDP2 copies a unit's shards to the GPU before it all-gathers them (before the unit's
forward, and again before its backward) and its reduce-scattered gradients back to the
host, and the optimizer steps on the CPU. :func:`autoplace.executor.data.wrap_data_parallel`
applies the policy with ``fully_shard`` on the same units as any FSDP2 plan.

A one-device offloaded plan (``data == 1``) is FSDP2 on a mesh of one rank: run in one
process, it joins the process group this process already is (a world of one, as a pool
job's), or :func:`one_rank_group` starts one (gloo on a CPU, NCCL on a GPU, on a free
local port) and destroys it when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplace.errors import PlanError

__all__ = ["host_threads", "offload_optimizer", "offload_policy", "on_host", "one_rank_group",
           "one_rank_mesh", "rank_threads"]


def offload_policy(device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for a rank on ``device``: shards in page-locked host
    memory on a GPU, so that their copies are asynchronous (pinning needs CUDA: on a CPU
    device the shards stay in ordinary memory)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda" and torch.cuda.is_available())


def offload_optimizer(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW over the host shards of an offloaded plan, with torch's fused CPU kernel.

    On a 2-core x86 machine (torch 2.13, one thread, 25M fp32 parameters) the fused step
    took 31 ms against 217-220 ms for the for-loop and foreach implementations the CPU
    would otherwise run; the result is AdamW's, to rounding."""
    return torch.optim.AdamW(params, lr=lr, fused=True)


def rank_threads() -> int:
    """CPU threads for one rank's optimizer step: the cores this process may use, shared
    evenly among the ranks of its node (torchrun's ``LOCAL_WORLD_SIZE``, 1 outside it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@contextlib.contextmanager
def host_threads(device: torch.device) -> Iterator[int]:
    """For an offloaded plan on a GPU, torch's CPU threads set to :func:`rank_threads` for
    the run (the optimizer steps on the CPU, on the critical path), restored on exit.

    autoplace's launchers start ranks with ``OMP_NUM_THREADS=1`` (torchrun's default too):
    on 2x NVIDIA H200 of a 32-core host (torch 2.11) gpt-1b offloaded steps in 940 ms with
    one thread a rank and in 385 ms with 16 (docs/simulator.md, offload). On a CPU device
    the ranks' compute is the CPU's: the threads are left as they are."""
    before = torch.get_num_threads()
    n = rank_threads() if device.type == "cuda" else before
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def on_host(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` (each rank's shard of it) is in host memory."""
    return all(_local(p).device.type == "cpu" for p in module.parameters())


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone for a one-device offloaded plan: the one in
    place when this process is a world of one, else a new one on a free local port (gloo
    for a CPU, NCCL for a GPU), destroyed on exit.

    Raises:
        PlanError: this process is one rank of a larger group (a one-device plan runs in a
            process of its own).
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise PlanError(
                "a one-device offloaded plan (parallel.data = 1, parallel.offload) runs in a "
                f"process of its own, but this process is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}; run it alone, or with parallel.data = "
                f"{dist.get_world_size()}")
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend, kw = "nccl", {"device_id": device}
    else:
        backend, kw = "gloo", {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1, **kw)
    try:
        yield
    finally:
        dist.destroy_process_group()


def one_rank_mesh(device: torch.device) -> Any:
    """The 1-D ``DeviceMesh`` (dimension ``dp``) of a one-device offloaded plan, on
    ``device``; its process group is :func:`one_rank_group`'s."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(device)
    return init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
