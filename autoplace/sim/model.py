"""Cost and memory model shared by the simulator's scalar and vectorised paths.

Everything here is plain data derived from an :class:`OpGraph`, a :class:`Plan` and a
:class:`Cluster`; the event loops live in ``sim_local`` (one process, any DAG
placement), ``sim_pipeline`` (torch.distributed.pipelining stages) and ``sim_batch``
(the numpy path over many plans). Both the scalar and the batch path compute times
with the formulas below, so they agree to rounding.

Op time under a batch split. A profiled op time ``t`` (whole batch) is read as a
fixed part ``f`` plus a part ``t - f`` that scales with the batch, so an op run on
``1 / (m d)`` of the batch (``m`` microbatches, ``d`` replicas) takes
``(t - f) / (m d) + f``: equal to ``t`` when nothing is split, and every microbatch
pays the fixed part again. ``f`` is the op's measured fixed part where the profile
has one (``OpNode.fwd_fixed_s`` / ``bwd_fixed_s``, fitted by
:func:`autoplace.costs.profile.profile` from a second run at a smaller batch; taken as
``min(f, t)``), else the device's launch overhead ``o``: ``f = min(t, o)``. The
measured part matters for ops whose time hardly shrinks with the batch (a cuDNN
LSTM stepping through its timesteps, small matmuls on a GPU), where ``min(t, o)``
would have microbatches look almost free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.capture.op_rules import SAVES_INPUTS, SAVES_NOTHING, save_time
from autoplace.cluster import Cluster
from autoplace.costs import estimate_costs
from autoplace.costs.collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from autoplace.graph import OpGraph
from autoplace.lowering import ROOT_UNIT, SELECTIVE_SAVED_KINDS, fsdp_unit_keys, gather_dtype
from autoplace.plan import Plan
from autoplace.sim.memory import loss_backward_bytes, loss_keep_bytes
from autoplace.sim.optimizer_host import optimizer_host_table

#: bytes of memory traffic per parameter byte of a fused AdamW step (reads p, g, m, v;
#: writes p, m, v).
UPDATE_TRAFFIC_PER_PARAM_BYTE = 7.0
#: AdamW keeps two fp32 moments per parameter.
OPTIMIZER_STATE_PER_PARAM_BYTE = 2.0
#: DDP's default ``bucket_cap_mb=25``.
BUCKET_BYTES = 25 * 2**20


def ensure_costs(graph: OpGraph, cluster: Cluster) -> None:
    """Fill missing per-kind costs with :func:`autoplace.costs.estimate_costs`."""
    if any(not graph.has_costs(kind) for kind in cluster.device_kinds):
        estimate_costs(graph, cluster)


#: ops whose module packs its weights into one cuDNN buffer on CUDA (``RNNBase``)
PACKED_RNN_KINDS = frozenset({"LSTM", "GRU", "RNN"})


@dataclass
class GraphArrays:
    """Structure of a graph as index lists and arrays (cached on the graph)."""

    n: int
    names: list[str]
    preds: list[list[int]]
    succs: list[list[int]]
    succ_bytes: list[list[float]]  # bytes of each edge in ``succs``
    edge_src: np.ndarray  # int64 [E], sorted by (src, dst)
    edge_dst: np.ndarray
    edge_bytes: np.ndarray  # float64 [E]
    param_bytes: np.ndarray  # float64 [n]
    param_count: np.ndarray  # float64 [n]: parameter tensors the op owns
    act_bytes: np.ndarray
    out_bytes: np.ndarray
    saved: np.ndarray  # bool [n]: a selective recompute keeps this op's output (lowering)
    save_time: np.ndarray  # int [n]: what the op keeps for backward (op_rules.save_time)
    # saved tensors counted at another op (``OpNode.shared_saves``), one row per (op, tensor):
    share_op: np.ndarray  # int64 [S] the op that saves it too
    share_owner: np.ndarray  # int64 [S] the op whose activation bytes count it
    share_key: np.ndarray  # int64 [S] the tensor, 0..T-1
    key_bytes: np.ndarray  # float64 [T] its bytes
    loss_keep: np.ndarray  # float64 [n]: on the output op, what the loss keeps for backward
    # float64 [n]: each op's transient in backward: its output's gradient (``out_bytes``);
    # on the output op what the loss makes beyond what it keeps (memory.loss_backward_bytes)
    back_bytes: np.ndarray
    block_key: list[str]  # FSDP2 unit per op, shard_units="blocks" (lowering.fsdp_unit_keys)
    module_key: list[str]  # the same for shard_units="modules"
    gather_scale: float = 1.0  # FSDP2 gathers parameters at autocast's dtype: 0.5 of fp32
    cast_scale: float = 0.0  # autocast's weight copies: 0.5 of fp32 under bf16 / fp16
    # float64 [n] or None: bytes each op keeps per microbatch whatever its size (a compiled
    # piece's own low-precision weight copies, ``sim.compiled.compiled_arrays``); None: none
    call_keep: np.ndarray | None = None
    # float64 [n]: a recurrent module's weights at the gather dtype (``PACKED_RNN_KINDS``):
    # cuDNN's packed copy of them, held under FSDP2 (replica_memory.static_memory)
    packed_bytes: np.ndarray | None = None


def graph_arrays(graph: OpGraph) -> GraphArrays:
    """Index form of ``graph`` (computed once per graph: the structure never changes)."""
    cached = graph.__dict__.get("_sim_arrays")
    if cached is not None and cached.n == len(graph):
        return cached
    idx = graph.index
    n = len(graph)
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    succ_bytes: list[list[float]] = [[] for _ in range(n)]
    edges = graph.edges
    for u, v, b in edges:
        preds[idx[v]].append(idx[u])
        succs[idx[u]].append(idx[v])
        succ_bytes[idx[u]].append(float(b))
    ops = graph.ops
    share, keys = [], {}
    for i, op in enumerate(ops):
        for owner, b in op.shared_saves:
            if owner in idx:
                share.append((i, idx[owner], keys.setdefault((owner, b), len(keys))))
    rows = np.array(share, dtype=np.int64).reshape(-1, 3)
    arrays = GraphArrays(
        n=n,
        names=list(graph.order),
        preds=preds,
        succs=succs,
        succ_bytes=succ_bytes,
        edge_src=np.array([idx[u] for u, _, _ in edges], dtype=np.int64),
        edge_dst=np.array([idx[v] for _, v, _ in edges], dtype=np.int64),
        edge_bytes=np.array([b for _, _, b in edges], dtype=np.float64),
        param_bytes=np.array([op.param_bytes for op in ops], dtype=np.float64),
        param_count=np.array([len(op.param_names) for op in ops], dtype=np.float64),
        act_bytes=np.array([op.activation_bytes for op in ops], dtype=np.float64),
        out_bytes=np.array([op.transient_bytes for op in ops], dtype=np.float64),
        saved=np.array([op.kind in SELECTIVE_SAVED_KINDS for op in ops], dtype=bool),
        # what an op keeps, by its kind's rule; nothing where the capture found it keeps
        # nothing (a product by a number, a dropout with p = 0)
        save_time=np.array([save_time(op.kind) if op.activation_bytes or op.shared_saves
                            else SAVES_NOTHING for op in ops], dtype=np.int8),
        share_op=rows[:, 0], share_owner=rows[:, 1], share_key=rows[:, 2],
        key_bytes=np.array([b for _, b in keys], dtype=np.float64),
        loss_keep=np.array([loss_keep_bytes(graph, op) for op in ops], dtype=np.float64),
        back_bytes=np.array([loss_backward_bytes(graph, op) if op.kind == "output"
                             else op.transient_bytes for op in ops], dtype=np.float64),
        block_key=fsdp_unit_keys(graph, "blocks"),
        module_key=fsdp_unit_keys(graph, "modules"),
        # FSDP2 gathers at the autocast dtype; an exported graph's parameters as they are
        gather_scale=0.5 if gather_dtype(graph) in ("bfloat16", "float16") else 1.0,
        cast_scale=0.5 if getattr(graph, "autocast_dtype", None) in ("bfloat16", "float16")
        else 0.0,
    )
    arrays.packed_bytes = np.where([op.kind in PACKED_RNN_KINDS for op in ops],
                                   arrays.param_bytes * arrays.gather_scale, 0.0)
    graph.__dict__["_sim_arrays"] = arrays
    return arrays


@dataclass
class CostTables:
    """Per device kind op times, and per cluster device rates (rebuilt per call: cheap)."""

    kinds: list[str]
    fwd: np.ndarray  # [num_kinds, n] seconds for the whole batch
    bwd: np.ndarray
    fwd_fixed: np.ndarray  # [num_kinds, n] batch-independent part of fwd, NaN = unknown
    bwd_fixed: np.ndarray
    host_fwd: np.ndarray  # [num_kinds, n] host seconds to issue each op's forward, NaN = unknown
    host_bwd: np.ndarray  # [num_kinds, n] the same for its backward
    host_fwd_fixed: np.ndarray  # [num_kinds, n] their batch-independent parts, NaN = all
    host_bwd_fixed: np.ndarray
    kind_of_device: np.ndarray  # [N] index into kinds
    overhead: np.ndarray  # [N] launch overhead, seconds
    host: np.ndarray  # [N] host seconds to issue one op (``host_dispatch_s``)
    ddp_host: np.ndarray  # [N] backward host seconds per parameter tensor under DDP
    shard_host: np.ndarray  # [N] host seconds per parameter tensor per FSDP2 collective
    copy_host: np.ndarray  # [N] host seconds to issue a copy to another GPU (Tensor.to)
    mem_bandwidth: np.ndarray  # [N] bytes/s
    usable_memory: np.ndarray  # [N] bytes
    alpha: np.ndarray  # [N, N] link latency
    inv_bw: np.ndarray  # [N, N] seconds per byte (0 on the diagonal)
    #: [num_kinds] host seconds per parameter tensor of a graphed piece's replay
    #: (GRAPH_PARAM_HOST_S; 0 where a profiled graph of several blocks already holds it)
    graph_param_host: np.ndarray
    #: [num_kinds, 3] host seconds of the optimizer's step (fixed, per parameter tensor)
    #: and of zero_grad per tensor (sim/optimizer_host.py)
    opt_host: np.ndarray


def cost_tables(graph: OpGraph, cluster: Cluster) -> CostTables:
    """Op times per device kind and device/link rates of ``cluster``."""
    kinds = cluster.device_kinds
    bw = np.array(cluster.bandwidth, dtype=np.float64)
    with np.errstate(divide="ignore"):
        inv = np.where(np.isfinite(bw) & (bw > 0), 1.0 / bw, 0.0)
    np.fill_diagonal(inv, 0.0)
    alpha = np.array(cluster.alpha_s, dtype=np.float64)
    np.fill_diagonal(alpha, 0.0)
    return CostTables(
        kinds=kinds,
        fwd=np.stack([graph.fwd_times(k) for k in kinds]),
        bwd=np.stack([graph.bwd_times(k) for k in kinds]),
        fwd_fixed=np.stack([graph.fwd_fixed_times(k) for k in kinds]),
        bwd_fixed=np.stack([graph.bwd_fixed_times(k) for k in kinds]),
        host_fwd=np.stack([graph.fwd_host_times(k) for k in kinds]),
        host_bwd=np.stack([graph.bwd_host_times(k) for k in kinds]),
        host_fwd_fixed=np.stack([graph.host_fixed_times(k) for k in kinds]),
        host_bwd_fixed=np.stack([graph.host_fixed_times(k, backward=True) for k in kinds]),
        kind_of_device=np.array([kinds.index(d.kind) for d in cluster.devices], dtype=np.int64),
        overhead=np.array([d.launch_overhead_s for d in cluster.devices], dtype=np.float64),
        host=np.array([d.host_dispatch_s for d in cluster.devices], dtype=np.float64),
        ddp_host=np.array([d.ddp_param_host_s for d in cluster.devices], dtype=np.float64),
        shard_host=np.array([d.shard_param_host_s for d in cluster.devices], dtype=np.float64),
        copy_host=np.array([d.copy_host_s for d in cluster.devices], dtype=np.float64),
        mem_bandwidth=np.array([d.memory_bandwidth for d in cluster.devices], dtype=np.float64),
        usable_memory=np.array([d.usable_memory_bytes for d in cluster.devices], dtype=np.float64),
        alpha=alpha,
        inv_bw=inv,
        graph_param_host=np.full(len(kinds), GRAPH_PARAM_HOST_S),
        opt_host=optimizer_host_table(graph, kinds),
    )


def host_times(tables: CostTables, cdev: np.ndarray, ops: np.ndarray,
               share: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Host seconds to issue the forward and the backward of op ``ops[i]`` on cluster
    device ``cdev[i]`` (arrays of one shape) for ``share`` of the batch: the profiled
    per-op times where the graph has them for the device's kind (affine in the share
    above their fixed parts, like device times), else the device's ``host_dispatch_s``."""
    kind = tables.kind_of_device[cdev]
    base = tables.host[cdev]
    out = []
    for full, fixed in ((tables.host_fwd, tables.host_fwd_fixed),
                        (tables.host_bwd, tables.host_bwd_fixed)):
        h = scaled(full[kind, ops], fixed[kind, ops], np.inf, share)
        out.append(np.where(np.isnan(h), base, h))
    return out[0], out[1]


