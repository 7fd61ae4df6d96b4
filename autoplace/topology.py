"""Nodes: hosts of devices joined by a network.

A multi-node cluster is ``num_nodes`` identical hosts of ``gpus_per_node`` devices;
device ``i`` lives on node ``i // gpus_per_node`` (torchrun's numbering: global rank
``node_rank * nproc_per_node + local_rank``). Two devices of one node copy over the
node's link (NVLink); two devices of different nodes over the network (RDMA, one NIC
per GPU as on rail-optimised H100 / H200 clusters). This module holds what that
structure implies without knowing :class:`~autoplace.cluster.Cluster` itself: the pair
matrices it fills, a fast check of those matrices (a 512-device cluster has 262,144
pairs), the compact JSON form of a node and the names of the multi-node presets.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

from autoplace.errors import AutoplaceError

__all__ = [
    "CPU_SPEC",
    "GPU_HOST_DISPATCH_S",
    "GPU_SPECS",
    "HOST_LINK_BANDWIDTH",
    "HOST_MEMORY_BANDWIDTH",
    "LINKS",
    "NETWORK_ALPHA_S",
    "NETWORK_BANDWIDTH",
    "NODE_COUNTS",
    "check_link_matrices",
    "check_nodes",
    "gpu_kind",
    "link_matrices",
    "multi_node_name",
]

#: Latency of one message between nodes over RDMA (InfiniBand / RoCE): a few us.
NETWORK_ALPHA_S = 5e-6
#: Bytes/s each GPU's NIC sends to another node: 400 Gb/s RDMA per GPU (Grand Teton,
#: DGX H100 / H200), the network torchtitan's multi-node measurements ran on.
NETWORK_BANDWIDTH = 50e9
#: Node counts of the multi-node presets.
NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
GiB = 2**30

#: host seconds to issue one op (forward, or one op's backward) from Python on a GPU
#: (eager PyTorch with autocast: ~20-40 us per op).
GPU_HOST_DISPATCH_S = 30e-6
#: Per parameter tensor, fitted to what DDP and FSDP2 plans measured beyond the simulated
#: step on 2x H200 (torch 2.11; docs/simulator.md, the links run: gpt-1b, gnmt-4,
#: inception-v3, 40 to 284 parameter tensors): DDP's backward hook, on the autograd thread, and
#: FSDP2's per-parameter work per all-gather / reduce-scatter, which the device waits for.
#: Per copy between two GPUs of one process (``Tensor.to`` forward, its gradient's copy back
#: in backward), fitted on the one-process placements of four stored suites (2x and 4x H200,
#: runs 20-21: median simulator error 6.5% -> 5.8%, with autograd's ready-queue order)
#: and checked on three earlier ones (runs 18-19: 8.2% -> 5.7%); inception-v3's searched
#: placements, 37-80 copies a step, had simulated 30-45% fast.
GPU_COPY_HOST_S = 0.2e-3
GPU_HOST_PARAM = dict(ddp_param_host_s=0.15e-3, shard_param_host_s=0.13e-3,
                      copy_host_s=GPU_COPY_HOST_S)
#: Bytes/s between host memory and a GPU, each way, over PCIe Gen4 x16 (A100): about
#: 25e9 achieved. The default for a device that names none.
HOST_LINK_BANDWIDTH = 25e9
#: The same over PCIe Gen5 x16 (H100, H200): about 50e9.
PCIE_GEN5_BANDWIDTH = 50e9
#: Bytes/s of host memory traffic of the CPU optimizer step of an offloaded plan (torch's
#: fused CPU AdamW on one thread; Device.host_memory_bandwidth says where it comes from).
HOST_MEMORY_BANDWIDTH = 20e9
#: The same for one rank on a GPU host, where each rank's fused CPU AdamW runs on its share
#: of the node's cores (16 in both runs below). Fitted on one: gpt-1b offloaded with its
#: blocks recomputed at a 12 GiB cap on one H200 of a 16-core host, 650 ms a step against
#: 1632 ms simulated at the one-thread rate. Checked on another: gpt-1b offloaded on 2x
#: H200 of a 32-core host, 385 ms measured against 308 simulated (docs/simulator.md, offload).
GPU_HOST_MEMORY_BANDWIDTH = 70e9


def _gpu(kind: str, memory_gib: int, peak_flops: float, memory_bandwidth: float,
         host_bandwidth: float) -> dict[str, Any]:
    """Device fields of one GPU kind; the host costs and CPU-update rate every GPU shares."""
    return dict(name="cuda:{i}", kind=kind, memory_bytes=memory_gib * GiB, peak_flops=peak_flops,
                memory_bandwidth=memory_bandwidth, launch_overhead_s=8e-6,
                host_dispatch_s=GPU_HOST_DISPATCH_S, **GPU_HOST_PARAM,
                host_bandwidth=host_bandwidth, host_memory_bandwidth=GPU_HOST_MEMORY_BANDWIDTH)


#: Device fields per GPU kind (the name is a pattern: ``{i}`` becomes the local index).
# Achievable (not datasheet) rates for bf16 training: ~60% of dense peak.
GPU_SPECS: dict[str, dict[str, Any]] = {
    "h100": _gpu("h100", 80, 600e12, 2.8e12, PCIE_GEN5_BANDWIDTH),
    "h200": _gpu("h200", 141, 600e12, 4.0e12, PCIE_GEN5_BANDWIDTH),
    "a100": _gpu("a100", 80, 250e12, 1.6e12, HOST_LINK_BANDWIDTH),
    # Grand Teton's H100: 96 GB HBM2e at 2.4 TB/s peak, run at a 500 W power limit
    # (torchtitan's multi-node measurements); rates scaled from the 700 W H100's.
    "h100-96": _gpu("h100-96", 96, 520e12, 2.0e12, PCIE_GEN5_BANDWIDTH),
    "a100-pcie": _gpu("a100-pcie", 40, 230e12, 1.3e12, HOST_LINK_BANDWIDTH),
}
_NVLINK4 = dict(alpha_s=10e-6, bandwidth=300e9, collective_bandwidth=250e9)
#: Links inside a node per GPU kind: copy latency and bandwidth, collective bus bandwidth.
LINKS: dict[str, dict[str, float]] = {
    "h100": _NVLINK4,
    "h200": _NVLINK4,
    "h100-96": _NVLINK4,
    "a100": dict(alpha_s=10e-6, bandwidth=200e9, collective_bandwidth=180e9),
    "a100-pcie": dict(alpha_s=15e-6, bandwidth=20e9, collective_bandwidth=16e9),
}
CPU_SPEC: dict[str, Any] = dict(name="cpu", kind="cpu", memory_bytes=8 * GiB,
                                peak_flops=150e9, memory_bandwidth=10e9,
                                launch_overhead_s=20e-6, host_bandwidth=10e9,
                                host_memory_bandwidth=10e9)


def gpu_kind(name: str) -> str:
    """The device kind of a GPU named ``name`` (``torch.cuda.get_device_name``)."""
    n = name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100"
    if "a100" in n:
        return "a100-pcie" if "pcie" in n else "a100"
    return re.sub(r"[^a-z0-9]+", "-", n).strip("-") or "gpu"


def multi_node_name(kind: str, gpus_per_node: int, num_nodes: int) -> str:
    """A multi-node preset's name: ``h100x8-n8`` is 8 nodes of 8 H100s."""
    return f"{kind}x{gpus_per_node}-n{num_nodes}"


