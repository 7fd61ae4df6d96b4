"""FSDP2 collectives of a one-process replica: per-unit all-gathers and reduce-scatters.

Units come from the lowering (:func:`autoplace.lowering.fsdp_unit_keys`, grouped per
device by :func:`autoplace.sim.model.fsdp_units`); the root module's unit is gathered
first in forward and first again in backward, and held while either runs. Forward (and
under ``fsdp``, not ``zero2``, backward too) all-gathers every unit once, on a gather stream per device, one unit prefetched ahead
(the next unit's gather is issued when the current unit's first op starts); with
microbatches a gathered unit stays until its last microbatch. A unit's gradients are
reduce-scattered on the collective stream once its last backward op ends. Both are priced
over the replica group's ranks by :mod:`autoplace.costs.collectives` (NCCL's ring inside
a node; across nodes too, at the bus bandwidth of the ranks' NICs); under HSDP over the
shard group, each reduce-scatter followed by an all-reduce of the shard across the replica
groups (:func:`autoplace.sim.model.grad_reduction`).

FSDP2's own work per parameter tensor and collective (copies in and out of the flat
buffers, hooks: ``Device.shard_param_host_s``) runs on the thread that issues the
unit's first op (the forward host thread; in backward the device's autograd thread),
before that op, and, for the reduce-scatter, after the unit's last backward op: it
overlaps the GPUs' work unless the host is what bounds the step.
"""

from __future__ import annotations

from autoplace.cluster import Cluster
from autoplace.plan import Plan
from autoplace.sim.model import (
    Event,
    affine_collective,
    coll_resource,
    collective_time,
    fsdp_units,
    grad_reduction,
    replica_group,
)


class FsdpStreams:
    """FSDP all-gathers (one unit prefetched ahead) and per-unit reduce-scatters."""

    def __init__(self, ga, lp, cluster: Cluster, plan: Plan, shard_host: list[float]) -> None:
        self.k = lp.k
        fu = fsdp_units(ga, lp.dev, lp.k, plan.parallel.shard_units, plan)
        self.unit_of, self.unit_bytes, unit_dev = fu.unit_of, fu.unit_bytes, fu.unit_dev
        self.gather_scale = ga.gather_scale  # gathered at the autocast dtype, reduced in fp32
        self.gather_backward = lp.shard == "fsdp"
        #: host seconds of FSDP2's per-parameter work per collective of each unit
        self.unit_host = [0.0] * len(unit_dev)
        for i, u in enumerate(self.unit_of):
            if u >= 0:
                self.unit_host[u] += float(ga.param_count[i]) * shard_host[unit_dev[u]]
        self.host_charged: dict[str, set[int]] = {"f": set(), "b": set()}
        units_on = [[u for u, j in enumerate(unit_dev) if j == jj] for jj in range(lp.k)]
        # gather order per device: forward in order; backward the root module's unit first
        # (gathered when its backward starts), then the others in reverse
        self.seq = {"f": units_on,
                    "b": [[u for u in us if fu.root[u]] + [u for u in us[::-1] if not fu.root[u]]
                          for us in units_on]}
        self.unit_dev = unit_dev
        self.ag = [affine_collective(cluster, "allgather", replica_group(plan, j))
                   for j in range(lp.k)]
        self.rs = [grad_reduction(cluster, plan, j) for j in range(lp.k)]  # HSDP: + all-reduce
        self.gather_free = [0.0] * lp.k
        self.coll_free = [0.0] * lp.k
        self.ptr = {"f": [0] * lp.k, "b": [0] * lp.k}
        self.end: dict[str, list[float | None]] = {
            "f": [None] * len(unit_dev), "b": [None] * len(unit_dev)}
        self.started: dict[str, set[int]] = {"f": set(), "b": set()}
        self.left = [0] * len(unit_dev)
        for u in self.unit_of:
            if u >= 0:
                self.left[u] += lp.m

    def prefetch(self, j: int, trigger: float, phase: str, events) -> None:
        seq, p = self.seq[phase][j], self.ptr[phase][j]
        if p >= len(seq):
            return
        u = seq[p]
        self.ptr[phase][j] = p + 1
        s0 = max(self.gather_free[j], trigger)
        e0 = s0 + collective_time(self.ag[j], self.gather_scale * self.unit_bytes[u])
        self.gather_free[j] = e0
        self.end[phase][u] = e0
        if events is not None:
            events.append(Event(coll_resource(j, self.k, "gather"), f"unit{u}", s0, e0,
                                "allgather"))

    def host(self, i: int, phase: str) -> float:
        """Host seconds to charge before issuing op ``i``: its unit's gather work, once
        per phase (``"b"``: only where backward gathers again)."""
        u = self.unit_of[i]
        if u < 0 or u in self.host_charged[phase] or (phase == "b" and not self.gather_backward):
            return 0.0
        self.host_charged[phase].add(u)
        return self.unit_host[u]

    def wait(self, i: int, now: float, start: float, phase: str, events) -> float:
        """When op ``i``'s unit is gathered; prefetches the next unit on its first start.
        Under ``zero2`` a unit gathered in forward stays for backward."""
        if phase == "b" and not self.gather_backward:
            return 0.0
        u = self.unit_of[i]
        j = self.unit_dev[u]
        while self.end[phase][u] is None:
            self.prefetch(j, now, phase, events)
        ready = self.end[phase][u]
        if u not in self.started[phase]:
            self.started[phase].add(u)
            self.prefetch(j, max(start, ready), phase, events)
        return ready

    def done(self, i: int, fin: float, host: float, events) -> float:
        """Op ``i``'s backward ended at ``fin``, issued by a host thread at ``host``: after
        the unit's last one, its reduce-scatter. Returns the host seconds it took."""
        u = self.unit_of[i]
        self.left[u] -= 1
        if self.left[u] == 0:
            j = self.unit_dev[u]
            s0 = max(self.coll_free[j], fin, host + self.unit_host[u])
            e0 = s0 + collective_time(self.rs[j], self.unit_bytes[u])
            self.coll_free[j] = e0
            if events is not None:
                events.append(Event(coll_resource(j, self.k), f"unit{u}", s0, e0, "reducescatter"))
            return self.unit_host[u]
        return 0.0
