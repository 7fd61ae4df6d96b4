"""Vectorised simulation of many ``pipeline == 1`` plans (numpy arrays over plans).

The same model as ``sim.local``, step for step: at step ``s`` every plan processes the
``s``-th item of its own issue order (``sim.batch_steps``), so each plan's compute and link
queues see the same order as in the scalar path; the backward's issue order and times
come from autograd's threads simulated for every plan at once (``sim.batch_issue``). Host
issue time is the scalar path's too, its clocks summed in the same order. Plans with
``pipeline > 1``, ZeRO-2 or FSDP, selective recompute, or replicas on unlike devices go
through the scalar path; plans with an issue priority stay here with the lowering's order.
"""

from __future__ import annotations

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.lowering import issue_order_items, validate
from autoplace.plan import Plan
from autoplace.sim.batch_issue import batch_backward_issue, pred_table
from autoplace.sim.batch_steps import Steps, backward_steps, forward_steps
from autoplace.sim.local import simulate_local
from autoplace.sim.model import (
    BUCKET_BYTES,
    DDP_GRAD_COPIES,
    OPTIMIZER_STATE_PER_PARAM_BYTE,
    UPDATE_TRAFFIC_PER_PARAM_BYTE,
    CostTables,
    GraphArrays,
    affine_collective,
    graph_arrays,
    graphed_grad_bytes,
    graphed_host,
    host_times,
    replicas_identical,
    scaled,
)
from autoplace.sim.pipeline import simulate_pipeline

#: bound on items x plans x local devices per vectorised chunk (memory ~ 100 bytes each)
_CHUNK_CELLS = 4_000_000


