"""Vectorised simulation of many ``pipeline == 1`` plans (numpy arrays over plans).

The same model as ``sim.local``, step for step: at step ``s`` every plan processes the
``s``-th item of its own issue order (``sim.batch_steps``), so each plan's compute and link
queues see the same order as in the scalar path; the backward's issue order and times
come from autograd's threads simulated for every plan at once (``sim.batch_issue``). Host
issue time is the scalar path's too, its clocks summed in the same order. Plans with
``pipeline > 1``, ZeRO-2 or FSDP, selective recompute, or replicas on unlike devices go
through the scalar path; plans with an issue priority stay here with the lowering's order.

The device dimension is each op's slots (``sim.batch_sends``: its own device and the few
its consumers use), never the cluster's devices, so a chunk of plans at 512 devices is
as wide as one at 8; data-parallel replicas that are alike are simulated once. Per graph
(edge tables) and per distinct device (op and host times) work is done once; the largest
tables live on buffers kept between batches (``sim.batch_scratch``).
"""

from __future__ import annotations

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.lowering import issue_order_items, validate
from autoplace.plan import Plan
from autoplace.sim.batch_finish import finish_batch
from autoplace.sim.batch_issue import batch_backward_issue
from autoplace.sim.batch_sends import edge_tables, plan_sends
from autoplace.sim.batch_steps import (
    backward_steps,
    forward_steps,
    host_clock,
    step_slots,
    step_tables,
)
from autoplace.sim.block_profile import (
    block_tables,
    default_recompute_host,
    gpu_kinds,
    region_ends,
)
from autoplace.sim.local import simulate_local
from autoplace.sim.model import (
    CostTables,
    GraphArrays,
    graph_arrays,
    graphed_host,
    host_times,
    replicas_identical,
    rerun_ops,
    scaled,
)
from autoplace.sim.pipeline import simulate_pipeline

#: bound on items x plans x slots per vectorised chunk (memory ~ 100 bytes each)
_CHUNK_CELLS = 4_000_000


