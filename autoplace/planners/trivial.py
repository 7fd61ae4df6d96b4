"""Trivial planners: everything on one device, round-robin, and random placement."""

from __future__ import annotations

import random
import time

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.planners._common import ensure_costs, make_plan, working_groups

__all__ = ["single", "round_robin", "random_placement"]


def single(graph: OpGraph, cluster: Cluster, *, device: int = 0) -> Plan:
    """Every op on one device (``device``, default 0)."""
    t0 = time.perf_counter()
    groups = {name: 0 for name in graph.order}
    return make_plan(graph, cluster, "single", t0, groups, [device])


def round_robin(graph: OpGraph, cluster: Cluster) -> Plan:
    """Co-location group ``i`` (in topological order) on device ``i mod D``."""
    t0 = time.perf_counter()
    groups = working_groups(graph)
    n = max(groups.values()) + 1
    return make_plan(graph, cluster, "round-robin", t0, groups,
                     [g % cluster.num_devices for g in range(n)])


def random_placement(graph: OpGraph, cluster: Cluster, *, seed: int = 0) -> Plan:
    """Each co-location group on a uniformly random device (seeded)."""
    t0 = time.perf_counter()
    ensure_costs(graph, cluster)
    groups = working_groups(graph)
    n = max(groups.values()) + 1
    rng = random.Random(seed)
    placement = [rng.randrange(cluster.num_devices) for _ in range(n)]
    return make_plan(graph, cluster, "random", t0, groups, placement, seed=seed)
