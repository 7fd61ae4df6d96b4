"""Scalar simulation of a single-process placement (``pipeline == 1``), with data parallel.

Per replica: ops are issued in :func:`issue_order_items` order (microbatch wavefront);
one compute queue per device runs them in that order (``start = max(device free,
inputs arrived)``); a tensor crossing devices is sent once per (producer, microbatch,
destination) on the directed link's queue right after its producer. Backward runs
the forward order reversed, after all forward work; the gradient of a tensor is
accumulated on each consumer device and sent back once. Then gradient collectives
(DDP buckets / ZeRO-2 reduce-scatter / FSDP per unit) and the AdamW update.

Host issue. A replica is one process: one Python thread issues every forward item
in issue order, each taking the op's profiled forward host time (``OpNode.fwd_host_s``:
Python, dispatcher, autocast and launches; else ``host_dispatch_s`` of the op's device)
and ``copy_host_s`` per copy to another GPU, and an op cannot start before it is issued.
The backward is issued by one autograd thread per device, each starting when the
forward is fully issued and taking its device's items from a ready queue, latest first
(``OpNode.bwd_host_s`` each; :func:`backward_issue`). With many microbatches x
ops, or small ops on fast GPUs, these host clocks, not the devices, bound the step: a
placement of Inception-v3 over two H200s in one process measured no faster than one GPU
while each GPU was busy only ~60% of the step. With no host times they change nothing.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from autoplace.cluster import Cluster
from autoplace.lowering import issue_order_items
from autoplace.plan import Plan
from autoplace.sim.fsdp import FsdpStreams
from autoplace.sim.model import (
    CostTables,
    Event,
    GraphArrays,
    MemoryModel,
    affine_collective,
    broadcast_tensors,
    bucket_ids,
    coll_resource,
    collective_time,
    grad_reduction,
    graphed_host,
    host_times,
    optimizer_shares,
    replica_group,
    replicas_identical,
    rerun_ops,
    scaled,
    shard_degree,
    update_time,
)
from autoplace.sim.optimizer_host import optimizer_host_s
from autoplace.sim.replica_memory import local_memory


@dataclass
class LocalPlan:
    """A plan in index form: local device and group of every op."""

    dev: list[int]
    group: list[int]
    k: int
    d: int
    m: int
    shard: str
    recompute: frozenset[int]
    selective: frozenset[int]
    needb: list[list[tuple[int, float]]]  # per op: (destination device, bytes), sorted
    cuda: bool = False  # on GPUs (cuDNN packs recurrent weights: replica_memory)


def local_plan(ga: GraphArrays, plan: Plan, cluster: Cluster | None = None) -> LocalPlan:
    group = [plan.groups[name] for name in ga.names]
    placement = plan.placement
    dev = [placement[g] for g in group]
    needb: list[list[tuple[int, float]]] = []
    for u in range(ga.n):
        du = dev[u]
        need: dict[int, float] = {}
        for v, b in zip(ga.succs[u], ga.succ_bytes[u]):
            e = dev[v]
            if e != du and b > need.get(e, 0.0):
                need[e] = b
        needb.append(sorted(need.items()))
    par = plan.parallel
    return LocalPlan(dev=dev, group=group, k=plan.devices_per_replica, d=par.data,
                     m=par.microbatches, shard=par.shard, recompute=plan.recompute,
                     selective=plan.selective, needb=needb,
                     cuda=cluster is not None and not cluster.is_cpu)


@dataclass
class ReplicaRun:
    dev_free: list[float]
    fwd_end: list[float]
    busy: list[float]
    last_bwd: list[float]  # per op, over microbatches
    coll_free: list[float]  # after FSDP reduce-scatters
    fsdp_reduced: bool = False  # the reduce-scatters above were simulated
    events: list[Event] = field(default_factory=list)
    host_end: float = 0.0  # when the host has issued the whole backward


def op_times(ga, lp: LocalPlan, tables: CostTables, base: int) -> tuple[list[float], list[float]]:
    """Per-microbatch forward and backward (with recompute) seconds of every op."""
    cdev = np.asarray(lp.dev, dtype=np.int64) + base
    kind = tables.kind_of_device[cdev]
    ar = np.arange(ga.n)
    share = 1.0 / (lp.m * lp.d)
    oh = tables.overhead[cdev]
    tf = scaled(tables.fwd[kind, ar], tables.fwd_fixed[kind, ar], oh, share)
    tb = scaled(tables.bwd[kind, ar], tables.bwd_fixed[kind, ar], oh, share)
    if lp.recompute or lp.selective:
        # a recomputed op runs its forward again in backward; under a selective
        # recompute only the ops whose outputs are not kept do
        rerun = rerun_ops(ga, lp.group, lp.recompute, lp.selective)
        tb = tb + np.where(rerun, tf, 0.0)
    return tf.tolist(), tb.tolist()


def run_replica(ga, lp: LocalPlan, tables: CostTables, cluster: Cluster, plan: Plan,
                order: list[int], base: int, record: bool) -> ReplicaRun:
    n, k, m = ga.n, lp.k, lp.m
    dev = lp.dev
    tf, tb = op_times(ga, lp, tables, base)
    ids = [base + j for j in range(k)]
    hf_op, hb_op = host_times(tables, np.asarray(dev, dtype=np.int64) + base, np.arange(n),
                              1.0 / (m * lp.d))
    if plan.parallel.graphs:
        per_param = tables.graph_param_host[tables.kind_of_device[np.asarray(dev) + base]]
        hf_op = hb_op = graphed_host(np.asarray(dev), ga.param_count, per_param)
    hf_op, hb_op = hf_op.tolist(), hb_op.tolist()
    # DDP's backward hook per parameter tensor, on the autograd thread (ZeRO-2 / FSDP:
    # FSDP2's per-parameter work, sim_fsdp)
    ddp_h = [float(tables.ddp_host[c]) if lp.d > 1 and lp.shard == "none" else 0.0
             for c in ids]
    npar = ga.param_count
    copy_h = [float(tables.copy_host[c]) for c in ids]
    alpha = [[float(tables.alpha[a, b]) for b in ids] for a in ids]
    inv_bw = [[float(tables.inv_bw[a, b]) for b in ids] for a in ids]
    dev_free = [0.0] * k
    busy = [0.0] * k
    link_free = [[0.0] * k for _ in range(k)]
    events: list[Event] = []
    names = ga.names

    def label(item: int) -> str:
        return names[item % n] if m == 1 else f"{names[item % n]}#mb{item // n}"

    sharded = lp.d > 1 and lp.shard in ("fsdp", "zero2")
    fs = FsdpStreams(ga, lp, cluster, plan, [float(tables.shard_host[c]) for c in ids]) \
        if sharded else None
    if fs:
        for j in range(k):
            fs.prefetch(j, 0.0, "f", events if record else None)

    # ---- forward (one host thread issues every item, in order)
    host_f = 0.0
    arrive: list[list[float] | None] = [None] * (m * n)
    for item in order:
        mb, i = divmod(item, n)
        d = dev[i]
        ready = 0.0
        off = mb * n
        for u in ga.preds[i]:
            t = arrive[off + u][d]
            if t > ready:
                ready = t
        host_f += hf_op[i]
        if fs is not None:
            host_f += fs.host(i, "f")
        start = dev_free[d] if dev_free[d] > ready else ready
        if host_f > start:
            start = host_f
        if fs is not None and fs.unit_of[i] >= 0:
            start = max(start, fs.wait(i, dev_free[d], start, "f", events if record else None))
        fin = start + tf[i]
        dev_free[d] = fin
        busy[d] += tf[i]
        row = [fin] * k
        for e, b in lp.needb[i]:
            b = b / (m * lp.d)
            host_f += copy_h[d]  # Tensor.to, issued by the forward thread
            s0 = link_free[d][e] if link_free[d][e] > fin else fin
            if host_f > s0:
                s0 = host_f
            arr = s0 + (alpha[d][e] + b * inv_bw[d][e])
            link_free[d][e] = arr
            row[e] = arr
            if record:
                events.append(Event(f"link{base + d}->{base + e}", label(item), s0, arr, "comm"))
        arrive[item] = row
        if record:
            events.append(Event(f"dev{base + d}", label(item), start, fin, "fwd"))
    fwd_end = list(dev_free)

    # ---- backward (one autograd host thread per device, after the forward is issued)
    if fs:
        for j in range(k):
            fs.prefetch(j, dev_free[j], "b", events if record else None)
    hb_tot = [hb_op[i] + npar[i] * ddp_h[dev[i]] for i in range(n)]
    items, issued, copied = backward_issue(ga, dev, order, hb_tot, copy_h, host_f, k)
    host_b = [0.0] * k  # FSDP2's per-parameter work on each autograd thread, so far
    bend = [0.0] * (m * n)
    last_bwd = [0.0] * n
    for item in items:
        mb, i = divmod(item, n)
        d = dev[i]
        off = mb * n
        ready_by: dict[int, float] = {}
        for w in ga.succs[i]:
            e = dev[w]
            t = bend[off + w]
            if t > ready_by.get(e, -1.0):
                ready_by[e] = t
        ready = 0.0
        need = dict(lp.needb[i])
        for e in sorted(ready_by):
            r = ready_by[e]
            b = need.get(e, 0.0) / (m * lp.d)
            if b > 0:
                s0 = link_free[e][d] if link_free[e][d] > r else r
                if copied is not None and copied[item * k + e] > s0:
                    s0 = copied[item * k + e]
                r = s0 + (alpha[e][d] + b * inv_bw[e][d])
                link_free[e][d] = r
                if record:
                    events.append(Event(f"link{base + e}->{base + d}", label(item), s0, r, "comm"))
            if r > ready:
                ready = r
        if fs is not None:
            host_b[d] += fs.host(i, "b")
        t_host = issued[item] + host_b[d]
        start = dev_free[d] if dev_free[d] > ready else ready
        if t_host > start:
            start = t_host
        if fs is not None and fs.unit_of[i] >= 0:
            start = max(start, fs.wait(i, dev_free[d], start, "b", events if record else None))
        fin = start + tb[i]
        dev_free[d] = fin
        busy[d] += tb[i]
        bend[item] = fin
        if fin > last_bwd[i]:
            last_bwd[i] = fin
        if fs is not None and fs.unit_of[i] >= 0:
            host_b[d] += fs.done(i, fin, t_host, events if record else None)
        if record:
            events.append(Event(f"dev{base + d}", label(item), start, fin, "bwd"))
    coll_free = fs.coll_free if fs else [0.0] * k
    host_end = max(host_f, max(issued, default=0.0)) + max(host_b, default=0.0)
    return ReplicaRun(dev_free, fwd_end, busy, last_bwd, coll_free, fs is not None, events,
                      host_end)


def backward_issue(ga, dev: list[int], order: list[int], hb: list[float],
                   copy_h: list[float], host_f: float, k: int
                   ) -> tuple[list[int], list[float], list[float] | None]:
    """The order in which autograd's threads issue one replica's backward, and when.

    PyTorch runs a process's backward on one thread per device, each taking from its
    ready queue the node created last in forward (highest sequence number); a node is
    ready once every consumer's gradient has been issued. So a device whose latest op
    waits for another device's thread issues an earlier op that is ready, where the
    reversed forward order would make it wait. Here each thread starts when the forward
    is fully issued (``host_f``) and takes ``hb[op]`` seconds per item. With ``copy_h``
    set, a gradient going back to another device is copied by the consumer device's
    thread (``copy_h[device]``, the backward of ``Tensor.to``: a task of its own, created
    with the first consumer there, ready when every consumer there is issued).

    Returns ``(items, issued, copied)``: items (``mb * n + op``) in issue order, the host
    time each item's issue ends, and at ``item * k + device`` the time its gradient's copy
    from that device is issued (None without copy costs). With no host costs this is the
    reversed forward order (ties go to the latest node).
    """
    n = ga.n
    mn = len(order)
    if k == 1:  # one thread: every item is ready when its turn comes in reversed order
        items = order[::-1]
        issued = [0.0] * mn
        t = host_f
        for it in items:
            t += hb[it % n]
            issued[it] = t
        return items, issued, None
    succs, preds = ga.succs, ga.preds
    pos = [0] * mn
    for s, it in enumerate(order):
        pos[it] = s
    with_copies = any(copy_h)
    # per op: consumers on its own device, and per other device its first consumer (in
    # issue order, the same in every microbatch) and how many consumers it has there
    same = [0] * n
    cross: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (device, first, count)
    for i in range(n):
        d = dev[i]
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for w in succs[i]:
            e = dev[w]
            if e == d or not with_copies:
                same[i] += 1
            else:
                count[e] = count.get(e, 0) + 1
                if e not in first or pos[w] < pos[first[e]]:
                    first[e] = w
        cross[i] = [(e, first[e], count[e]) for e in sorted(first)]
    # tasks: items 0..mn-1, then copies; device, cost, priority (-2 seq; a copy sits just
    # before its first consumer), dependencies left, and each item's first copy task
    t_dev = [dev[it % n] for it in range(mn)]
    t_cost = [hb[it % n] for it in range(mn)]
    t_key = [-2 * p for p in pos]
    t_item = list(range(mn))
    deps = [same[it % n] + len(cross[it % n]) for it in range(mn)]
    cfirst = [0] * mn
    for it in range(mn):
        i = it % n
        cfirst[it] = len(t_dev)
        off = it - i
        for e, w, c in cross[i]:
            t_dev.append(e)
            t_cost.append(copy_h[e])
            t_key.append(1 - 2 * pos[off + w])
            t_item.append(it)
            deps.append(c)
    slot = [0] * (n * k)  # copy task of op u to device e: cfirst[item] + slot[u * k + e]
    for i in range(n):
        for x, (e, _, _) in enumerate(cross[i]):
            slot[i * k + e] = x
    ntask = len(t_dev)
    rtime = [host_f] * ntask
    heappush, heappop = heapq.heappush, heapq.heappop
    waiting: list[list[tuple[float, int, int]]] = [[] for _ in range(k)]
    ready: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for t in range(ntask):
        if deps[t] == 0:
            waiting[t_dev[t]].append((host_f, t_key[t], t))
    for w in waiting:
        heapq.heapify(w)
    clock = [host_f] * k
    threads = range(k)
    items: list[int] = []
    issued = [0.0] * mn
    copied = [0.0] * (mn * k) if with_copies else None
    inf = float("inf")
    for _ in range(ntask):
        # each thread's next task: the first by key among those released by its clock,
        # else the earliest released after it (a task never starts before it is released)
        best, bt, bkey = -1, inf, 0
        for j in threads:
            rj, wj = ready[j], waiting[j]
            t = clock[j]
            while wj and wj[0][0] <= t:
                _, key, task = heappop(wj)
                heappush(rj, (key, task))
            if rj:
                key = rj[0][0]
            elif wj:
                t, key = wj[0][0], wj[0][1]
            else:
                continue
            if t < bt or (t == bt and key < bkey):
                best, bt, bkey = j, t, key
        task = heappop(ready[best])[1] if ready[best] else heappop(waiting[best])[2]
        end = bt + t_cost[task]
        clock[best] = end
        if task < mn:  # an item: its producers here, or their copies to here, move on
            items.append(task)
            issued[task] = end
            i = task % n
            off = task - i
            tgts = [off + u if not with_copies or dev[u] == best
                    else cfirst[off + u] + slot[u * k + best] for u in preds[i]]
        else:  # a copy back: the item it belongs to moves on
            tgts = [t_item[task]]
            copied[tgts[0] * k + best] = end
        for tgt in tgts:
            deps[tgt] -= 1
            if rtime[tgt] < end:
                rtime[tgt] = end
            if not deps[tgt]:
                heappush(waiting[t_dev[tgt]], (rtime[tgt], t_key[tgt], tgt))
    return items, issued, copied


def simulate_local(ga, plan: Plan, cluster: Cluster, tables: CostTables, record: bool) -> dict:
    """Step time, busy time, memory and timeline of a ``pipeline == 1`` plan."""
    lp = local_plan(ga, plan, cluster)
    prio = [plan.priority[g] for g in lp.group] if plan.priority else None
    order = issue_order_items(ga.preds, lp.dev, lp.m, prio)
    reps = [0] if replicas_identical(cluster, plan) else list(range(lp.d))
    runs = {r: run_replica(ga, lp, tables, cluster, plan, order, r * lp.k, record and r == 0)
            for r in reps}
    last = np.max([runs[r].last_bwd for r in reps], axis=0)
    out = finish_step(ga, lp, plan, cluster, tables, runs, last,
                      local_memory(ga, lp, plan, order), record)
    out["forward_end_s"] = max(runs[reps[0]].fwd_end)
    return out


def finish_step(ga, lp: LocalPlan, plan: Plan, cluster: Cluster, tables: CostTables,
                runs: dict, last_bwd, mem: list[MemoryModel], record: bool) -> dict:
    """Gradient collectives, optimizer update, and per cluster device figures.

    ``runs`` maps simulated replicas to objects with ``dev_free``, ``busy``,
    ``coll_free`` and ``events``; ``last_bwd`` is when each op's gradient is final.
    """
    k, d, shard = lp.k, lp.d, lp.shard
    reps = sorted(runs)
    events = list(runs[reps[0]].events)
    pbytes = np.zeros(k)
    np.add.at(pbytes, np.asarray(lp.dev), ga.param_bytes)

    # ---- gradient collectives overlapped with backward (DDP / ZeRO-2 buckets)
    coll_end = [max(runs[r].coll_free[j] for r in reps) for j in range(k)]
    own_rs = all(getattr(runs[r], "fsdp_reduced", False) for r in reps)
    if d > 1 and not own_rs:
        kind = "allreduce" if shard == "none" else "reducescatter"
        for j in range(k):
            c = affine_collective(cluster, kind, replica_group(plan, j)) if shard == "none" \
                else grad_reduction(cluster, plan, j)
            for b, nbytes, ready in buckets_of(ga, lp.dev, j, last_bwd):
                s0 = max(coll_end[j], ready)
                coll_end[j] = s0 + collective_time(c, nbytes)
                if record:
                    events.append(Event(coll_resource(j, k), f"bucket{b}", s0, coll_end[j], kind))

    # ---- optimizer update (and ZeRO-2's all-gather of the updated parameters), issued
    # by each replica's process once its backward is issued (sim/optimizer_host.py)
    # (pipeline stages' processes each update their own parameters: not charged)
    # ZeRO-1: each rank updates its share of the tensors, then broadcasts them
    opt_bytes, opt_tensors = optimizer_shares(ga, plan)
    step_h, zero_h = optimizer_host_s(tables.opt_host, int(tables.kind_of_device[0]),
                                      float(ga.param_count.sum()), opt_tensors) \
        if plan.parallel.pipeline == 1 else (0.0, 0.0)
    host_ready = max(getattr(runs[r], "host_end", 0.0) for r in reps) + step_h
    step = host_ready + zero_h if step_h or zero_h else 0.0
    busy = [0.0] * cluster.num_devices
    upd_end = [0.0] * k
    for r in range(d):
        run = runs[r if r in runs else reps[0]]
        for j in range(k):
            c = r * k + j
            t_up = update_time(pbytes[j] * opt_bytes, tables.mem_bandwidth[c],
                               shard_degree(plan), shard) if pbytes[j] else 0.0
            s0 = max(run.dev_free[j], coll_end[j], host_ready if step_h else 0.0)
            end = s0 + t_up if t_up else run.dev_free[j]
            upd_end[j] = max(upd_end[j], end)
            busy[c] = run.busy[j] + t_up
            step = max(step, end, coll_end[j])
            if record and r == 0 and t_up:
                events.append(Event(f"dev{c}", "update", s0, end, "update"))
    if record and step_h:
        events.append(Event("host", "optimizer step, zero_grad", host_ready - step_h,
                            host_ready + zero_h, "host"))
    zero1 = plan.parallel.shard_optimizer  # data >= 2 (ParallelConfig)
    if (shard == "zero2" and not own_rs) or zero1:
        # pipeline stages: one gather after the update; ZeRO-1: every rank broadcasts the
        # fp32 parameters it updated, tensor by tensor, one rank after the other (each
        # broadcast moves its bytes at the bus bandwidth: d / (d - 1) times a ring
        # all-gather of them all, and pays a collective's latency)
        scale = d / (d - 1) if zero1 else ga.gather_scale
        tensors = np.bincount(np.asarray(lp.dev), weights=broadcast_tensors(ga), minlength=k)
        for j in range(k):
            if pbytes[j]:
                c = affine_collective(cluster, "allgather", replica_group(plan, j))
                s0 = max(coll_end[j], upd_end[j])
                e0 = s0 + collective_time(c, scale * pbytes[j]) \
                    + (max(0.0, tensors[j] - 1) * c[0] if zero1 else 0.0)
                step = max(step, e0)
                if record:
                    events.append(Event(coll_resource(j, k), "params", s0, e0, "allgather"))

    peak = [0.0] * cluster.num_devices
    breakdown: list[dict | None] = [None] * cluster.num_devices
    for r in range(d):
        for j in range(k):
            peak[r * k + j] = mem[j].total
            breakdown[r * k + j] = mem[j].to_json()
    return {"step": step, "busy": busy, "peak": peak, "breakdown": breakdown, "events": events}


def buckets_of(ga, dev: list[int], j: int, last_bwd) -> list[tuple[int, float, float]]:
    """``(bucket, bytes, ready time)`` of local device ``j``'s gradient buckets, in order."""
    ops = [i for i in range(ga.n - 1, -1, -1) if dev[i] == j and ga.param_bytes[i] > 0]
    if not ops:
        return []
    pb = ga.param_bytes[ops]
    ids = bucket_ids(pb)
    out = []
    for b in range(int(ids[-1]) + 1):
        sel = ids == b
        if sel.any():
            ready = max(last_bwd[ops[x]] for x in np.flatnonzero(sel))
            out.append((b, float(pb[sel].sum()), float(ready)))
    return out