#: host seconds to replay one graphed piece (``parallel.graphs``): the autograd call and
#: its copies into the static inputs, plus this much per parameter tensor the piece takes
#: (fitted on 2x H200, docs/simulator.md: gpt-1b on one GPU as one piece, 290 parameter
#: tensors, issued its forward in 2.1 ms and its backward in 3.3 ms, against 13 and 24 ms
#: eagerly)
GRAPH_PIECE_HOST_S = 50e-6
GRAPH_PARAM_HOST_S = 9e-6


def graphed_host(dev: np.ndarray, param_count: np.ndarray,
                 per_param: np.ndarray | float = GRAPH_PARAM_HOST_S) -> np.ndarray:
    """Host seconds per op of a plan whose runs of ops on one device (consecutive in
    program order) each replay as one CUDA graph: a piece's whole cost on its first op,
    zero on the others. ``per_param``: seconds per parameter tensor, per op (its device
    kind's ``CostTables.graph_param_host``) or one for all."""
    dev = np.asarray(dev)
    start = np.r_[True, dev[1:] != dev[:-1]]
    piece = np.cumsum(start) - 1
    params = np.bincount(piece, weights=np.asarray(param_count, dtype=float)
                         * np.broadcast_to(per_param, dev.shape))
    return np.where(start, GRAPH_PIECE_HOST_S + params[piece], 0.0)


