"""The CUDA caching allocator under a memory cap: the memory a sharded plan reserves, and
what its retries cost when that does not fit.

The allocator keeps a pool per CUDA stream, and a block freed in one stream's pool is
not reused by another's; with expandable segments (the executor's setting under a cap) a
pool's pages are unmapped only when an allocation fails and the allocator retries,
freeing every cached block. FSDP2 allocates on two streams of its own: its all-gathers'
outputs with their copy-in inputs, ``(1 + 1/d)`` of a unit's gathered parameters, the
largest unit deciding that pool; and its reduce-scatters, whose outputs are the sharded
gradients (fp32, ``1/d`` of the parameters). Reserved memory is about the compute
stream's peak plus those two pools. Where that exceeds the cap, the step makes
:data:`RETRIES_PER_STEP` retries, each unmapping and mapping again about the usable
memory (:data:`RETRY_S_PER_BYTE`).

Measured on 2x H200 with the allocator's record (``run --memory``; the runs are cited in
docs/simulator.md): gpt-1b at 16 GiB, FSDP2 13.07 GiB
allocated, pools 13.49 + 1.90 + 0.59 = 15.97 GiB reserved, no retry; ZeRO-2 14.47 allocated,
14.54 + 1.90 + 0.59 = 17.0, two retries a step; GNMT-4 at 4.37 GiB, FSDP2 by blocks
3.70 + 0.39 + 0.33 = 4.42 (retries), by modules 3.56 + 0.33 + 0.18 = 4.07 (none).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplace.cluster import Cluster
from autoplace.plan import Plan
from autoplace.sim.model import GraphArrays, fsdp_units, shard_degree

__all__ = ["RETRIES_PER_STEP", "RETRY_S_PER_BYTE", "allocator_retry_s", "retry_charge_s",
           "side_pool_bytes"]

#: allocator retries a step of a sharded plan makes when its reserved memory exceeds the
#: cap: two on every rank, gpt-1b's ZeRO-2 (16 GiB) and GNMT-4's ZeRO-2 and FSDP2 by blocks
#: (4.37 GiB) alike (1.4-2 in GNMT-4's FSDP2 runs)
RETRIES_PER_STEP = 2
#: seconds one retry costs per byte of usable memory: the median over gpt-1b's runs at
#: 16 GiB (ZeRO-2 eager and compiled, FSDP2 + per-block checkpointing as one unit; 3.1-4.9
#: ms per GiB: measured minus simulated step over the retries). Held out, GNMT-4's ZeRO-2
#: and FSDP2 at 4.37 GiB measure 4.6-7.9 ms per GiB; their steps come out 3-9% low
RETRY_S_PER_BYTE = 3.76e-3 / 2**30


def side_pool_bytes(ga: GraphArrays, plan: Plan) -> float:
    """Bytes FSDP2's all-gather and reduce-scatter streams hold in pools of their own on
    each rank of a sharded one-device replica (0 for other plans: DDP, placements,
    pipelines, tensor parallel, offloaded shards)."""
    par = plan.parallel
    if (par.shard == "none" or par.data <= 1 or par.offload or par.pipeline > 1
            or par.tensor > 1 or plan.num_devices != par.data):
        return 0.0
    d = shard_degree(plan)
    units = fsdp_units(ga, [0] * ga.n, 1, par.shard_units, plan)
    gather = (1.0 + 1.0 / d) * max(units.unit_bytes, default=0.0) * ga.gather_scale
    return gather + float(ga.param_bytes.sum()) / d


def retry_charge_s(peak: float, usable: float, pools: float) -> float:
    """Seconds a step on one GPU loses to allocator retries: where its peak fits its
    usable memory but the peak plus the side pools does not, :data:`RETRIES_PER_STEP`
    retries of :data:`RETRY_S_PER_BYTE` per usable byte; else 0."""
    return RETRIES_PER_STEP * RETRY_S_PER_BYTE * usable if peak <= usable < peak + pools \
        else 0.0


def allocator_retry_s(ga: GraphArrays, plan: Plan, cluster: Cluster,
                      peak: Sequence[float]) -> float:
    """Seconds a step loses to allocator retries: the most :func:`retry_charge_s` of the
    plan's GPUs, with the side pools of :func:`side_pool_bytes`."""
    pools = side_pool_bytes(ga, plan)
    if pools <= 0:
        return 0.0
    return max((retry_charge_s(peak[j], float(d.usable_memory_bytes), pools)
                for j, d in enumerate(cluster.devices[:plan.num_devices]) if d.kind != "cpu"),
               default=0.0)
