"""Stage-level simulation of a ``torch.distributed.pipelining`` plan (``pipeline > 1``).

Stage ``s`` runs on local device ``s`` in its own process. Per microbatch a stage
takes the sum of its ops' per-microbatch times forward (``F``) and backward (``B``,
plus recomputed forwards), and sends the tensors crossing the cut to the next stage
(each producer once, bytes / microbatches) on the link's queue; gradients come back
the same way. Stages follow their schedule's action order:

* GPipe: ``F0 .. F(m-1), B0 .. B(m-1)``, every microbatch's activations held;
* 1F1B: ``p - s - 1`` warm-up forwards, then one forward / one backward, then the
  remaining backwards; stage ``s`` holds at most ``min(m, p - s)`` microbatches.

A stage's forward or backward of one microbatch takes at least the host time its
process needs to issue the stage's ops (their profiled host times, else
``host_dispatch_s`` per op, see :mod:`autoplace.sim.local`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoplace.cluster import Cluster
from autoplace.lowering import pipeline_actions
from autoplace.plan import Plan
from autoplace.sim.local import finish_step, local_plan, op_times
from autoplace.sim.memory import stage_events, timeline_peak
from autoplace.sim.model import (
    CostTables,
    Event,
    MemoryModel,
    affine_collective,
    coll_resource,
    collective_time,
    fsdp_units,
    host_times,
    replica_group,
    replicas_identical,
)
from autoplace.sim.replica_memory import op_memory, static_memory, with_peak

__all__ = ["simulate_pipeline"]


def inflight_microbatches(schedule: str, stages: int, microbatches: int) -> list[int]:
    """Microbatches whose activations each stage holds at its peak."""
    if schedule == "gpipe":
        return [microbatches] * stages
    return [min(microbatches, stages - s) for s in range(stages)]


@dataclass
class _StageRun:
    dev_free: list[float]
    busy: list[float]
    coll_free: list[float]
    last_b: list[float]
    events: list[Event] = field(default_factory=list)


def cut_bytes(ga, stage: list[int], p: int) -> list[float]:
    """Bytes crossing the cut after each stage (each producer counted once)."""
    cut = [0.0] * (p - 1)
    for u in range(ga.n):
        su = stage[u]
        top = -1
        size: dict[int, float] = {}
        for v, b in zip(ga.succs[u], ga.succ_bytes[u]):
            sv = stage[v]
            if sv > su:
                top = max(top, sv)
                size[sv] = max(size.get(sv, 0.0), b)
        if top > su:
            b = max(size.values())
            for s in range(su, top):  # a skip connection is relayed through the stages between
                cut[s] += b
    return cut


def _run_stages(ga, lp, plan: Plan, cluster: Cluster, tables: CostTables, base: int,
                record: bool) -> _StageRun:
    p, m = plan.parallel.pipeline, lp.m
    tf, tb = op_times(ga, lp, tables, base)
    fwd = [0.0] * p
    bwd = [0.0] * p
    for i, s in enumerate(lp.dev):
        fwd[s] += tf[i]
        bwd[s] += tb[i]
    # each stage's process issues its ops one by one from Python (forward, then the
    # backward it waits for): a microbatch takes at least that host time
    stage_of = np.asarray(lp.dev, dtype=np.int64)
    hf, hb = host_times(tables, stage_of + base, np.arange(ga.n), 1.0 / (m * lp.d))
    issue_f = np.bincount(stage_of, weights=hf, minlength=p)
    issue_b = np.bincount(stage_of, weights=hb, minlength=p)
    for s in range(p):
        fwd[s] = max(fwd[s], float(issue_f[s]))
        bwd[s] = max(bwd[s], float(issue_b[s]))
    cut = [b / (m * lp.d) for b in cut_bytes(ga, lp.dev, p)]

    def link(a: int, b: int, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return float(tables.alpha[base + a, base + b] + nbytes * tables.inv_bw[base + a, base + b])

    dur_f = [link(s, s + 1, cut[s]) for s in range(p - 1)]
    dur_b = [link(s + 1, s, cut[s]) for s in range(p - 1)]
    acts = [pipeline_actions(plan.parallel.schedule, p, m, s) for s in range(p)]
    events: list[Event] = []
    free = [0.0] * p
    coll_free = [0.0] * p
    farr: list[list[float | None]] = [[None] * m for _ in range(p)]
    barr: list[list[float | None]] = [[None] * m for _ in range(p)]
    fend: list[list[float | None]] = [[None] * m for _ in range(p)]
    farr[0] = [0.0] * m
    if lp.shard == "fsdp":  # gather each stage's units from the start; F0 waits for the first
        fu = fsdp_units(ga, lp.dev, p, plan.parallel.shard_units, plan)
        for s in range(p):
            c = affine_collective(cluster, "allgather", replica_group(plan, s))
            t = 0.0
            for u in (u for u, j in enumerate(fu.unit_dev) if j == s):
                t0, t = t, t + collective_time(c, ga.gather_scale * fu.unit_bytes[u])
                if t0 == 0.0:
                    free[s] = t
                if record and base == 0:
                    events.append(Event(coll_resource(s, p, "gather"), f"unit{u}", t0, t,
                                        "allgather"))
    link_f = [0.0] * max(p - 1, 0)
    link_b = [0.0] * max(p - 1, 0)
    pos = [0] * p
    busy = [0.0] * p
    left = 2 * m * p
    while left:
        progressed = False
        for s in range(p):
            while pos[s] < len(acts[s]):
                a = acts[s][pos[s]]
                i = int(a[1:])
                if a[0] == "F":
                    ready = farr[s][i]
                    if ready is None:
                        break
                    start = max(free[s], ready)
                    end = start + fwd[s]
                    fend[s][i] = end
                    if s < p - 1:
                        if dur_f[s]:
                            s0 = max(link_f[s], end)
                            link_f[s] = farr[s + 1][i] = s0 + dur_f[s]
                            if record and base == 0:
                                events.append(Event(f"link{s}->{s + 1}", a, s0, link_f[s], "comm"))
                        else:
                            farr[s + 1][i] = end
                else:
                    ready = barr[s][i] if s < p - 1 else fend[s][i]
                    if ready is None:
                        break
                    start = max(free[s], ready)
                    end = start + bwd[s]
                    if s > 0:
                        if dur_b[s - 1]:
                            s0 = max(link_b[s - 1], end)
                            link_b[s - 1] = barr[s - 1][i] = s0 + dur_b[s - 1]
                            if record and base == 0:
                                events.append(Event(f"link{s}->{s - 1}", a, s0, link_b[s - 1],
                                                    "comm"))
                        else:
                            barr[s - 1][i] = end
                free[s] = end
                busy[s] += end - start
                if record and base == 0:
                    events.append(Event(f"dev{s}", a, start, end,
                                        "fwd" if a[0] == "F" else "bwd"))
                pos[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # cannot happen for GPipe / 1F1B orders
            raise RuntimeError(f"pipeline schedule deadlocked at stage positions {pos}")
    return _StageRun(dev_free=free, busy=busy, coll_free=coll_free, last_b=list(free),
                     events=events)


def simulate_pipeline(ga, plan: Plan, cluster: Cluster, tables: CostTables, record: bool) -> dict:
    """Step time, busy time, memory and timeline of a ``pipeline > 1`` plan."""
    lp = local_plan(ga, plan, cluster)
    reps = [0] if replicas_identical(cluster, plan) else list(range(lp.d))
    runs = {r: _run_stages(ga, lp, plan, cluster, tables, r * lp.k, record and r == 0)
            for r in reps}
    last_stage = np.max([runs[r].last_b for r in reps], axis=0)
    last = last_stage[np.asarray(lp.dev)]
    out = finish_step(ga, lp, plan, cluster, tables, runs, last, stage_memory(ga, lp, plan),
                      record)
    return out


def stage_memory(ga, lp, plan: Plan) -> list[MemoryModel]:
    """Memory of each stage of one replica at its peak: :func:`static_memory` and the
    running activations, gradients and transients of its schedule's actions
    (:func:`autoplace.sim.memory.stage_events`: every microbatch a stage has run forward
    and not yet backward holds its activations and the output it sent; the last stage
    holds a microbatch's model output and what its loss saved until its backward), and
    the buffers its
    ``PipelineStage`` receives into: one per microbatch for the activations coming in
    (every stage but the first) and one for the gradients coming back (every stage but the
    last), allocated when the schedule first runs and kept (``_setup_forward_recv_info``,
    ``_setup_backward_recv_info``), whatever the schedule. On the 14 pipelines of four
    stored suites on 2x and 4x H200 (gpt-1b, GNMT-4, branchy-mlp, Inception-v3) they bring
    every stage's simulated peak closer to the measured one, none past it by more than 3%
    (``docs/simulator.md``)."""
    p = plan.parallel.pipeline
    per = op_memory(ga, lp, plan)
    outputs = np.zeros(ga.n)  # the values the graph's sinks (its output) read
    for v in range(ga.n):
        if not ga.succs[v]:
            outputs[ga.preds[v]] = ga.out_bytes[ga.preds[v]]
    cut = cut_bytes(ga, lp.dev, p)
    events = stage_events(np.asarray(lp.dev), plan.parallel.schedule, p, lp.m, per["kept"],
                          per["back"], per["fwd_out"], per["grad"], 1.0 / (lp.m * lp.d),
                          cut, outputs, per["once"])
    mems = with_peak(static_memory(ga, lp, plan), timeline_peak(*events, p), per["shared"])
    for s, mem in enumerate(mems):  # the stage's receive buffers, one per microbatch
        mem.activations += ((cut[s - 1] if s > 0 else 0.0)
                            + (cut[s] if s < p - 1 else 0.0)) / lp.d
    return mems
