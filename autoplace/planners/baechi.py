"""Baechi: memory-constrained placement (Jeon et al. 2021, https://arxiv.org/abs/2010.03413).

Every co-location group needs ``4 x params`` (parameters, gradients, two Adam moments)
plus its kept activations on its device, and a device needs room for the largest
output of its ops on top; no device is given more than its usable memory while any
placement of the group fits.

* ``m-topo``: groups in topological order fill devices in turn, each up to an even
  share of the total memory (and never over a device's usable memory; when that
  leaves the last device short, each device is filled up to its usable memory).
* ``m-etf``: earliest-task-first list scheduling: repeatedly the ready group and
  device with the earliest start time, among devices with room.
* ``m-sct``: m-ETF with small-communication-time favourite children: an LP
  relaxation (Hanen & Munier) picks for each group at most one child to keep on its
  device; a ready favourite child goes to its favourite parent's device when that
  does not start it later than ETF would by more than the transfer it saves.
"""

from __future__ import annotations

import time

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.planners._common import (
    GroupView,
    ensure_costs,
    group_view,
    make_plan,
    mean_link,
    working_groups,
)
from autoplace.planners._schedule import ListSchedule

__all__ = ["m_topo", "m_etf", "m_sct", "favourite_children"]


def _setup(graph: OpGraph, cluster: Cluster, max_groups: int):
    ensure_costs(graph, cluster)
    groups = working_groups(graph, max_groups)
    return groups, group_view(graph, cluster, groups)


def m_topo(graph: OpGraph, cluster: Cluster, *, max_groups: int = 1024) -> Plan:
    """Topological order, each device filled up to an even share of the memory.

    Args:
        max_groups: coarsen to at most this many contiguous groups first when there are more.
    """
    t0 = time.perf_counter()
    groups, view = _setup(graph, cluster, max_groups)
    # an even share of the memory per device; when the last device then overflows,
    # fill each device up to its usable memory instead
    for share in (view.memory_bytes.sum() / view.num_devices, float("inf")):
        placement, feasible = _fill_in_order(view, share)
        if feasible:
            break
    return make_plan(graph, cluster, "m-topo", t0, groups, placement,
                     memory_feasible=feasible)


def _fill_in_order(view: GroupView, share: float) -> tuple[np.ndarray, bool]:
    n_dev = view.num_devices
    used = np.zeros(n_dev)
    peak = np.zeros(n_dev)  # largest transient tensor per device
    placement = np.zeros(view.num_groups, dtype=np.int64)

    def need(g: int, d: int) -> float:
        return used[d] + view.memory_bytes[g] + max(peak[d], view.transient_bytes[g])

    d = 0
    for g in view.order:
        while d < n_dev - 1 and (need(g, d) > view.usable_bytes[d]
                                 or (used[d] > 0 and used[d] + view.memory_bytes[g] > share)):
            d += 1
        target = d
        if need(g, d) > view.usable_bytes[d]:  # nothing later fits: the freest device
            target = int(np.argmax([view.usable_bytes[x] - need(g, x) for x in range(n_dev)]))
        placement[g] = target
        used[target] += view.memory_bytes[g]
        peak[target] = max(peak[target], view.transient_bytes[g])
    return placement, bool(np.all(used + peak <= view.usable_bytes))


def _etf(view: GroupView, cluster: Cluster, favourite: dict[int, int] | None) -> ListSchedule:
    sched = ListSchedule(view, cluster)
    missing = np.array([len(p) for p in view.preds])
    ready = {g for g in range(view.num_groups) if missing[g] == 0}
    fav_parent: dict[int, int] = {c: p for p, c in (favourite or {}).items()}
    while ready:
        best = None
        for g in ready:
            for d in sched.feasible_devices(g):
                start = sched.start_s(g, d)
                key = (start, start + view.time_s[g, d], g, d)
                if best is None or key < best:
                    best = key
        _, _, g, d = best
        if favourite is not None:
            # a ready favourite child of a placed parent: keep it with that parent
            for c in sorted(ready):
                p = fav_parent.get(c)
                if p is None:
                    continue
                pd = int(sched.device[p])
                if not sched.fits(c, pd):
                    continue
                saved = max((cluster.transfer_time(pd, (pd + 1) % view.num_devices, b)
                             for q, b in view.preds[c] if q == p), default=0.0)
                if sched.start_s(c, pd) <= best[0] + saved:
                    g, d = c, pd
                    break
        sched.place(g, d)
        ready.discard(g)
        for s, _ in view.succs[g]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.add(s)
    return sched