def graphed_grad_bytes(param_bytes: np.ndarray | float, m: int) -> np.ndarray | float:
    """Gradient memory a graphed plan holds beyond eager's one ``.grad`` per parameter:
    each microbatch's piece returns its parameters' gradients in static buffers of its
    own, and only the first microbatch's become the ``.grad`` (2x H200, docs/simulator.md:
    gpt-1b's halves, 1.9 GiB of parameters each, peaked 1.5-2.1, 5.0-5.3 and 12.6-12.7 GiB
    higher per GPU graphed with 2, 4 and 8 microbatches; this predicts 1.9, 5.7, 13.3)."""
    return (m - 1) * param_bytes


def fixed_part(t: np.ndarray, fixed: np.ndarray | None, overhead: np.ndarray | float
               ) -> np.ndarray:
    """The part of op time ``t`` no batch split removes: ``min(fixed, t)`` where the
    profiled ``fixed`` is known (not NaN), else ``min(t, overhead)``."""
    base = np.minimum(t, overhead)
    if fixed is None:
        return base
    known = ~np.isnan(fixed)
    if not known.any():
        return base
    return np.where(known, np.minimum(fixed, t), base)


def scaled(t: np.ndarray, fixed: np.ndarray | None, overhead: np.ndarray | float,
           share: np.ndarray | float) -> np.ndarray:
    """Time of an op run on ``share`` of the batch (see the module docstring); ``fixed``
    is the profiled fixed part per op (NaN or None: unknown)."""
    f = fixed_part(t, fixed, overhead)
    return (t - f) * share + f