def check_nodes(num_devices: int, gpus_per_node: Any, where: str) -> int:
    """``gpus_per_node`` checked against the device count; returns it as an int."""
    if (not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool)
            or gpus_per_node < 1):
        raise AutoplaceError(f"{where}: gpus_per_node must be a positive integer, got "
                             f"{gpus_per_node!r}")
    if num_devices % gpus_per_node:
        raise AutoplaceError(
            f"{where}: {num_devices} devices do not split into nodes of {gpus_per_node}; "
            f"gpus_per_node must divide the device count (valid: "
            f"{', '.join(str(g) for g in range(1, num_devices + 1) if num_devices % g == 0)})")
    return gpus_per_node


#: Matrices :func:`link_matrices` built, by id (holding them keeps the ids unique): a
#: cluster whose matrices are one of these needs no entry-by-entry check.
_BUILT: dict[int, tuple] = {}


@lru_cache(maxsize=64)
def link_matrices(
    num_devices: int,
    gpus_per_node: int,
    link_alpha_s: float,
    link_bandwidth: float,
    network_alpha_s: float,
    network_bandwidth: float,
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """``(alpha_s, bandwidth)`` of every ordered device pair: the node's link inside a
    node, the network between nodes, free (0 s, inf bytes/s) from a device to itself.

    Rows are built by concatenating runs of one value, and the result is cached: a
    512-device cluster's matrices cost a few milliseconds once, and every variation of
    the cluster (a memory cap, a renamed copy) shares the same tuples.
    """
    n, g = num_devices, gpus_per_node
    alpha, bandwidth = [], []
    for node in range(n // g):
        before, after = node * g, n - (node + 1) * g
        for local in range(g):
            a_in = (link_alpha_s,) * local + (0.0,) + (link_alpha_s,) * (g - local - 1)
            b_in = (link_bandwidth,) * local + (math.inf,) + (link_bandwidth,) * (g - local - 1)
            alpha.append((network_alpha_s,) * before + a_in + (network_alpha_s,) * after)
            bandwidth.append((network_bandwidth,) * before + b_in + (network_bandwidth,) * after)
    out = tuple(alpha), tuple(bandwidth)
    if len(_BUILT) >= 128:
        del _BUILT[next(iter(_BUILT))]
    _BUILT[id(out[0])], _BUILT[id(out[1])] = out[0], out[1]
    return out


def check_link_matrices(alpha_s: Any, bandwidth: Any, num_devices: int, where: str) -> None:
    """Raise :class:`AutoplaceError` naming the first bad entry: both matrices
    ``n x n``; latencies finite and >= 0; bandwidths positive and finite between two
    devices, positive (inf allowed) from a device to itself.

    Each row is checked once per distinct ``(type, value)`` in it, so a node-built
    512-device cluster (three distinct values a row) checks in milliseconds.
    """
    n = num_devices
    for label, m in (("alpha_s", alpha_s), ("bandwidth", bandwidth)):
        if len(m) != n or any(len(row) != n for row in m):
            raise AutoplaceError(f"{where}: {label} must be {n}x{n}")
    if _BUILT.get(id(alpha_s)) is alpha_s and _BUILT.get(id(bandwidth)) is bandwidth:
        return  # built from checked numbers by link_matrices
    for i in range(n):
        a_row, b_row = alpha_s[i], bandwidth[i]
        for x in {(type(x), x) for x in a_row}:
            if not _finite_at_least(x[1], 0.0, strict=False):
                j = _first(a_row, x[1])
                raise AutoplaceError(f"{where}: link {i}->{j} alpha_s must be a finite "
                                     f"number >= 0, got {x[1]!r}")
        self_bw = b_row[i]
        if not _is_number(self_bw) or not self_bw > 0:
            raise AutoplaceError(f"{where}: link {i}->{i} bandwidth must be positive, got "
                                 f"{self_bw!r}")
        for x in {(type(x), x) for x in b_row[:i] + b_row[i + 1:]}:
            if not _finite_at_least(x[1], 0.0, strict=True):
                j = _first(b_row, x[1], skip=i)
                raise AutoplaceError(f"{where}: link {i}->{j} bandwidth must be a positive "
                                     f"finite number, got {x[1]!r}")


def node_json(devices: list[dict[str, Any]], link_alpha_s: float | None,
              link_bandwidth: float | None) -> dict[str, Any]:
    """One node of the compact form: its devices and the link between two of them."""
    node: dict[str, Any] = {"devices": devices}
    if link_alpha_s is not None:
        node["link_alpha_s"] = link_alpha_s
        node["link_bandwidth"] = link_bandwidth
    return node


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite_at_least(x: Any, low: float, *, strict: bool) -> bool:
    if not _is_number(x) or not math.isfinite(x):
        return False
    return x > low if strict else x >= low


def _first(row: tuple, value: Any, skip: int = -1) -> int:
    for j, x in enumerate(row):
        if j != skip and (x is value or x == value or (x != x and value != value)):
            return j
    return -1