def run_batch(graph: OpGraph, plans: list[Plan], cluster: Cluster, tables: CostTables
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(step_time_s [P], peak_memory_bytes [P, D] float)`` of every plan."""
    ga = graph_arrays(graph)
    num = len(plans)
    step = np.zeros(num)
    peak = np.zeros((num, cluster.num_devices))
    gids, place, k_all = _validate_and_group_ids(ga, graph, plans, cluster)
    by_m: dict[int, list[int]] = {}
    alike: dict[tuple[int, int], bool] = {}  # (replicas, devices each): replicas alike
    for p, plan in enumerate(plans):
        par = plan.parallel
        key = (par.data, int(k_all[p]))
        if key not in alike:
            alike[key] = replicas_identical(cluster, plan)
        if (par.pipeline > 1 or par.shard != "none" or par.shard_optimizer or plan.selective
                or not alike[key]):
            sim = simulate_pipeline if par.pipeline > 1 else simulate_local
            out = sim(ga, plan, cluster, block_tables(graph, tables, ga, plan), False)
            step[p] = out["step"]
            peak[p] = out["peak"]
        else:
            by_m.setdefault(par.microbatches, []).append(p)
    et = edge_tables(ga)
    for m, idx in by_m.items():
        # an op's slots: its device and at most one per consumer, or per other device
        k_max = int(k_all[idx].max())
        slots = 1 + min(et.max_out, k_max - 1)
        size = max(1, _CHUNK_CELLS // (m * ga.n * slots))
        for c in range(0, len(idx), size):
            sel = idx[c:c + size]
            dev = np.stack([place[p][gids[p]] for p in sel])  # [P, n] local device of each op
            s, pk = _run_chunk(ga, [plans[p] for p in sel], np.stack([gids[p] for p in sel]),
                               dev, k_all[sel], m, cluster, tables)
            step[sel] = s
            peak[sel] = pk
    return step, peak


def _validate_and_group_ids(ga: GraphArrays, graph: OpGraph, plans: list[Plan],
                            cluster: Cluster) -> tuple[list[np.ndarray], list[np.ndarray],
                                                       np.ndarray]:
    """Validate every plan (the full check once per distinct grouping). Returns each
    plan's group id per op, its placement as an array, and its devices per replica."""
    place = _placements(plans)
    k_all = np.array([int(x.max()) + 1 if len(x) else 1 for x in place], np.int64)
    low_ok = [len(x) == 0 or int(x.min()) >= 0 for x in place]
    out: list[np.ndarray] = []
    last_groups: dict | None = None
    last_ids = np.zeros(0, np.int64)
    max_gid = -1
    for p, plan in enumerate(plans):
        same = last_groups is not None and (plan.groups is last_groups or plan.groups == last_groups)
        fp = plan.model.get("fingerprint")
        par = plan.parallel
        light_ok = (
            same and (fp is None or fp == graph.fingerprint) and par.pipeline == 1
            and max_gid < len(plan.placement)
            and all(0 <= g < len(plan.placement) for g in plan.recompute)
            and low_ok[p] and int(k_all[p]) * par.data <= cluster.num_devices
            and not (par.shard != "none" and par.data == 1)
            and not (par.shard_optimizer and int(k_all[p]) > 1)
        )
        if not light_ok:
            validate(graph, plan, cluster)
            if not same:
                last_groups = plan.groups
                last_ids = np.array([plan.groups[name] for name in ga.names], dtype=np.int64)
                max_gid = int(last_ids.max())
        out.append(last_ids)
    return out, place, k_all


def _placements(plans: list[Plan]) -> list[np.ndarray]:
    """Every plan's placement as integers (one conversion for the batch when every plan
    has as many groups)."""
    if len({len(p.placement) for p in plans}) == 1:
        return list(np.array([p.placement for p in plans], np.int64))
    return [np.asarray(p.placement, np.int64) for p in plans]


def _run_chunk(ga: GraphArrays, plans: list[Plan], gid: np.ndarray, dev: np.ndarray,
               k_plan: np.ndarray, m: int, cluster: Cluster, tables: CostTables
               ) -> tuple[np.ndarray, np.ndarray]:
    n, num = ga.n, len(plans)
    ar = np.arange(n)
    dev_t = np.ascontiguousarray(dev.T)  # [n, P]: arrays are op-major from here on
    kk = int(k_plan.max())
    d = np.array([p.parallel.data for p in plans], np.float64)
    mdiv = m * d  # the scalar path divides by m * d

    # ---- op times [n, P]: per (device, op) for each share of the batch, then per plan
    share = 1.0 / mdiv
    ids = np.arange(kk)
    kind = tables.kind_of_device[ids].astype(np.float64)
    tf, tb = _device_op_tables(dev_t, share, np.stack([kind, tables.overhead[ids]], 1),
                               lambda devs, sh: _op_times(tables, devs, sh))
    rc_op = np.zeros((num, n), bool)  # what the forward does not keep
    rerun = np.zeros((num, n), bool)  # what runs again (sim.model.rerun_ops)
    for p, plan in enumerate(plans):
        if plan.recompute:
            rc_op[p] = np.isin(gid[p], list(plan.recompute))
            rerun[p] = rerun_ops(ga, gid[p], plan.recompute, frozenset())
    if rerun.any():
        tb = tb + np.where(rerun.T, tf, 0.0)

    # ---- each op's slots: its device, then the others its consumers use
    sends = plan_sends(ga, dev_t)
    # ---- issue order: sort (mb, op) by (mb + level, mb, op), as lowering.issue_order_items
    order_t = _issue_orders(ga, plans, gid, dev, dev_t, m, kk)  # [mn, P] item per step
    rc_host = default_recompute_host(tables.kinds)  # checkpointing's host time (block_profile)
    rc_priced = bool(rc_op.any() and rc_host.any())  # (0 by default: nothing to add)
    # an eager plan's recompute issued again on a GPU kind (block_profile.reissued_forward;
    # a graph with a profiled block has its recompute plans simulated one by one)
    reissue = rerun.T & gpu_kinds(tables.kinds)[tables.kind_of_device[dev_t]] & ~np.array(
        [p.parallel.compile for p in plans])[None, :]  # [n, P]
    host_on = bool(tables.host.any() or tables.ddp_host.any() or tables.copy_host.any()
                   or np.isfinite(tables.host_fwd).any() or np.isfinite(tables.host_bwd).any()
                   or rc_priced or reissue.any())
    hf_t = hb_t = None
    copy_h = tables.copy_host[:kk]  # replica 0's devices (replicas are alike here)
    if host_on:  # [n, P] host seconds per op, forward and backward
        hf_t, hb_t = _device_op_tables(
            dev_t, share, np.stack([kind, tables.host[ids]], 1),
            lambda devs, sh: host_times(tables, devs, ar[None, :], sh))
        for p, pl in enumerate(plans):
            if pl.parallel.graphs:  # one replay per piece (sim_local)
                hf_t[:, p] = hb_t[:, p] = graphed_host(
                    dev_t[:, p], ga.param_count,
                    tables.graph_param_host[tables.kind_of_device[dev_t[:, p]]])
        if reissue.any():  # the recomputed forward, issued again in the backward
            hb_t = hb_t + np.where(reissue, hf_t, 0.0)
        if rc_priced:  # a checkpointed region's host time, on its last op's backward
            ends = np.stack([region_ends(g)[1] for g in gid]).T & rc_op.T  # [n, P]
            hb_t = hb_t + np.where(ends, rc_host[tables.kind_of_device[dev_t]], 0.0)
        ddp = (d > 1) & np.array([pl.parallel.shard == "none" for pl in plans])
        if ddp.any():  # DDP's backward hook per parameter tensor (sim_local)
            hb_t = hb_t + ga.param_count[:, None] * tables.ddp_host[dev_t] * ddp[None, :]
    # ---- the backward's issue (batch_issue) first: its tables and the loops' are not
    # held at once; with no host costs it is the reversed forward order
    ss = step_slots(sends, order_t, dev_t)
    steps = m * n
    bpos = np.broadcast_to(np.arange(steps - 1, -1, -1)[:, None], (steps, num))
    host = issued = copied = None
    if host_on:
        host = host_clock(ss, hf_t, copy_h)
        copy_on = np.logical_or.accumulate(copy_h != 0)[k_plan - 1]
        bpos, issued, copied = batch_backward_issue(ga, dev, order_t, m, hb_t, copy_h,
                                                    copy_on, host[-1, -1], kk, sends)
    # when each plan's host has issued its whole backward (sim/optimizer_host.py)
    host_end = np.zeros(num) if host is None else np.maximum(host[-1, -1], issued.max(0))
    st = step_tables(ga, sends, ss, order_t, kk, tf, tb, mdiv, tables, host)
    del ss, host
    dev_free, link_free = forward_steps(st, num, kk)
    bfin = backward_steps(st, dev_free, link_free, num, bpos, issued, copied)
    dev_free = dev_free.reshape(num, kk)
    last_bwd = bfin.reshape(m, n, num).max(0).T  # [P, n]
    return finish_batch(ga, plans, dev, gid, rc_op, last_bwd, dev_free, d, k_plan, kk, m,
                        cluster, tables, order_t.T, host_end)


def _op_times(tables: CostTables, devs: np.ndarray, share: float
              ) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds ``[len(devs), n]`` of every op on each device."""
    devs = devs.reshape(-1)
    kind = tables.kind_of_device[devs]
    oh = tables.overhead[devs][:, None]
    return (scaled(tables.fwd[kind], tables.fwd_fixed[kind], oh, share),
            scaled(tables.bwd[kind], tables.bwd_fixed[kind], oh, share))


def _device_op_tables(dev_t: np.ndarray, share: np.ndarray, sig: np.ndarray, fn
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``fn(devices [U, 1], share) -> (a, b)``, tables ``[U, n]`` per device and op,
    evaluated once per distinct share of the batch and per distinct device (``sig [K,
    c]``: what ``fn`` reads of a device) and read at every plan's ``[n, P]`` devices: the
    same numbers as evaluating it per plan."""
    n, num = dev_t.shape
    _, first, inverse = np.unique(sig, axis=0, return_index=True, return_inverse=True)
    devs = first[:, None]
    cell = inverse.reshape(-1)[dev_t] * n + np.arange(n)[:, None]
    values = np.unique(share)
    if len(values) == 1:
        return tuple(np.asarray(t, np.float64).reshape(-1).take(cell)
                     for t in fn(devs, float(values[0])))
    out = (np.empty((n, num)), np.empty((n, num)))
    for v in values.tolist():
        cols = np.flatnonzero(share == v)
        for o, t in zip(out, fn(devs, v)):
            o[:, cols] = np.asarray(t, np.float64).reshape(-1).take(cell[:, cols])
    return out


def _issue_orders(ga: GraphArrays, plans: list[Plan], gid: np.ndarray, dev: np.ndarray,
                  dev_t: np.ndarray, m: int, kk: int) -> np.ndarray:
    """``[m n, P]`` forward issue order (item per step) of every plan, as
    ``lowering.issue_order_items``: the wavefront sort, vectorised; a plan with an issue
    priority takes the lowering's order itself."""
    n, num = dev_t.shape
    pidx = np.arange(num)
    # devices ranked by their first op (unused ones after, in device order)
    first = np.tile(n + np.arange(kk), num)
    np.minimum.at(first, (pidx[:, None] * kk + dev).reshape(-1), np.tile(np.arange(n), num))
    rank = np.argsort(np.argsort(first.reshape(num, kk), axis=1), axis=1)
    rank_t = rank[pidx, dev_t]  # [n, P]
    level_t = np.empty_like(rank_t)
    for i in range(n):
        pr = ga.preds[i]
        if not pr:
            level_t[i] = rank_t[i]
        elif len(pr) == 1:
            np.maximum(rank_t[i], level_t[pr[0]], out=level_t[i])
        else:
            np.maximum(rank_t[i], level_t[pr].max(0), out=level_t[i])
    items = np.arange(m * n)
    key = ((items // n + level_t.T[:, items % n]) * m + items // n) * n + items % n  # [P, mn]
    order_t = np.ascontiguousarray(np.argsort(key, axis=1).T)
    for p, plan in enumerate(plans):
        if plan.priority:
            prio = np.asarray(plan.priority)[gid[p]].tolist()
            order_t[:, p] = issue_order_items(ga.preds, dev[p].tolist(), m, prio)
    return order_t
