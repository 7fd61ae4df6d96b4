"""Hash placement (Mayer et al. 2017, https://arxiv.org/abs/1711.01912).

Each co-location group goes to the device its name hashes to, with devices weighted
by capacity (peak FLOP/s): a device twice as fast receives twice as many groups.
The hash is stable across runs (BLAKE2 of the group's first op name).
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.planners._common import make_plan, working_groups

__all__ = ["hash_placement"]


def _unit_hash(text: str) -> float:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def hash_placement(graph: OpGraph, cluster: Cluster) -> Plan:
    """Group -> hash(name) mod devices, weighted by each device's peak FLOP/s."""
    t0 = time.perf_counter()
    groups = working_groups(graph)
    n = max(groups.values()) + 1
    first: dict[int, str] = {}
    for name in graph.order:
        first.setdefault(groups[name], name)
    capacity = np.array([d.peak_flops for d in cluster.devices], dtype=np.float64)
    bounds = np.cumsum(capacity) / capacity.sum()
    placement = [
        min(int(np.searchsorted(bounds, _unit_hash(first[g]), side="right")),
            cluster.num_devices - 1)
        for g in range(n)
    ]
    return make_plan(graph, cluster, "hash", t0, groups, placement)
