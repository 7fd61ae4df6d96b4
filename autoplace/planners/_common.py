"""Shared pieces of the baseline planners: costs, working groups, per-group arrays, plans."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from autoplace.cluster import Cluster
from autoplace.costs import estimate_costs
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph
from autoplace.grouping import coarsen, colocation_groups, group_graph, placement_order
from autoplace.plan import ParallelConfig, Plan

#: model-state bytes per parameter byte: parameters + gradients + two Adam moments.
MODEL_STATE_FACTOR = 4


def ensure_costs(graph: OpGraph, cluster: Cluster) -> OpGraph:
    """Fill per-op times for every device kind of ``cluster`` that the graph lacks."""
    if not all(graph.has_costs(k) for k in cluster.device_kinds):
        estimate_costs(graph, cluster)
    return graph


def working_groups(graph: OpGraph, max_groups: int | None = None) -> dict[str, int]:
    """Co-location groups whose quotient graph is a DAG, ids in topological order.

    Co-location groups that form a cycle between them are merged. With ``max_groups``
    and more groups than that, contiguous intervals (:func:`grouping.coarsen`) are used.
    """
    if max_groups is not None:
        n_coloc = len(set(colocation_groups(graph).values()))
        if n_coloc > max_groups:
            return coarsen(graph, max_groups, method="contiguous")
    groups = colocation_groups(graph)
    gg = group_graph(graph, groups)
    if nx.is_directed_acyclic_graph(gg):
        return groups
    cond = nx.condensation(gg)
    comp = cond.graph["mapping"]  # group -> component
    # renumber components by their first op in placement order (a topological order)
    ids: dict[int, int] = {}
    out: dict[str, int] = {}
    for name in placement_order(graph):
        c = comp[groups[name]]
        if c not in ids:
            ids[c] = len(ids)
        out[name] = ids[c]
    if not nx.is_directed_acyclic_graph(group_graph(graph, out)):  # pragma: no cover
        order = {c: i for i, c in enumerate(nx.topological_sort(cond))}
        out = {name: order[comp[groups[name]]] for name in graph.order}
    return out


@dataclass
class GroupView:
    """Per-group arrays for one grouping on one cluster (``G`` groups, ``D`` devices).

    Attributes:
        groups: op -> group id.
        fwd_s, bwd_s: ``[G, D]`` forward / backward seconds of each group on each device.
        param_bytes, activation_bytes: ``[G]`` sums over the group's ops.
        memory_bytes: ``[G]`` training memory: model states plus kept activations.
        transient_bytes: ``[G]`` largest output of one op of the group (a device also
            needs room for the largest transient tensor of its ops).
        edges: group-level ``(src, dst, bytes)``.
        preds, succs: adjacency lists with bytes.
        order: group ids in a topological order.
        usable_bytes: ``[D]`` memory each device may use.
        capacity: ``[D]`` peak FLOP/s of each device.
    """

    groups: dict[str, int]
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    memory_bytes: np.ndarray
    transient_bytes: np.ndarray
    edges: list[tuple[int, int, int]]
    preds: list[list[tuple[int, int]]]
    succs: list[list[tuple[int, int]]]
    order: list[int]
    usable_bytes: np.ndarray
    capacity: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.param_bytes)

    @property
    def num_devices(self) -> int:
        return len(self.usable_bytes)

    @property
    def time_s(self) -> np.ndarray:
        """``[G, D]`` forward + backward seconds."""
        return self.fwd_s + self.bwd_s


def group_view(graph: OpGraph, cluster: Cluster, groups: dict[str, int]) -> GroupView:
    """Per-group costs of ``groups`` on every device of ``cluster``."""
    g_count = max(groups.values()) + 1
    d_count = cluster.num_devices
    gid = np.array([groups[n] for n in graph.order])
    kinds = cluster.device_kinds
    fwd = np.zeros((g_count, d_count))
    bwd = np.zeros((g_count, d_count))
    for kind in kinds:
        f = np.bincount(gid, weights=graph.fwd_times(kind), minlength=g_count)
        b = np.bincount(gid, weights=graph.bwd_times(kind), minlength=g_count)
        for d, dev in enumerate(cluster.devices):
            if dev.kind == kind:
                fwd[:, d] = f
                bwd[:, d] = b
    params = np.bincount(gid, weights=[op.param_bytes for op in graph], minlength=g_count)
    acts = np.bincount(gid, weights=[op.activation_bytes for op in graph], minlength=g_count)
    transient = np.zeros(g_count)
    np.maximum.at(transient, gid, [float(op.transient_bytes) for op in graph])
    gg = group_graph(graph, groups)
    edges = [(int(u), int(v), int(d["bytes"])) for u, v, d in gg.edges(data=True)]
    preds: list[list[tuple[int, int]]] = [[] for _ in range(g_count)]
    succs: list[list[tuple[int, int]]] = [[] for _ in range(g_count)]
    for u, v, b in edges:
        preds[v].append((u, b))
        succs[u].append((v, b))
    order = list(nx.lexicographical_topological_sort(gg))
    return GroupView(
        groups=groups, fwd_s=fwd, bwd_s=bwd, param_bytes=params, activation_bytes=acts,
        memory_bytes=MODEL_STATE_FACTOR * params + acts, transient_bytes=transient, edges=edges, preds=preds, succs=succs,
        order=order,
        usable_bytes=np.array([d.usable_memory_bytes for d in cluster.devices], dtype=np.float64),
        capacity=np.array([d.peak_flops for d in cluster.devices], dtype=np.float64),
    )


def mean_link(cluster: Cluster) -> tuple[float, float]:
    """Mean latency (s) and bandwidth (bytes/s) over links between distinct devices."""
    n = cluster.num_devices
    if n < 2:
        return 0.0, float("inf")
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    return (float(np.mean([cluster.alpha_s[i][j] for i, j in pairs])),
            float(np.mean([cluster.bandwidth[i][j] for i, j in pairs])))


def make_plan(
    graph: OpGraph,
    cluster: Cluster,
    name: str,
    t0: float,
    groups: dict[str, int],
    placement: list[int] | np.ndarray,
    *,
    parallel: ParallelConfig | None = None,
    recompute: set[int] | frozenset[int] = frozenset(),
    selective: set[int] | frozenset[int] = frozenset(),
    **info: Any,
) -> Plan:
    """A plan recording the planner's name and its search time (since ``t0``)."""
    placement = [int(d) for d in placement]
    if max(placement) >= cluster.num_devices:
        raise AutoplaceError(
            f"planner {name!r} placed a group on device {max(placement)}, but cluster "
            f"{cluster.name!r} has {cluster.num_devices} devices"
        )
    return Plan.from_groups(
        graph, groups, placement, parallel=parallel, recompute=recompute, selective=selective,
        planner=name, cluster=cluster, search_time_s=time.perf_counter() - t0, **info,
    )
