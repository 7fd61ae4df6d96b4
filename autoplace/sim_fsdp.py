"""FSDP collectives of a one-process replica: per-unit all-gathers and reduce-scatters.

A unit is a run of parameter-holding ops on one device sharing a module block
(``sim_model.fsdp_units``). Forward and backward each all-gather every unit once,
on a gather stream per device, one unit prefetched ahead (the next unit's gather is
issued when the current unit's first op starts); with microbatches a gathered unit
stays until its last microbatch. A unit's gradients are reduce-scattered on the
collective stream once its last backward op ends.
"""

from __future__ import annotations

from autoplace.cluster import Cluster
from autoplace.plan import Plan
from autoplace.sim_model import (
    Event,
    affine_collective,
    coll_resource,
    collective_time,
    fsdp_units,
    replica_group,
)


class FsdpStreams:
    """FSDP all-gathers (one unit prefetched ahead) and per-unit reduce-scatters."""

    def __init__(self, ga, lp, cluster: Cluster, plan: Plan) -> None:
        self.k = lp.k
        self.unit_of, self.unit_bytes, unit_dev = fsdp_units(ga, lp.dev, lp.k)
        self.units_on = [[u for u, j in enumerate(unit_dev) if j == jj] for jj in range(lp.k)]
        self.unit_dev = unit_dev
        self.ag = [affine_collective(cluster, "allgather", replica_group(plan, j))
                   for j in range(lp.k)]
        self.rs = [affine_collective(cluster, "reducescatter", replica_group(plan, j))
                   for j in range(lp.k)]
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

    def _seq(self, j: int, phase: str) -> list[int]:
        return self.units_on[j] if phase == "f" else self.units_on[j][::-1]

    def prefetch(self, j: int, trigger: float, phase: str, events) -> None:
        seq, p = self._seq(j, phase), self.ptr[phase][j]
        if p >= len(seq):
            return
        u = seq[p]
        self.ptr[phase][j] = p + 1
        s0 = max(self.gather_free[j], trigger)
        e0 = s0 + collective_time(self.ag[j], self.unit_bytes[u])
        self.gather_free[j] = e0
        self.end[phase][u] = e0
        if events is not None:
            events.append(Event(coll_resource(j, self.k, "gather"), f"unit{u}", s0, e0,
                                "allgather"))

    def wait(self, i: int, now: float, start: float, phase: str, events) -> float:
        """When op ``i``'s unit is gathered; prefetches the next unit on its first start."""
        u = self.unit_of[i]
        j = self.unit_dev[u]
        while self.end[phase][u] is None:
            self.prefetch(j, now, phase, events)
        ready = self.end[phase][u]
        if u not in self.started[phase]:
            self.started[phase].add(u)
            self.prefetch(j, max(start, ready), phase, events)
        return ready

    def done(self, i: int, fin: float, events) -> None:
        u = self.unit_of[i]
        self.left[u] -= 1
        if self.left[u] == 0:
            j = self.unit_dev[u]
            s0 = max(self.coll_free[j], fin)
            e0 = s0 + collective_time(self.rs[j], self.unit_bytes[u])
            self.coll_free[j] = e0
            if events is not None:
                events.append(Event(coll_resource(j, self.k), f"unit{u}", s0, e0, "reducescatter"))