def affine_collective(cluster: Cluster, kind: str, group: list[int]) -> tuple[float, float]:
    """``(c0, c1)`` with ``time(nbytes) = c0 + c1 * nbytes`` for ``nbytes > 0``.

    The collective costs (:mod:`autoplace.costs.collectives`) are affine in the size on
    one node, and piecewise affine across nodes (NCCL's pick of ring, tree or
    hierarchical); reading them as two coefficients through 1 MiB and 1 GiB lets the
    scalar and the vectorised path use one formula.
    """
    fn = {"allreduce": all_reduce_s, "allgather": all_gather_s,
          "reducescatter": reduce_scatter_s}[kind]
    if len(group) <= 1:
        return 0.0, 0.0
    a, b = float(2**20), float(2**30)
    ta, tb = fn(cluster, a, group), fn(cluster, b, group)
    c1 = (tb - ta) / (b - a)
    return ta - c1 * a, c1


def collective_time(c: tuple[float, float], nbytes: float) -> float:
    return c[0] + c[1] * nbytes if nbytes > 0 else 0.0


def replica_group(plan: Plan, local: int) -> list[int]:
    """Cluster devices holding local device ``local`` in every replica: the group its
    gradients are reduced over and, sharded, its parameters gathered from. Under HSDP
    (``parallel.replicate > 1``) replica 0's shard group only (replicas ``0 .. S-1``, ``S``
    = :func:`shard_degree`, as the executor's ``(dp_replicate, dp_shard)`` mesh lays them
    out); :func:`grad_reduction` adds the all-reduce across the groups."""
    k = plan.devices_per_replica
    return [r * k + local for r in range(shard_degree(plan))]


