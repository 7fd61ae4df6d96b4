"""The step of an offloaded plan (``parallel.offload``): FSDP2 with its shards on the host.

FSDP2's ``CPUOffloadPolicy`` keeps every rank's parameter shards, their gradients and the
AdamW state in host memory; the GPU holds only the units in flight and the activations.
Each rank is one device in one process (``pipeline == 1``, one local device), so a
replica's ops run in issue order on one compute queue, issued by the host threads as in
:mod:`autoplace.sim.local`. On top of that, per FSDP2 unit (the lowering's units, as
:class:`autoplace.sim.fsdp.FsdpStreams` gathers them, one unit prefetched ahead):

* before its forward, and again before its backward (a unit is resharded after its
  forward), its fp32 shard (unit bytes / :func:`shard_count`) is copied host -> device
  over the device's host link (``Device.host_bandwidth``), then all-gathered: the copy is
  FSDP2's copy-in on the all-gather stream, so it overlaps the compute of the unit before;
* after its last backward op, its gradients are reduce-scattered (fp32), then the shard
  is copied device -> host. The host link is full duplex: one queue each way;
* when every gradient is on the host, the optimizer steps on the CPU over the rank's
  shard: ``7 x shard bytes`` (AdamW's traffic, as :func:`autoplace.sim.model.update_time`
  prices it on a device) at ``Device.host_memory_bandwidth``, each rank's own rate: the
  executor gives every rank on a GPU its share of the node's cores
  (:func:`autoplace.executor.offload.host_threads`).

On a CPU device the host is the device: its copies cost nothing.

GPU memory: the gathered units (the root's, the current and the prefetched one, at the
gather dtype); each unit's unsharded gradients and their fp32 copy from its backward to
its reduce-scatter, in the timeline as FSDP2 without offload (one rank included); cuDNN's
packed copy of recurrent weights on GPUs; activations and transients as in any one-process
replica. Measured on one H200 (gpt-1b at batch 4, its blocks recomputed, a group of one):
at the peak, the start of the backward, no gradient exists yet and only the root's unit is
gathered (``scripts/bench/peak_contents.py``). The host holds the fp32 shard, its gradient and AdamW's two moments per
parameter (``memory_breakdown[...]["host"]``, not compared with any capacity).
"""

from __future__ import annotations

import numpy as np

from autoplace.cluster import Cluster
from autoplace.lowering import issue_order_items
from autoplace.plan import Plan
from autoplace.sim.fsdp import FsdpStreams
from autoplace.sim.local import backward_issue, local_plan, op_times
from autoplace.sim.model import (
    OPTIMIZER_STATE_PER_PARAM_BYTE,
    UPDATE_TRAFFIC_PER_PARAM_BYTE,
    CostTables,
    Event,
    GraphArrays,
    MemoryModel,
    coll_resource,
    collective_time,
    fsdp_units,
    host_times,
    replicas_identical,
)
from autoplace.sim.replica_memory import local_memory

__all__ = ["OffloadStreams", "host_bytes", "host_copy_s", "offload_memory", "shard_count",
           "simulate_offload"]


def host_copy_s(cluster: Cluster, device: int, nbytes: float) -> float:
    """Seconds to copy ``nbytes`` between host memory and cluster device ``device`` (0 on
    a CPU device: its memory is the host's)."""
    dev = cluster.devices[device]
    if dev.kind == "cpu" or nbytes <= 0:
        return 0.0
    return float(nbytes) / dev.host_bandwidth


