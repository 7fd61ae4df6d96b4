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
* ``method="branch"`` (:func:`branch_groups`): not intervals; groups follow the graph's
  structure so parallel branches can be placed on different devices. The group graph
  is still acyclic.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np

from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph

__all__ = [
    "colocation_groups", "coarsen", "group_costs", "group_graph", "placement_order",
    "VIEW_KINDS", "METHODS", "branch_groups", "branch_blocks", "branch_chains",
    "auto_group_count",
]

METHODS = ("contiguous", "module", "branch")

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
    """Op -> group id with at most ``max_groups`` groups.

    ``contiguous`` and ``module`` groups are intervals of placement order; ``branch``
    groups (:func:`branch_groups`) follow the graph's structure, keeping parallel
    branches apart, and are numbered in a topological order of the (acyclic) group graph.

    Args:
        graph: the graph.
        max_groups: the largest number of groups wanted (>= 1).
        method: ``"contiguous"`` (balanced cost), ``"module"`` (module hierarchy) or
            ``"branch"`` (structure-aware).
        weights: optional cost per op in topological order (default: fwd+bwd time).
    """
    if max_groups < 1:
        raise AutoplaceError(f"max_groups must be >= 1, got {max_groups}")
    if method not in METHODS:
        raise AutoplaceError(f"unknown grouping method {method!r}; valid: {', '.join(METHODS)}")
    if method == "branch":
        return branch_groups(graph, max_groups, weights=weights)
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
    ``fwd_fixed_s``, ``bwd_fixed_s`` (the batch-independent parts: NaN for a group
    with an op whose part is unknown, or with no ``device_kind``), ``flops``,
    ``param_bytes``, ``activation_bytes``, ``output_bytes``, ``num_ops``."""
    n = max(groups.values()) + 1 if groups else 0
    out = {k: np.zeros(n) for k in ("fwd_time_s", "bwd_time_s", "fwd_fixed_s", "bwd_fixed_s",
                                    "flops", "param_bytes", "activation_bytes",
                                    "output_bytes", "num_ops")}
    if device_kind is None:
        out["fwd_fixed_s"][:] = out["bwd_fixed_s"][:] = np.nan
    for op in graph:
        g = groups[op.name]
        if device_kind is not None:
            out["fwd_time_s"][g] += op.fwd_time_s.get(device_kind, 0.0)
            out["bwd_time_s"][g] += op.bwd_time_s.get(device_kind, 0.0)
            out["fwd_fixed_s"][g] += op.fwd_fixed_s.get(device_kind, np.nan)
            out["bwd_fixed_s"][g] += op.bwd_fixed_s.get(device_kind, np.nan)
        out["flops"][g] += op.flops
        out["param_bytes"][g] += op.param_bytes
        out["activation_bytes"][g] += op.activation_bytes
        out["output_bytes"][g] += op.output_bytes
        out["num_ops"][g] += 1
    return out


# ----------------------------------------------------------------- branch-aware
def _coloc_units(graph: OpGraph) -> tuple[list[list[str]], dict[str, int], list[set[int]]]:
    """Co-location groups merged into an acyclic quotient graph (cycles, which views and
    in-place ops can create, are merged). Returns the units (op lists in placement order)
    numbered in a topological order of the quotient graph (ties: first op in placement
    order), each op's unit, and each unit's successor units."""
    order = placement_order(graph)
    pos = {name: i for i, name in enumerate(order)}
    coloc = colocation_groups(graph)
    q = nx.DiGraph()
    q.add_nodes_from(set(coloc.values()))
    q.add_edges_from((coloc[u], coloc[v]) for u, v, _ in graph.edges if coloc[u] != coloc[v])
    cond = nx.condensation(q)
    mapping = cond.graph["mapping"]  # coloc id -> condensed node
    first: dict[int, int] = {}
    for name in order:
        first.setdefault(mapping[coloc[name]], pos[name])
    topo = list(nx.lexicographical_topological_sort(cond, key=lambda c: first[c]))
    rank = {c: i for i, c in enumerate(topo)}
    unit_of = {name: rank[mapping[coloc[name]]] for name in order}
    units: list[list[str]] = [[] for _ in topo]
    for name in order:
        units[unit_of[name]].append(name)
    succ: list[set[int]] = [set() for _ in topo]
    for u, v in cond.edges:
        succ[rank[u]].add(rank[v])
    return units, unit_of, succ


class _Clusters:
    """Clusters of units on an acyclic graph, merged and split so the graph stays acyclic."""

    def __init__(self, weights: np.ndarray, succ: list[set[int]]) -> None:
        n = len(weights)
        self.uw = weights
        self.usucc = succ
        self.members: dict[int, list[int]] = {i: [i] for i in range(n)}
        self.weight: dict[int, float] = {i: float(weights[i]) for i in range(n)}
        self.rebuild()

    def rebuild(self) -> None:
        self.cluster_of = {u: c for c, ms in self.members.items() for u in ms}
        self.succ: dict[int, set[int]] = {c: set() for c in self.members}
        self.pred: dict[int, set[int]] = {c: set() for c in self.members}
        for u, vs in enumerate(self.usucc):
            cu = self.cluster_of[u]
            for v in vs:
                cv = self.cluster_of[v]
                if cu != cv:
                    self.succ[cu].add(cv)
                    self.pred[cv].add(cu)

    def merge(self, a: int, b: int) -> int:
        """Merge cluster ``b`` into ``a`` (the caller checked it keeps the graph acyclic)."""
        self.members[a] = sorted(self.members[a] + self.members.pop(b))
        self.weight[a] += self.weight.pop(b)
        for c in self.succ.pop(b):
            self.pred[c].discard(b)
            if c != a:
                self.succ[a].add(c)
                self.pred[c].add(a)
        for c in self.pred.pop(b):
            self.succ[c].discard(b)
            if c != a:
                self.pred[a].add(c)
                self.succ[c].add(a)
        self.succ[a].discard(a)
        self.pred[a].discard(a)
        for u in self.members[a]:
            self.cluster_of[u] = a
        return a

    def reaches(self, a: int, b: int, *, skip_direct: bool) -> bool:
        """Whether a path leads from ``a`` to ``b`` (of two or more edges with ``skip_direct``)."""
        stack = [c for c in self.succ[a] if not (skip_direct and c == b)]
        seen = set(stack)
        while stack:
            c = stack.pop()
            if c == b:
                return True
            for d in self.succ[c]:
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return False

    def safe(self, a: int, b: int) -> bool:
        """Merging ``a`` and ``b`` keeps the graph acyclic: no path of two or more edges
        between them in either direction."""
        return not (self.reaches(a, b, skip_direct=True) or self.reaches(b, a, skip_direct=True))

    def contract_chains(self) -> None:
        """Merge every edge ``a -> b`` where ``a`` has one successor and ``b`` one predecessor."""
        changed = True
        while changed:
            changed = False
            for a in list(self.members):
                if a in self.members and len(self.succ[a]) == 1:
                    b = next(iter(self.succ[a]))
                    if len(self.pred[b]) == 1:
                        self.merge(a, b)
                        changed = True

    def split_heavy(self, cap: float, new_id: int) -> int:
        """Cut every cluster heavier than ``cap`` into runs of its units (in topological
        order, which keeps the graph acyclic) of at most about ``cap``."""
        for c in list(self.members):
            ms = self.members[c]
            if self.weight[c] <= cap or len(ms) < 2:
                continue
            runs: list[list[int]] = [[]]
            acc = 0.0
            for u in ms:
                w = float(self.uw[u])
                if runs[-1] and acc + w > cap:
                    runs.append([])
                    acc = 0.0
                runs[-1].append(u)
                acc += w
            if len(runs) < 2:
                continue
            self.members[c] = runs[0]
            self.weight[c] = float(self.uw[runs[0]].sum())
            for run in runs[1:]:
                self.members[new_id] = run
                self.weight[new_id] = float(self.uw[run].sum())
                new_id += 1
        self.rebuild()
        return new_id

    def merge_down(self, k: int) -> None:
        """Merge clusters, lightest combined pair first, until at most ``k`` are left:
        producer-consumer pairs first, then (no safe edge left) any safe pair."""
        import heapq

        def cost(a: int, b: int) -> float:
            # combined weight, times the branches the merge would join: a fork's other
            # consumers and a join's other producers (0 for a link of a chain)
            joins = len(self.succ[a]) - 1 + len(self.pred[b]) - 1
            return (self.weight[a] + self.weight[b]) * (1 + joins)

        heap = [(cost(a, b), a, b) for a in self.succ for b in self.succ[a]]
        heapq.heapify(heap)
        while len(self.members) > k and heap:
            w, a, b = heapq.heappop(heap)
            if a not in self.members or b not in self.members or b not in self.succ[a]:
                continue
            now = cost(a, b)
            if abs(now - w) > 1e-12 * max(w, 1e-30):
                heapq.heappush(heap, (now, a, b))
                continue
            if not self.safe(a, b):
                continue  # becomes safe only if the other path merges in: re-pushed then
            self.merge(a, b)
            for c in list(self.succ[a]) + list(self.pred[a]):  # edges whose cost changed
                for d in self.succ[c]:
                    heapq.heappush(heap, (cost(c, d), c, d))
                for d in self.pred[c]:
                    heapq.heappush(heap, (cost(d, c), d, c))
        while len(self.members) > k:  # disconnected parts, or no safe edge: lightest safe pair
            cs = sorted(self.members, key=lambda c: self.weight[c])
            done = False
            for i, a in enumerate(cs):
                for b in cs[i + 1:]:
                    if self.safe(a, b):
                        self.merge(a, b)
                        done = True
                        break
                if done:
                    break
            if not done:  # cannot happen on an acyclic graph; kept as a guard
                raise AutoplaceError("branch grouping could not merge down to max_groups")


def branch_groups(
    graph: OpGraph, max_groups: int, *, weights: np.ndarray | None = None
) -> dict[str, int]:
    """Op -> group id, at most ``max_groups`` groups, keeping parallel branches apart.

    Unlike :func:`coarsen`'s intervals, a group need not be contiguous in program order,
    so parallel branches (inception towers, the branches of a branchy MLP, an encoder
    beside a decoder) can land in different groups and so on different devices. Steps,
    all on the acyclic graph of co-location groups (cycles merged):

    1. contract linear chains (an edge whose producer has one consumer and whose
       consumer has one producer): a branch becomes one cluster;
    2. cut clusters heavier than ``total / max_groups`` into runs of their units in
       topological order (a long chain is split as :func:`coarsen` would);
    3. merge producer-consumer pairs, cheapest first, skipping merges that would close a
       cycle, until at most ``max_groups`` are left. A merge costs the pair's combined
       weight times one plus the branches it joins (the producer's other consumers and
       the consumer's other producers), so chain links merge first and parallel
       branches (which share no edge) meet only through forks and joins, lightest first.

    The group graph is acyclic; ids ``0..G-1`` follow a topological order of it (ties by
    first op in placement order). No co-location group is split.
    """
    if max_groups < 1:
        raise AutoplaceError(f"max_groups must be >= 1, got {max_groups}")
    units, unit_of, succ = _coloc_units(graph)
    w_topo = _op_weights(graph) if weights is None else np.asarray(weights, dtype=np.float64)
    uw = np.zeros(len(units))
    for name, u in unit_of.items():
        uw[u] += w_topo[graph.index[name]]
    cl = _Clusters(uw, succ)
    cl.contract_chains()
    total = float(uw.sum())
    if total > 0:
        cl.split_heavy(total / max_groups, len(units))
    cl.merge_down(max_groups)
    # number clusters in a topological order of the cluster graph, ties by first unit
    cg = nx.DiGraph()
    cg.add_nodes_from(cl.members)
    cg.add_edges_from((a, b) for a in cl.succ for b in cl.succ[a])
    first = {c: min(ms) for c, ms in cl.members.items()}
    ids = {c: i for i, c in enumerate(nx.lexicographical_topological_sort(
        cg, key=lambda c: first[c]))}
    return {name: ids[cl.cluster_of[u]] for name, u in unit_of.items()}


def branch_blocks(graph: OpGraph) -> int:
    """Multi-branch blocks of a graph: co-location units (see :func:`branch_groups`) with
    three or more consumer units, such as an inception module's fork into its towers. A
    residual fork (one consumer plus the skip connection) does not count."""
    _, _, succ = _coloc_units(graph)
    return sum(1 for s in succ if len(s) >= 3)


def branch_chains(graph: OpGraph) -> int:
    """Linear chains of a graph: the clusters left after step 1 of :func:`branch_groups`
    (contracting every producer-consumer edge of a one-consumer producer and a
    one-producer consumer). A branch with no fork or join inside is one chain."""
    units, _, succ = _coloc_units(graph)
    cl = _Clusters(np.ones(len(units)), succ)
    cl.contract_chains()
    return len(cl.members)


def auto_group_count(graph: OpGraph, base: int = 16, per_block: int = 2,
                     cap: int | None = None, min_groups: int = 8) -> int:
    """A group count for :func:`branch_groups` from the graph's structure.

    ``base`` plus ``per_block`` for every multi-branch block (:func:`branch_blocks`) after
    the first, at most ``cap`` (default ``2 * base``): graphs of many parallel-tower
    blocks (inception) get groups to keep their towers apart, while chains, residual
    stacks and graphs with one fork keep ``base``. A small fork-join graph (a block, and
    no more linear chains (:func:`branch_chains`) than ``min_groups``, like a branchy
    MLP's input chain, towers and head) gets ``min_groups``: a group per chain is enough,
    and more would only cut its towers into pieces a policy must put back on one device.
    """
    cap = 2 * base if cap is None else cap
    blocks = branch_blocks(graph)
    if blocks >= 1 and branch_chains(graph) <= min_groups:
        return max(1, min(min_groups, cap))
    return max(1, min(cap, base + per_block * max(0, blocks - 1)))
