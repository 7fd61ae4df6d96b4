"""One replica's memory at its peak: what a step holds throughout (parameters, autocast's
weight copies, AdamW state, the gradients the backward does not make) and, per op, what
the step's timeline reads (:mod:`autoplace.sim.memory`): activations kept, transients,
gradients made by the backward, saved tensors shared between ops. Used by the one-process
replica (:mod:`autoplace.sim.local`), pipeline stages (:mod:`autoplace.sim.pipeline`) and
offloaded plans (:mod:`autoplace.sim.offload`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from autoplace.lowering import issue_order_items
from autoplace.plan import Plan
from autoplace.sim.memory import (
    Peak,
    cast_copy_bytes,
    cast_weight_bytes,
    replica_events,
    timeline_peak,
)
from autoplace.sim.model import (
    BUCKET_BYTES,
    MemoryModel,
    fsdp_units,
    graphed_grad_bytes,
    optimizer_shares,
    recompute_boundary_bytes,
    recomputed_ops,
    shard_degree,
    shared_save_bytes,
    state_memory,
)

if TYPE_CHECKING:
    from autoplace.sim.local import LocalPlan

__all__ = ["casts_saved", "local_memory", "made_grad_share", "op_memory", "static_memory",
           "with_peak"]


def sharded(lp: LocalPlan) -> bool:
    """Whether the replica's parameters are sharded over its data-parallel ranks (FSDP2 or
    ZeRO-2 with more than one replica)."""
    return lp.d > 1 and lp.shard != "none"


def op_memory(ga, lp: LocalPlan, plan: Plan) -> dict[str, np.ndarray]:
    """Per op, what :mod:`autoplace.sim.memory`'s events read (``kept``, ``back``,
    ``fwd_out``, ``grad``), and per local device the saved copies held beside the op that
    counts them (``shared``).

    A recomputed op keeps nothing; its group keeps the tensors it reads from outside
    (counted on the group's first op, freed when its backward ends) and holds its
    activations again while its backward runs, the larger of that and the op's output
    gradient being the transient. The output op keeps what the loss saves
    (``GraphArrays.loss_keep``), its workspace beyond that being its transient in forward
    and the gradients its backward makes its transient in backward
    (``GraphArrays.back_bytes``). A compiled plan's ops that autocast would cast the
    weights of keep their low-precision copies per microbatch (``GraphArrays.call_keep``;
    none where FSDP2 or ZeRO-2 shard, nor in a region under the selective policy, whose
    policy saves the matmuls' outputs and not the casts: gpt-1b's every block selective and
    compiled held 21.8 GiB on one H200, eagerly 23.8, its weights at bf16 being 2.0).
    Gradients are made by the backward, whole or as their shard
    (:func:`made_grad_share`; the rest ``state_memory`` counts)."""
    group = np.asarray(lp.group)
    rc_op = recomputed_ops(ga, lp.group, lp.recompute, lp.selective)
    act = ga.act_bytes
    if ga.call_keep is not None and not sharded(lp):
        # kept per microbatch whatever its size; the events scale kept by 1 / (m d). A
        # compiled region under the selective policy saves only the policy's outputs and
        # casts its weights again in backward
        keep = np.where(np.isin(group, list(lp.selective)), 0.0, ga.call_keep) \
            if lp.selective else ga.call_keep
        act = act + keep * (lp.m * lp.d)
    kept = np.where(rc_op, 0.0, act) + ga.loss_keep
    if casts_saved(ga, plan):
        # one copy per replica, shared by its microbatches (m items of 1 / (m d) each)
        kept = kept + cast_weight_bytes(ga) * lp.d
    for g, b in recompute_boundary_bytes(ga, lp.group, lp.recompute | lp.selective).items():
        kept[int(np.argmax(group == g))] += b
    gact = np.zeros(int(group.max()) + 1 if len(group) else 1)
    np.add.at(gact, group[rc_op], ga.act_bytes[rc_op])
    has_rc = np.zeros_like(gact, dtype=bool)
    has_rc[group[rc_op]] = True
    fwd_out = ga.out_bytes - ga.loss_keep
    back = np.maximum(ga.back_bytes, np.where(has_rc[group], gact[group], 0.0))
    grad = ga.param_bytes * made_grad_share(lp, plan)
    shared = shared_save_bytes(ga, np.asarray(lp.dev), ~rc_op, lp.k)
    once = None
    if sharded(lp) or plan.parallel.offload:  # offloaded: a group of one reduce-scatters too
        # a unit's reduce-scatter, after its backward (its first op's): its unsharded
        # gradients at the gather dtype and their fp32 copy FSDP2 reduces
        fu = fsdp_units(ga, lp.dev, lp.k, plan.parallel.shard_units, plan)
        unit = np.asarray(fu.unit_of)
        once = np.zeros(ga.n)
        for u, b in enumerate(fu.unit_bytes):
            once[int(np.argmax(unit == u))] = b * (1.0 + ga.gather_scale)
    return {"kept": kept, "back": back, "fwd_out": fwd_out, "grad": grad, "shared": shared,
            "once": once}


def casts_saved(ga, plan: Plan) -> bool:
    """Whether autocast's weight copies live as the ops that read them save them, from
    the op's forward to its backward: in a one-process program, whose backward runs
    outside the autocast region (``executor.build``: the region's exit drops its cache,
    and each copy lives on in the saved tensors of the ops that read it; a recomputed op's
    copy is counted the same way, an over-count until its group's backward). A pipeline's
    schedule runs wholly inside the region: its copies stay to the step's end
    (:func:`static_memory`). None under FSDP2 or ZeRO-2 (gathered at the autocast dtype,
    one rank included) or in a compiled plan (``GraphArrays.call_keep``). A plan with
    selective checkpointing runs its backward inside the region too (a selective
    recompute must issue the casts its forward issued), and a graphed plan's copies are
    made in its graphs' private pools, which keep them: both hold them to the step's
    end."""
    par = plan.parallel
    return (par.pipeline == 1 and par.shard == "none" and ga.call_keep is None
            and not plan.selective and not par.graphs)


def made_grad_share(lp: LocalPlan, plan: Plan) -> float:
    """Share of its parameters' bytes an op's first backward allocates as gradient, after
    ``zero_grad(set_to_none=True)`` freed the last: all of them in one process; the shard
    (``1 / shard_degree``) under FSDP2 and ZeRO-2, made by each unit's reduce-scatter;
    none under DDP (``gradient_as_bucket_view=True``: the gradients are views of its
    buckets, which live from its construction) or offloaded (the shards go to the host)."""
    if plan.parallel.offload:
        return 0.0
    if sharded(lp):
        return 1.0 / shard_degree(plan)
    return 1.0 if lp.d == 1 or lp.k > 1 else 0.0


def static_memory(ga, lp: LocalPlan, plan: Plan) -> list[MemoryModel]:
    """Per local device, the memory a step holds throughout: parameters (and autocast's
    weight copies where they are not sharded), AdamW state (under ZeRO-1 the most loaded
    rank's share, :func:`~autoplace.sim.model.optimizer_shares`), and the gradients that are not
    made by the backward (sharded ones, DDP's buckets, a graphed plan's static buffers).

    Sharded on GPUs, a recurrent module's whole weights at the gather dtype stay too
    (``GraphArrays.packed_bytes``): a packed copy of what FSDP2 gathered (cuDNN's flat
    buffer, ``RNNBase.flatten_parameters``), which FSDP2's resharding does not free.
    Measured on GNMT-4 under ``fully_shard`` on one H200: 0.36 GiB held between steps
    beyond the shards and AdamW state, its LSTMs' weights being 0.29 GiB, the largest
    storages held being parameters that view one flat buffer per LSTM
    (``scripts/bench/lstm_fsdp_memory.py``); with packing turned off, the same bytes were
    held by cuDNN's per-call copies instead and GNMT-4's peak on 2x H200 did not change."""
    k, m = lp.k, lp.m
    dev = np.asarray(lp.dev)
    max_unit = [0.0] * k
    root = [0.0] * k
    if lp.shard == "fsdp":  # the gathered units it holds (zero2 holds all of them)
        fu = fsdp_units(ga, lp.dev, k, plan.parallel.shard_units, plan)
        for b, j, is_root in zip(fu.unit_bytes, fu.unit_dev, fu.root):
            if is_root:
                root[j] += b
            else:
                max_unit[j] = max(max_unit[j], b)
    pb = np.bincount(dev, weights=ga.param_bytes, minlength=k)[:k]
    is_sharded = sharded(lp)
    # weight copies beside the parameters: autocast's where they are not sharded (FSDP2
    # gathers at the autocast dtype: autocast then has nothing to cast), cuDNN's packed
    # recurrent weights where they are, on GPUs
    if not is_sharded:
        copies = np.zeros(k) if casts_saved(ga, plan) else cast_copy_bytes(ga, dev, k)
    elif lp.cuda and ga.packed_bytes is not None:
        copies = np.bincount(dev, weights=ga.packed_bytes, minlength=k)[:k]
    else:
        copies = np.zeros(k)
    out = []
    opt_share = optimizer_shares(ga, plan)[0]  # ZeRO-1: this rank's share of AdamW's state
    for j in range(k):
        mem = state_memory(pb[j], shard_degree(plan), lp.shard, max_unit[j], ga.gather_scale,
                           root_bytes=root[j])
        mem.optimizer *= opt_share
        mem.params += copies[j]
        mem.grads -= pb[j] * made_grad_share(lp, plan)  # the ops' ``grad`` events count it
        if is_sharded:  # the unsharded gradients: each unit's reduce-scatter (op_memory)
            mem.grads -= min(float(BUCKET_BYTES), pb[j])
        if plan.parallel.graphs:
            mem.grads += graphed_grad_bytes(pb[j], m)
        out.append(mem)
    return out


def local_memory(ga, lp: LocalPlan, plan: Plan, order: list[int] | None = None
                 ) -> list[MemoryModel]:
    """Memory of each local device of one replica at its peak: :func:`static_memory` and
    the running activations, gradients and transients of its forward in issue order
    (``order``: ``lowering.issue_order_items``) and its backward in the reverse order
    (:func:`autoplace.sim.memory.replica_events`)."""
    if order is None:
        prio = [plan.priority[g] for g in lp.group] if plan.priority else None
        order = issue_order_items(ga.preds, lp.dev, lp.m, prio)
    per = op_memory(ga, lp, plan)
    events = replica_events(ga.n, np.asarray(lp.dev)[None, :], np.asarray(order)[None, :],
                            per["kept"], per["back"], per["fwd_out"], per["grad"],
                            np.array([1.0 / (lp.m * lp.d)]), per["once"])
    return with_peak(static_memory(ga, lp, plan), timeline_peak(*events, lp.k), per["shared"])


def with_peak(mems: list[MemoryModel], peak: Peak, shared: np.ndarray) -> list[MemoryModel]:
    """``mems`` (static parts per local device) with the timeline's peak added."""
    for j, mem in enumerate(mems):
        mem.activations = float(peak.activations[j] + shared[j])
        mem.grads += float(peak.grads[j])
        mem.transient = float(peak.transient[j])
    return mems
