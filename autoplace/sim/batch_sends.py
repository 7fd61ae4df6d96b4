"""Where each op's output goes, per plan, in slots: the device dimension of the batch.

An op sends its output to the few devices its consumers run on, however many devices the
cluster has. So the batched simulator keeps, per op and plan, a short list of *slots*:
slot 0 is the op's own device, slots ``1..`` the other devices its consumers use, in
device order (the order the scalar path issues the copies in). Every per-step array is
``[slots, plans]`` and every per-item table ``[items, slots, plans]``: at 512 devices an
op of a residual MLP still has 3 slots, where a row per device would have 512.

Links are cells of one flat table: ``(plan * K + src) * K + dst`` while that table is
small, else one cell per distinct ``(plan, src, dst)`` the chunk uses (found without a
sort: a scratch table per group of plans maps each link to its first use).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.sim import batch_scratch as scratch
from autoplace.sim.model import GraphArrays

__all__ = ["EdgeTables", "Sends", "edge_tables", "link_cells", "plan_sends"]

#: predecessor lists longer than this are walked per plan (rare: an op fed by many)
MAX_DENSE_FANIN = 8
#: largest direct link table (plans x K x K cells); past it links get compact cells
DIRECT_LINK_CELLS = 1 << 21


@dataclass(frozen=True)
class EdgeTables:
    """Per-graph edge structure the batch reads (built once per graph, cached on it).

    Attributes:
        pred: ``[n, F]`` distinct producers of every op, padded with ``n``.
        pred_edge: ``[n, F]`` an edge index from each producer to the op (0 on padding).
        extra: op -> ``(producers, edge indices)`` past the ``F`` dense ones.
        dist_src, dist_dst: every distinct ``(src, dst)`` pair (an op may read a tensor
            twice), sorted; ``dist_edge``: an edge index of each.
        pair_a, pair_b: every pair of edges ``a < b`` with the same producer.
        multi: the edges out of producers with several consumers (sorted); ``pair_la``,
            ``pair_lb``: the pairs' edges as indices into it.
        max_out: the most consumers one op has.
    """

    pred: np.ndarray
    pred_edge: np.ndarray
    extra: dict[int, tuple[np.ndarray, np.ndarray]]
    dist_src: np.ndarray
    dist_dst: np.ndarray
    dist_edge: np.ndarray
    pair_a: np.ndarray
    pair_b: np.ndarray
    multi: np.ndarray
    pair_la: np.ndarray
    pair_lb: np.ndarray
    max_out: int


def edge_tables(ga: GraphArrays) -> EdgeTables:
    """The graph's :class:`EdgeTables` (cached on ``ga``)."""
    cached = ga.__dict__.get("_batch_edge_tables")
    if cached is not None:
        return cached
    n = ga.n
    es, ed = ga.edge_src, ga.edge_dst
    edge_of: dict[tuple[int, int], int] = {}
    for e, (u, v) in enumerate(zip(es.tolist(), ed.tolist())):
        edge_of.setdefault((u, v), e)
    lists = [list(dict.fromkeys(x)) for x in ga.preds]
    width = max(1, min(MAX_DENSE_FANIN, max((len(x) for x in lists), default=1)))
    pred = np.full((n, width), n, np.int64)
    pred_edge = np.zeros((n, width), np.int64)
    extra: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i, x in enumerate(lists):
        w = min(len(x), width)
        pred[i, :w] = x[:w]
        pred_edge[i, :w] = [edge_of[(u, i)] for u in x[:w]]
        if len(x) > width:
            more = x[width:]
            extra[i] = (np.asarray(more, np.int64),
                        np.asarray([edge_of[(u, i)] for u in more], np.int64))
    keys = sorted(edge_of)
    dist = np.asarray(keys, np.int64).reshape(-1, 2)
    # pairs of edges out of one producer (edges are sorted by producer)
    starts = np.flatnonzero(np.r_[True, es[1:] != es[:-1]]) if len(es) else np.zeros(0, int)
    ends = np.r_[starts[1:], len(es)].astype(np.int64)
    pa: list[np.ndarray] = []
    pb: list[np.ndarray] = []
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        if hi - lo > 1:
            a, b = np.triu_indices(hi - lo, 1)
            pa.append(a + lo)
            pb.append(b + lo)
    pair_a = np.concatenate(pa) if pa else np.zeros(0, np.int64)
    pair_b = np.concatenate(pb) if pb else np.zeros(0, np.int64)
    multi = np.unique(np.r_[pair_a, pair_b]).astype(np.int64)
    out = EdgeTables(
        pred=pred, pred_edge=pred_edge, extra=extra,
        dist_src=np.ascontiguousarray(dist[:, 0]), dist_dst=np.ascontiguousarray(dist[:, 1]),
        dist_edge=np.asarray([edge_of[k] for k in keys], np.int64),
        pair_a=pair_a, pair_b=pair_b, multi=multi,
        pair_la=np.searchsorted(multi, pair_a), pair_lb=np.searchsorted(multi, pair_b),
        max_out=int((ends - starts).max(initial=0)),
    )
    ga.__dict__["_batch_edge_tables"] = out
    return out


@dataclass
class Sends:
    """Slots of every op in every plan of a chunk (``P`` plans, ``S1`` slots).

    Attributes:
        width: ``S1``, 1 + the most other devices one op sends to in the chunk.
        dev: ``[n, S1, P]`` device of each slot (slot 0 and padding: the op's own).
        nbytes: ``[n, S1, P]`` bytes sent there (the largest over its consumers there),
            0 in slot 0, on padding, and where every consumer there reads 0 bytes.
        used: ``[n, S1, P]`` bool, a slot past 0 with a consumer (0 bytes or not).
        edge_slot: ``[E, P]`` int32, slot of each edge's consumer in its producer's list.
        pred_slot: ``[n, F, P]`` the same for each op's dense producers (0 on padding).
    """

    width: int
    dev: np.ndarray
    nbytes: np.ndarray
    used: np.ndarray
    edge_slot: np.ndarray
    pred_slot: np.ndarray


