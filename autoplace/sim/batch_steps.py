"""The forward and backward event loops of many one-process replicas, in lockstep.

Step ``s`` of the forward processes the ``s``-th item of every plan's issue order; step
``s`` of the backward the ``s``-th item each plan's autograd threads issue
(:mod:`autoplace.sim.batch_issue`). Per step the work is a fixed few numpy operations on
``[slots, plans]`` arrays (:mod:`autoplace.sim.batch_sends`: the op's own device and the
few others its consumers use), whatever the number of devices: a reduction over slots
runs along the first axis (numpy reduces a short last axis one row at a time, ten times
slower). Everything a step reads is laid out per step beforehand, so a step slices rows.
Cells are flat: an item's row is ``(microbatch * (n + 1) + op) * P + plan`` (op ``n`` of
every microbatch is padding that stays 0 / -inf), its value on a slot's device
``row * S1 + slot``, a device's ``plan * K + device``, a link's as ``batch_sends.link_cells``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.sim import batch_scratch as scratch
from autoplace.sim.batch_sends import Sends, edge_tables, link_cells
from autoplace.sim.model import CostTables, GraphArrays

__all__ = ["StepSlots", "Steps", "backward_steps", "forward_steps", "host_clock", "step_slots",
           "step_tables"]


@dataclass
class Steps:
    """Per forward step ``s`` and plan ``p`` (arrays ``[m n, P]`` unless noted)."""

    item: np.ndarray  # item (mb * n + op) at step s
    dev_row: np.ndarray  # device cell of its op
    item_row: np.ndarray  # item row of it: its output on slot j is at item_row * S1 + j
    in_cell: np.ndarray | None  # [m n, F, P] each producer's output cell on this op's device
    t_fwd: np.ndarray  # forward seconds
    t_bwd: np.ndarray  # backward seconds
    link_f: np.ndarray | None  # [m n, S1, P] link cell to each slot's device
    link_b: np.ndarray | None  # [m n, S1, P] link cell back from it
    dur_f: np.ndarray | None  # [m n, S1, P] link seconds to each slot's device, -inf: none
    dur_b: np.ndarray | None  # [m n, S1, P] link seconds back from it
    host: np.ndarray | None  # [m n, S1, P] forward host clock: after the op, after each copy
    extra: dict[tuple[int, int], np.ndarray]  # (step, plan) -> cells past the F inputs
    has_extra: np.ndarray | None  # [m n, P] bool: the step's op has inputs past F
    width: int  # S1, slots per op
    links: int  # link cells
    rows: int  # item rows (m (n + 1) P)


@dataclass
class StepSlots:
    """What each forward step's op sends, per slot (``[m n, S1, P]``; None with one slot)."""

    op: np.ndarray  # [m n, P] the op of each step
    dev: np.ndarray  # [m n, P] its device
    nbytes: np.ndarray | None  # bytes sent to each slot's device (0: nothing)


def step_slots(sends: Sends, order_t: np.ndarray, dev_t: np.ndarray) -> StepSlots:
    """Each step's op, device and slots, for items ``order_t [m n, P]`` in issue order."""
    n, num = dev_t.shape
    pidx = np.arange(num)
    op_t = order_t % n
    dev_s = dev_t.take(op_t * num + pidx)
    if sends.width == 1:
        return StepSlots(op=op_t, dev=dev_s, nbytes=None)
    return StepSlots(op=op_t, dev=dev_s, nbytes=scratch.take("steps.nbytes", sends.nbytes,
                                                            _per_slot(op_t, sends.width)))


def _per_slot(op_t: np.ndarray, width: int) -> np.ndarray:
    """``[m n, S1, P]`` cells of each step's slots in the ``[n, S1, P]`` tables."""
    num = op_t.shape[1]
    return (op_t[:, None, :] * width + np.arange(width)[:, None]) * num + np.arange(num)