def run_batch(graph: OpGraph, plans: list[Plan], cluster: Cluster, tables: CostTables
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(step_time_s [P], peak_memory_bytes [P, D] float)`` of every plan."""
    ga = graph_arrays(graph)
    num = len(plans)
    step = np.zeros(num)
    peak = np.zeros((num, cluster.num_devices))
    gids = _validate_and_group_ids(ga, graph, plans, cluster)
    by_m: dict[int, list[int]] = {}
    for p, plan in enumerate(plans):
        par = plan.parallel
        if par.pipeline > 1 or par.shard != "none" or plan.selective \
                or not replicas_identical(cluster, plan):
            sim = simulate_pipeline if par.pipeline > 1 else simulate_local
            out = sim(ga, plan, cluster, tables, False)
            step[p] = out["step"]
            peak[p] = out["peak"]
        else:
            by_m.setdefault(par.microbatches, []).append(p)
    for m, idx in by_m.items():
        k_max = max(plans[p].devices_per_replica for p in idx)
        size = max(1, _CHUNK_CELLS // (m * ga.n * k_max))
        for c in range(0, len(idx), size):
            sel = idx[c:c + size]
            s, pk = _run_chunk(ga, [plans[p] for p in sel], np.stack([gids[p] for p in sel]),
                               m, cluster, tables)
            step[sel] = s
            peak[sel] = pk
    return step, peak


def _validate_and_group_ids(ga: GraphArrays, graph: OpGraph, plans: list[Plan],
                            cluster: Cluster) -> list[np.ndarray]:
    """Validate every plan (the full check once per distinct grouping) and return
    each plan's group id per op."""
    out: list[np.ndarray] = []
    last_groups: dict | None = None
    last_ids = np.zeros(0, np.int64)
    max_gid = -1
    for plan in plans:
        same = last_groups is not None and (plan.groups is last_groups or plan.groups == last_groups)
        fp = plan.model.get("fingerprint")
        par = plan.parallel
        light_ok = (
            same and (fp is None or fp == graph.fingerprint) and par.pipeline == 1
            and max_gid < len(plan.placement)
            and all(0 <= g < len(plan.placement) for g in plan.recompute)
            and _devices_ok(plan.placement, par.data, cluster.num_devices)
            and not (par.shard != "none" and par.data == 1)
        )
        if not light_ok:
            validate(graph, plan, cluster)
            if not same:
                last_groups = plan.groups
                last_ids = np.array([plan.groups[name] for name in ga.names], dtype=np.int64)
                max_gid = int(last_ids.max())
        out.append(last_ids)
    return out


def _devices_ok(placement: tuple[int, ...], data: int, num_devices: int) -> bool:
    arr = np.asarray(placement)
    return bool(arr.min() >= 0 and (arr.max() + 1) * data <= num_devices)


def _run_chunk(ga: GraphArrays, plans: list[Plan], gid: np.ndarray, m: int,
               cluster: Cluster, tables: CostTables) -> tuple[np.ndarray, np.ndarray]:
    n, num = ga.n, len(plans)
    pidx = np.arange(num)
    ar = np.arange(n)
    placement = [np.asarray(p.placement, np.int64) for p in plans]
    dev = np.stack([pl[g] for pl, g in zip(placement, gid)])  # [P, n] local device
    dev_t = np.ascontiguousarray(dev.T)  # [n, P]: arrays are op-major from here on
    k_plan = np.array([p.devices_per_replica for p in plans])
    kk = int(k_plan.max())
    d = np.array([p.parallel.data for p in plans], np.float64)
    mdiv = m * d  # the scalar path divides by m * d

    # ---- op times [n, P]
    kind = tables.kind_of_device[dev_t]
    oh = tables.overhead[dev_t]
    share = 1.0 / mdiv
    col = ar[:, None]
    tf = scaled(tables.fwd[kind, col], tables.fwd_fixed[kind, col], oh, share)
    tb = scaled(tables.bwd[kind, col], tables.bwd_fixed[kind, col], oh, share)
    rc_op = np.zeros((num, n), bool)
    for p, plan in enumerate(plans):
        if plan.recompute:
            rc_op[p] = np.isin(gid[p], list(plan.recompute))
    if rc_op.any():
        tb = tb + np.where(rc_op.T, tf, 0.0)

    # ---- link time of the tensor each op sends to each other device (max over its
    # consumers there), -inf where nothing is sent: max(queue, t) + -inf drops out
    es, ed, eb = ga.edge_src, ga.edge_dst, ga.edge_bytes
    durs_f: list[np.ndarray] = []
    durs_b: list[np.ndarray] = []
    if len(es) and kk > 1:
        dv, du = dev_t[ed], dev_t[es]
        starts = np.flatnonzero(np.r_[True, es[1:] != es[:-1]])
        heads = es[starts]
        if kk == 2:  # a crossing edge goes to the one other device
            other = np.zeros((n, num))
            other[heads] = np.maximum.reduceat(np.where(dv != du, eb[:, None], 0.0), starts, 0)
        alpha, inv = tables.alpha, tables.inv_bw
        for e in range(kk):
            if kk == 2:
                nb = np.where(dev_t == 1 - e, other, 0.0)
            else:
                nb = np.zeros((n, num))
                nb[heads] = np.maximum.reduceat(np.where(dv == e, eb[:, None], 0.0), starts, 0)
                nb *= dev_t != e
            bmb = nb / mdiv
            sent = nb > 0
            durs_f.append(np.where(sent, alpha[dev_t, e] + bmb * inv[dev_t, e], -np.inf))
            durs_b.append(np.where(sent, alpha[e, dev_t] + bmb * inv[e, dev_t], -np.inf))

    # ---- issue order: sort (mb, op) by (mb + level, mb, op), as lowering.issue_order_items
    order_t = _issue_orders(ga, plans, gid, dev, dev_t, m, kk)  # [mn, P] item per step
    steps = m * n
    op_t = order_t % n
    mboff_t = (order_t // n) * (n + 1)  # row offset of the item's microbatch (n + 1 rows each)
    flat = op_t * num + pidx
    dev_s = np.take(dev_t, flat)
    host_on = bool(tables.host.any() or tables.ddp_host.any() or tables.copy_host.any()
                   or np.isfinite(tables.host_fwd).any() or np.isfinite(tables.host_bwd).any())
    dur_f = dur_b = host = hb_t = None
    if kk > 1:
        dur_f = np.stack([np.take(x, flat) for x in durs_f], 1)  # [mn, K, P]
        dur_b = np.stack([np.take(x, flat) for x in durs_b], 1)
    copy_h = tables.copy_host[:kk]  # replica 0's devices (replicas are alike here)
    if host_on:  # [n, P] host seconds per op, forward and backward
        hf_t, hb_t = host_times(tables, dev_t, np.broadcast_to(col, dev_t.shape), share)
        for p, pl in enumerate(plans):
            if pl.parallel.graphs:  # one replay per piece (sim_local)
                hf_t[:, p] = hb_t[:, p] = graphed_host(dev_t[:, p], ga.param_count)
        ddp = (d > 1) & np.array([pl.parallel.shard == "none" for pl in plans])
        if ddp.any():  # DDP's backward hook per parameter tensor (sim_local)
            hb_t = hb_t + ga.param_count[:, None] * tables.ddp_host[dev_t] * ddp[None, :]
        # the forward thread's clock, added up in its order (sim_local): each op, then
        # each copy it sends (to devices in order; adding 0.0 where none changes nothing)
        inc = np.zeros((steps, kk + 1, num))
        inc[:, 0] = np.take(hf_t, flat)
        if kk > 1:
            inc[:, 1:] = np.where(dur_f > -np.inf, copy_h[dev_s][:, None, :], 0.0)
        host = np.cumsum(inc.reshape(-1, num), 0).reshape(steps, kk + 1, num)
    pred_tab, pred_extra = pred_table(ga)
    # cell (producer item, plan, this op's device) of each input: read forward, written back
    in_cell = ((mboff_t[:, None, :] + pred_tab[op_t].transpose(0, 2, 1)) * num + pidx) * kk
    in_cell += dev_s[:, None, :]
    # cells of the inputs past the dense table's width, per (forward step, plan)
    extra_at: dict[tuple[int, int], np.ndarray] = {}
    has_extra = None
    if pred_extra:
        has_extra = np.isin(op_t, list(pred_extra))
        s_hit, p_hit = np.nonzero(has_extra)
        for s, p in zip(s_hit.tolist(), p_hit.tolist()):
            more = ((mboff_t[s, p] + pred_extra[op_t[s, p]]) * num + p) * kk + dev_s[s, p]
            extra_at[(s, p)] = more
    st = Steps(item=order_t, dev_row=pidx * kk + dev_s, item_row=(mboff_t + op_t) * num + pidx,
               in_cell=in_cell, t_fwd=np.take(tf, flat), t_bwd=np.take(tb, flat),
               dur_f=dur_f, dur_b=dur_b, host=host, extra=extra_at, has_extra=has_extra)
    del flat
    rows = m * (n + 1) * num
    _, dev_free, link_free = forward_steps(st, num, kk, rows)
    # backward: each plan's issue order and host times (batch_issue); with no host
    # costs the reversed forward order
    bpos = np.broadcast_to(np.arange(steps - 1, -1, -1)[:, None], (steps, num))
    issued = copied = None
    if host_on:
        copy_on = np.array([bool(copy_h[:k].any()) for k in k_plan.tolist()])
        bpos, issued, copied = batch_backward_issue(ga, dev, order_t, m, hb_t, copy_h,
                                                    copy_on, host[-1, -1], kk)
    bfin = backward_steps(st, dev_free, link_free, num, kk, rows, bpos, issued, copied)
    dev_free = dev_free.reshape(num, kk)
    last_bwd = bfin.reshape(m, n, num).max(0).T  # [P, n]

    return _finish(ga, plans, dev, gid, rc_op, last_bwd, dev_free, d, k_plan, kk, m,
                   cluster, tables)


def _issue_orders(ga: GraphArrays, plans: list[Plan], gid: np.ndarray, dev: np.ndarray,
                  dev_t: np.ndarray, m: int, kk: int) -> np.ndarray:
    """``[m n, P]`` forward issue order (item per step) of every plan, as
    ``lowering.issue_order_items``: the wavefront sort, vectorised; a plan with an issue
    priority takes the lowering's order itself."""
    n, num = dev_t.shape
    pidx = np.arange(num)
    first = np.stack([np.where((dev == j).any(1), (dev == j).argmax(1), n + j)
                      for j in range(kk)], 1)
    rank = np.argsort(np.argsort(first, axis=1), axis=1)
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


def _finish(ga, plans, dev, gid, rc_op, last_bwd, dev_free, d, k_plan, kk, m,
            cluster: Cluster, tables: CostTables) -> tuple[np.ndarray, np.ndarray]:
    num, n = dev.shape
    pidx = np.arange(num)
    pbytes = np.stack([np.where(dev == j, ga.param_bytes, 0.0).sum(1) for j in range(kk)], 1)
    coll = np.zeros((num, kk))
    coeff_cache: dict[tuple, tuple[float, float]] = {}

    def coeffs(kind: str, j: int) -> np.ndarray:
        out = np.zeros((num, 2))
        for p, plan in enumerate(plans):
            dd, k = plan.parallel.data, plan.devices_per_replica
            if j >= k:
                continue
            key = (kind, dd, k, j)
            if key not in coeff_cache:
                coeff_cache[key] = affine_collective(cluster, kind, [r * k + j for r in range(dd)])
            out[p] = coeff_cache[key]
        return out

    multi = d > 1
    if multi.any():  # gradient buckets in reverse topological order
        rev_params = ga.param_bytes[::-1]
        for j in range(kk):
            pb = np.where(dev[:, ::-1] == j, rev_params, 0.0)
            before = np.cumsum(pb, 1) - pb
            bid = np.floor(before / BUCKET_BYTES).astype(np.int64)
            has = (pb > 0) & multi[:, None]
            if not has.any():
                continue
            nbk = int(bid[has].max()) + 1
            key = (pidx[:, None] * nbk + bid)[has]
            nbytes = np.bincount(key, weights=pb[has], minlength=num * nbk).reshape(num, nbk)
            starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            ready = np.zeros(num * nbk)
            ready[key[starts]] = np.maximum.reduceat(last_bwd[:, ::-1][has], starts)
            ready = ready.reshape(num, nbk)
            c = coeffs("allreduce", j)
            for b in range(nbk):
                x = nbytes[:, b]
                t = np.maximum(coll[:, j], ready[:, b]) + (c[:, 0] + c[:, 1] * x)
                coll[:, j] = np.where(x > 0, t, coll[:, j])

    bw = tables.mem_bandwidth[:kk]
    t_up = UPDATE_TRAFFIC_PER_PARAM_BYTE * pbytes / bw[None, :]
    upd_end = np.where(t_up > 0, np.maximum(dev_free, coll) + t_up, dev_free)
    step = np.maximum(upd_end, coll).max(1)

    mem = _memory(ga, plans, dev, gid, rc_op, pbytes, d, kk, m)
    peak = np.zeros((num, cluster.num_devices))
    for p in range(num):
        k = int(k_plan[p])
        for r in range(int(d[p])):
            peak[p, r * k:(r + 1) * k] = mem[p, :k]
    return step, peak


def _memory(ga, plans, dev, gid, rc_op, pbytes, d, kk, m) -> np.ndarray:
    num, n = dev.shape
    pidx = np.arange(num)
    dcol = d[:, None]
    ddp = (dcol > 1) & (np.array([pl.devices_per_replica for pl in plans])[:, None] == 1)
    grads = np.where(ddp, DDP_GRAD_COPIES * pbytes, pbytes)  # sim_model.state_memory
    graphed = np.array([pl.parallel.graphs for pl in plans])[:, None]
    grads = grads + np.where(graphed, graphed_grad_bytes(pbytes, m), 0.0)  # (sim_local)
    opt = OPTIMIZER_STATE_PER_PARAM_BYTE * pbytes
    kept = np.stack([np.where((dev == j) & ~rc_op, ga.act_bytes, 0.0).sum(1)
                     for j in range(kk)], 1)
    big_out = np.stack([np.where(dev == j, ga.out_bytes, 0.0).max(1) for j in range(kk)], 1)
    big_rc = np.zeros((num, kk))
    if rc_op.any():
        gmax = int(gid.max()) + 1
        place = np.full((num, gmax), -1, np.int64)
        for p, plan in enumerate(plans):
            place[p, : len(plan.placement)] = plan.placement
        gact = np.bincount((pidx[:, None] * gmax + gid)[rc_op],
                           weights=np.broadcast_to(ga.act_bytes, (num, n))[rc_op],
                           minlength=num * gmax).reshape(num, gmax)
        rc_g = np.zeros((num, gmax), bool)
        for p, plan in enumerate(plans):
            rc_g[p, list(plan.recompute)] = True
        for j in range(kk):
            big_rc[:, j] = np.where((place == j) & rc_g, gact, 0.0).max(1)
        # inputs a recomputed group keeps: each outside producer once per group
        es, ed, eb = ga.edge_src, ga.edge_dst, ga.edge_bytes
        gu, gv = gid[:, es], gid[:, ed]
        cross = rc_g[pidx[:, None], gv] & (gu != gv)
        dup = np.zeros_like(cross)
        o = 1
        while o < len(es) and (es[o:] == es[:-o]).any():
            same = es[o:] == es[:-o]
            dup[:, o:] |= same[None, :] & (gv[:, o:] == gv[:, :-o])
            o += 1
        keep = np.where(cross & ~dup, eb[None, :], 0.0)
        gdev = place[pidx[:, None], gv]
        kept = kept + np.stack([np.where(gdev == j, keep, 0.0).sum(1) for j in range(kk)], 1)
    acts = kept * m / (m * dcol)
    transient = (big_out + big_rc) / (m * dcol)
    return pbytes + grads + opt + acts + transient
