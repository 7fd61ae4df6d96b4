"""autoplace: find and run the fastest way to train a PyTorch model on a set of devices."""

from __future__ import annotations

from typing import Any

from autoplace.cluster import Cluster, Device
from autoplace.errors import AutoplaceError, CaptureError, OutOfMemoryError, PlanError
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import ParallelConfig, Plan
from autoplace.workloads import Workload

__version__ = "0.1.0"

__all__ = [
    "AutoplaceError", "CaptureError", "Cluster", "Device", "OpGraph", "OpNode",
    "OutOfMemoryError", "ParallelConfig", "Plan", "PlanError", "Workload",
    "capture", "estimate_costs", "execute", "lower_bound", "simulate",
]


def __getattr__(name: str) -> Any:
    # heavy parts load on first use so `import autoplace` stays fast
    if name == "capture":
        from autoplace.capture import capture

        return capture
    if name == "estimate_costs":
        from autoplace.costs import estimate_costs

        return estimate_costs
    if name in ("simulate", "lower_bound", "simulate_batch"):
        from autoplace import sim

        return getattr(sim, name)
    if name == "execute":
        from autoplace.executor import execute

        return execute
    raise AttributeError(f"module 'autoplace' has no attribute {name!r}")