def host_clock(ss: StepSlots, hf_t: np.ndarray, copy_h: np.ndarray) -> np.ndarray:
    """The forward thread's clock ``[m n, S1, P]``, added up in its order (``sim_local``):
    each op (``hf_t [n, P]`` host seconds), then each copy it sends (``copy_h`` per
    device), to its slots' devices in order; adding 0.0 where none changes nothing."""
    mn, num = ss.op.shape
    width = 1 if ss.nbytes is None else ss.nbytes.shape[1]
    host = scratch.table("steps.host", (mn, width, num), np.float64, 0.0)
    host[:, 0] = hf_t.take(ss.op * num + np.arange(num))
    if width > 1:
        host[:, 1:] = np.where(ss.nbytes[:, 1:] > 0, copy_h[ss.dev][:, None, :], 0.0)
    rows = host.reshape(-1, num)  # a running sum down the rows (cumsum along axis 0
    for i in range(1, len(rows)):  # walks each column with a stride: 6x slower)
        np.add(rows[i - 1], rows[i], out=rows[i])
    return host


def step_tables(ga: GraphArrays, sends: Sends, ss: StepSlots, order_t: np.ndarray, kk: int,
                tf: np.ndarray, tb: np.ndarray, mdiv: np.ndarray, tables: CostTables,
                host: np.ndarray | None) -> Steps:
    """The tables the loops read, per forward step: ``order_t [m n, P]`` items in issue
    order, ``ss`` their slots, ``tf``, ``tb`` ``[n, P]`` seconds per op, ``mdiv [P]`` the
    batch split (microbatches x replicas), ``host`` the forward host clock (None: no host
    costs)."""
    n = ga.n
    mn, num = order_t.shape
    m = mn // n
    width = sends.width
    pidx = np.arange(num)
    op_t = ss.op
    mboff_t = (order_t // n) * (n + 1)  # row offset of the item's microbatch (n + 1 rows each)
    flat = op_t * num + pidx
    link_f = link_b = dur_f = dur_b = None
    links = 1
    if width > 1:  # each step's slots: link cells and seconds there and back (-inf: none)
        sent = ss.nbytes > 0
        dst = scratch.take("steps.dst", sends.dev, _per_slot(op_t, width))
        src = np.broadcast_to(ss.dev[:, None, :], dst.shape)
        link_f, link_b, links = link_cells(src, dst, sent, kk)
        sel = np.flatnonzero(sent)
        del sent
        s_sel = ss.dev.reshape(-1).take(sel // (width * num) * num + sel % num)
        d_sel = dst.reshape(-1).take(sel)
        del dst
        bmb = ss.nbytes.reshape(-1).take(sel) / mdiv.take(sel % num)
        ncl = tables.alpha.shape[0]
        alpha, inv = tables.alpha.reshape(-1), tables.inv_bw.reshape(-1)
        dur_f = scratch.table("steps.dur_f", ss.nbytes.shape, np.float64, -np.inf)
        dur_b = scratch.table("steps.dur_b", ss.nbytes.shape, np.float64, -np.inf)
        li = s_sel * ncl + d_sel
        dur_f.reshape(-1)[sel] = alpha.take(li) + bmb * inv.take(li)
        li = d_sel * ncl + s_sel
        dur_b.reshape(-1)[sel] = alpha.take(li) + bmb * inv.take(li)
    et = edge_tables(ga)
    fan = et.pred.shape[1]
    # each input: (producer item row, slot of this op's device) -- read forward, written back
    opf = scratch.table("steps.opf", (mn, fan, num), np.int64)  # [mn, F, P] (op, input)
    np.multiply(op_t[:, None, :], fan, out=opf)
    opf += np.arange(fan)[:, None]
    in_cell = scratch.take("steps.in_cell", et.pred, opf)
    opf *= num
    opf += pidx
    pslot = scratch.take("steps.pslot", sends.pred_slot, opf)
    del opf
    if m > 1:
        in_cell += mboff_t[:, None, :]
    in_cell *= num
    in_cell += pidx
    in_cell *= width
    in_cell += pslot
    del pslot
    # cells of the inputs past the dense table's width, per (forward step, plan)
    extra_at: dict[tuple[int, int], np.ndarray] = {}
    has_extra = None
    if et.extra:
        has_extra = np.isin(op_t, list(et.extra))
        s_hit, p_hit = np.nonzero(has_extra)
        for s, p in zip(s_hit.tolist(), p_hit.tolist()):
            more, edges = et.extra[int(op_t[s, p])]
            extra_at[(s, p)] = ((mboff_t[s, p] + more) * num + p) * width \
                + sends.edge_slot[edges, p]
    return Steps(item=order_t, dev_row=pidx * kk + ss.dev, item_row=(mboff_t + op_t) * num + pidx,
                 in_cell=in_cell, t_fwd=tf.take(flat), t_bwd=tb.take(flat), link_f=link_f,
                 link_b=link_b, dur_f=dur_f, dur_b=dur_b, host=host, extra=extra_at,
                 has_extra=has_extra, width=width, links=links, rows=m * (n + 1) * num)


def forward_steps(st: Steps, num: int, kk: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward of every plan. Returns ``(dev_free, link_free)``, the devices' and links'
    clocks at its end, and drops the tables only the forward reads from ``st`` (its
    peak memory is what a step of the batch costs: pages the process maps afresh)."""
    width = st.width
    arrive = scratch.table("steps.arrive", (st.rows * width,), np.float64, 0.0)
    ej = np.arange(width)[:, None]
    dev_free = np.zeros(num * kk)
    link_free = scratch.table("steps.link_free", (st.links,), np.float64, 0.0)
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
    st.link_f = st.dur_f = st.host = None
    return dev_free, link_free


def backward_steps(st: Steps, dev_free: np.ndarray, link_free: np.ndarray, num: int,
                   bpos: np.ndarray, issued: np.ndarray | None,
                   copied: np.ndarray | None) -> np.ndarray:
    """Backward of every plan, its items in ``bpos`` order (``[m n, P]`` forward steps),
    not started before ``issued`` (``[m n, P]``) nor a gradient's copy from a slot's
    device before ``copied`` (``[m n, S1, P]``), both in that order. Updates
    ``dev_free`` and drops the tables of ``st`` it has read; returns each item's finish
    ``[m n, P]``."""
    mn = len(st.item)
    width = st.width
    pidx = np.arange(num)
    ej = np.arange(width)[:, None]
    # per item and slot: the latest of its consumers' gradients there
    grad = scratch.table("steps.grad", (st.rows * width,), np.float64, -np.inf)
    # the tables in backward order: step s reads row s
    fl = bpos * num + pidx  # [mn, P] cell of each backward step in the [mn, P] tables
    row_b = scratch.take("steps.row_b", st.dev_row, fl)
    t_b = scratch.take("steps.t_b", st.t_bwd, fl)
    item_b = scratch.take("steps.item_b", st.item_row, fl)
    item_b *= width
    blk = (bpos * (width * num))[:, None, :] + (np.arange(width)[:, None] * num + pidx)
    in_b = scratch.take("steps.in_b", st.in_cell,
                        (bpos * (st.in_cell.shape[1] * num))[:, None, :]
                        + (np.arange(st.in_cell.shape[1])[:, None] * num + pidx))
    if width > 1:
        link_b = scratch.take("steps.link_bb", st.link_b, blk)
        dur_b = scratch.take("steps.dur_bb", st.dur_b, blk)
    del blk
    st.in_cell = st.link_b = st.dur_b = None
    fins = scratch.table("steps.fins", (mn, num), np.float64)
    extra = st.extra
    has_extra = st.has_extra.reshape(-1).take(fl) if extra else None
    for s in range(mn):
        r = grad.take(item_b[s] + ej)  # [S1, P] gradient done per slot
        if width > 1:
            lcell = link_b[s]  # link from each slot's device to this one
            lfb = link_free.take(lcell)
            s0 = np.maximum(lfb, r)
            if copied is not None:  # the copy back is issued by the consumer's thread
                np.maximum(s0, copied[s], out=s0)
            arr = s0 + dur_b[s]
            link_free[lcell] = np.maximum(lfb, arr)
            ready = np.maximum.reduce(np.maximum(arr, r), 0)
        else:
            ready = r[0]
        row = row_b[s]
        start = np.maximum(dev_free.take(row), ready)
        if issued is not None:
            np.maximum(start, issued[s], out=start)
        fin = start + t_b[s]
        dev_free[row] = fin
        fins[s] = fin
        cells = in_b[s]  # [F, P]
        grad[cells] = np.maximum(grad.take(cells), fin)
        if extra and has_extra[s].any():
            for p in np.flatnonzero(has_extra[s]).tolist():
                more = extra[(int(bpos[s, p]), p)]
                grad[more] = np.maximum(grad[more], fin[p])
    bfin = np.empty((mn, num))
    bfin.reshape(-1)[st.item.reshape(-1).take(fl) * num + pidx] = fins
    return bfin
