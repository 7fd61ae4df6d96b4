"""Simulating many candidate plans: :func:`autoplace.sim.simulate_batch`, or one by one."""

from __future__ import annotations

import numpy as np

from autoplace import sim
from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.plan import Plan


def evaluate(graph: OpGraph, plans: list[Plan], cluster: Cluster
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(step_time_s [P], peak_memory_bytes [P, D], oom [P])`` of ``plans``."""
    if not plans:
        d = cluster.num_devices
        return np.zeros(0), np.zeros((0, d), dtype=np.int64), np.zeros(0, dtype=bool)
    try:
        res = sim.simulate_batch(graph, plans, cluster)
        return (np.asarray(res.step_time_s, dtype=np.float64),
                np.asarray(res.peak_memory_bytes), np.asarray(res.oom, dtype=bool))
    except ImportError:  # the vectorised path is optional
        rows = [sim.simulate(graph, p, cluster) for p in plans]
        return (np.array([r.step_time_s for r in rows]),
                np.array([r.peak_memory_bytes for r in rows], dtype=np.int64),
                np.array([r.oom for r in rows], dtype=bool))


def overflow(peak: np.ndarray, cluster: Cluster) -> np.ndarray:
    """Worst ratio of peak to usable memory over devices, per plan."""
    usable = np.array([d.usable_memory_bytes for d in cluster.devices], dtype=np.float64)
    return (peak / usable[None, :]).max(axis=1)