def shard_degree(plan: Plan) -> int:
    """Ranks a sharded plan's state is split over: ``data``, or ``data / replicate``
    under HSDP (each replica group holds a whole copy)."""
    return plan.parallel.data // plan.parallel.replicate


def broadcast_tensors(ga: GraphArrays) -> np.ndarray:
    """``[n]`` parameter tensors each op's ZeRO-1 rank updates and broadcasts: its named
    parameters, one where an op has parameter bytes but no names (a graph built by
    hand)."""
    return np.maximum(ga.param_count.astype(np.int64), ga.param_bytes > 0)


def optimizer_shares(ga: GraphArrays, plan: Plan) -> tuple[float, float]:
    """``(bytes share, tensor share)``: what the most loaded rank of a ZeRO-1 plan
    (``parallel.shard_optimizer``) keeps AdamW state for and updates, of the replica's
    parameters; ``(1, 1)`` otherwise. ``ZeroRedundancyOptimizer`` hands the parameter
    tensors out largest first, each to the rank with the fewest elements so far; an op's
    tensors are taken as equal shares of its parameter bytes."""
    d = plan.parallel.data  # >= 2 with shard_optimizer (ParallelConfig)
    total = float(ga.param_bytes.sum())
    if not plan.parallel.shard_optimizer or total <= 0:
        return 1.0, 1.0
    count = broadcast_tensors(ga)
    has = count > 0
    sizes = np.sort(np.repeat(ga.param_bytes[has] / count[has], count[has]))[::-1]
    load, tensors = np.zeros(d), np.zeros(d)
    for size in sizes:
        r = int(np.argmin(load))
        load[r] += size
        tensors[r] += 1
    return float(load.max()) / total, float(tensors.max()) / max(1, len(sizes))


def grad_reduction(cluster: Cluster, plan: Plan, local: int) -> tuple[float, float]:
    """:func:`affine_collective` of a sharded plan's gradient reduction on local device
    ``local``: a reduce-scatter over its shard group, and under HSDP an all-reduce of the
    ``1 / S`` shard across the replica groups (replicas ``0, S, 2S, ...``: across nodes
    where a group fills one), run one after the other."""
    rs = affine_collective(cluster, "reducescatter", replica_group(plan, local))
    par = plan.parallel
    if par.replicate <= 1:
        return rs
    s, k = shard_degree(plan), plan.devices_per_replica
    ar = affine_collective(cluster, "allreduce", [r * s * k + local for r in range(par.replicate)])
    return rs[0] + ar[0], rs[1] + ar[1] / s