class OffloadStreams(FsdpStreams):
    """:class:`FsdpStreams` with each unit's shard copied in before its all-gather and its
    gradient shard copied out after its reduce-scatter, on one host-link queue each way."""

    def __init__(self, ga: GraphArrays, lp, cluster: Cluster, plan: Plan,
                 shard_host: list[float], base: int) -> None:
        super().__init__(ga, lp, cluster, plan, shard_host)
        self.base = base
        shards = shard_count(plan)
        self.copy_s = [host_copy_s(cluster, base + j, b / shards)
                       for b, j in zip(self.unit_bytes, self.unit_dev)]
        self.h2d_free = [0.0] * lp.k
        self.d2h_free = [0.0] * lp.k

    def prefetch(self, j: int, trigger: float, phase: str, events) -> None:
        seq, p = self.seq[phase][j], self.ptr[phase][j]
        if p >= len(seq):
            return
        u = seq[p]
        self.ptr[phase][j] = p + 1
        c0 = max(self.h2d_free[j], trigger)
        c1 = c0 + self.copy_s[u]
        self.h2d_free[j] = c1
        s0 = max(self.gather_free[j], c1)
        e0 = s0 + collective_time(self.ag[j], self.gather_scale * self.unit_bytes[u])
        self.gather_free[j] = e0
        self.end[phase][u] = e0
        if events is not None:
            if c1 > c0:
                events.append(Event(coll_resource(j, self.k, "h2d"), f"unit{u}", c0, c1, "comm"))
            if e0 > s0:
                events.append(Event(coll_resource(j, self.k, "gather"), f"unit{u}", s0, e0,
                                    "allgather"))

    def done(self, i: int, fin: float, host: float, events) -> float:
        u = self.unit_of[i]
        last = self.left[u] == 1
        spent = super().done(i, fin, host, events)
        if last:
            j = self.unit_dev[u]
            s0 = max(self.d2h_free[j], self.coll_free[j])
            self.d2h_free[j] = s0 + self.copy_s[u]
            if events is not None and self.copy_s[u] > 0:
                events.append(Event(coll_resource(j, self.k, "d2h"), f"unit{u}", s0,
                                    self.d2h_free[j], "comm"))
        return spent


def offload_memory(ga: GraphArrays, lp, plan: Plan) -> MemoryModel:
    """GPU memory of one rank of an offloaded plan (see the module docstring); the bytes
    its host holds are :func:`host_bytes`."""
    mem = local_memory(ga, lp, plan)[0]  # activations and transients of the replica
    fu = fsdp_units(ga, lp.dev, 1, plan.parallel.shard_units, plan)
    root = sum(b for b, r in zip(fu.unit_bytes, fu.root) if r)
    largest = max((b for b, r in zip(fu.unit_bytes, fu.root) if not r), default=0.0)
    total = float(ga.param_bytes.sum())
    in_flight = min(total, root + 2.0 * largest)
    # the gathered units at the gather dtype (the fp32 shard each copies in lives only
    # until its all-gather, before the activations peak); cuDNN's packed copy of a
    # recurrent module's gathered weights stays beside them, as in any sharded replica on
    # GPUs (``static_memory``)
    packed = (float(ga.packed_bytes.sum()) if lp.cuda and ga.packed_bytes is not None
              else 0.0)
    mem.params = ga.gather_scale * in_flight + packed
    # each unit's unsharded gradients and their fp32 copy live from its backward to its
    # reduce-scatter: the timeline counts them there (``op_memory``'s ``once``)
    mem.grads = 0.0
    mem.optimizer = 0.0
    return mem


def host_bytes(ga: GraphArrays, plan: Plan) -> float:
    """Host bytes of one rank: its fp32 parameter shard, its gradient and AdamW's moments."""
    return float(ga.param_bytes.sum()) / shard_count(plan) * (2.0 + OPTIMIZER_STATE_PER_PARAM_BYTE)


def shard_count(plan: Plan) -> int:
    """Ranks each parameter is split over: ``data``, or ``data / replicate`` under HSDP."""
    return plan.parallel.data // plan.parallel.replicate


