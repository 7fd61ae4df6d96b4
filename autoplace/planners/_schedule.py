"""List-scheduling state shared by the critical-path and Baechi planners.

Groups run forward + backward as one task (``GroupView.time_s``); a task may start on
device ``d`` when ``d`` is free and every input has arrived over its link.
"""

from __future__ import annotations

import numpy as np

from autoplace.cluster import Cluster
from autoplace.planners._common import GroupView


class ListSchedule:
    """Devices' availability, each placed group's device and finish time, memory used."""

    def __init__(self, view: GroupView, cluster: Cluster) -> None:
        self.view = view
        self.cluster = cluster
        n, d = view.num_groups, view.num_devices
        self.device = np.full(n, -1, dtype=np.int64)
        self.finish_s = np.zeros(n)
        self.free_at_s = np.zeros(d)
        self.memory_used = np.zeros(d)
        self.transient = np.zeros(d)
        self.busy_s = np.zeros(d)

    def data_ready_s(self, g: int, d: int) -> float:
        """When every input of ``g`` is on device ``d``."""
        t = 0.0
        for p, nbytes in self.view.preds[g]:
            t = max(t, self.finish_s[p] + self.cluster.transfer_time(int(self.device[p]), d, nbytes))
        return t

    def start_s(self, g: int, d: int) -> float:
        """Earliest start of ``g`` on ``d`` (appended after the device's last task)."""
        return max(self.free_at_s[d], self.data_ready_s(g, d))

    def fits(self, g: int, d: int) -> bool:
        """Room on ``d`` for ``g``'s memory, with the largest transient tensor on top."""
        v = self.view
        peak = max(self.transient[d], v.transient_bytes[g])
        return self.memory_used[d] + v.memory_bytes[g] + peak <= v.usable_bytes[d]

    def feasible_devices(self, g: int) -> list[int]:
        """Devices with room for ``g``; the one with the most free memory if none has."""
        ok = [d for d in range(self.view.num_devices) if self.fits(g, d)]
        if ok:
            return ok
        return [int(np.argmax(self.view.usable_bytes - self.memory_used - self.transient))]

    def place(self, g: int, d: int) -> float:
        """Schedule ``g`` on ``d`` at its earliest start; returns its finish time."""
        start = self.start_s(g, d)
        dur = self.view.time_s[g, d]
        self.device[g] = d
        self.finish_s[g] = start + dur
        self.free_at_s[d] = start + dur
        self.busy_s[d] += dur
        self.memory_used[d] += self.view.memory_bytes[g]
        self.transient[d] = max(self.transient[d], self.view.transient_bytes[g])
        return start + dur

    @property
    def memory_feasible(self) -> bool:
        return bool(np.all(self.memory_used + self.transient <= self.view.usable_bytes))

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max()) if len(self.finish_s) else 0.0