def m_etf(graph: OpGraph, cluster: Cluster, *, max_groups: int = 1024) -> Plan:
    """Memory-constrained earliest-task-first list scheduling.

    Args:
        max_groups: coarsen to at most this many contiguous groups first when there are more.
    """
    t0 = time.perf_counter()
    groups, view = _setup(graph, cluster, max_groups)
    sched = _etf(view, cluster, None)
    return make_plan(graph, cluster, "m-etf", t0, groups, sched.device,
                     memory_feasible=sched.memory_feasible, makespan_s=sched.makespan_s)


def favourite_children(view: GroupView, cluster: Cluster) -> dict[int, int]:
    """Parent -> favourite child from the LP relaxation of small-communication scheduling.

    Variables: ``x_e`` in [0, 1] per edge (0: same device, no transfer), start time
    ``s_g`` per group, makespan ``w``. Minimise ``w`` subject to ``s_v >= s_u + p_u +
    c_e x_e``, ``w >= s_g + p_g``, and at most one child and one parent per group kept
    together (``sum x >= degree - 1``). Edges with ``x_e < 0.5`` are favourites.
    """
    n, m = view.num_groups, len(view.edges)
    if m == 0:
        return {}
    alpha, bw = mean_link(cluster)
    p = view.time_s.mean(axis=1)
    c = np.array([alpha + b / bw for _, _, b in view.edges])
    nv = m + n + 1  # x (m), s (n), w
    rows, cols, vals, rhs = [], [], [], []
    r = 0
    for e, (u, v, _) in enumerate(view.edges):  # s_u - s_v + c x <= -p_u
        rows += [r, r, r]
        cols += [m + u, m + v, e]
        vals += [1.0, -1.0, c[e]]
        rhs.append(-p[u])
        r += 1
    for g in range(n):  # s_g - w <= -p_g
        rows += [r, r]
        cols += [m + g, m + n]
        vals += [1.0, -1.0]
        rhs.append(-p[g])
        r += 1
    out_edges: list[list[int]] = [[] for _ in range(n)]
    in_edges: list[list[int]] = [[] for _ in range(n)]
    for e, (u, v, _) in enumerate(view.edges):
        out_edges[u].append(e)
        in_edges[v].append(e)
    for lists in (out_edges, in_edges):
        for es in lists:
            if len(es) > 1:  # -sum x <= -(deg - 1)
                rows += [r] * len(es)
                cols += es
                vals += [-1.0] * len(es)
                rhs.append(-(len(es) - 1.0))
                r += 1
    a_ub = sparse.csr_matrix((vals, (rows, cols)), shape=(r, nv))
    cost = np.zeros(nv)
    cost[-1] = 1.0
    bounds = [(0.0, 1.0)] * m + [(0.0, None)] * (n + 1)
    res = linprog(cost, A_ub=a_ub, b_ub=np.array(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        return {}
    x = res.x[:m]
    fav: dict[int, int] = {}
    for e, (u, v, _) in enumerate(view.edges):
        if x[e] < 0.5 and u not in fav and v not in fav.values():
            fav[u] = v
    return fav


def m_sct(graph: OpGraph, cluster: Cluster, *, max_groups: int = 512) -> Plan:
    """m-ETF with favourite children from the small-communication-time LP.

    Args:
        max_groups: coarsen to at most this many contiguous groups first when there are more.
    """
    t0 = time.perf_counter()
    groups, view = _setup(graph, cluster, max_groups)
    fav = favourite_children(view, cluster)
    sched = _etf(view, cluster, fav)
    return make_plan(graph, cluster, "m-sct", t0, groups, sched.device,
                     memory_feasible=sched.memory_feasible, makespan_s=sched.makespan_s,
                     favourite_children=len(fav))