def replicas_identical(cluster: Cluster, plan: Plan) -> bool:
    """True when every replica's devices and links equal replica 0's."""
    d = plan.parallel.data
    if d == 1:
        return True
    k = plan.devices_per_replica

    def sig(r: int) -> tuple:
        ids = [r * k + j for j in range(k)]
        devs = tuple(
            (x.kind, x.launch_overhead_s, x.host_dispatch_s, x.ddp_param_host_s,
             x.shard_param_host_s, x.memory_bandwidth)
            for x in (cluster.devices[i] for i in ids)
        )
        links = tuple(
            (cluster.alpha_s[i][j], cluster.bandwidth[i][j]) for i in ids for j in ids if i != j
        )
        return devs, links

    first = sig(0)
    return all(sig(r) == first for r in range(1, d))


def bucket_ids(param_bytes: np.ndarray) -> np.ndarray:
    """Bucket of each op given its parameter bytes, ops listed in bucket-filling order.

    An op goes into bucket ``floor(bytes before it / BUCKET_BYTES)``: buckets fill to
    about 25 MB in reverse topological order, like DDP's.
    """
    before = np.cumsum(param_bytes) - param_bytes
    return np.floor(before / BUCKET_BYTES).astype(np.int64)


@dataclass
class FsdpUnits:
    """FSDP2 units of one replica: on each device (rank or stage), the root module's unit
    first (gathered when forward starts and again when backward starts, held while either
    runs), then one per unit key in order of first use
    (:func:`autoplace.lowering.fsdp_unit_keys`)."""

    unit_of: list[int]  # per op, -1 for ops without parameter bytes
    unit_bytes: list[float]
    unit_dev: list[int]
    root: list[bool]  # per unit: the root's


def rooted_keys(ga: GraphArrays, plan: Plan, keys: list[str]) -> list[str]:
    """``keys`` (each op's FSDP2 unit) with the ops of the pieces the executor leaves to
    the root's unit in the root's (``executor.data.unit_members``): a checkpointed or
    compiled group holding a recurrent module, and a compiled group whose parameters
    belong to several units or partly to the root's (hooks inside a compiled graph break
    it). A piece is a group of a compiled plan, or a recomputed group."""
    par = plan.parallel
    pieces = set(plan.recompute) | set(plan.selective)
    if not pieces and not par.compile:
        return keys
    group = [plan.groups[name] for name in ga.names]
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        if ga.param_bytes[i] > 0 and (par.compile or g in pieces):
            by_group.setdefault(g, []).append(i)
    rnn = ga.packed_bytes if ga.packed_bytes is not None else np.zeros(ga.n)
    out = list(keys)
    for ops in by_group.values():
        found = {keys[i] for i in ops}
        if found == {ROOT_UNIT}:
            continue
        if any(rnn[i] > 0 for i in ops) or (par.compile and len(found) > 1):
            for i in ops:
                out[i] = ROOT_UNIT
    return out


def fsdp_units(ga: GraphArrays, dev: list[int], k: int, units: str = "blocks",
               plan: Plan | None = None) -> FsdpUnits:
    """The FSDP2 units of a replica whose op ``i`` runs on local device ``dev[i]``; with
    ``plan``, its pieces that stay in the root's unit there (:func:`rooted_keys`)."""
    keys = ga.module_key if units == "modules" else ga.block_key
    if plan is not None:
        keys = rooted_keys(ga, plan, keys)
    found: dict[tuple[int, str], int] = {}
    out = FsdpUnits(unit_of=[-1] * ga.n, unit_bytes=[], unit_dev=[], root=[])
    order = [i for i in range(ga.n) if ga.param_bytes[i] > 0]
    roots = [i for i in order if keys[i] == ROOT_UNIT]
    for i in roots + [i for i in order if keys[i] != ROOT_UNIT]:
        key = (dev[i], keys[i])
        u = found.get(key)
        if u is None:
            u = found[key] = len(out.unit_bytes)
            out.unit_bytes.append(0.0)
            out.unit_dev.append(dev[i])
            out.root.append(keys[i] == ROOT_UNIT)
        out.unit_of[i] = u
        out.unit_bytes[u] += float(ga.param_bytes[i])
    return out


