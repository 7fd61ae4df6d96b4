"""Critical-path placement (Mayer et al. 2017, https://arxiv.org/abs/1711.01912).

The groups on the critical path (longest path by mean compute time plus transfer
time) all go to the fastest device; every other group, in order of decreasing bottom
level, goes to the device where it finishes earliest. Devices without room for a
group are skipped while any device has room.

``critical-path-mo`` (multi-objective) scores every group's devices by a weighted sum
of normalised finish time, load balance, traffic and memory use, with a bonus for
keeping critical-path groups on the critical-path device, instead of pinning them.
"""

from __future__ import annotations

import time

import numpy as np

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

__all__ = ["critical_path", "critical_path_mo", "critical_path_groups"]


def _levels(view: GroupView, cluster: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean task time, top level and bottom level of every group."""
    alpha, bw = mean_link(cluster)
    t = view.time_s.mean(axis=1)
    comm = (lambda b: alpha + b / bw) if cluster.num_devices > 1 else (lambda b: 0.0)
    n = view.num_groups
    top = np.zeros(n)
    for g in view.order:
        for p, b in view.preds[g]:
            top[g] = max(top[g], top[p] + t[p] + comm(b))
    bottom = t.copy()
    for g in reversed(view.order):
        for s, b in view.succs[g]:
            bottom[g] = max(bottom[g], t[g] + comm(b) + bottom[s])
    return t, top, bottom


def critical_path_groups(view: GroupView, cluster: Cluster) -> list[int]:
    """Group ids on one longest path of the group DAG (compute + mean transfer time)."""
    alpha, bw = mean_link(cluster)
    t, top, bottom = _levels(view, cluster)
    g = int(np.argmax(top + bottom))
    # walk back to the path's source, then forward along the longest continuation
    while view.preds[g]:
        g = max(view.preds[g], key=lambda pb: top[pb[0]] + t[pb[0]] + alpha + pb[1] / bw)[0]
    path = [g]
    while view.succs[g]:
        g = max(view.succs[g], key=lambda sb: alpha + sb[1] / bw + bottom[sb[0]])[0]
        path.append(g)
    return path


def _fastest_device(view: GroupView, path: list[int]) -> int:
    return int(np.argmin(view.time_s[path].sum(axis=0)))


def _place(
    graph: OpGraph, cluster: Cluster, name: str, weights: dict[str, float] | None
) -> Plan:
    t0 = time.perf_counter()
    ensure_costs(graph, cluster)
    groups = working_groups(graph)
    view = group_view(graph, cluster, groups)
    path = critical_path_groups(view, cluster)
    fast = _fastest_device(view, path)
    on_path = set(path)
    _, _, bottom = _levels(view, cluster)
    index = {g: i for i, g in enumerate(view.order)}
    priority = sorted(range(view.num_groups), key=lambda g: (-bottom[g], index[g]))
    # a group may precede a producer in bottom-level order only when times are zero;
    # restore a topological order among those by index.
    priority = _topological_stable(view, priority)
    sched = ListSchedule(view, cluster)
    total_work = view.time_s.mean(axis=1).sum()
    mean_t = max(total_work / max(view.num_groups, 1), 1e-12)
    for g in priority:
        if weights is None and g in on_path and sched.fits(g, fast):
            sched.place(g, fast)
            continue
        cands = sched.feasible_devices(g)
        if weights is None:
            d = min(cands, key=lambda d: (sched.start_s(g, d) + view.time_s[g, d], d))
        else:
            def score(d: int, g: int = g) -> tuple[float, int]:
                bonus = weights["path"] if (g in on_path and d == fast) else 0.0
                return _score(sched, g, d, weights, total_work, mean_t) - bonus, d

            d = min(cands, key=score)
        sched.place(g, d)
    info = {"critical_path_groups": len(path), "critical_path_device": fast,
            "memory_feasible": sched.memory_feasible}
    if weights is not None:
        info["weights"] = weights
    return make_plan(graph, cluster, name, t0, groups, sched.device, **info)


def _topological_stable(view: GroupView, priority: list[int]) -> list[int]:
    placed: set[int] = set()
    out: list[int] = []
    pending = list(priority)
    while pending:
        rest = []
        for g in pending:
            if all(p in placed for p, _ in view.preds[g]):
                placed.add(g)
                out.append(g)
            else:
                rest.append(g)
        pending = rest
    return out


def _score(
    sched: ListSchedule, g: int, d: int, w: dict[str, float], total_work: float, mean_t: float
) -> float:
    view = sched.view
    finish = sched.start_s(g, d) + view.time_s[g, d]
    horizon = max(sched.makespan_s, total_work / view.num_devices, 1e-12)
    balance = (sched.busy_s[d] + view.time_s[g, d]) / max(total_work / view.num_devices, 1e-12)
    traffic = sum(sched.cluster.transfer_time(int(sched.device[p]), d, b)
                  for p, b in view.preds[g]) / mean_t
    memory = (sched.memory_used[d] + view.memory_bytes[g]) / view.usable_bytes[d]
    return (w["time"] * finish / horizon + w["balance"] * balance
            + w["traffic"] * traffic + w["memory"] * memory)


def critical_path(graph: OpGraph, cluster: Cluster) -> Plan:
    """Critical path on the fastest device, the rest by earliest finish time."""
    return _place(graph, cluster, "critical-path", None)


def critical_path_mo(
    graph: OpGraph,
    cluster: Cluster,
    *,
    time_weight: float = 1.0,
    balance_weight: float = 0.5,
    traffic_weight: float = 0.2,
    memory_weight: float = 0.5,
    path_weight: float = 0.5,
) -> Plan:
    """Critical path on the fastest device, the rest by a weighted multi-objective score.

    Args:
        time_weight: weight of the finish time (relative to the schedule's horizon).
        balance_weight: weight of the device's compute load (relative to an even share).
        traffic_weight: weight of the transfer time into the device (relative to a mean task).
        memory_weight: weight of the device's memory use (fraction of usable memory).
        path_weight: bonus for keeping a critical-path group on the critical-path device.
    """
    weights = {"time": time_weight, "balance": balance_weight, "traffic": traffic_weight,
               "memory": memory_weight, "path": path_weight}
    return _place(graph, cluster, "critical-path-mo", weights)
