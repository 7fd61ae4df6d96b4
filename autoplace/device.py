"""A device of a cluster: its memory, its speed and the host's costs of driving it.

The checks on these numbers (:func:`check_positive`, :func:`check_non_negative`) also
serve the cluster's own fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autoplace.errors import AutoplaceError
from autoplace.topology import HOST_LINK_BANDWIDTH, HOST_MEMORY_BANDWIDTH

__all__ = ["Device", "is_number", "check_positive", "check_non_negative"]


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device.

    Attributes:
        name: torch device string (``"cuda:0"``, ``"cpu"``).
        kind: device kind, the key of per-op costs (``"h100"``, ``"h200"``, ``"cpu"``).
        memory_bytes: physical memory.
        memory_cap_bytes: a cap below ``memory_bytes`` (enforced on real GPUs), or None.
        peak_flops: achievable dense FLOP/s for the training dtype.
        memory_bandwidth: achievable bytes/s of device memory.
        launch_overhead_s: fixed device-side cost per op (the kernel launch floor: an
            op never runs shorter on the device, whatever its share of the batch).
        host_dispatch_s: host time to issue one op (one forward op, or one op's
            backward) from Python in one process. The simulator serialises these
            issues on one host thread for a process's forward pass and on one
            autograd thread per device for its backward, and an op cannot start
            before it is issued: with many microbatches x ops the host, not the
            device, can bound the step. 0 for CPU devices (measured CPU op times
            already include the dispatch, and the CPU is the device); about 30 us
            for GPUs driven eagerly under autocast.
        ddp_param_host_s: backward host time per parameter tensor under DDP (its
            autograd hook and bucketing), on the autograd thread's clock like
            ``host_dispatch_s``: hidden behind long kernels, it bounds the step of a
            model with many small ones.
        shard_param_host_s: host time per parameter tensor per sharded collective of
            FSDP2 (all-gather before forward and before backward, reduce-scatter after
            it: 3 a step; ZeRO-2: 2) that the device waits for: added to the step.
        copy_host_s: host time to issue one copy to another GPU of the same process.
        host_bandwidth: bytes/s of the link between the host's memory and this device,
            each way (PCIe: Gen5 x16 ~50e9 on H100 / H200, Gen4 x16 ~25e9 on A100). An
            offloaded plan (``parallel.offload``) copies each FSDP2 unit's parameters
            over it before forward and backward, and its gradients back after.
        host_memory_bandwidth: bytes/s of host memory traffic one rank's optimizer step
            reaches on the CPU (AdamW moves 7 bytes per parameter byte), for an offloaded
            plan's step. On a GPU each rank steps on its share of the node's cores
            (:func:`autoplace.executor.offload.host_threads`); a CPU device's rank on one
            thread. The default, 20e9, is about what torch's fused CPU AdamW reached on
            one thread of a 2-core x86 machine (22.5 GB/s, torch 2.13).
    """

    name: str
    kind: str
    memory_bytes: int
    memory_cap_bytes: int | None = None
    peak_flops: float = 1e12
    memory_bandwidth: float = 50e9
    launch_overhead_s: float = 5e-6
    host_dispatch_s: float = 0.0
    ddp_param_host_s: float = 0.0
    shard_param_host_s: float = 0.0
    copy_host_s: float = 0.0
    host_bandwidth: float = HOST_LINK_BANDWIDTH
    host_memory_bandwidth: float = HOST_MEMORY_BANDWIDTH

    def __post_init__(self) -> None:
        for key in ("name", "kind"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise AutoplaceError(f"device {key} must be a non-empty string, got "
                                     f"{getattr(self, key)!r}")
        label = f"device {self.name!r}"
        check_positive(self.memory_bytes, f"{label}: memory_bytes")
        if self.memory_cap_bytes is not None:
            check_positive(self.memory_cap_bytes, f"{label}: memory_cap_bytes")
        check_positive(self.peak_flops, f"{label}: peak_flops")
        check_positive(self.memory_bandwidth, f"{label}: memory_bandwidth")
        check_positive(self.host_bandwidth, f"{label}: host_bandwidth")
        check_positive(self.host_memory_bandwidth, f"{label}: host_memory_bandwidth")
        for key in ("launch_overhead_s", "host_dispatch_s", "ddp_param_host_s",
                    "shard_param_host_s", "copy_host_s"):
            check_non_negative(getattr(self, key), f"{label}: {key}")

    @property
    def usable_memory_bytes(self) -> int:
        """Memory a plan may use: the cap when set, else the physical memory."""
        if self.memory_cap_bytes is None:
            return self.memory_bytes
        return min(self.memory_bytes, self.memory_cap_bytes)


def is_number(x: Any) -> bool:
    """Whether ``x`` is an int or a float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_positive(x: Any, what: str) -> None:
    """Raise :class:`AutoplaceError` unless ``x`` is a positive finite number."""
    if not is_number(x) or not math.isfinite(x) or x <= 0:
        raise AutoplaceError(f"{what} must be a positive finite number, got {x!r}")


def check_non_negative(x: Any, what: str) -> None:
    """Raise :class:`AutoplaceError` unless ``x`` is a finite number >= 0."""
    if not is_number(x) or not math.isfinite(x) or x < 0:
        raise AutoplaceError(f"{what} must be a finite number >= 0, got {x!r}")
