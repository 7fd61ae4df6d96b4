"""The shard mode (and, where it pays, compilation) of a policy's plan, chosen after it.

The placement env's actions have no shard mode, and the shipped pre-trained GNN has no
compile lever either: a policy's data-parallel plan is therefore also simulated with ZeRO-1
(one device per replica), ZeRO-2 and FSDP (and compiled, when asked), and the fastest
variant that fits is kept. Both the pre-trained GNN's zero-shot and fine-tuned plans
(:mod:`autoplace.policies.pretrained`) and the demo's freshly trained policy go through
:func:`best_shard_variant`.
"""

from __future__ import annotations

import math
from dataclasses import replace

from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph
from autoplace.plan import SHARD_MODES, Plan
from autoplace.sim import simulate

__all__ = ["CHOSEN_AFTER", "best_shard_variant"]

#: what a variant's ``planner`` says of the shard mode or compilation chosen here
CHOSEN_AFTER = "chosen on the simulator after the policy"


def best_shard_variant(graph: OpGraph, plan: Plan, cluster: Cluster, *, compile: bool = False,
                       beat_s: float | None = None) -> tuple[Plan, float]:
    """``plan``, or the fastest of its variants with another shard mode (ZeRO-1, ZeRO-2, FSDP: only
    for a data-parallel plan without sharding) or, with ``compile``, compiled, that fits in
    memory and is simulated faster than ``beat_s``.

    Args:
        graph: the graph ``plan`` places.
        plan: a policy's plan.
        cluster: the cluster it runs on.
        compile: also try each variant compiled (a policy without the compile lever on a
            cluster where :func:`autoplace.envs.levers.compile_pays`).
        beat_s: the step time a variant must beat (default: ``plan``'s, simulated; ``inf``
            takes any variant that fits).

    Returns:
        ``(plan, beat_s)`` when no variant is faster, else the fastest variant (its
        ``planner`` says what was chosen after the policy: ``shard``, ``compile``) and its
        simulated step time.
    """
    if beat_s is None:
        beat_s = simulate(graph, plan, cluster).step_time_s
    par = plan.parallel
    # (shard, shard_optimizer): DDP, ZeRO-1, ZeRO-2, FSDP
    shards = [(s, False) for s in SHARD_MODES] + [("none", True)] \
        if par.data > 1 and par.shard == "none" else [(par.shard, par.shard_optimizer)]
    compiles = (par.compile, True) if compile else (par.compile,)
    best, best_s = plan, beat_s
    for shard, zero1 in shards:
        for compiled in dict.fromkeys(compiles):
            if (shard, zero1, compiled) == (par.shard, par.shard_optimizer, par.compile):
                continue
            try:
                variant = plan.with_parallel(shard=shard, shard_optimizer=zero1,
                                             compile=compiled)
                res = simulate(graph, variant, cluster)
            except AutoplaceError:  # a split this shard mode does not combine with
                continue
            if not res.oom and math.isfinite(res.step_time_s) and res.step_time_s < best_s:
                best, best_s = variant, float(res.step_time_s)
    if best is plan:
        return plan, beat_s
    chosen = {k: CHOSEN_AFTER for k, changed in (
        ("shard", (best.parallel.shard, best.parallel.shard_optimizer)
         != (par.shard, par.shard_optimizer)),
        ("compile", best.parallel.compile != plan.parallel.compile)) if changed}
    return replace(best, planner={**best.planner, **chosen}), best_s
