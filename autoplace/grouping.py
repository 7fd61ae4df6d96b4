"""Grouping: which ops must share a device, and coarsening a graph into placeable groups.

Co-location (:func:`colocation_groups`): a parameter fetch (``param``) and a model
input (``input``) go with their first consumer; view-like and in-place ops go with
the op that produced their input; the ``output`` op goes with its producer.

Coarsening (:func:`coarsen`) works on the *placement order*: the topological order
with every source op (params, inputs) sunk to just before its first consumer. Every
group is an interval of that order, so the group graph is acyclic and any device
per group is a valid placement. No interval boundary splits a co-location group.

* ``method="contiguous"``: at most K intervals of balanced cost (forward+backward
  time of the first device kind with costs, FLOPs otherwise).
* ``method="module"``: runs of ops sharing a module-path prefix (the deepest prefix
  depth that gives at most K runs), adjacent runs merged if still too many.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np

from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph

__all__ = [
    "colocation_groups", "coarsen", "group_costs", "group_graph", "placement_order",
    "VIEW_KINDS", "METHODS",
]

METHODS = ("contiguous", "module")

#: Op kinds that alias or cheaply reshape their input: they stay with its producer.
VIEW_KINDS = frozenset({
    "view", "reshape", "permute", "transpose", "contiguous", "expand", "expand_as",
    "flatten", "unsqueeze", "squeeze", "getitem", "size", "getattr", "t", "narrow",
    "select", "slice", "unflatten", "view_as", "split", "chunk", "unbind", "detach",
    "alias", "_unsafe_view", "dim", "type_as", "to", "float", "half", "bfloat16",
})


def _is_inplace(kind: str) -> bool:
    return (kind.endswith("_") and not kind.startswith("_")) or kind in (
        "iadd", "isub", "imul", "itruediv")


def colocation_groups(graph: OpGraph) -> dict[str, int]:
    """Op -> group id, where ops of one group must share a device.

    Ids are numbered ``0..G-1`` in order of each group's first op in placement order.
    """
    uf = nx.utils.UnionFind(graph.order)
    for op in graph:
        preds = graph.preds(op.name)
        succs = graph.succs(op.name)
        if op.kind in ("param", "input") and succs:
            uf.union(op.name, succs[0])
        elif op.kind == "output" and preds:
            uf.union(op.name, preds[-1])
        elif (op.kind in VIEW_KINDS or _is_inplace(op.kind)) and preds:
            # the data input: the latest producer that is not a parameter or model input
            src = [p for p in preds if graph[p].kind not in ("param", "input")] or preds
            uf.union(op.name, src[-1])
    order = placement_order(graph)
    ids: dict[str, int] = {}
    out: dict[str, int] = {}
    for name in order:
        root = uf[name]
        if root not in ids:
            ids[root] = len(ids)
        out[name] = ids[root]
    return out


def placement_order(graph: OpGraph) -> list[str]:
    """Topological order with every source op sunk to just before its first consumer."""
    key: dict[str, tuple[int, int]] = {}
    for op in graph:
        i = graph.index[op.name]
        succs = graph.succs(op.name)
        if op.kind in ("param", "input") and succs and not graph.preds(op.name):
            key[op.name] = (graph.index[succs[0]], -1)
        else:
            key[op.name] = (i, 0)
    return sorted(graph.order, key=lambda n: (key[n], graph.index[n]))


def _op_weights(graph: OpGraph) -> np.ndarray:
    kinds = [k for op in graph for k in op.fwd_time_s]
    kind = kinds[0] if kinds else None
    if kind is not None:
        w = graph.fwd_times(kind) + graph.bwd_times(kind)
    else:
        w = np.array([op.flops for op in graph], dtype=np.float64) * 3
    if not np.any(w > 0):
        w = np.ones(len(graph))
    return w


def _blocked_cuts(order: list[str], coloc: dict[str, int]) -> np.ndarray:
    """blocked[i] is True when a cut between order[i-1] and order[i] splits a co-location group."""
    n = len(order)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, name in enumerate(order):
        g = coloc[name]
        first.setdefault(g, i)
        last[g] = i
    diff = np.zeros(n + 1, dtype=np.int64)
    for g, a in first.items():
        b = last[g]
        if b > a:
            diff[a + 1] += 1
            diff[b + 1] -= 1
    return np.cumsum(diff)[:n] > 0


def coarsen(
    graph: OpGraph,
    max_groups: int,
    *,
    method: str = "contiguous",
    weights: np.ndarray | None = None,
) -> dict[str, int]:
    """Op -> group id with at most ``max_groups`` groups, each an interval of placement order.

    Args:
        graph: the graph.
        max_groups: the largest number of groups wanted (>= 1).
        method: ``"contiguous"`` (balanced cost) or ``"module"`` (module hierarchy).
        weights: optional cost per op in topological order (default: fwd+bwd time).
    """
    if max_groups < 1:
        raise AutoplaceError(f"max_groups must be >= 1, got {max_groups}")
    if method not in METHODS:
        raise AutoplaceError(f"unknown grouping method {method!r}; valid: {', '.join(METHODS)}")
    order = placement_order(graph)
    coloc = colocation_groups(graph)
    blocked = _blocked_cuts(order, coloc)
    w_topo = _op_weights(graph) if weights is None else np.asarray(weights, dtype=np.float64)
    w = np.array([w_topo[graph.index[n]] for n in order])
    allowed = [i for i in range(1, len(order)) if not blocked[i]]
    if method == "contiguous":
        cuts = _balanced_cuts(w, allowed, max_groups)
    else:
        cuts = _module_cuts(graph, order, allowed, w, max_groups)
    return _intervals_to_groups(order, cuts)


def _balanced_cuts(w: np.ndarray, allowed: list[int], k: int) -> list[int]:
    """Choose at most k-1 cut points from ``allowed`` splitting ``w`` into balanced intervals."""
    if k <= 1 or not allowed:
        return []
    if len(allowed) <= k - 1:
        return list(allowed)
    cum = np.concatenate([[0.0], np.cumsum(w)])
    total = cum[-1]
    cuts: list[int] = []
    allowed_arr = np.array(allowed)
    for j in range(1, k):
        target = total * j / k
        pos = int(np.searchsorted(cum[allowed_arr], target))
        cands = [allowed_arr[min(pos, len(allowed_arr) - 1)], allowed_arr[max(pos - 1, 0)]]
        best = min(cands, key=lambda c: abs(cum[c] - target))
        if not cuts or best > cuts[-1]:
            cuts.append(int(best))
    return cuts


def _module_cuts(
    graph: OpGraph, order: list[str], allowed: list[int], w: np.ndarray, k: int
) -> list[int]:
    paths = [graph[n].module_path.split(".") if graph[n].module_path else [] for n in order]
    depth_max = max((len(p) for p in paths), default=0)
    allowed_set = set(allowed)
    best: list[int] = []
    for depth in range(0, depth_max + 1):
        keys = [".".join(p[:depth]) for p in paths]
        cuts = [i for i in range(1, len(order)) if keys[i] != keys[i - 1] and i in allowed_set]
        if len(cuts) + 1 <= k:
            best = cuts
        else:
            if depth == 0 or not best:
                best = cuts
            break
    # merge adjacent intervals (smallest combined weight first) until at most k
    cuts = list(best)
    while len(cuts) + 1 > k:
        bounds = [0, *cuts, len(order)]
        seg = [w[bounds[i]:bounds[i + 1]].sum() for i in range(len(bounds) - 1)]
        j = int(np.argmin([seg[i] + seg[i + 1] for i in range(len(seg) - 1)]))
        del cuts[j]
    return cuts


def _intervals_to_groups(order: list[str], cuts: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    g = 0
    cut_set = set(cuts)
    for i, name in enumerate(order):
        if i in cut_set:
            g += 1
        out[name] = g
    return out


def group_graph(graph: OpGraph, groups: dict[str, int]) -> nx.DiGraph:
    """The quotient graph: one node per group id, edge attribute ``bytes`` summed."""
    gg = nx.DiGraph()
    gg.add_nodes_from(sorted(set(groups.values())))
    for u, v, b in graph.edges:
        gu, gv = groups[u], groups[v]
        if gu != gv:
            if gg.has_edge(gu, gv):
                gg.edges[gu, gv]["bytes"] += b
            else:
                gg.add_edge(gu, gv, bytes=b)
    return gg


def group_costs(graph: OpGraph, groups: dict[str, int], device_kind: str | None) -> dict[str, Any]:
    """Per-group sums (arrays indexed by group id): ``fwd_time_s``, ``bwd_time_s``,
    ``flops``, ``param_bytes``, ``activation_bytes``, ``output_bytes``, ``num_ops``."""
    n = max(groups.values()) + 1 if groups else 0
    out = {k: np.zeros(n) for k in ("fwd_time_s", "bwd_time_s", "flops", "param_bytes",
                                    "activation_bytes", "output_bytes", "num_ops")}
    for op in graph:
        g = groups[op.name]
        if device_kind is not None:
            out["fwd_time_s"][g] += op.fwd_time_s.get(device_kind, 0.0)
            out["bwd_time_s"][g] += op.bwd_time_s.get(device_kind, 0.0)
        out["flops"][g] += op.flops
        out["param_bytes"][g] += op.param_bytes
        out["activation_bytes"][g] += op.activation_bytes
        out["output_bytes"][g] += op.output_bytes
        out["num_ops"][g] += 1
    return out
