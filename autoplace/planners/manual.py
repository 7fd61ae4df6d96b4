"""The options an engineer writes by hand (shared/MEASURED.md), as plans.

One device; the model cut into one contiguous run per device in one process (the two
halves); DDP; FSDP2; an even ``torch.distributed.pipelining`` split with GPipe and 1F1B;
and the per-block levers a strong user adds to the one-device and data-parallel options
(:func:`lever_plans`): ``torch.compile`` on each block, ``torch.utils.checkpoint`` on each
block (whole or selective), both; DDP + per-block checkpointing; DDP + compile; FSDP2 +
per-block checkpointing + compile (torchtitan's recipe); FSDP2 with the parameters,
gradients and optimizer state offloaded to the host, with and without per-block
checkpointing (what trains when nothing else fits).
The splits are balanced by the graph's *analytic* costs (FLOPs and bytes, as
:func:`autoplace.costs.estimate_costs` estimates them), never by a profile: a hand-made
split does not move with a profile's noise, so the same options come out of every run
(a one-op shift of gpt-1b's two halves put the head's 1.5 GiB logits over a 16 GiB
cap). The benchmark suite measures these as the options to beat, and the ``auto``
planner measures them among its candidates.
"""

from __future__ import annotations

from typing import Any

from autoplace import planners
from autoplace.cluster import Cluster
from autoplace.costs import estimate_costs
from autoplace.graph import OpGraph
from autoplace.lowering import block_group_ids, block_groups
from autoplace.plan import ParallelConfig, Plan

__all__ = ["analytic_copy", "hand_written", "halves_name", "lever_plans"]

#: every cost a profile fills; an analytic copy has none of them until estimated
_PROFILED = ("fwd_time_s", "bwd_time_s", "fwd_fixed_s", "bwd_fixed_s", "fwd_host_s",
             "bwd_host_s", "fwd_host_fixed_s", "bwd_host_fixed_s")


def analytic_copy(graph: OpGraph, cluster: Cluster) -> OpGraph:
    """A copy of ``graph`` whose costs are all estimated from FLOPs and bytes for
    ``cluster``'s device kinds (``graph`` itself is not changed)."""
    data = graph.to_json()
    for node in data["nodes"]:
        for key in _PROFILED:
            node[key] = {}
    out = OpGraph.from_json(data)
    for attr in ("batch_size", "spec"):
        if hasattr(graph, attr):
            setattr(out, attr, getattr(graph, attr))
    return estimate_costs(out, cluster)


def halves_name(num_devices: int) -> str:
    """The hand-written contiguous split's name: ``two-halves``, ``4-parts``, ..."""
    return "two-halves" if num_devices == 2 else f"{num_devices}-parts"


def hand_written(graph: OpGraph, cluster: Cluster, *, levers: bool = True) -> dict[str, Plan]:
    """The hand-written options for ``graph`` on ``cluster``, by name: ``single``, the
    contiguous split (:func:`halves_name`, two or more devices), ``ddp``, ``fsdp``,
    ``pipeline-gpipe`` and ``pipeline-1f1b`` (two or more devices; ``max(8, devices)``
    microbatches), and with ``levers`` the per-block recipes (:func:`lever_plans`). Splits
    are balanced by analytic costs (:func:`analytic_copy`)."""
    g = analytic_copy(graph, cluster)
    n = cluster.num_devices
    out: dict[str, Any] = {"single": planners.get("single")(g, cluster)}
    if n > 1:
        out[halves_name(n)] = planners.get("expert")(
            g, cluster, per_layer=False).with_parallel(microbatches=1)
    out["ddp"] = planners.get("ddp")(g, cluster)
    out["fsdp"] = planners.get("fsdp")(g, cluster)
    if n > 1:
        for sched in ("gpipe", "1f1b"):
            out[f"pipeline-{sched}"] = planners.get("pipeline")(
                g, cluster, microbatches=max(8, n), schedule=sched)
    if levers:
        out.update(lever_plans(g, cluster))
    return out


def lever_plans(graph: OpGraph, cluster: Cluster) -> dict[str, Plan]:
    """The per-block recipes, by name, as plans whose groups are the model's blocks
    (:func:`autoplace.lowering.block_groups`): ``compile-blocks``, ``checkpoint-blocks``,
    ``selective-blocks``, ``checkpoint-blocks+compile``, ``selective-blocks+compile`` on one
    device, and with two or more devices ``ddp+checkpoint-blocks``, ``ddp+compile``,
    ``fsdp+compile-blocks`` and ``fsdp+checkpoint-blocks+compile`` (torchtitan's recipe
    without and with per-block checkpointing); on GPUs ``fsdp+offload`` and
    ``fsdp+offload+checkpoint-blocks`` (FSDP2 over every device, one included, with its
    shards, gradients and AdamW state in host memory: ``parallel.offload``). None when the
    graph has no blocks; the compiled and offloaded ones only on GPUs (on CPUs inductor's
    compile takes longer than the steps it saves, and the host's memory is the device's)."""
    groups = block_groups(graph)
    blocks = block_group_ids(graph, groups)
    if not blocks:
        return {}
    n_groups = max(groups.values()) + 1
    n = cluster.num_devices

    def plan(name: str, recompute=(), selective=(), **parallel: Any) -> Plan:
        return Plan.from_groups(graph, groups, [0] * n_groups, recompute=set(recompute),
                                selective=set(selective), parallel=ParallelConfig(**parallel),
                                planner=name, cluster=cluster)

    out = {
        "checkpoint-blocks": plan("checkpoint-blocks", recompute=blocks),
        "selective-blocks": plan("selective-blocks", selective=blocks),
    }
    if n > 1:  # DDP that does not fit: checkpointing each block, as on one device
        out["ddp+checkpoint-blocks"] = plan("ddp+checkpoint-blocks", recompute=blocks, data=n)
    if any(d.kind == "cpu" for d in cluster.devices):
        return out
    out.update({
        "compile-blocks": plan("compile-blocks", compile=True),
        "checkpoint-blocks+compile": plan("checkpoint-blocks+compile", recompute=blocks,
                                          compile=True),
        "selective-blocks+compile": plan("selective-blocks+compile", selective=blocks,
                                         compile=True),
        "fsdp+offload": plan("fsdp+offload", data=n, shard="fsdp", offload=True),
        "fsdp+offload+checkpoint-blocks": plan("fsdp+offload+checkpoint-blocks",
                                               recompute=blocks, data=n, shard="fsdp",
                                               offload=True),
    })
    if n > 1:
        out["ddp+compile"] = plan("ddp+compile", data=n, compile=True)
        out["fsdp+compile-blocks"] = plan("fsdp+compile-blocks", data=n, shard="fsdp",
                                          compile=True)
        out["fsdp+checkpoint-blocks+compile"] = plan(
            "fsdp+checkpoint-blocks+compile", recompute=blocks, data=n, shard="fsdp",
            compile=True)
    return out
