"""End of a batched step: DDP's gradient buckets, the AdamW update and memory per device.

The same formulas as ``local.finish_step`` and ``replica_memory.local_memory`` (whose memory
timeline, ``sim.memory``, takes every plan's events at once), over ``[plans, devices]`` arrays built with one ``bincount`` / ``maximum.at`` each (never a pass per
device: a chunk at 512 devices has 512 of them). Byte counts are whole numbers, so sums
in another order are the same sums.
"""

from __future__ import annotations

import numpy as np

from autoplace.cluster import Cluster
from autoplace.plan import Plan
from autoplace.sim.memory import cast_copy_bytes, cast_weight_bytes, replica_events, timeline_peak
from autoplace.sim.model import (
    BUCKET_BYTES,
    OPTIMIZER_STATE_PER_PARAM_BYTE,
    UPDATE_TRAFFIC_PER_PARAM_BYTE,
    CostTables,
    GraphArrays,
    affine_collective,
    graphed_grad_bytes,
    shared_save_bytes,
)
from autoplace.sim.optimizer_host import optimizer_host_s
from autoplace.sim.replica_memory import casts_saved

__all__ = ["finish_batch"]


def finish_batch(ga: GraphArrays, plans: list[Plan], dev: np.ndarray, gid: np.ndarray,
                 rc_op: np.ndarray, last_bwd: np.ndarray, dev_free: np.ndarray,
                 d: np.ndarray, k_plan: np.ndarray, kk: int, m: int, cluster: Cluster,
                 tables: CostTables, order: np.ndarray, host_end: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(step_time_s [P], peak_memory_bytes [P, D])`` from each plan's device clocks
    (``dev_free [P, K]``), when each op's gradient is final (``last_bwd [P, n]``), its
    forward issue order (``order [P, m n]``) and when its host has issued the backward
    (``host_end [P]``: the optimizer's host work follows, sim/optimizer_host.py)."""
    num, n = dev.shape
    cell = np.arange(num)[:, None] * kk + dev  # [P, n] device cell of every op
    pbytes = _per_device(cell, ga.param_bytes, num * kk).reshape(num, kk)
    coll = np.zeros((num, kk))
    multi = np.flatnonzero(d > 1)
    if len(multi):
        coll[multi] = _ddp_buckets(ga, plans, dev[multi], multi, last_bwd[multi], kk,
                                   cluster)
    bw = tables.mem_bandwidth[:kk]
    t_up = UPDATE_TRAFFIC_PER_PARAM_BYTE * pbytes / bw[None, :]
    step_h, zero_h = optimizer_host_s(tables.opt_host, int(tables.kind_of_device[0]),
                                      float(ga.param_count.sum()))
    start = np.maximum(dev_free, coll)
    if step_h:
        start = np.maximum(start, (host_end + step_h)[:, None])
    upd_end = np.where(t_up > 0, start + t_up, dev_free)
    step = np.maximum(upd_end, coll).max(1)
    if step_h or zero_h:
        step = np.maximum(step, host_end + step_h + zero_h)

    mem = _memory(ga, plans, dev, cell, gid, rc_op, pbytes, d, k_plan, kk, m, order)
    # replica r's local device j is cluster device r * k + j
    col = np.arange(cluster.num_devices)
    local = col[None, :] % k_plan[:, None]
    on = col[None, :] < (k_plan * d.astype(np.int64))[:, None]
    peak = np.where(on, np.take_along_axis(mem, local, 1), 0.0)
    return step, peak


def _per_device(cell: np.ndarray, per_op: np.ndarray, size: int) -> np.ndarray:
    """Sum of ``per_op`` (``[n]`` or ``[P, n]``) over the ops of every device cell."""
    w = np.broadcast_to(per_op, cell.shape).reshape(-1)
    return np.bincount(cell.reshape(-1), weights=w, minlength=size)


def _max_per_device(cell: np.ndarray, per_op: np.ndarray, size: int) -> np.ndarray:
    """Largest non-negative ``per_op`` over the ops of every device cell (0: none)."""
    out = np.zeros(size)
    np.maximum.at(out, cell.reshape(-1), np.broadcast_to(per_op, cell.shape).reshape(-1))
    return out


def _ddp_buckets(ga: GraphArrays, plans: list[Plan], dev: np.ndarray, which: np.ndarray,
                 last_bwd: np.ndarray, kk: int, cluster: Cluster) -> np.ndarray:
    """When each device's gradient all-reduces end (``[Q, K]``) for the data-parallel
    plans ``which``: 25 MB buckets filled in reverse topological order per device, each
    all-reduced once its last gradient is final and the previous bucket is done."""
    num, n = dev.shape
    rev = np.arange(n - 1, -1, -1)
    with_params = rev[ga.param_bytes[rev] > 0]  # ops holding parameters, last first
    coll = np.zeros(num * kk)
    if not len(with_params):
        return coll.reshape(num, kk)
    q, x = np.divmod(np.arange(num * len(with_params)), len(with_params))
    op = with_params[x]
    grp = q * kk + dev[q, op]  # (plan, device) of every op with parameters
    order = np.argsort(grp, kind="stable")  # per group, in reverse topological order
    grp, op, q = grp[order], op[order], q[order]
    pb = ga.param_bytes[op]
    total = np.cumsum(pb)
    starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    offset = np.repeat(total[starts] - pb[starts], np.diff(np.r_[starts, len(grp)]))
    bucket = np.floor((total - pb - offset) / BUCKET_BYTES).astype(np.int64)
    nb = int(bucket.max()) + 1
    key = grp * nb + bucket
    nbytes = np.bincount(key, weights=pb, minlength=num * kk * nb).reshape(num * kk, nb)
    ready = np.full(num * kk * nb, -np.inf)
    np.maximum.at(ready, key, last_bwd[q, op])
    ready = ready.reshape(num * kk, nb)
    # all-reduce coefficients of each group's ring (replicas of its local device)
    groups = grp[starts]
    c = np.zeros((num * kk, 2))
    cache: dict[tuple[int, int, int], tuple[float, float]] = {}
    for g in groups.tolist():
        plan = plans[int(which[g // kk])]
        j, dd, k = g % kk, plan.parallel.data, plan.devices_per_replica
        if (dd, k, j) not in cache:
            cache[(dd, k, j)] = affine_collective(cluster, "allreduce",
                                                  [r * k + j for r in range(dd)])
        c[g] = cache[(dd, k, j)]
    for b in range(nb):
        xb = nbytes[groups, b]
        t = np.maximum(coll[groups], ready[groups, b]) + (c[groups, 0] + c[groups, 1] * xb)
        coll[groups] = np.where(xb > 0, t, coll[groups])
    return coll.reshape(num, kk)


def _memory(ga: GraphArrays, plans: list[Plan], dev: np.ndarray, cell: np.ndarray,
            gid: np.ndarray, rc_op: np.ndarray, pbytes: np.ndarray, d: np.ndarray,
            k_plan: np.ndarray, kk: int, m: int, order: np.ndarray) -> np.ndarray:
    """``[P, K]`` bytes per local device at its peak, as ``replica_memory.local_memory`` (no
    sharding): the static parts, and the timeline of ``order`` ``[P, m n]`` (forward issue
    order) through :func:`autoplace.sim.memory.timeline_peak`."""
    num, n = dev.shape
    size = num * kk
    pidx = np.arange(num)
    dcol = d[:, None]
    ddp = (dcol > 1) & (k_plan[:, None] == 1)  # DDP: its buckets hold the gradients
    grads = np.where(ddp, pbytes, 0.0)  # (replica_memory.static_memory)
    graphed = np.array([pl.parallel.graphs for pl in plans])[:, None]
    grads = grads + np.where(graphed, graphed_grad_bytes(pbytes, m), 0.0)
    opt = OPTIMIZER_STATE_PER_PARAM_BYTE * pbytes
    # [P, n] (replica_memory.op_memory): autocast's weight copies saved by the ops that read
    # them, one copy per replica, where replica_memory.casts_saved says so; else held the
    # whole step beside the parameters (replica_memory.static_memory)
    saved = np.array([casts_saved(ga, pl) for pl in plans])[:, None]
    cast = np.where(saved, 0.0, cast_copy_bytes(ga, cell, size).reshape(num, kk))
    kept = (np.where(rc_op, 0.0, ga.act_bytes) + ga.loss_keep
            + np.where(saved, cast_weight_bytes(ga)[None, :] * d[:, None], 0.0))
    fwd_out = ga.out_bytes - ga.loss_keep
    back = np.broadcast_to(ga.back_bytes, (num, n))
    shared = shared_save_bytes(ga, cell, ~rc_op, size)
    if rc_op.any():
        gmax = int(gid.max()) + 1
        gkey = pidx[:, None] * gmax + gid  # [P, n] (plan, group) of every op
        gact = np.bincount(gkey[rc_op], weights=np.broadcast_to(ga.act_bytes, (num, n))[rc_op],
                           minlength=num * gmax)
        has_rc = np.zeros(num * gmax, bool)
        has_rc[gkey[rc_op]] = True
        back = np.maximum(back, np.where(has_rc[gkey], gact[gkey], 0.0))
        rc_g = np.zeros((num, gmax), bool)
        for p, plan in enumerate(plans):
            rc_g[p, list(plan.recompute)] = True
        # inputs a recomputed group keeps: each outside producer once per group, counted
        # on the group's first op
        es, eb = ga.edge_src, ga.edge_bytes
        gu, gv = gid[:, es], gid[:, ga.edge_dst]
        cross = rc_g[pidx[:, None], gv] & (gu != gv)
        dup = np.zeros_like(cross)
        o = 1
        while o < len(es) and (es[o:] == es[:-o]).any():
            same = es[o:] == es[:-o]
            dup[:, o:] |= same[None, :] & (gv[:, o:] == gv[:, :-o])
            o += 1
        keep = cross & ~dup
        first = np.full(num * gmax, n)
        np.minimum.at(first, gkey.reshape(-1), np.tile(np.arange(n), num))
        at = first[(pidx[:, None] * gmax + gv)[keep]]
        kept = kept.copy()
        np.add.at(kept, (np.broadcast_to(pidx[:, None], keep.shape)[keep], at),
                  np.broadcast_to(eb, keep.shape)[keep])
    grad = np.where(ddp, 0.0, np.broadcast_to(ga.param_bytes, (num, n)))
    peak = timeline_peak(*replica_events(n, dev, order, kept, back, fwd_out, grad,
                                         1.0 / (m * d)), kk)
    return pbytes + cast + grads + opt + (peak.total + shared).reshape(num, kk)