def plan_sends(ga: GraphArrays, dev_t: np.ndarray) -> Sends:
    """The :class:`Sends` of plans whose ops run on ``dev_t`` (``[n, P]`` local device)."""
    et = edge_tables(ga)
    n, num = dev_t.shape
    es, eb = ga.edge_src, ga.edge_bytes
    dv = dev_t[ga.edge_dst]  # [E, P] the consumer's device
    cross = dv != dev_t[es]
    cols = np.arange(num)
    # an edge is the first to its device when no earlier edge of its producer goes there;
    # its slot is 1 + the number of distinct other devices below its device (only edges
    # out of a producer with several consumers can have a slot past 1)
    edge_slot = cross.astype(np.int32)
    first = cross
    if len(et.pair_a):
        multi = et.multi
        nm = len(multi)
        la, lb = et.pair_la, et.pair_lb
        dvm = dv[multi]
        dva, dvb = dvm[la], dvm[lb]  # [Q, P]
        dup = np.bincount((lb[:, None] * num + cols)[dva == dvb], minlength=nm * num) > 0
        first_m = cross[multi] & ~dup.reshape(nm, num)
        fa, fb = first_m[la], first_m[lb]
        below = np.bincount((lb[:, None] * num + cols)[fa & (dva < dvb)], minlength=nm * num)
        below += np.bincount((la[:, None] * num + cols)[fb & (dvb < dva)], minlength=nm * num)
        edge_slot[multi] += (below.reshape(nm, num) * cross[multi]).astype(np.int32)
        first = cross.copy()
        first[multi] = first_m
    width = 1 + int(edge_slot.max(initial=0))
    sdev = scratch.table("sends.dev", (n, width, num), np.int64)
    sdev[:] = dev_t[:, None, :]
    nbytes = scratch.table("sends.nbytes", (n, width, num), np.float64, 0.0)
    used = scratch.table("sends.used", (n, width, num), bool, False)
    if width > 1:
        fi = np.flatnonzero(first)  # one edge per (op, slot, plan)
        e_i, p_i = np.divmod(fi, num)
        one = (es.take(e_i) * width + edge_slot.reshape(-1).take(fi)) * num + p_i
        sdev.reshape(-1)[one] = dv.reshape(-1).take(fi)
        used.reshape(-1)[one] = True
        nbytes.reshape(-1)[one] = eb.take(e_i)
        mi = np.flatnonzero(cross & ~first)  # further consumers there: the largest is sent
        if len(mi):
            e_i, p_i = np.divmod(mi, num)
            more = (es.take(e_i) * width + edge_slot.reshape(-1).take(mi)) * num + p_i
            np.maximum.at(nbytes.reshape(-1), more, eb.take(e_i))
    return Sends(width=width, dev=sdev, nbytes=nbytes, used=used, edge_slot=edge_slot,
                 pred_slot=edge_slot[et.pred_edge])


def link_cells(src: np.ndarray, dst: np.ndarray, sent: np.ndarray, kk: int
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """Link cells of slots (arrays ``[..., P]``, the plan last): ``(forward (src -> dst),
    backward (dst -> src), number of cells)``. A slot that sends nothing gets a cell no
    real link has (written with its own value)."""
    num = src.shape[-1]
    plan = np.arange(num)
    if num * kk * kk <= DIRECT_LINK_CELLS:  # a device's self link is never used
        fwd = scratch.table("links.fwd", sent.shape, np.int64)
        bwd = scratch.table("links.bwd", sent.shape, np.int64)
        for out, a, b in ((fwd, src, dst), (bwd, dst, src)):
            np.multiply(a, kk, out=out)
            out += b
            out += plan * (kk * kk)
        return fwd, bwd, num * kk * kk
    # compact: each (plan, src, dst) its first use's index among the sent slots
    sel = np.flatnonzero(sent.reshape(-1))
    p_of = sel % num
    s_of = src.reshape(-1)[sel]
    d_of = dst.reshape(-1)[sel]
    ids = np.empty(2 * len(sel), np.int64)
    group = max(1, DIRECT_LINK_CELLS // (kk * kk))
    first_use = np.empty(group * kk * kk, np.int64)
    # per group of plans: forward keys then backward keys, in plan order
    gid = p_of // group
    order = np.argsort(gid, kind="stable")
    bounds = np.searchsorted(gid[order], np.arange(-(-num // group) + 1))
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if lo == hi:
            continue
        pos = order[lo:hi]
        pl = p_of[pos] % group
        keys = np.concatenate([(pl * kk + s_of[pos]) * kk + d_of[pos],
                               (pl * kk + d_of[pos]) * kk + s_of[pos]])
        where = np.concatenate([pos, pos + len(sel)])
        first_use[keys] = where
        ids[where] = first_use[keys]
    dummy = 2 * len(sel)
    fwd = scratch.table("links.fwd", sent.shape, np.int64, dummy)
    bwd = scratch.table("links.bwd", sent.shape, np.int64, dummy)
    fwd.reshape(-1)[sel] = ids[: len(sel)]
    bwd.reshape(-1)[sel] = ids[len(sel):]
    return fwd, bwd, dummy + 1
