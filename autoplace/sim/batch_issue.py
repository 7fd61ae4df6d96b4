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

from dataclasses import dataclass

import numpy as np

from autoplace.sim import batch_scratch as scratch
from autoplace.sim.batch_sends import EdgeTables, Sends, edge_tables, plan_sends
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
    pos_t = scratch.table("issue.pos", (mn, num), np.int64)  # forward step of every item
    pos_t.reshape(-1)[order_t * num + pidx] = np.arange(mn)[:, None]
    with_copies = ns > 0 and bool(copy_on.any())
    cp = _copy_tasks(et, sends, copy_on, pos_t, order_t, n, with_copies)
    cmax = int(cp.per_mb.max()) if with_copies else 0
    width = mn + m * cmax + 2  # items, copies, then an empty slot and a sink for padding
    empty, sink = width - 2, width - 1

    # ---- per task (``[task, plan]``, flat ``task * P + plan`` so that the plans' tasks of
    # one step lie close): thread's clock cell, host cost, key, dependencies, targets
    fan = et.pred.shape[1]
    nw = num * width
    shift = max(1, int(nw - 1).bit_length())
    thr = scratch.table("issue.thr", (width, num), np.int64, num * kk)  # num*kk: nobody's
    cost = scratch.table("issue.cost", (width, num), np.float64, 0.0)
    key = scratch.table("issue.key", (width, num), np.int64, _NONE)  # latest created first
    deps = scratch.table("issue.deps", (width, num), np.int64, 1 << 40)  # 1 << 40: never
    thr[:mn] = _per_item(dev.T + pidx * kk, m)
    cost[:mn] = _per_item(hb_t, m)
    np.left_shift(2 * mn - 2 * pos_t, shift, out=key[:mn])
    key[:mn] |= np.arange(mn * num).reshape(mn, num)
    # an item waits for its consumers on its device and for its copies to other devices
    deps[:mn] = _per_item(cp.waits.reshape(n, num), m)
    # an item's producers: the producer's item on the same device, else its copy to here
    tgt = scratch.table("issue.tgt", (fan, width, num), np.int64)
    tgt[:, mn:] = sink * num + pidx
    mb_of = np.arange(mn)[:, None] // n
    for f in range(fan):
        pu = np.tile(et.pred[:, f], m)[:, None]  # [mn, 1]
        pslot = _per_item(sends.pred_slot[:, f], m)  # [mn, P]
        cell = (pidx * n + pu) * max(ns, 1) + pslot - 1
        row = np.where(pu == n, sink,
                       np.where((pslot > 0) & copy_on, mn + mb_of * cmax
                                + cp.rank.take(cell, mode="clip"), mb_of * n + pu))
        row *= num
        row += pidx
        tgt[f, :mn] = row
    del pslot, cell, row
    if with_copies:
        e_c = sends.dev[cp.u, cp.j + 1, cp.p]
        at0 = (mn + cp.r) * num + cp.p  # flat cell of each copy task of microbatch 0
        for mb in range(m):
            at = at0 + mb * cmax * num
            thr.reshape(-1)[at] = cp.p * kk + e_c
            cost.reshape(-1)[at] = copy_h[e_c]
            deps.reshape(-1)[at] = cp.consumers
            tgt[0].reshape(-1)[at] = (mb * n + cp.u) * num + cp.p
            # just after its first consumer (w); equal keys (one consumer, several
            # producers) go in task order, producer order, as the scalar path's
            kq = 2 * mn + 1 - 2 * pos_t.reshape(-1).take((mb * n + cp.w) * num + cp.p)
            kq <<= shift
            kq |= at
            key.reshape(-1)[at] = kq
        del e_c, at0, at, kq
    rt_f = scratch.table("issue.rt", (width, num), np.float64)  # release time; inf: taken
    rt_f[:] = host_f
    rt_f = rt_f.reshape(-1)
    rt_f[empty * num + pidx] = np.inf
    clock = np.append(np.repeat(host_f, kk), np.inf)  # per thread, and one for nobody
    extra_f = _extra_targets(et.extra, sends, dev, cp.rank, copy_on, n, m, ns, cmax)
    cp.rank = cp.waits = cp.consumers = cp.w = None  # only the copies' ids are read on
    steps = mn + m * int(cp.per_mb.max()) if with_copies else mn
    fewest = mn + m * int(cp.per_mb.min()) if with_copies else mn
    thr, cost, key, deps, tgt = (x.reshape(-1) for x in (thr, cost, key, deps, tgt))
    tend, taken = _take_tasks(deps, rt_f, clock, thr, cost, key, (1 << shift) - 1,
                              tgt.reshape(fan, nw), extra_f, empty * num + pidx, steps, fewest)
    del thr, cost, key, deps, tgt, rt_f
    # ---- per plan, items in the order taken (each plan takes each of its mn items once)
    seq = taken.T  # [P, steps] flat task ids
    item_ids = seq[seq < mn * num].reshape(num, mn).T  # [mn, P]
    del seq, taken
    bpos = pos_t.reshape(-1).take(item_ids)
    issued = tend.take(item_ids)
    copied = None
    if with_copies:  # a copy's item's backward step
        bstep = pos_t.reshape(-1)  # reused: positions are no longer needed
        bstep[item_ids] = np.arange(mn)[:, None]
        copied = scratch.table("issue.copied", (mn, ns + 1, num), np.float64, 0.0)
        for mb in range(m):
            at = (mn + mb * cmax + cp.r) * num + cp.p
            step_of = bstep.take((mb * n + cp.u) * num + cp.p)
            copied.reshape(-1)[(step_of * (ns + 1) + cp.j + 1) * num + cp.p] = tend.take(at)
    return bpos, issued, copied


