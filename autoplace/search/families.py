"""What makes plans alike: the execution *family* a plan's measured/simulated error is
shared in (:mod:`autoplace.search.calibration`), and the *signature* that makes two plans
the same plan."""

from __future__ import annotations

from autoplace.plan import Plan

__all__ = ["family", "signature"]


def family(plan: Plan) -> str:
    """The execution family of a plan: its measured/simulated error is shared in a family
    (compiled plans apart: the simulator prices their fused ops with one factor,
    :mod:`autoplace.sim.compiled`, whose error is their own; offloaded plans too: their
    host-link copies and CPU update, :mod:`autoplace.sim.offload`)."""
    return _layout(plan) + ("+offload" if plan.parallel.offload else "") \
        + ("+compile" if plan.parallel.compile else "")


def _layout(plan: Plan) -> str:
    p = plan.parallel
    dp = f"dp-{p.shard}" + ("+modules" if p.shard_units == "modules" else "") \
        + ("+zero1" if p.shard_optimizer else "")
    if p.offload and p.data == 1:  # FSDP2 on one rank
        return dp
    if p.pipeline > 1:
        return "pipeline" if p.data == 1 else f"{dp}+pipeline"
    local = "placement" if plan.devices_per_replica > 1 else "single"
    if local == "placement" and p.microbatches > 1:
        local = "placement+mb"  # microbatches flowing through a one-process placement
    if p.data > 1:
        return dp + ("+placement" if plan.devices_per_replica > 1 else "")
    return local + ("+graphs" if p.graphs else "")


def signature(plan: Plan) -> tuple:
    """What makes two plans the same plan: each op's device, the split, the ops recomputed
    (whole and selectively), and, for compiled plans, the pieces (the groups)."""
    ops = sorted(plan.groups)
    return (tuple(plan.placement[plan.groups[op]] for op in ops), plan.parallel,
            tuple(op for op in ops if plan.groups[op] in plan.recompute),
            tuple(op for op in ops if plan.groups[op] in plan.selective),
            tuple(plan.groups[op] for op in ops) if plan.parallel.compile else ())