def recomputed_ops(ga: GraphArrays, group: list[int], recompute: frozenset[int],
                   selective: frozenset[int]) -> np.ndarray:
    """bool ``[n]``: the ops whose saved tensors the forward drops and backward builds
    again (every op of a ``recompute`` group; the ops of a ``selective`` group whose
    outputs are not kept). Which of them run again: :func:`rerun_ops`."""
    gid = np.asarray(group)
    out = np.isin(gid, list(recompute)) if recompute else np.zeros(ga.n, bool)
    if selective:
        out |= np.isin(gid, list(selective)) & ~ga.saved
    return out


def rerun_ops(ga: GraphArrays, group: list[int], recompute: frozenset[int],
              selective: frozenset[int]) -> np.ndarray:
    """bool ``[n]``: the :func:`recomputed_ops` whose forward runs again in backward. A
    non-reentrant checkpoint's recompute stops once it has packed the region's last saved
    tensor, so it runs the group's ops up to its last op that keeps a tensor for backward,
    and that one only where it keeps one it computes (``op_rules.save_time``): a
    transformer block's last matmul, which keeps its input, and the residual add after it
    do not run again."""
    out = recomputed_ops(ga, group, recompute, selective)
    gid = np.asarray(group)
    regions = np.flatnonzero(np.isin(gid, list(recompute | selective)))
    if not len(regions):
        return out
    keepers = regions[ga.save_time[regions] > 0]
    last = np.full(int(gid[regions].max()) + 1, -1, dtype=np.int64)
    np.maximum.at(last, gid[keepers], keepers)
    stop = last[gid[regions]]
    ran = (regions < stop) | ((regions == stop) & (ga.save_time[regions] != SAVES_INPUTS))
    out[regions[~ran]] = False
    return out


def recompute_boundary_bytes(
    ga: GraphArrays, group: list[int], recompute: frozenset[int]
) -> dict[int, float]:
    """Bytes a recomputed group keeps: each outside tensor it reads, counted once.

    A producer feeding several ops of the group counts once, with the bytes of its
    first edge into the group.
    """
    out: dict[int, float] = {}
    if not recompute:
        return out
    seen: set[tuple[int, int]] = set()
    for u, v, b in zip(ga.edge_src.tolist(), ga.edge_dst.tolist(), ga.edge_bytes.tolist()):
        g = group[v]
        if g in recompute and group[u] != g and (u, g) not in seen:
            seen.add((u, g))
            out[g] = out.get(g, 0.0) + b
    return out


