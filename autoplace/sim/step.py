"""Event-driven simulator of one training step under a :class:`Plan`; the RL reward.

:func:`simulate` returns the step time, per-device busy time and peak memory, OOM
as a result (never an exception), and optionally the timeline for a Gantt chart.
:func:`simulate_batch` does the same for many plans at once with numpy (plans with
``pipeline == 1``; others go through :func:`simulate`), and agrees with it.
:func:`lower_bound` is a time no plan can beat on the cluster.

Model, in brief (details in ``sim_model``, ``sim_local``, ``sim_pipeline``):

* compute: one queue per device in issue order (:func:`issue_order`: forward of all
  microbatches as a wavefront, then backward in reverse, then the AdamW update,
  whose time is ``7 x parameter bytes / memory bandwidth``); an op on ``1/(m d)``
  of the batch takes ``(t - f) / (m d) + f``, where the fixed part ``f`` is the
  profiled one (``OpNode.fwd_fixed_s`` / ``bwd_fixed_s``, capped at ``t``) where
  known, else ``min(t, o)`` (``o`` = launch overhead);
* host issue (``pipeline == 1``): a replica is one process; one host thread issues
  every forward item in order (``host_dispatch_s`` each, 30 us on GPU presets, 0 on
  CPU), then one autograd thread per device issues that device's backward items as
  PyTorch's engine does: from a ready queue, the latest-created ready node first, a
  node ready once its consumers' gradients are issued (``sim_local.backward_issue``);
  an op never starts before it is issued, so many microbatches x ops on fast GPUs
  can be host-bound;
* transfers: one queue per directed link, ``alpha + bytes / bandwidth``, a tensor
  sent once per (producer, microbatch, destination device), not before the host
  thread issued the copy (``copy_host_s`` each, 0.2 ms on GPU presets: the forward
  thread for ``Tensor.to``, the consumer device's autograd thread for the gradient);
* data parallel: DDP all-reduces gradients in 25 MB buckets in reverse topological
  order on a collective stream overlapping backward, its per-parameter backward hook on
  the autograd thread's clock (``ddp_param_host_s``). In a one-process replica FSDP2
  (``fsdp``, and ``zero2`` without the backward gathers) all-gathers each unit (module
  block) one ahead at the autocast dtype and reduce-scatters it after its last backward
  op, its per-parameter work (``shard_param_host_s``) on the host clocks (``sim_fsdp``);
  sharded pipeline stages reduce-scatter in buckets, ZeRO-2 all-gathers the updated
  parameters, and :func:`sharded_host_s` adds the per-parameter work to the step;
* pipelines: stage-level GPipe / 1F1B schedules with boundary transfers;
* memory per device: parameters + gradients + AdamW state (sharded as configured)
  + activations kept for backward (microbatches held per the schedule; recomputed
  groups keep only their inputs) + the largest transient output (and recomputed
  group) + cuBLAS's workspaces on GPUs that run matmuls (``sim_workspace``), compared
  with ``usable_memory_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.lowering import validate
from autoplace.plan import Plan
from autoplace.sim.allocator import allocator_retry_s
from autoplace.sim.batch import run_batch
from autoplace.sim.block_profile import block_tables, needs_scalar
from autoplace.sim.compiled import compiled_arrays, compiled_tables, fused_times
from autoplace.sim.local import simulate_local
from autoplace.sim.model import (
    Event,
    cost_tables,
    ensure_costs,
    graph_arrays,
    lower_bound_from,
)
from autoplace.sim.offload import simulate_offload
from autoplace.sim.pipeline import simulate_pipeline
from autoplace.sim.tensor import simulate_tensor
from autoplace.sim.workspace import blas_workspace

__all__ = [
    "BatchResult", "Event", "SimResult", "lower_bound", "sharded_host_s", "simulate",
    "simulate_batch",
]


@dataclass
class SimResult:
    """What one simulated training step costs.

    Attributes:
        step_time_s: seconds per training step.
        busy_time_s: compute seconds per cluster device (0 for unused devices).
        peak_memory_bytes: peak memory per cluster device.
        oom: True when some device needs more than its usable memory.
        oom_devices: cluster indices of those devices.
        lower_bound_s: :func:`lower_bound` of the graph on the cluster.
        timeline: the events of replica 0 when asked for, else None.
        memory_breakdown: per cluster device, bytes of params / grads / optimizer /
            activations / transient (None for unused devices).
    """

    step_time_s: float
    busy_time_s: list[float]
    peak_memory_bytes: list[int]
    oom: bool
    oom_devices: list[int]
    lower_bound_s: float
    timeline: list[Event] | None = None
    memory_breakdown: list[dict[str, int] | None] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "busy_time_s": list(self.busy_time_s),
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "oom": self.oom,
            "oom_devices": list(self.oom_devices),
            "lower_bound_s": self.lower_bound_s,
            "memory_breakdown": self.memory_breakdown,
            "timeline": None if self.timeline is None else [e.to_json() for e in self.timeline],
        }

    def __repr__(self) -> str:
        mem = ", ".join(f"{b / 2**30:.2f}" for b in self.peak_memory_bytes)
        return (f"SimResult(step={self.step_time_s * 1e3:.3f} ms, lower_bound="
                f"{self.lower_bound_s * 1e3:.3f} ms, peak GiB=[{mem}], oom={self.oom})")


@dataclass
class BatchResult:
    """:func:`simulate_batch` results; row ``p`` is plan ``p``.

    Attributes:
        step_time_s: float64 ``[P]``.
        peak_memory_bytes: int64 ``[P, D]`` (D = cluster devices).
        oom: bool ``[P]``.
        lower_bound_s: :func:`lower_bound` of the graph on the cluster.
    """

    step_time_s: np.ndarray
    peak_memory_bytes: np.ndarray
    oom: np.ndarray
    lower_bound_s: float

    def __len__(self) -> int:
        return len(self.step_time_s)

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s.tolist(),
                "peak_memory_bytes": self.peak_memory_bytes.tolist(),
                "oom": self.oom.tolist(), "lower_bound_s": self.lower_bound_s}


def simulate(graph: OpGraph, plan: Plan, cluster: Cluster, *, timeline: bool = False) -> SimResult:
    """Simulate one training step of ``graph`` under ``plan`` on ``cluster``.

    Raises:
        PlanError: the plan does not fit the graph or the cluster (``plan.validate``).
    """
    validate(graph, plan, cluster)
    ensure_costs(graph, cluster)
    if plan.parallel.tensor > 1:  # one rank of each tensor group (sim/tensor.py)
        return simulate_tensor(graph, plan, cluster, simulate, timeline=timeline)
    ga = graph_arrays(graph)
    tables = cost_tables(graph, cluster)
    if plan.parallel.compile:  # compiled pieces fuse their cheap ops (sim/compiled.py)
        tables = compiled_tables(tables, ga, fused_times(graph, tables.kinds), graph=graph,
                                 plan=plan)
        ga = compiled_arrays(graph, ga, plan)
    # checkpointing's host time and CUDA graphs' device time, profiled on the card
    tables = block_tables(graph, tables, ga, plan)  # (sim/block_profile.py)
    if plan.parallel.offload:  # shards on the host, the update on the CPU (sim/offload.py)
        out = simulate_offload(ga, plan, cluster, tables, timeline)
    elif plan.parallel.pipeline > 1:
        out = simulate_pipeline(ga, plan, cluster, tables, timeline)
    else:
        out = simulate_local(ga, plan, cluster, tables, timeline)
    extra = sharded_host_s(graph, plan, cluster)
    work = blas_workspace(graph, plan, cluster)
    peak = [int(round(x + w)) for x, w in zip(out["peak"], work)]
    breakdown = out["breakdown"]
    if breakdown is not None:
        for j, b in enumerate(breakdown[:len(work)]):
            if isinstance(b, dict) and work[j] > 0:
                b["workspace"] = int(work[j])
                b["total"] = int(b.get("total", 0) + work[j])
    retry = allocator_retry_s(ga, plan, cluster, peak)  # reserved over the cap (sim/allocator.py)
    step = float(out["step"]) + extra + retry
    usable = tables.usable_memory
    oom_devices = [i for i, b in enumerate(peak) if b > usable[i]]
    events = None
    if timeline:
        if extra > 0:
            out["events"].append(Event("host", "FSDP2 per-parameter work", float(out["step"]),
                                       float(out["step"]) + extra, "host"))
        if retry > 0:
            out["events"].append(Event("host", "allocator retries at the memory cap",
                                       step - retry, step, "host"))
        events = sorted(out["events"], key=lambda e: (e.start_s, e.resource))
    return SimResult(
        step_time_s=step,
        busy_time_s=[float(x) for x in out["busy"]],
        peak_memory_bytes=peak,
        oom=bool(oom_devices),
        oom_devices=oom_devices,
        lower_bound_s=_cached_lower_bound(graph, cluster, tables),
        timeline=events,
        memory_breakdown=breakdown,
    )


def simulate_batch(graph: OpGraph, plans: list[Plan], cluster: Cluster) -> BatchResult:
    """Simulate many plans; vectorised over plans with ``pipeline == 1``.

    Results equal :func:`simulate`'s (to rounding). Plans are validated first.
    """
    ensure_costs(graph, cluster)
    tables = cost_tables(graph, cluster)
    plans = list(plans)
    # tensor-parallel plans (sim/tensor.py), compiled ones (their own op costs),
    # offloaded ones (sim/offload.py) and those a profiled block prices
    # (sim/block_profile.py) one by one
    if any(_one_by_one(graph, p) for p in plans):
        flat = [i for i, p in enumerate(plans) if not _one_by_one(graph, p)]
        step = np.zeros(len(plans))
        peak = np.zeros((len(plans), cluster.num_devices))
        if flat:
            step[flat], peak[flat] = run_batch(graph, [plans[i] for i in flat], cluster, tables)
            peak[flat] += [blas_workspace(graph, plans[i], cluster) for i in flat]
            step[flat] += [_host_extra(graph, plans[i], cluster, peak[i]) for i in flat]
        for i, p in enumerate(plans):
            if _one_by_one(graph, p):
                res = simulate(graph, p, cluster)
                step[i], peak[i] = res.step_time_s, res.peak_memory_bytes
        return _batch_result(graph, cluster, tables, step, peak)
    step, peak = run_batch(graph, plans, cluster, tables)
    peak = peak + np.array([blas_workspace(graph, p, cluster) for p in plans]).reshape(peak.shape)
    step = step + np.array([_host_extra(graph, p, cluster, peak[i]) for i, p in enumerate(plans)])
    return _batch_result(graph, cluster, tables, step, peak)


def _host_extra(graph: OpGraph, plan: Plan, cluster: Cluster, peak: np.ndarray) -> float:
    """What :func:`simulate` adds to a plan's step after its timeline: FSDP2's
    per-parameter host work and allocator retries over a cap."""
    rounded = [int(round(x)) for x in peak]
    return sharded_host_s(graph, plan, cluster) + allocator_retry_s(
        graph_arrays(graph), plan, cluster, rounded)


def _one_by_one(graph: OpGraph, plan: Plan) -> bool:
    par = plan.parallel
    return par.tensor > 1 or par.compile or par.offload or needs_scalar(graph, plan)


def _batch_result(graph: OpGraph, cluster: Cluster, tables, step: np.ndarray,
                  peak: np.ndarray) -> BatchResult:
    peak_i = np.rint(peak).astype(np.int64)
    oom = (peak_i > tables.usable_memory[None, :]).any(axis=1)
    return BatchResult(step_time_s=step, peak_memory_bytes=peak_i, oom=oom,
                       lower_bound_s=_cached_lower_bound(graph, cluster, tables))


def sharded_host_s(graph: OpGraph, plan: Plan, cluster: Cluster) -> float:
    """Host time FSDP2's per-parameter work adds to a step of sharded pipeline stages.

    Per parameter tensor and sharded collective (``fsdp``: all-gather before forward and
    before backward, reduce-scatter after it; ``zero2``: the reduce-scatter and the
    all-gather of updated parameters), ``Device.shard_param_host_s``, which the device
    waits for: the largest such sum over the devices of a replica (they run in parallel).
    0 for every other plan: a one-process replica charges this work on its host clocks
    (``sim_fsdp.FsdpStreams.host``).
    """
    par = plan.parallel
    if par.data <= 1 or par.shard not in ("fsdp", "zero2") or par.pipeline <= 1:
        return 0.0
    phases = 3 if par.shard == "fsdp" else 2
    ga = graph_arrays(graph)
    per_dev: dict[int, float] = {}
    for name, count in zip(ga.names, ga.param_count.tolist()):
        if count:
            j = plan.placement[plan.groups[name]]
            per_dev[j] = per_dev.get(j, 0.0) + count
    return max((phases * c * cluster.devices[j].shard_param_host_s
                for j, c in per_dev.items()), default=0.0)


def lower_bound(graph: OpGraph, cluster: Cluster) -> float:
    """Seconds no plan's simulated step time can go below on ``cluster``.

    The larger of (a) all forward + backward work at its fastest device kind plus the
    AdamW update at the best memory bandwidth, spread over every device, and (b) the
    critical path of the part of each op's time no batch split removes (its fixed
    part: the profiled one where known, else ``min(t, launch overhead)``; forward then
    backward). The full critical path is not a bound: data parallelism and
    microbatches split every op's work.
    """
    ensure_costs(graph, cluster)
    return _cached_lower_bound(graph, cluster, cost_tables(graph, cluster))


def _cached_lower_bound(graph: OpGraph, cluster: Cluster, tables) -> float:
    key = (cluster.devices, cluster.alpha_s, cluster.bandwidth,
           float(tables.fwd.sum()), float(tables.bwd.sum()),
           float(np.nansum(tables.fwd_fixed)), float(np.nansum(tables.bwd_fixed)),
           int(np.isnan(tables.fwd_fixed).sum()), int(np.isnan(tables.bwd_fixed).sum()))
    cache = graph.__dict__.setdefault("_sim_lower_bound", {})
    if key not in cache:
        cache.clear()
        cache[key] = lower_bound_from(graph, cluster, tables)
    return cache[key]
