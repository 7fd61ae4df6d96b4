"""Autograd's backward issue for many plans at once: ``local.backward_issue`` over numpy.

The model is :func:`autoplace.sim.local.backward_issue`'s: per replica one host thread per
device, each taking from the tasks released on it (every consumer's gradient issued, and
for a gradient going back to another device its copy, a task of the consumer device's
thread) the one with the smallest ``(max(thread clock, release time), key)``, the key
being "latest created in forward first". The plan-wide choice is the smallest of those
over the threads, which is the smallest ``(max(clock of its thread, release), key)`` over
every released task of the plan: one reduction over a short row per plan, whatever the
number of devices.

So every plan takes one task per step, in lockstep: a plan's released tasks sit in a row
of a ``[plans, width]`` table (appended ``fan-in`` columns a step, compacted when full),
and a step is a fixed few dozen numpy operations whatever the placement; the number of
steps is the largest task count (items plus gradient copies) of the batch.
"""

from __future__ import annotations

import numpy as np

from autoplace.sim.model import GraphArrays

__all__ = ["batch_backward_issue", "pred_table"]

#: predecessor lists longer than this are walked per plan (rare: an op fed by many)
MAX_DENSE_FANIN = 8


def pred_table(ga: GraphArrays) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Distinct producers of every op as a dense ``[n, F]`` table padded with ``n``, and
    the producers past ``F`` of the ops that have more (cached on ``ga``)."""
    cached = ga.__dict__.get("_pred_table")
    if cached is not None:
        return cached
    lists = [list(dict.fromkeys(x)) for x in ga.preds]
    width = max(1, min(MAX_DENSE_FANIN, max((len(x) for x in lists), default=1)))
    table = np.full((ga.n, width), ga.n, np.int64)
    extra: dict[int, np.ndarray] = {}
    for i, x in enumerate(lists):
        table[i, : min(len(x), width)] = x[:width]
        if len(x) > width:
            extra[i] = np.asarray(x[width:], np.int64)
    ga.__dict__["_pred_table"] = (table, extra)
    return table, extra


def batch_backward_issue(ga: GraphArrays, dev: np.ndarray, order_t: np.ndarray, m: int,
                         hb_t: np.ndarray, copy_h: np.ndarray, copy_on: np.ndarray,
                         host_f: np.ndarray, kk: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Backward issue order and times of ``P`` one-process replicas.

    Args:
        ga: the graph's arrays.
        dev: ``[P, n]`` local device of every op.
        order_t: ``[m n, P]`` forward issue order (items ``mb * n + op``).
        m: microbatches.
        hb_t: ``[n, P]`` backward host seconds of each op's item.
        copy_h: ``[kk]`` host seconds of a gradient copy issued by each local device's thread.
        copy_on: ``[P]`` whether the plan's copies are tasks of their own (some device of
            the plan has a copy cost), as ``local.backward_issue``'s ``with_copies``.
        host_f: ``[P]`` when the forward is fully issued (the threads start then).
        kk: local devices of the widest plan.

    Returns:
        ``(bpos, issued, copied)``, each row ``s`` the ``s``-th backward item a plan issues:
        ``bpos [m n, P]`` its forward step, ``issued [m n, P]`` when its issue ends, and
        ``copied [m n, P, kk]`` when its gradient's copy from each device is issued (0
        where none; None when no copy has a host cost), as ``local.backward_issue``.
    """
    num, n = dev.shape
    mn = m * n
    pidx = np.arange(num)
    pos = np.empty((num, mn), np.int64)  # forward step of every item
    pos[pidx[:, None], order_t.T] = np.arange(mn)[None, :]
    with_copies = kk > 1 and bool(copy_on.any())

    # ---- copy tasks: (plan, op, device) with consumers of the op on that other device
    es, ed = _distinct_edges(ga)
    du, dv = dev[:, es], dev[:, ed]  # [P, E]
    cross = (du != dv) & copy_on[:, None]
    cidx = ((pidx[:, None] * n + es[None, :]) * kk + dv)[cross]
    ccount = np.bincount(cidx, minlength=num * n * kk)  # consumers there
    # the first consumer there in issue order (the same op in every microbatch)
    first = np.full(num * n * kk, mn, np.int64)
    np.minimum.at(first, cidx, pos[:, ed][cross])
    has = ccount > 0
    per_mb = has.reshape(num, n * kk).sum(1)  # copies per microbatch of each plan
    cmax = int(per_mb.max()) if with_copies else 0
    width = mn + m * cmax + 2  # items, copies, then an empty slot and a sink for padding
    empty, sink = width - 2, width - 1
    rank = (np.cumsum(has.reshape(num, n * kk), 1) - 1).reshape(-1)  # copy's index in mb
    base = pidx * width

    # ---- per task: thread (flat clock cell), host cost, key, dependencies, targets
    ptab, extra = pred_table(ga)
    fan = ptab.shape[1]
    thr = np.full((num, width), num * kk, np.int64)  # clock cell num*kk: nobody's
    cost = np.zeros((num, width))
    key = np.full((num, width), np.inf)
    deps = np.zeros((num, width), np.int64)
    tgt = np.full((num, width, fan), sink, np.int64)  # local task ids
    items = np.arange(mn)
    op_of = items % n
    mb_of = items // n
    dev_it = dev[:, op_of]  # [P, mn]
    thr[:, :mn] = pidx[:, None] * kk + dev_it
    cost[:, :mn] = hb_t.T[:, op_of]
    key[:, :mn] = (-2.0 * pos) * mn + items  # latest created first; ids break no ties
    succ_n = np.bincount(es, minlength=n)
    same_n = succ_n[None, :] - ccount.reshape(num, n, kk).sum(2)
    deps[:, :mn] = (same_n + has.reshape(num, n, kk).sum(2))[:, op_of]
    # an item's producers: the producer's item on the same device, else its copy to here
    pu = ptab[op_of]  # [mn, F]
    pad = pu == n
    pu_c = np.where(pad, 0, pu)
    prod_item = mb_of[:, None] * n + pu_c  # [mn, F]
    dev_pu = dev[:, pu_c]  # [P, mn, F]
    cell = (pidx[:, None, None] * n + pu_c[None]) * kk + dev_it[:, :, None]
    via_copy = (dev_pu != dev_it[:, :, None]) & copy_on[:, None, None]
    copy_task = mn + mb_of[None, :, None] * cmax + rank[cell]
    tgt[:, :mn, :] = np.where(pad[None], sink,
                              np.where(via_copy, copy_task, prod_item[None]))
    if with_copies:
        p_c, u_c, e_c = np.unravel_index(np.flatnonzero(has), (num, n, kk))
        w_pos0 = first[has]  # forward step of the first consumer's microbatch-0 item
        w_op = order_t[w_pos0, p_c] % n
        r_c = rank[np.flatnonzero(has)]
        for mb in range(m):
            t_c = mn + mb * cmax + r_c
            it_c = mb * n + u_c
            thr[p_c, t_c] = p_c * kk + e_c
            cost[p_c, t_c] = copy_h[e_c]
            # just after its first consumer; equal keys (one consumer, several producers)
            # go in producer order, as the scalar path's task ids do
            key[p_c, t_c] = (1.0 - 2.0 * pos[p_c, mb * n + w_op]) * mn + it_c
            deps[p_c, t_c] = ccount[np.flatnonzero(has)]
            tgt[p_c, t_c, 0] = it_c
    # unused copy slots, the empty slot and the sink are never released
    if cmax:
        unused = (np.arange(m * cmax) % cmax)[None, :] >= per_mb[:, None]
        deps[:, mn:mn + m * cmax][unused] = 1 << 40
    deps[:, empty:] = 1 << 40

    flat_tgt = (tgt + base[:, None, None]).reshape(num * width, fan)
    thr_f, cost_f, key_f = thr.reshape(-1), cost.reshape(-1), key.reshape(-1)
    deps_f = deps.reshape(-1)
    rt_f = np.repeat(host_f, width)  # release time of every task
    rt_f[base + empty] = np.inf
    clock = np.append(np.repeat(host_f, kk), np.inf)
    tend = np.zeros(num * width)  # when each task's issue ends
    tstep = np.full(num * width, 1 << 40, np.int64)  # the step that took it
    extra_f: dict[int, np.ndarray] = {}  # flat task -> flat targets past the table
    if extra:
        for i, more in extra.items():
            for mb in range(m):
                it = mb * n + i
                for p in range(num):
                    d_i = dev[p, i]
                    ts = [mb * n + u if dev[p, u] == d_i or not copy_on[p]
                          else mn + mb * cmax + int(rank[(p * n + u) * kk + d_i])
                          for u in more.tolist()]
                    extra_f[base[p] + it] = base[p] + np.asarray(ts, np.int64)
    has_extra = np.zeros(num * width, bool)
    has_extra[list(extra_f)] = True

    # ---- released tasks, one row per plan; ``empty`` marks a free slot
    start = np.flatnonzero(deps_f == 0)
    cnt0 = np.bincount(start // width, minlength=num)
    cap = max(4 * fan, 2 * int(cnt0.max()) + fan)
    buf = np.full((num, cap), 0, np.int64)
    buf += (base + empty)[:, None]
    col = np.arange(len(start)) - np.repeat(np.cumsum(cnt0) - cnt0, cnt0)
    buf[start // width, col] = start
    used = int(cnt0.max())
    steps = mn + m * int(per_mb.max()) if with_copies else mn
    rows = pidx * cap
    for s in range(steps):
        if used + fan > cap:
            buf, used, cap = _compact(buf, base + empty, fan)
            rows = pidx * cap
        bt = buf[:, :used]
        e = np.maximum(rt_f.take(bt), clock.take(thr_f.take(bt)))
        emin = e.min(1)
        slot = np.where(e == emin[:, None], key_f.take(bt), np.inf).argmin(1)
        fl = rows + slot
        flat_buf = buf.reshape(-1)
        task = flat_buf.take(fl)
        flat_buf[fl] = base + empty
        end = emin + cost_f.take(task)
        clock[thr_f.take(task)] = end
        tend[task] = end
        tstep[task] = s
        tg = flat_tgt.take(task, axis=0)  # [P, F]
        left = deps_f.take(tg) - 1
        deps_f[tg] = left
        rt_f[tg] = np.maximum(rt_f.take(tg), end[:, None])
        buf[:, used:used + fan] = np.where(left == 0, tg, (base + empty)[:, None])
        used += fan
        if extra_f and has_extra.take(task).any():
            more = _extra_targets(task, end, extra_f, has_extra, deps_f, rt_f)
            if more:
                if used + len(more[0]) > cap:
                    buf, used, cap = _compact(buf, base + empty, fan + len(more[0]))
                    rows = pidx * cap
                for p, t in zip(*more):
                    buf[p, used] = t
                    used += 1
    # ---- per plan, items in the order taken
    it_step = tstep.reshape(num, width)[:, :mn]
    by_step = np.argsort(it_step, axis=1, kind="stable")  # [P, mn] items in issue order
    bpos = np.ascontiguousarray(np.take_along_axis(pos, by_step, 1).T)
    issued = np.ascontiguousarray(np.take_along_axis(tend.reshape(num, width)[:, :mn],
                                                     by_step, 1).T)
    copied = None
    if with_copies:
        copied = np.zeros((mn, num, kk))
        it_sorted = by_step  # [P, mn]
        u_of = it_sorted % n
        mb_s = it_sorted // n
        for e in range(kk):
            c_cell = (pidx[:, None] * n + u_of) * kk + e
            ok = has[c_cell]
            t_id = mn + mb_s * cmax + rank[c_cell]
            val = tend.take(base[:, None] + np.where(ok, t_id, empty))
            copied[:, :, e] = np.where(ok, val, 0.0).T
    return bpos, issued, copied


def _distinct_edges(ga: GraphArrays) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` of every distinct edge (an op may read one tensor twice), cached."""
    cached = ga.__dict__.get("_distinct_edges")
    if cached is None:
        pairs = np.unique(np.stack([ga.edge_src, ga.edge_dst], 1), axis=0).reshape(-1, 2)
        cached = (np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1]))
        ga.__dict__["_distinct_edges"] = cached
    return cached


def _compact(buf: np.ndarray, empty: np.ndarray, room: int) -> tuple[np.ndarray, int, int]:
    """Released tasks moved to the front of each row; the table widened if ``room``
    more columns do not fit. Returns ``(table, used columns, width)``."""
    live = buf != empty[:, None]
    order = np.argsort(~live, axis=1, kind="stable")
    buf = np.take_along_axis(buf, order, 1)
    used = int(live.sum(1).max())
    cap = buf.shape[1]
    if used + room > cap // 2:
        cap = 2 * (used + room)
        wide = np.empty((buf.shape[0], cap), np.int64)
        wide[:] = empty[:, None]
        wide[:, : buf.shape[1]] = buf
        buf = wide
    buf[:, used:] = empty[:, None]
    return buf, used, cap


def _extra_targets(task, end, extra_f, has_extra, deps_f, rt_f):
    """Dependencies past the dense table of the tasks just taken; returns the
    ``(plans, tasks)`` they release."""
    plans, released = [], []
    for p in np.flatnonzero(has_extra.take(task)).tolist():
        more = extra_f[int(task[p])]
        deps_f[more] -= 1
        rt_f[more] = np.maximum(rt_f[more], end[p])
        for t in more[deps_f[more] == 0].tolist():
            plans.append(p)
            released.append(t)
    return (plans, released) if plans else None
