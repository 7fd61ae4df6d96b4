"""Expert placement: what a practitioner writes by hand.

The ops, in placement order, are cut into one contiguous run per device balanced by
compute (``grouping.coarsen`` with ``K = devices``): run ``i`` on device ``i``. For
recurrent models (ops of kind ``LSTM``) it is the per-layer split of Sutskever et
al. 2014 / GNMT: LSTM layer ``k`` on device ``k mod D``, the ops between layers with
the layer before them (the ops before the first layer on device 0).
"""

from __future__ import annotations

import time

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.grouping import coarsen, placement_order
from autoplace.plan import Plan
from autoplace.planners._common import ensure_costs, make_plan, working_groups

__all__ = ["expert"]

RNN_KINDS = ("LSTM", "GRU", "RNN")


def expert(graph: OpGraph, cluster: Cluster, *, per_layer: bool | None = None) -> Plan:
    """A contiguous compute-balanced split, or a per-layer split for LSTM models.

    Args:
        per_layer: force (True) or forbid (False) the per-layer split; by default it is
            used when the graph has LSTM/GRU/RNN ops.
    """
    t0 = time.perf_counter()
    ensure_costs(graph, cluster)
    n_dev = cluster.num_devices
    rnn_ops = [op.name for op in graph if op.kind in RNN_KINDS]
    if per_layer is None:
        per_layer = bool(rnn_ops)
    if not per_layer or not rnn_ops:
        kind = cluster.devices[0].kind
        weights = graph.fwd_times(kind) + graph.bwd_times(kind)
        groups = coarsen(graph, n_dev, method="contiguous", weights=weights)
        n = max(groups.values()) + 1
        return make_plan(graph, cluster, "expert", t0, groups, list(range(n)), split="contiguous")
    groups = working_groups(graph)
    layer_of = {name: k for k, name in enumerate(o for o in placement_order(graph)
                                                 if o in set(rnn_ops))}
    placement: dict[int, int] = {}
    # a group holding an RNN layer goes to that layer's device; other groups follow the
    # last device assigned in placement order
    for name in placement_order(graph):
        if name in layer_of and groups[name] not in placement:
            placement[groups[name]] = layer_of[name] % n_dev
    current = 0
    for name in placement_order(graph):
        g = groups[name]
        if g in placement:
            current = placement[g]
        else:
            placement[g] = current
    n = max(groups.values()) + 1
    return make_plan(graph, cluster, "expert", t0, groups, [placement[g] for g in range(n)],
                     split="per-layer", layers=len(rnn_ops))