def _run_replica(ga: GraphArrays, lp, tables: CostTables, cluster: Cluster, plan: Plan,
                 order: list[int], base: int, record: bool) -> dict:
    """Forward, backward and the host-link copies of the replica on cluster device
    ``base``: when its device ends, when its last gradient reaches the host, busy time."""
    n, m = ga.n, lp.m
    tf, tb = op_times(ga, lp, tables, base)
    hf, hb = host_times(tables, np.full(n, base, dtype=np.int64), np.arange(n),
                        1.0 / (m * lp.d))
    hf, hb = hf.tolist(), hb.tolist()
    events: list[Event] | None = [] if record else None
    fs = OffloadStreams(ga, lp, cluster, plan, [float(tables.shard_host[base])], base)

    def label(item: int) -> str:
        return ga.names[item % n] if m == 1 else f"{ga.names[item % n]}#mb{item // n}"

    fs.prefetch(0, 0.0, "f", events)
    free = busy = host = 0.0
    for item in order:  # one host thread issues the forward
        i = item % n
        host += hf[i] + fs.host(i, "f")
        start = max(free, host)
        if fs.unit_of[i] >= 0:
            start = max(start, fs.wait(i, free, start, "f", events))
        free = start + tf[i]
        busy += tf[i]
        if events is not None:
            events.append(Event(f"dev{base}", label(item), start, free, "fwd"))
    fs.prefetch(0, free, "b", events)
    items, issued, _ = backward_issue(ga, lp.dev, order, hb, [0.0], host, 1)
    host_b = 0.0  # FSDP2's per-parameter work on the autograd thread, so far
    for item in items:
        i = item % n
        host_b += fs.host(i, "b")
        t_host = issued[item] + host_b
        start = max(free, t_host)
        if fs.unit_of[i] >= 0:
            start = max(start, fs.wait(i, free, start, "b", events))
        free = start + tb[i]
        busy += tb[i]
        if fs.unit_of[i] >= 0:
            host_b += fs.done(i, free, t_host, events)
        if events is not None:
            events.append(Event(f"dev{base}", label(item), start, free, "bwd"))
    home = max(free, fs.coll_free[0], fs.d2h_free[0])
    return {"free": free, "home": home, "busy": busy, "events": events or []}


def simulate_offload(ga: GraphArrays, plan: Plan, cluster: Cluster, tables: CostTables,
                     record: bool) -> dict:
    """Step time, busy time, memory and timeline of an offloaded plan (the same keys as
    :func:`autoplace.sim.local.simulate_local` returns)."""
    lp = local_plan(ga, plan, cluster)
    prio = [plan.priority[g] for g in lp.group] if plan.priority else None
    order = issue_order_items(ga.preds, lp.dev, lp.m, prio)
    shard_bytes = float(ga.param_bytes.sum()) / shard_count(plan)
    mem = offload_memory(ga, lp, plan)
    breakdown = {**mem.to_json(), "host": int(host_bytes(ga, plan))}
    step = 0.0
    busy = [0.0] * cluster.num_devices
    peak = [0.0] * cluster.num_devices
    rows: list[dict | None] = [None] * cluster.num_devices
    events: list[Event] = []
    used = cluster.devices[:lp.d]
    same = replicas_identical(cluster, plan) and len(
        {(x.host_bandwidth, x.host_memory_bandwidth) for x in used}) == 1
    run: dict = {}
    for r in range(lp.d):  # one rank per device: every replica when their rates differ
        if r == 0 or not same:
            run = _run_replica(ga, lp, tables, cluster, plan, order, r, record and r == 0)
        t_opt = UPDATE_TRAFFIC_PER_PARAM_BYTE * shard_bytes / \
            cluster.devices[r].host_memory_bandwidth if shard_bytes else 0.0
        step = max(step, run["home"] + t_opt)
        busy[r], peak[r], rows[r] = run["busy"], mem.total, dict(breakdown)
        if r == 0:
            events = run["events"]
            if record and t_opt:
                events.append(Event("host0", "update", run["home"], run["home"] + t_opt,
                                    "update"))
    return {"step": step, "busy": busy, "peak": peak, "breakdown": rows, "events": events}
