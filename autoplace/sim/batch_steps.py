"""The forward and backward event loops of many one-process replicas, in lockstep.

Step ``s`` of the forward processes the ``s``-th item of every plan's issue order; step
``s`` of the backward the ``s``-th item each plan's autograd threads issue
(:mod:`autoplace.sim.batch_issue`). Per step the work is a fixed few numpy operations on
``[slots, plans]`` arrays (:mod:`autoplace.sim.batch_sends`: the op's own device and the
few others its consumers use), whatever the number of devices: a reduction over slots
runs along the first axis (numpy reduces a short last axis one row at a time, ten times
slower). Cells are flat: an item's row is ``(microbatch * (n + 1) + op) * P + plan`` (op
``n`` of every microbatch is padding that stays 0 / -inf), its value on a slot's device
``row * S1 + slot``, a device's ``plan * K + device``, a link's as ``batch_sends.link_cells``.
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
    in_cell: np.ndarray  # [m n, F, P] (item row of each producer) * S1 + slot of this device
    t_fwd: np.ndarray  # forward seconds
    t_bwd: np.ndarray  # backward seconds
    link_f: np.ndarray | None  # [m n, S1, P] link cell to each slot's device
    link_b: np.ndarray | None  # [m n, S1, P] link cell back from it
    dur_f: np.ndarray | None  # [m n, S1, P] link seconds to each slot's device, -inf: none
    dur_b: np.ndarray | None  # [m n, S1, P] link seconds back from it
    host: np.ndarray | None  # [m n, S1, P] forward host clock: after the op, after each copy
    extra: dict[tuple[int, int], np.ndarray]  # (step, plan) -> cells past the F inputs
    has_extra: np.ndarray | None  # [m n, P] bool: the step's op has inputs past F


def forward_steps(st: Steps, num: int, kk: int, width: int, rows: int, links: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward of every plan. Returns ``(arrive, dev_free, link_free)``: ``arrive[row *
    S1 + slot]`` when an item's output is on a slot's device, the devices' and links'
    clocks."""
    arrive = np.zeros(rows * width)
    dev_free = np.zeros(num * kk)
    link_free = np.zeros(links)
    ej = np.arange(width)[:, None]
    extra = st.extra
    host = st.host
    for s in range(len(st.item)):
        ready = np.maximum.reduce(arrive.take(st.in_cell[s]), 0)
        if extra and st.has_extra[s].any():
            for p in np.flatnonzero(st.has_extra[s]).tolist():
                ready[p] = max(ready[p], arrive[extra[(s, p)]].max())
        row = st.dev_row[s]
        start = np.maximum(dev_free.take(row), ready)
        if host is not None:
            np.maximum(start, host[s, 0], out=start)
        fin = start + st.t_fwd[s]
        dev_free[row] = fin
        if width > 1:
            lrow = st.link_f[s]
            lf = link_free.take(lrow)
            s0 = np.maximum(lf, fin)
            if host is not None:  # each copy issued by the forward thread
                np.maximum(s0, host[s], out=s0)
            arr = s0 + st.dur_f[s]
            link_free[lrow] = np.maximum(lf, arr)
            arrive[st.item_row[s] * width + ej] = np.maximum(arr, fin)
        else:
            arrive[st.item_row[s]] = fin
    return arrive, dev_free, link_free


def backward_steps(st: Steps, dev_free: np.ndarray, link_free: np.ndarray, num: int,
                   width: int, rows: int, bpos: np.ndarray, issued: np.ndarray | None,
                   copied: np.ndarray | None) -> np.ndarray:
    """Backward of every plan, its items in ``bpos`` order (``[m n, P]`` forward steps),
    not started before ``issued`` (``[m n, P]``) nor a gradient's copy before ``copied``
    (``[m n, S1, P]``). Updates ``dev_free``; returns each item's finish ``[m n, P]``."""
    mn = len(st.item)
    pidx = np.arange(num)
    grad = np.full(rows * width, -np.inf)  # per item and slot: max over its consumers there
    bfin = np.zeros((mn, num))
    bfin_f = bfin.reshape(-1)
    ej = np.arange(width)[:, None]
    jcol = ej * num + pidx  # [S1, P] offsets in a step's [S1, P] block
    item_f, dev_row_f, item_row_f = st.item.reshape(-1), st.dev_row.reshape(-1), \
        st.item_row.reshape(-1)
    t_bwd_f = st.t_bwd.reshape(-1)
    in_cell = np.ascontiguousarray(st.in_cell.transpose(0, 2, 1)).reshape(mn * num, -1)
    link_b = st.link_b.reshape(-1) if width > 1 else None
    dur_b = st.dur_b.reshape(-1) if width > 1 else None
    extra = st.extra
    has_extra = st.has_extra.reshape(-1) if extra else None
    for s in range(mn):
        fl = bpos[s] * num + pidx
        row = dev_row_f.take(fl)
        r = grad.take(item_row_f.take(fl) * width + ej)  # [S1, P] gradient done per slot
        if width > 1:
            blk = bpos[s] * (width * num) + jcol
            lcell = link_b.take(blk)  # link from each slot's device to this one
            lfb = link_free.take(lcell)
            s0 = np.maximum(lfb, r)
            if copied is not None:  # the copy back is issued by the consumer's thread
                np.maximum(s0, copied[s], out=s0)
            arr = s0 + dur_b.take(blk)
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