@dataclass
class _Copies:
    """The gradient copies of a microbatch, per copy (plan, op, slot, index in the plan's
    microbatch, consumers there, first consumer in issue order), and per cell."""

    p: np.ndarray
    u: np.ndarray
    j: np.ndarray
    r: np.ndarray
    consumers: np.ndarray | None
    w: np.ndarray | None
    per_mb: np.ndarray  # [P] copies per microbatch
    rank: np.ndarray | None  # [P n S] index of the copy of (plan, op, slot)
    waits: np.ndarray | None  # [n P] consumers on the op's device plus its copies


def _copy_tasks(et: EdgeTables, sends: Sends, copy_on: np.ndarray, pos_t: np.ndarray,
                order_t: np.ndarray, n: int, with_copies: bool) -> _Copies:
    """Copy tasks: (plan, op, slot) with consumers of the op on that slot's device."""
    num = len(copy_on)
    pidx = np.arange(num)
    ns = max(sends.width - 1, 1)
    es, ed = et.dist_src, et.dist_dst
    slot = sends.edge_slot[et.dist_edge].T  # [P, E]
    cross = (slot > 0) & copy_on[:, None]
    ncell = num * n * ns
    cidx = ((pidx[:, None] * n + es) * ns + slot - 1)[cross]
    del slot
    ccount = np.bincount(cidx, minlength=ncell)  # consumers there
    flat_has = np.flatnonzero(ccount)  # by plan, op, slot: a microbatch's copies in order
    p_c, rest = np.divmod(flat_has, n * ns)
    u_c, j_c = np.divmod(rest, ns)
    del rest
    # plans, ops and slots are small integers: int32 halves the pages these take
    p_c, u_c, j_c = p_c.astype(np.int32), u_c.astype(np.int32), j_c.astype(np.int32)
    per_mb = np.bincount(p_c, minlength=num)
    rank_c = (np.arange(len(flat_has)) - (np.cumsum(per_mb) - per_mb)[p_c]).astype(np.int32)
    rank = scratch.table("issue.rank", (ncell,), np.int64, 0)
    rank[flat_has] = rank_c
    waits = np.bincount((es * num + pidx[:, None])[~cross], minlength=n * num)
    waits += np.bincount(u_c * num + p_c, minlength=n * num)
    w_c = None
    if with_copies:  # the first consumer there in issue order (the same in every microbatch)
        first = scratch.table("issue.first", (ncell,), np.int64, len(pos_t))
        np.minimum.at(first, cidx, pos_t[ed].T[cross])
        w_c = order_t[first[flat_has], p_c] % n
    return _Copies(p=p_c, u=u_c, j=j_c, r=rank_c, consumers=ccount[flat_has], w=w_c,
                   per_mb=per_mb, rank=rank, waits=waits)


def _per_item(x: np.ndarray, m: int) -> np.ndarray:
    """``[n, ...]`` per op to ``[m n, ...]`` per item (item ``mb * n + op``)."""
    return x if m == 1 else np.tile(x, (m,) + (1,) * (x.ndim - 1))


#: the key of no task (empty slots), above every task's
_NONE = np.int64(1) << 62
#: free rows (x fan-in) the released-task table keeps after each compaction
_ROOM = 8


def _take_tasks(deps_f, rt_f, clock, thr_f, cost_f, key_f, mask, tgt_f, extra_f, empty,
                steps, fewest) -> tuple[np.ndarray, np.ndarray]:
    """The lockstep loop: each step every plan takes its next task. Returns when each
    task's issue ends (flat task ids) and the task each plan took at each step."""
    nw = len(rt_f)
    fan = len(tgt_f)
    tend = scratch.table("issue.tend", (nw,), np.float64, 0.0)
    taken = scratch.table("issue.taken", (steps, len(empty)), np.int64)
    # released tasks, a row per slot and a column per plan: task, clock cell, key
    start = np.flatnonzero(deps_f == 0)
    num = len(empty)
    plan_of = start % num
    cnt0 = np.bincount(plan_of, minlength=num)
    order = np.argsort(plan_of, kind="stable")
    cap = int(cnt0.max()) + _ROOM * fan
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
    f_off = (np.arange(fan) * nw)[:, None]  # row f of the [F, nw] targets, flat
    tgt_f = tgt_f.reshape(-1)
    for s in range(steps):
        if used + fan > cap:
            b_task, b_thr, b_key, used = _compact(b_task, b_thr, b_key, used, rt_f, empty, fan,
                                                  nobody)
            cap = b_task.shape[0]
        e = rt_f.take(b_task[:used])
        np.maximum(e, clock.take(b_thr[:used]), out=e)
        emin = np.minimum.reduce(e, 0)
        task = np.minimum.reduce(b_key[:used], 0, where=e == emin, initial=_NONE) & mask
        if s >= fewest:  # a plan with no task left takes its empty slot
            task = np.where(emin < inf, task, empty)
        end = emin + cost_f.take(task)
        rt_f[task] = inf
        clock[thr_f.take(task)] = end
        tend[task] = end
        taken[s] = task
        tg = tgt_f.take(task + f_off)  # [F, P]
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
    return tend, taken


def _compact(b_task, b_thr, b_key, used, rt_f, empty, room, nobody):
    """Released tasks moved to the first rows of new tables with ``_ROOM x room`` free rows
    (``nobody``: the clock cell of no thread). Returns ``(b_task, b_thr, b_key, used)``."""
    live = rt_f.take(b_task[:used]) < np.inf
    keep = int(live.sum(0).max())
    cap = keep + _ROOM * room
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
