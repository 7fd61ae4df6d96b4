"""Balanced min-cut placement: k-way partition of the group graph minimising cut bytes.

Recursive bisection: the device list is halved, and the groups are split in
proportion to the halves' capacity (peak FLOP/s). Each bisection starts from the
best of a topological-order split and a spectral (Fiedler vector) split at the
weighted target, then greedily moves boundary groups while the cut shrinks and the
balance stays within ``imbalance``. Node weight = forward + backward time, edge
weight = bytes. METIS (``pymetis``) is used instead when it is importable and every
device has the same capacity.
"""

from __future__ import annotations

import time

import networkx as nx
import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.planners._common import (
    GroupView,
    ensure_costs,
    group_view,
    make_plan,
    working_groups,
)

__all__ = ["mincut", "bisect"]


def _adjacency(view: GroupView) -> list[dict[int, float]]:
    adj: list[dict[int, float]] = [{} for _ in range(view.num_groups)]
    for u, v, b in view.edges:
        adj[u][v] = adj[u].get(v, 0.0) + b
        adj[v][u] = adj[v].get(u, 0.0) + b
    return adj


def _cut(adj: list[dict[int, float]], side: dict[int, int]) -> float:
    return sum(w for u in side for v, w in adj[u].items() if v in side and side[v] != side[u]) / 2


def _split_at(ordered: list[int], w: np.ndarray, frac: float) -> dict[int, int]:
    cum = np.cumsum([w[g] for g in ordered])
    k = int(np.searchsorted(cum, frac * cum[-1])) if len(cum) else 0
    k = min(max(k, 1), len(ordered) - 1)
    return {g: (0 if i < k else 1) for i, g in enumerate(ordered)}


def _refine(adj, side: dict[int, int], w: np.ndarray, frac: float, imbalance: float) -> None:
    total = sum(w[g] for g in side)
    load = [sum(w[g] for g in side if side[g] == s) for s in (0, 1)]
    target = (frac * total, (1 - frac) * total)
    slack = imbalance * total + max(w[g] for g in side)
    for _ in range(8):
        moved = False
        for u in list(side):
            s = side[u]
            ext = sum(x for v, x in adj[u].items() if v in side and side[v] != s)
            internal = sum(x for v, x in adj[u].items() if v in side and side[v] == s)
            if ext <= internal or load[s] - w[u] <= 0:
                continue
            if load[1 - s] + w[u] > target[1 - s] + slack:
                continue
            side[u] = 1 - s
            load[s] -= w[u]
            load[1 - s] += w[u]
            moved = True
        if not moved:
            break


def bisect(
    view: GroupView, adj: list[dict[int, float]], nodes: list[int], w: np.ndarray,
    frac: float, imbalance: float,
) -> tuple[list[int], list[int]]:
    """Split ``nodes`` into two parts of weight about ``frac`` and ``1 - frac``."""
    if len(nodes) < 2:
        return list(nodes), []
    index = {g: i for i, g in enumerate(view.order)}
    candidates = [sorted(nodes, key=index.__getitem__)]
    sub = nx.Graph()
    sub.add_nodes_from(nodes)
    node_set = set(nodes)
    sub.add_weighted_edges_from(
        (u, v, 1.0 + np.log1p(x)) for u in nodes for v, x in adj[u].items() if v in node_set
    )
    if len(nodes) > 2 and nx.is_connected(sub):
        try:
            fied = nx.fiedler_vector(sub, weight="weight", method="tracemin_lu", seed=0)
            order = [nodes_i for _, nodes_i in sorted(zip(fied, list(sub.nodes)))]
            candidates += [order, order[::-1]]
        except (nx.NetworkXError, ValueError, ImportError, np.linalg.LinAlgError):
            pass
    best, best_cut = None, float("inf")
    for ordered in candidates:
        side = _split_at(ordered, w, frac)
        _refine(adj, side, w, frac, imbalance)
        c = _cut(adj, side)
        if c < best_cut and 0 < sum(side.values()) < len(side):
            best, best_cut = side, c
    if best is None:
        best = _split_at(candidates[0], w, frac)
    return [g for g in nodes if best[g] == 0], [g for g in nodes if best[g] == 1]


def _metis(view: GroupView, adj, k: int, w: np.ndarray) -> list[int] | None:
    try:
        import pymetis
    except ImportError:
        return None
    xadj, adjncy, eweights = [0], [], []
    for u in range(view.num_groups):
        for v, x in adj[u].items():
            adjncy.append(v)
            eweights.append(max(1, int(x // 1024)))
        xadj.append(len(adjncy))
    vweights = [max(1, int(1e6 * x / max(w.sum(), 1e-12))) for x in w]
    _, parts = pymetis.part_graph(k, xadj=xadj, adjncy=adjncy, vweights=vweights,
                                  eweights=eweights)
    return list(parts)


def mincut(
    graph: OpGraph, cluster: Cluster, *, imbalance: float = 0.05, max_groups: int = 512,
    use_metis: bool = True,
) -> Plan:
    """Balanced k-way min-cut over co-location groups.

    Args:
        imbalance: allowed excess of a part over its target weight (fraction of the total).
        max_groups: coarsen to at most this many contiguous groups first when there are more.
        use_metis: use pymetis when importable and devices are identical.
    """
    t0 = time.perf_counter()
    ensure_costs(graph, cluster)
    groups = working_groups(graph, max_groups)
    view = group_view(graph, cluster, groups)
    adj = _adjacency(view)
    w = view.time_s.mean(axis=1) + 1e-9
    n_dev = cluster.num_devices
    placement = np.zeros(view.num_groups, dtype=np.int64)
    method = "bisection"
    parts = None
    if use_metis and n_dev > 1 and len(set(view.capacity)) == 1:
        parts = _metis(view, adj, n_dev, w)
    if parts is not None:
        placement[:] = parts
        method = "metis"
    else:
        stack = [(list(range(view.num_groups)), list(range(n_dev)))]
        while stack:
            nodes, devs = stack.pop()
            if len(devs) == 1 or not nodes:
                placement[nodes] = devs[0]
                continue
            half = len(devs) // 2
            left, right = devs[:half], devs[half:]
            frac = view.capacity[left].sum() / view.capacity[devs].sum()
            a, b = bisect(view, adj, nodes, w, frac, imbalance)
            stack += [(a, left), (b, right)]
    cut = _cut(adj, {g: int(placement[g]) for g in range(view.num_groups)})
    return make_plan(graph, cluster, "mincut", t0, groups, placement, method=method,
                     cut_bytes=int(cut))