@dataclass
class MemoryModel:
    """Memory of one local device, bytes."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    transient: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def to_json(self) -> dict[str, int]:
        return {
            "params": int(self.params), "grads": int(self.grads),
            "optimizer": int(self.optimizer), "activations": int(self.activations),
            "transient": int(self.transient), "total": int(self.total),
        }


def state_memory(param_bytes: float, d: int, shard: str, max_unit: float = 0.0,
                 gather_scale: float = 1.0, root_bytes: float = 0.0) -> MemoryModel:
    """Parameters, gradients and AdamW state of ``param_bytes`` under a sharding mode.

    Sharded, the gathered parameters take ``gather_scale`` of their bytes (FSDP2 gathers
    at the autocast dtype). Under DDP the gradients are its buckets, made once: the
    executor keeps DDP from rebuilding them after the first step
    (``executor.data.wrap_data_parallel``), where the first ones would live on through the
    second step, a second copy of the gradients at its peak. A replica over several
    devices is not wrapped in DDP (``executor.data.allreduce_grads``)."""
    pb = float(param_bytes)
    if shard == "none" or d == 1:
        return MemoryModel(params=pb, grads=pb, optimizer=OPTIMIZER_STATE_PER_PARAM_BYTE * pb)
    # an unsharded gradient bucket exists until it is reduce-scattered
    grads = pb / d + min(float(BUCKET_BYTES), pb)
    opt = OPTIMIZER_STATE_PER_PARAM_BYTE * pb / d
    if shard == "zero2":  # the shard, and every unit gathered from forward to backward
        return MemoryModel(params=pb / d + gather_scale * pb, grads=grads, optimizer=opt)
    # fsdp: the root's unit, the current and the prefetched unit are gathered whole
    params = min(pb, pb / d + gather_scale * (root_bytes + 2.0 * max_unit))
    return MemoryModel(params=params, grads=grads, optimizer=opt)


def shared_save_bytes(ga: GraphArrays, cell: np.ndarray, kept: np.ndarray, size: int
                      ) -> np.ndarray:
    """``[size]`` bytes of saved tensors held on a device beside the op that counts them.

    A tensor several ops save is one allocation, counted in the activation bytes of the
    first (``OpNode.shared_saves``). Another op that saves it on another device keeps the
    copy it received: each device holding one counts it once. ``cell``: ``[n]`` or
    ``[P, n]`` device slot of every op (``p * k + device`` for plan ``p``); ``kept``:
    ops whose activations stay (not recomputed), same shape.
    """
    out = np.zeros(size)
    if not len(ga.share_op):
        return out
    cell, kept = np.atleast_2d(cell), np.atleast_2d(kept)
    mine, owner = cell[:, ga.share_op], cell[:, ga.share_owner]
    hold = kept[:, ga.share_op] & ((mine != owner) | ~kept[:, ga.share_owner])
    nk = len(ga.key_bytes)
    codes = np.unique(mine[hold] * nk + np.broadcast_to(ga.share_key, mine.shape)[hold])
    return out + np.bincount(codes // nk, weights=ga.key_bytes[codes % nk], minlength=size)


def update_time(param_bytes: float, mem_bandwidth: float, d: int, shard: str) -> float:
    """AdamW step time of ``param_bytes`` (split over ``d`` ranks when sharded)."""
    t = UPDATE_TRAFFIC_PER_PARAM_BYTE * float(param_bytes) / mem_bandwidth
    return t / d if shard != "none" else t


def lower_bound_from(graph: OpGraph, cluster: Cluster, tables: CostTables) -> float:
    """See :func:`autoplace.sim.lower_bound`."""
    ga = graph_arrays(graph)
    n_dev = cluster.num_devices
    t_min = (tables.fwd + tables.bwd).min(axis=0)
    total = float(t_min.sum())
    total += UPDATE_TRAFFIC_PER_PARAM_BYTE * float(ga.param_bytes.sum()) / float(
        tables.mem_bandwidth.max()
    )
    # the part of every op no batch split removes (see ``fixed_part``) on the best device
    fixed = np.full(ga.n, np.inf)
    for ki in range(len(tables.kinds)):
        oh = tables.overhead[tables.kind_of_device == ki].min()
        fixed = np.minimum(
            fixed, fixed_part(tables.fwd[ki], tables.fwd_fixed[ki], oh)
            + fixed_part(tables.bwd[ki], tables.bwd_fixed[ki], oh)
        )
    longest = np.zeros(ga.n)
    for i in range(ga.n):
        best = max((longest[u] for u in ga.preds[i]), default=0.0)
        longest[i] = best + fixed[i]
    crit = float(longest.max()) if ga.n else 0.0
    return max(total / n_dev, crit)


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of the simulated timeline.

    Attributes:
        resource: ``"dev0"`` (compute), ``"link0->1"`` (a copy), ``"coll"`` / ``"coll1"``
            (gradient collectives of local device 1), ``"gather1"`` (FSDP all-gathers).
        name: op name (``"op3#mb1"`` with microbatches), stage action (``"F2"``) or bucket.
        start_s: start time, seconds from the beginning of the step.
        end_s: end time, seconds.
        kind: ``fwd``, ``bwd``, ``comm``, ``allreduce``, ``allgather``, ``reducescatter``
            or ``update``.
    """

    resource: str
    name: str
    start_s: float
    end_s: float
    kind: str

    def to_json(self) -> list:
        return [self.resource, self.name, self.start_s, self.end_s, self.kind]


def coll_resource(j: int, k: int, prefix: str = "coll") -> str:
    """Timeline resource of local device ``j``'s collective stream."""
    return prefix if k == 1 else f"{prefix}{j}"
