"""Memory the math libraries keep on a GPU beside the model's tensors.

PyTorch gives each cuBLAS handle a workspace per CUDA stream, from the caching allocator,
when the handle's first matmul runs, and keeps it (``CublasHandlePool``:
``getChosenWorkspaceSize``): 32 MiB on compute capability 9 (H100, H200), ``:4096:2:16:8``
(8.125 MiB) elsewhere. Handles are per thread, and a step runs its matmuls from two: the
forward's, and autograd's thread for the device in backward. So a GPU that runs a matmul
holds two workspaces through the step. On one H200 (torch 2.11), GNMT-4 and Inception-v3
held 71 MiB at the start of a step beyond their parameters and AdamW state, one process
each; a convolutional U-Net without matmuls held none of it
(``docs/simulator.md``, memory)."""

from __future__ import annotations

import numpy as np

from autoplace.capture.op_rules import MATMUL_KINDS
from autoplace.cluster import Cluster, Device
from autoplace.graph import OpGraph
from autoplace.plan import Plan

__all__ = ["BLAS_THREADS", "blas_workspace", "blas_workspace_bytes"]

#: workspace bytes of one cuBLAS handle on one stream, by GPU kind; others take ``None``'s
_WORKSPACE = {"h100": 32 * 2**20, "h100-96": 32 * 2**20, "h200": 32 * 2**20,
              None: (4096 * 2 + 16 * 8) * 2**10}
#: threads issuing a step's matmuls on one device: the forward's and autograd's
BLAS_THREADS = 2


def blas_workspace_bytes(device: Device) -> float:
    """What a device that runs matmuls holds in cuBLAS workspaces (0 on a CPU)."""
    if device.kind == "cpu":
        return 0.0
    return float(BLAS_THREADS * _WORKSPACE.get(device.kind, _WORKSPACE[None]))


def blas_workspace(graph: OpGraph, plan: Plan, cluster: Cluster) -> np.ndarray:
    """``[devices]``: the cuBLAS workspaces each cluster device holds under ``plan`` (on
    every device whose part of the plan runs a matmul)."""
    per_device = cluster.__dict__.get("_sim_blas_workspace")
    if per_device is None:  # computed once per cluster
        per_device = np.array([blas_workspace_bytes(d) for d in cluster.devices])
        cluster.__dict__["_sim_blas_workspace"] = per_device
    if not per_device.any():
        return np.zeros(cluster.num_devices)
    names = graph.__dict__.get("_sim_matmuls")
    if names is None:  # computed once per graph
        names = [op.name for op in graph if op.kind in MATMUL_KINDS]
        graph.__dict__["_sim_matmuls"] = names
    if not names:
        return np.zeros(cluster.num_devices)
    k, t = plan.devices_per_replica, plan.parallel.tensor
    used = np.zeros(cluster.num_devices, dtype=bool)
    if k == 1:
        local = {0}
    else:
        groups, placement = plan.groups, plan.placement
        local = {placement[groups[n]] for n in names}
    for r in range(plan.parallel.data):
        for i, dev in enumerate(plan.replica_devices(r)):
            if i // t in local and dev < cluster.num_devices:
                used[dev] = True
    return np.where(used, per_device, 0.0)
