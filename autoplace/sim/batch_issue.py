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

from autoplace.sim.batch_sends import Sends, edge_tables, plan_sends
from autoplace.sim.model import GraphArrays

__all__ = ["batch_backward_issue"]


def batch_backward_issue(ga: GraphArrays, dev: np.ndarray, order_t: np.ndarray, m: int,
                         hb_t: np.ndarray, copy_h: np.ndarray, copy_on: np.ndarray,
                         host_f: np.ndarray, kk: int, sends: Sends | None = None
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
        sends: the plans' slots (``batch_sends.plan_sends``), built here when None.

    Returns:
        ``(bpos, issued, copied)``, each row ``s`` the ``s``-th backward item a plan issues:
        ``bpos [m n, P]`` its forward step, ``issued [m n, P]`` when its issue ends, and
        ``copied [m n, S1, P]`` when its gradient's copy from each slot's device is issued
        (0 where none, and in slot 0; None when no copy has a host cost), as
        ``local.backward_issue``.
    """
    num, n = dev.shape
    mn = m * n
    pidx = np.arange(num)
    if sends is None:
        sends = plan_sends(ga, np.ascontiguousarray(dev.T))
    et = edge_tables(ga)
    ns = sends.width - 1  # copy slots per op
    pos = np.empty((num, mn), np.int64)  # forward step of every item
    pos[pidx[:, None], order_t.T] = np.arange(mn)[None, :]
    with_copies = ns > 0 and bool(copy_on.any())

    # ---- copy tasks: (plan, op, slot) with consumers of the op on that slot's device
    es, ed = et.dist_src, et.dist_dst
    slot = sends.edge_slot[et.dist_edge].T  # [P, E]
    cross = (slot > 0) & copy_on[:, None]
    cidx = ((pidx[:, None] * n + es[None, :]) * max(ns, 1) + slot - 1)[cross]
    ncell = num * n * max(ns, 1)
    ccount = np.bincount(cidx, minlength=ncell)  # consumers there
    # the first consumer there in issue order (the same op in every microbatch)
    first = np.full(ncell, mn, np.int64)
    np.minimum.at(first, cidx, pos[:, ed][cross])
    has = ccount > 0
    per_mb = np.count_nonzero(has.reshape(num, -1), 1)  # copies per microbatch of each plan
    cmax = int(per_mb.max()) if with_copies else 0
    width = mn + m * cmax + 2  # items, copies, then an empty slot and a sink for padding
    empty, sink = width - 2, width - 1
    rank = np.cumsum(has.reshape(num, -1), 1, dtype=np.int64).reshape(-1) - 1  # index in mb

    # ---- per task (``[task, plan]``, flat ``task * P + plan`` so that the plans' tasks of
    # one step lie close): thread's clock cell, host cost, key, dependencies, targets
    fan = et.pred.shape[1]
    nw = num * width
    thr = np.full((width, num), num * kk, np.int64)  # clock cell num*kk: nobody's
    cost = np.zeros((width, num))
    kq = np.full((width, num), -1, np.int64)  # priority: latest created first
    deps = np.zeros((width, num), np.int64)
    tgt = np.full((fan, width, num), sink, np.int64)  # task ids, made flat below
    items = np.arange(mn)
    op_of = items % n
    mb_of = items // n
    dev_it = dev.T[op_of]  # [mn, P]
    thr[:mn] = pidx * kk + dev_it
    cost[:mn] = hb_t[op_of]
    kq[:mn] = 2 * mn - 2 * pos.T
    succ_n = np.bincount(es, minlength=n)
    cc = ccount.reshape(num, n, -1)
    deps[:mn] = (succ_n[:, None] - cc.sum(2).T + has.reshape(num, n, -1).sum(2).T)[op_of]
    # an item's producers: the producer's item on the same device, else its copy to here
    pu = et.pred[op_of]  # [mn, F]
    pad = pu == n
    pslot = sends.pred_slot[op_of]  # [mn, F, P]
    for f in range(fan):
        via_copy = (pslot[:, f] > 0) & copy_on
        cell = (pidx * n + pu[:, f, None]) * max(ns, 1) + pslot[:, f] - 1
        tgt[f, :mn] = np.where(pad[:, f, None], sink,
                               np.where(via_copy, mn + mb_of[:, None] * cmax
                                        + rank.take(cell, mode="clip"),
                                        (mb_of * n + pu[:, f])[:, None]))
    if with_copies:
        flat_has = np.flatnonzero(has)
        p_c, rest = np.divmod(flat_has, n * ns)
        u_c, j_c = np.divmod(rest, ns)
        e_c = sends.dev[u_c, j_c + 1, p_c]
        at = rank[flat_has] * num + p_c  # cell of each copy in a [cmax, P] block
        blocks = {}
        for name, val, fill in (("thr", p_c * kk + e_c, num * kk), ("cost", copy_h[e_c], 0.0),
                                ("deps", ccount[flat_has], 1 << 40), ("u", u_c, 0),
                                ("w", order_t[first[flat_has], p_c] % n, 0)):
            blk = np.full(cmax * num, fill, np.asarray(val).dtype)
            blk[at] = val  # unused copy slots are never released
            blocks[name] = blk.reshape(cmax, num)
        pos_f = pos.T.reshape(-1)
        for mb in range(m):
            rows = slice(mn + mb * cmax, mn + (mb + 1) * cmax)
            thr[rows] = blocks["thr"]
            cost[rows] = blocks["cost"]
            deps[rows] = blocks["deps"]
            tgt[0, rows] = mb * n + blocks["u"]
            # just after its first consumer (w); equal keys (one consumer, several
            # producers) go in task order, producer order, as the scalar path's
            kq[rows] = 2 * mn + 1 - 2 * pos_f.take((mb * n + blocks["w"]) * num + pidx)
    deps[empty:] = 1 << 40  # the empty slot and the sink are never released

    shift = max(1, int(nw - 1).bit_length())
    flat_ids = np.arange(nw, dtype=np.int64).reshape(width, num)
    key = (kq << shift) | flat_ids  # the task is read back from its key's low bits
    key[kq < 0] = _NONE
    tgt_f = (tgt * num + pidx).reshape(fan, nw)
    rt_f = np.tile(host_f, width)  # release time of every task; inf once taken
    rt_f[empty * num + pidx] = np.inf
    clock = np.append(np.repeat(host_f, kk), np.inf)  # per thread, and one for nobody
    extra_f = _extra_targets(et.extra, sends, dev, rank, copy_on, n, m, ns, cmax)
    steps = mn + m * int(per_mb.max()) if with_copies else mn
    fewest = mn + m * int(per_mb.min()) if with_copies else mn
    tend, tstep = _take_tasks(deps.reshape(-1), rt_f, clock, thr.reshape(-1), cost.reshape(-1),
                              key.reshape(-1), (1 << shift) - 1, tgt_f, extra_f,
                              empty * num + pidx, steps, fewest)
    tend, tstep = tend.reshape(width, num), tstep.reshape(width, num)
    # ---- per plan, items in the order taken
    by_step = np.argsort(tstep[:mn], axis=0, kind="stable")  # [mn, P] items in issue order
    bpos = np.take_along_axis(pos.T, by_step, 0)
    issued = np.take_along_axis(tend[:mn], by_step, 0)
    copied = None
    if with_copies:
        copied = np.zeros((mn, ns + 1, num))
        u_of = by_step % n
        mb_s = by_step // n
        tend_f = tend.reshape(-1)
        for j in range(ns):
            c_cell = (pidx * n + u_of) * ns + j
            ok = has.take(c_cell)
            t_id = (mn + mb_s * cmax + rank.take(c_cell)) * num + pidx
            copied[:, j + 1] = np.where(ok, tend_f.take(t_id, mode="clip"), 0.0)
    return bpos, issued, copied


#: the key of no task (empty slots), above every task's
_NONE = np.int64(1) << 62


def _take_tasks(deps_f, rt_f, clock, thr_f, cost_f, key_f, mask, tgt_f, extra_f, empty,
                steps, fewest) -> tuple[np.ndarray, np.ndarray]:
    """The lockstep loop: each step every plan takes its next task. Returns when each
    task's issue ends and at which step it was taken (flat task ids)."""
    nw = len(rt_f)
    fan = tgt_f.shape[0]
    tend = np.zeros(nw)
    tstep = np.full(nw, 1 << 40, np.int64)
    # released tasks, a row per slot and a column per plan: task, clock cell, key
    start = np.flatnonzero(deps_f == 0)
    num = len(empty)
    plan_of = start % num
    cnt0 = np.bincount(plan_of, minlength=num)
    order = np.argsort(plan_of, kind="stable")
    cap = int(cnt0.max()) + 16 * fan
    b_task = np.empty((cap, num), np.int64)
    b_task[:] = empty
    b_task[np.arange(len(start)) - np.repeat(np.cumsum(cnt0) - cnt0, cnt0),
           plan_of[order]] = start[order]
    b_thr = thr_f.take(b_task)
    b_key = key_f.take(b_task)
    used = int(cnt0.max())
    has_extra = np.zeros(nw, bool)
    has_extra[list(extra_f)] = True
    inf = np.inf
    nobody = len(clock) - 1
    for s in range(steps):
        if used + fan > cap:
            b_task, b_thr, b_key, used = _compact(b_task, b_thr, b_key, used, rt_f, empty, fan,
                                                  nobody)
            cap = b_task.shape[0]
        e = np.maximum(rt_f.take(b_task[:used]), clock.take(b_thr[:used]))
        emin = np.minimum.reduce(e, 0)
        task = np.minimum.reduce(np.where(e == emin, b_key[:used], _NONE), 0) & mask
        if s >= fewest:  # a plan with no task left takes its empty slot
            task = np.where(emin < inf, task, empty)
        end = emin + cost_f.take(task)
        rt_f[task] = inf
        clock[thr_f.take(task)] = end
        tend[task] = end
        tstep[task] = s
        tg = tgt_f.take(task, axis=1)  # [F, P]
        left = deps_f.take(tg) - 1
        deps_f[tg] = left
        rt_f[tg] = np.maximum(rt_f.take(tg), end)
        new = np.where(left == 0, tg, empty)
        b_task[used:used + fan] = new
        b_thr[used:used + fan] = thr_f.take(new)
        b_key[used:used + fan] = key_f.take(new)
        used += fan
        if extra_f and has_extra.take(task).any():
            rows = _release_extra(task, end, extra_f, has_extra, deps_f, rt_f, empty)
            if used + len(rows) > b_task.shape[0]:
                b_task, b_thr, b_key, used = _compact(b_task, b_thr, b_key, used, rt_f,
                                                      empty, fan + len(rows), nobody)
            b_task[used:used + len(rows)] = rows
            b_thr[used:used + len(rows)] = thr_f.take(rows)
            b_key[used:used + len(rows)] = key_f.take(rows)
            used += len(rows)
    return tend, tstep


def _compact(b_task, b_thr, b_key, used, rt_f, empty, room, nobody):
    """Released tasks moved to the first rows, keeping at least ``16 room`` free rows
    (``nobody``: the clock cell of no thread). Returns ``(b_task, b_thr, b_key, used)``."""
    live = rt_f.take(b_task[:used]) < np.inf
    keep = int(live.sum(0).max())
    cap = max(b_task.shape[0], keep + 16 * room)
    rows, cols = np.nonzero(live)
    dest = (np.cumsum(live, 0) - 1)[rows, cols]
    out = []
    for arr, fill in ((b_task, empty), (b_thr, nobody), (b_key, _NONE)):
        new = np.empty((cap, arr.shape[1]), arr.dtype)
        new[:] = fill
        new[dest, cols] = arr[rows, cols]
        out.append(new)
    return out[0], out[1], out[2], keep


def _release_extra(task, end, extra_f, has_extra, deps_f, rt_f, empty) -> np.ndarray:
    """Dependencies past the dense table of the tasks just taken: ``[R, P]`` rows of the
    tasks they release (``empty`` elsewhere)."""
    got: list[tuple[int, int]] = []
    for p in np.flatnonzero(has_extra.take(task)).tolist():
        more = extra_f[int(task[p])]
        deps_f[more] -= 1
        rt_f[more] = np.maximum(rt_f[more], end[p])
        got += [(p, t) for t in more[deps_f[more] == 0].tolist()]
    per = np.bincount([p for p, _ in got], minlength=len(empty)) if got else np.zeros(1, int)
    rows = np.empty((int(per.max()), len(empty)), np.int64)
    rows[:] = empty
    seen = [0] * len(empty)
    for p, t in got:
        rows[seen[p], p] = t
        seen[p] += 1
    return rows


def _extra_targets(extra, sends: Sends, dev, rank, copy_on, n, m, ns, cmax
                   ) -> dict[int, np.ndarray]:
    """Flat task -> flat tasks it releases past the dense table (the producers past
    ``MAX_DENSE_FANIN`` of an op fed by many)."""
    out: dict[int, np.ndarray] = {}
    num = dev.shape[0]
    mn = m * n
    for i, (more, edges) in extra.items():
        slots = sends.edge_slot[edges]  # [len(more), P]
        for p in range(num):
            for mb in range(m):
                ts = [mb * n + u if slots[x, p] == 0 or not copy_on[p]
                      else mn + mb * cmax + int(rank[(p * n + u) * ns + slots[x, p] - 1])
                      for x, u in enumerate(more.tolist())]
                out[(mb * n + i) * num + p] = np.asarray(ts, np.int64) * num + p
    return out
