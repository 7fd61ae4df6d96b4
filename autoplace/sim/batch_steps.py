"""The forward and backward event loops of many one-process replicas, in lockstep.

Step ``s`` of the forward processes the ``s``-th item of every plan's issue order; step
``s`` of the backward the ``s``-th item each plan's autograd threads issue
(:mod:`autoplace.sim.batch_issue`). Per step the work is a fixed few numpy operations on
``[devices, plans]`` arrays, whatever the placement: a reduction over devices runs along
the first axis (numpy reduces a short last axis one row at a time, ten times slower).
Cells are flat: an item's row is ``(microbatch * (n + 1) + op) * P + plan`` (op ``n`` of
every microbatch is padding that stays 0 / -inf), a device's ``plan * K + device``, a link's
``(plan * K + src) * K + dst``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Steps", "backward_steps", "forward_steps"]


@dataclass
class Steps:
    """Per forward step ``s`` and plan ``p`` (arrays ``[m n, P]`` unless noted)."""

    item: np.ndarray  # item (mb * n + op) at step s
    dev_row: np.ndarray  # device cell of its op
    item_row: np.ndarray  # item row of it
    in_cell: np.ndarray  # [m n, F, P] (item row of each producer) * K + this device
    t_fwd: np.ndarray  # forward seconds
    t_bwd: np.ndarray  # backward seconds
    dur_f: np.ndarray | None  # [m n, K, P] link seconds to each device, -inf: none sent
    dur_b: np.ndarray | None  # [m n, K, P] link seconds back from each device
    host: np.ndarray | None  # [m n, K + 1, P] forward host clock: after the op, per copy
    extra: dict[tuple[int, int], np.ndarray]  # (step, plan) -> cells past the F inputs
    has_extra: np.ndarray | None  # [m n, P] bool: the step's op has inputs past F


def forward_steps(st: Steps, num: int, kk: int, rows: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward of every plan. Returns ``(arrive, dev_free, link_free)``: ``arrive[row *
    K + device]`` when an item's output is on a device, the devices' and links' clocks."""
    arrive = np.zeros(rows * kk)
    dev_free = np.zeros(num * kk)
    link_free = np.zeros(num * kk * kk)
    ek = np.arange(kk)[:, None]
    extra = st.extra
    for s in range(len(st.item)):
        ready = np.maximum.reduce(arrive.take(st.in_cell[s]), 0)
        if extra and st.has_extra[s].any():
            for p in np.flatnonzero(st.has_extra[s]).tolist():
                ready[p] = max(ready[p], arrive[extra[(s, p)]].max())
        row = st.dev_row[s]
        start = np.maximum(dev_free.take(row), ready)
        if st.host is not None:
            np.maximum(start, st.host[s, 0], out=start)
        fin = start + st.t_fwd[s]
        dev_free[row] = fin
        if kk > 1:
            lrow = row * kk + ek
            lf = link_free.take(lrow)
            s0 = np.maximum(lf, fin)
            if st.host is not None:  # each copy issued by the forward thread
                np.maximum(s0, st.host[s, 1:], out=s0)
            arr = s0 + st.dur_f[s]
            link_free[lrow] = np.maximum(lf, arr)
            arrive[st.item_row[s] * kk + ek] = np.maximum(arr, fin)
        else:
            arrive[st.item_row[s]] = fin
    return arrive, dev_free, link_free


def backward_steps(st: Steps, dev_free: np.ndarray, link_free: np.ndarray, num: int, kk: int,
                   rows: int, bpos: np.ndarray, issued: np.ndarray | None,
                   copied: np.ndarray | None) -> np.ndarray:
    """Backward of every plan, its items in ``bpos`` order (``[m n, P]`` forward steps),
    not started before ``issued`` (``[m n, P]``) nor a gradient's copy before ``copied``
    (``[m n, K, P]``). Updates ``dev_free``; returns each item's finish ``[m n, P]``."""
    mn = len(st.item)
    pidx = np.arange(num)
    grad = np.full(rows * kk, -np.inf)  # per item and device: max over its consumers there
    bfin = np.zeros((mn, num))
    bfin_f = bfin.reshape(-1)
    ek = np.arange(kk)[:, None]
    dcells = pidx * kk + ek  # [K, P] device cells of every plan
    item_f, dev_row_f, item_row_f = st.item.reshape(-1), st.dev_row.reshape(-1), \
        st.item_row.reshape(-1)
    t_bwd_f = st.t_bwd.reshape(-1)
    in_cell = np.ascontiguousarray(st.in_cell.transpose(0, 2, 1)).reshape(mn * num, -1)
    extra = st.extra
    has_extra = st.has_extra.reshape(-1) if extra else None
    for s in range(mn):
        fl = bpos[s] * num + pidx
        row = dev_row_f.take(fl)
        r = grad.take(item_row_f.take(fl) * kk + ek)  # [K, P] gradient complete on each device
        if kk > 1:
            d = row - pidx * kk
            lcell = dcells * kk + d  # link from each device to this one
            lfb = link_free.take(lcell)
            s0 = np.maximum(lfb, r)
            if copied is not None:  # the copy back is issued by the consumer's thread
                np.maximum(s0, copied[s], out=s0)
            arr = s0 + st.dur_b.take(bpos[s] * (kk * num) + ek * num + pidx)
            link_free[lcell] = np.maximum(lfb, arr)
            ready = np.maximum.reduce(np.maximum(arr, r), 0)
        else:
            ready = r[0]
        start = np.maximum(dev_free.take(row), ready)
        if issued is not None:
            np.maximum(start, issued[s], out=start)
        fin = start + t_bwd_f.take(fl)
        dev_free[row] = fin
        bfin_f[item_f.take(fl) * num + pidx] = fin
        cells = in_cell.take(fl, axis=0).T  # [F, P]
        grad[cells] = np.maximum(grad.take(cells), fin)
        if extra and has_extra.take(fl).any():
            for p in np.flatnonzero(has_extra.take(fl)).tolist():
                more = extra[(int(bpos[s, p]), p)]
                grad[more] = np.maximum(grad[more], fin[p])
    return bfin
