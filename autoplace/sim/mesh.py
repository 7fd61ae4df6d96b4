"""Closed-form step time and memory of a device-mesh plan (dp x fsdp/hsdp x tp x pp) per block.

For Llama-scale models on many nodes the op-level simulator (:func:`autoplace.sim.simulate`)
would schedule every op of every microbatch on every device; this model instead sums the
graph's op costs per *block* (:func:`autoplace.lowering.block_regions`: a transformer layer;
the ops before the first block and after the last are two more units) and combines them in
closed form. It reads the same data and constants as the op-level simulator:

* compute: the graph's op times on the cluster's device kind (estimated from FLOPs and bytes
  with the device's ``peak_flops`` / ``memory_bandwidth`` by ``ensure_costs``, or profiled),
  split into the part that scales with the batch and the fixed part per op
  (``sim.model.scaled``), divided by the tensor-parallel degree ``t`` (Megatron column /
  row splits); with ``sequence_parallel`` every op works on ``1/t``, without it the ops
  of the residual stream (the block ops outside the Linear pairs' units of
  :func:`autoplace.tensor_shards.find_tensor_shards`: norms, residual adds) run whole on
  every rank and keep their activations whole;
* tensor parallel: per block and microbatch two all-gathers and two reduce-scatters of the
  block's input at the autocast dtype forward with ``sequence_parallel`` (two all-reduces
  without it), as many backward, and again for a fully recomputed block; summed with
  compute, or hidden behind it with ``async_tp``;
* FSDP / HSDP (``shard``): per unit (block) an all-gather of its bf16 parameters before
  forward and before backward and a reduce-scatter of its gradients after backward
  (HSDP: and an all-reduce across replica groups), each overlapping the previous unit's
  compute (``max`` per unit); with a pipeline, parameters are gathered once per step and
  kept (torchtitan's ``reshard_after_forward=False`` under pipelining), and gradients are
  reduced once after the last microbatch (held unsharded until then, at the gather dtype);
* DDP (``none``): the gradients all-reduced while backward runs, the last bucket exposed;
* pipeline: stages of contiguous blocks, ``sum_s (F_s + B_s) + (m - 1) max_s (F_s + B_s)``
  plus the boundary sends (GPipe and 1F1B have the same bubble; they differ in memory);
* the AdamW update (``sim.model.update_time``) and FSDP2's host work per parameter tensor
  and collective (``Device.shard_param_host_s``), as the op-level simulator charges them;
* memory per GPU, the largest stage: parameters, gradients and optimizer state
  (``sim.model.state_memory``), activations kept per block for its checkpoint mode
  (``none``, ``selective``: what the op-level simulator keeps for a selective group,
  ``full``: the block's inputs) times the microbatches a stage holds
  (``sim.pipeline.inflight_microbatches``), the largest transient, divided by ``t``.

Collectives are priced by ``sim.model.affine_collective`` (:mod:`autoplace.costs.collectives`:
ring, tree or hierarchical as NCCL picks) over the exact ranks of each group in the plan's
device numbering, pipeline sends by ``send_recv_s`` between neighbouring stages (``Plan.replica_devices``), so a group within a node
and one across nodes cost what the cluster says. :class:`MeshFit` holds the constants a
benchmark may fit (an efficiency on compute, a memory overhead); its defaults are neutral;
:data:`FITTED` holds those fitted for a device kind, the default there (:func:`default_fit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoplace.capture.op_rules import ATTENTION_KINDS, MATMUL_KINDS
from autoplace.cluster import Cluster
from autoplace.costs.collectives import send_recv_s
from autoplace.errors import AutoplaceError, PlanError
from autoplace.graph import OpGraph
from autoplace.lowering import block_groups, block_regions
from autoplace.plan import Plan
from autoplace.sim.model import (
    BUCKET_BYTES,
    affine_collective,
    collective_time,
    ensure_costs,
    fixed_part,
    graph_arrays,
    recompute_boundary_bytes,
    recomputed_ops,
    rerun_ops,
    state_memory,
    update_time,
)
from autoplace.sim.pipeline import inflight_microbatches
from autoplace.tensor_shards import find_tensor_shards

__all__ = ["AC_MODES", "FITTED", "BlockTable", "MeshConfig", "MeshFit", "MeshResult",
           "block_table", "default_fit", "estimate", "estimate_config", "mesh_config"]

#: activation checkpointing per block: keep everything, keep matmul / attention outputs
#: (recompute the rest), keep only the block's inputs (recompute all of it)
AC_MODES = ("none", "selective", "full")
_LINEAR = frozenset({"Linear", "linear"})


@dataclass(frozen=True, kw_only=True)
class MeshFit:
    """Constants fitted to measurements (neutral by default: the graph's costs as they are)."""

    compute_scale: float = 1.0
    """Multiplies every op time (1 / an MFU-like efficiency of the estimated op costs)."""
    compile_elementwise: float = 1.0
    """Factor on the time of ops other than matmuls and attention under ``torch.compile``."""
    compile_activation: float = 1.0
    """Factor on the activations those ops keep, and on a recomputed block's working set,
    under ``torch.compile`` (fused kernels do not materialise the intermediates)."""
    float8_speedup: float = 1.0
    """A block's Linear ops run this many times faster with float8 matmuls."""
    activation_scale: float = 1.0
    """Factor on the activations kept for backward (what a checkpoint policy keeps beyond
    or short of the op rules' count)."""
    memory_overhead_bytes: float = 0.0
    """Added to every GPU's peak (allocator reserve, CUDA context, NCCL buffers)."""


#: fitted by scripts/bench/bench_published.py on torchtitan's four single-host Llama 3.1 rows
#: (t1-fsdp, t1-compile, t1-float8, t2-cp1; docs/simulator.md, the mesh model), on the op
#: estimates of the GPUs' autocast dtypes: held-out median error on 16-64 hosts 2.9%
#: tokens/s and 9.9% peak memory, so they are the default on the device kind they describe
FITTED = {"h100-96": MeshFit(compute_scale=1.088, compile_elementwise=0.387,
                             compile_activation=0.446, float8_speedup=1.587,
                             activation_scale=0.399, memory_overhead_bytes=16 * 2**30)}


def default_fit(cluster: Cluster) -> MeshFit:
    """The constants fitted for ``cluster``'s device kind (:data:`FITTED`), else neutral."""
    return FITTED.get(cluster.devices[0].kind, MeshFit())


@dataclass
class BlockTable:
    """Per-unit sums of one graph on one device kind; unit 0 is what runs before the first
    block, the last unit what runs after the last block (output head and loss)."""

    names: list[str]
    var: dict[str, np.ndarray]  # "fwd"/"bwd" x "lin"/"mm"/"other": batch-scaled seconds
    fixed_fwd: np.ndarray  # seconds per microbatch that no split removes, forward
    fixed_bwd: np.ndarray  # the same, backward
    recompute_var: dict[str, np.ndarray]  # "<AC mode>_<lin|mm|other>" -> fwd seconds again
    recompute_fixed: dict[str, np.ndarray]  # AC mode -> their fixed seconds
    kept: dict[str, np.ndarray]  # AC mode -> activation bytes kept (whole graph batch)
    kept_other: np.ndarray  # bytes kept by non-matmul ops, mode none (compile fuses them)
    full_act: np.ndarray  # all activation bytes of the unit (held while recomputed)
    transient: np.ndarray  # largest transient of one op (graph batch)
    input_bytes: np.ndarray  # bytes of the tensors entering the unit (graph batch)
    param_bytes: np.ndarray
    param_count: np.ndarray
    batch_size: int
    tokens_per_sample: int
    gather_scale: float
    stream_var: dict[str, np.ndarray] = field(default_factory=dict)
    """Residual-stream ops (whole without sequence parallelism): ``fwd`` / ``bwd``
    batch-scaled seconds, ``<AC mode>`` their forward again, ``kept_<AC mode>`` the
    activation bytes they keep."""

    @property
    def num_blocks(self) -> int:
        return len(self.names) - 2


def block_table(graph: OpGraph, cluster: Cluster) -> BlockTable:
    """The per-block sums of ``graph`` on ``cluster``'s first device kind (cached)."""
    kind = cluster.devices[0].kind
    key = ("_mesh_table", kind, cluster.devices[0].launch_overhead_s)
    cached = graph.__dict__.get(key)
    if cached is not None:
        return cached
    ensure_costs(graph, cluster)
    ga = graph_arrays(graph)
    regions = block_regions(graph)
    names = [r for r in dict.fromkeys(regions) if r]
    if not names:
        raise AutoplaceError(f"graph {graph.name!r} has no blocks (module paths with an index, "
                             "like layers.0): the mesh model plans repeated blocks")
    u = len(names) + 2
    # an op outside every block belongs to the next block (a buffer fetched for it), to
    # unit 0 before the first block and to the last unit after the last one
    unit = np.empty(len(regions), dtype=np.int64)
    nxt = u - 1
    for i in range(len(regions) - 1, -1, -1):
        if regions[i]:
            nxt = names.index(regions[i]) + 1
        unit[i] = nxt
    unit[:regions.index(names[0])] = 0
    ops = graph.ops
    stream = _stream_mask(graph, regions)
    overhead = cluster.devices[0].launch_overhead_s
    fwd, bwd = graph.fwd_times(kind), graph.bwd_times(kind)
    f_fix = fixed_part(fwd, graph.fwd_fixed_times(kind), overhead)
    b_fix = fixed_part(bwd, graph.bwd_fixed_times(kind), overhead)
    lin = np.array([op.kind in _LINEAR for op in ops])
    mm = np.array([op.kind in MATMUL_KINDS or op.kind in ATTENTION_KINDS for op in ops]) & ~lin

    def per_unit(x: np.ndarray) -> np.ndarray:
        return np.bincount(unit, weights=np.asarray(x, dtype=float), minlength=u)

    var = {}
    for name, t, fx in (("fwd", fwd, f_fix), ("bwd", bwd, b_fix)):
        for cat, mask in (("lin", lin), ("mm", mm), ("other", ~(lin | mm))):
            var[f"{name}_{cat}"] = per_unit((t - fx) * mask)
    groups = block_groups(graph)
    group = [groups[n] for n in graph.order]
    in_block = {groups[n] for n, r in zip(graph.order, regions) if r}
    blocks = frozenset(in_block)
    kept, recompute_var, recompute_fixed = {}, {}, {}
    stream_var = {"fwd": per_unit((fwd - f_fix) * stream), "bwd": per_unit((bwd - b_fix) * stream)}
    for mode in AC_MODES:
        rc = frozenset() if mode != "full" else blocks
        sel = frozenset() if mode != "selective" else blocks
        again = recomputed_ops(ga, group, rc, sel)  # what the forward does not keep
        ran = rerun_ops(ga, group, rc, sel)  # what runs again
        bounds = recompute_boundary_bytes(ga, group, rc | sel)
        gunit = {group[i]: unit[i] for i in range(ga.n)}
        k = per_unit(ga.act_bytes * ~again)
        for g, b in bounds.items():
            k[gunit[g]] += b
        kept[mode] = k
        for cat, mask in (("lin", lin), ("mm", mm), ("other", ~(lin | mm))):
            recompute_var[f"{mode}_{cat}"] = per_unit((fwd - f_fix) * ran * mask)
        recompute_fixed[mode] = per_unit(f_fix * ran)
        stream_var[mode] = per_unit((fwd - f_fix) * ran * stream)
        stream_var[f"kept_{mode}"] = per_unit(ga.act_bytes * ~again * stream)
    inputs = np.zeros(u)
    free = np.array([op.kind in ("param", "input") for op in ops])
    seen: set[tuple[int, int]] = set()  # a tensor read by several ops of a unit enters once
    for s, d, b in zip(ga.edge_src.tolist(), ga.edge_dst.tolist(), ga.edge_bytes.tolist()):
        if unit[s] != unit[d] and not free[s] and (s, unit[d]) not in seen:
            seen.add((s, int(unit[d])))
            inputs[unit[d]] += b
    trans = np.zeros(u)
    np.maximum.at(trans, unit, ga.out_bytes)
    inp = next((op for op in ops if op.kind == "input"), None)
    bs = int(getattr(graph, "batch_size", 0) or (inp.output_shapes[0][0] if inp else 1))
    tokens = int(np.prod(inp.output_shapes[0])) // bs if inp and inp.output_shapes else 1
    table = BlockTable(
        names=["<before>", *names, "<after>"], var=var, fixed_fwd=per_unit(f_fix),
        fixed_bwd=per_unit(b_fix), recompute_var=recompute_var, recompute_fixed=recompute_fixed, kept=kept, kept_other=per_unit(ga.act_bytes * ~(lin | mm)),
        full_act=per_unit(ga.act_bytes), transient=trans, input_bytes=inputs,
        param_bytes=per_unit(ga.param_bytes), param_count=per_unit(ga.param_count),
        batch_size=bs, tokens_per_sample=tokens, gather_scale=ga.gather_scale,
        stream_var=stream_var)
    graph.__dict__[key] = table
    return table


def _stream_mask(graph: OpGraph, regions: list[str]) -> np.ndarray:
    """The block ops tensor parallelism leaves whole: those outside every Linear pair's
    unit (:func:`autoplace.tensor_shards.find_tensor_shards`); without a unit to find (no
    fx program, no pair), the block ops that are neither Linears nor matmuls."""
    try:
        split = find_tensor_shards(graph, 1).split_ops
    except PlanError:
        return np.array([bool(r) and op.kind not in _LINEAR and op.kind not in MATMUL_KINDS
                         and op.kind not in ATTENTION_KINDS
                         for op, r in zip(graph.ops, regions)])
    return np.array([bool(r) and op.name not in split and op.kind not in ("param", "input")
                     for op, r in zip(graph.ops, regions)])


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """One point of the mesh search: the plan's split in the form the model reads."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    shard: str = "fsdp"
    replicate: int = 1
    stage_of_block: tuple[int, ...] = ()  # pipeline stage per block (empty: all stage 0)
    ac_of_block: tuple[str, ...] = ()  # AC mode per block (empty: all "none")
    compile: bool = False
    batch_size: int = 0  # global batch in samples (0: the graph's)
    sequence_parallel: bool = False  # with tensor > 1: the residual stream on 1/t


@dataclass
class MeshResult:
    """Predicted step of one mesh configuration."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    peak_memory_bytes: float
    oom: bool
    num_gpus: int
    breakdown_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: dict[str, float] = field(default_factory=dict)
    stage_peak_bytes: list[float] = field(default_factory=list)  # per pipeline stage


def _groups(cfg: MeshConfig) -> dict[str, list[int]]:
    """Ranks of stage 0's collectives in the plan's numbering ((r * pp + s) * tp + j)."""
    k, t, d = cfg.pipeline, cfg.tensor, cfg.data
    shard = d // cfg.replicate if cfg.shard != "none" else d
    return {"tp": list(range(t)), "dp": [r * k * t for r in range(d)],
            "shard": [r * k * t for r in range(shard)],
            "replicate": [r * shard * k * t for r in range(cfg.replicate)],
            "p2p": [0, t] if k > 1 else [0]}


def estimate_config(table: BlockTable, cfg: MeshConfig, cluster: Cluster, *,
                    fit: MeshFit | None = None, float8: bool = False,
                    async_tp: bool = False) -> MeshResult:
    """Step time and peak memory per GPU of ``cfg`` (see the module docstring).

    ``float8`` and ``async_tp`` are techniques outside the plan space (the executor does
    not run them); a benchmark against published runs uses them with a fitted ``fit``.
    """
    fit = fit or default_fit(cluster)
    nb, t, p, m = table.num_blocks, cfg.tensor, cfg.pipeline, cfg.microbatches
    n_gpu = cfg.data * t * p
    if n_gpu > cluster.num_devices:
        raise AutoplaceError(f"mesh dp={cfg.data} x tp={t} x pp={p} needs {n_gpu} devices, "
                             f"cluster {cluster.name!r} has {cluster.num_devices}")
    batch = cfg.batch_size or table.batch_size
    if batch % (cfg.data * m):
        raise AutoplaceError(f"a global batch of {batch} does not split into {cfg.data} "
                             f"replicas x {m} microbatches")
    mb = batch // (cfg.data * m)  # samples per microbatch
    share = mb / table.batch_size
    stage = np.r_[0, np.asarray(cfg.stage_of_block or [0] * nb), p - 1]
    modes = ["none", *(cfg.ac_of_block or ["none"] * nb), "none"]
    dev = cluster.devices[0]
    # compute per unit and microbatch, on 1/t of the work
    el = fit.compile_elementwise if cfg.compile else 1.0
    lin = 1.0 / fit.float8_speedup if float8 else 1.0
    is_block = np.r_[False, np.ones(nb, bool), False]
    lin_f = np.where(is_block, lin, 1.0)
    v = table.var
    fwd = (v["fwd_lin"] * lin_f + v["fwd_mm"] + v["fwd_other"] * el)
    bwd = (v["bwd_lin"] * lin_f + v["bwd_mm"] + v["bwd_other"] * el)
    rv = table.recompute_var
    again = np.array([rv[f"{a}_lin"][i] * lin_f[i] + rv[f"{a}_mm"][i] + rv[f"{a}_other"][i] * el
                      for i, a in enumerate(modes)])
    again_fixed = np.array([table.recompute_fixed[a][i] for i, a in enumerate(modes)])
    scale = fit.compute_scale * share / t
    f_u = fwd * scale + table.fixed_fwd * fit.compute_scale
    b_u = (bwd + again) * scale + (table.fixed_bwd + again_fixed) * fit.compute_scale
    whole = t > 1 and not cfg.sequence_parallel  # the stream runs whole on every rank
    sv = table.stream_var
    if whole:
        extra = fit.compute_scale * share * (1.0 - 1.0 / t) * el
        f_u = f_u + sv["fwd"] * extra
        b_u = b_u + (sv["bwd"] + np.array([sv[a][i] for i, a in enumerate(modes)])) * extra
    # tensor-parallel collectives: 2 all-gathers + 2 reduce-scatters of the block input
    g = _groups(cfg)
    coll = {name: {kind: affine_collective(cluster, kind, ranks)
                   for kind in ("allgather", "reducescatter", "allreduce")}
            for name, ranks in g.items() if name != "p2p"}
    act_b = table.input_bytes * share * table.gather_scale
    if whole:
        tp_one = np.array([2 * collective_time(coll["tp"]["allreduce"], x) for x in act_b])
    else:
        tp_one = np.array([2 * (collective_time(coll["tp"]["allgather"], x)
                                + collective_time(coll["tp"]["reducescatter"], x))
                           for x in act_b])
    tp_f = tp_one * is_block
    tp_b = tp_one * is_block * np.array([2.0 if a == "full" else 1.0 for a in modes])
    if async_tp:
        f_u, b_u = np.maximum(f_u, tp_f), np.maximum(b_u, tp_b)
    else:
        f_u, b_u = f_u + tp_f, b_u + tp_b
    # parameter collectives per unit (on the 1/t shard of every parameter)
    pb = table.param_bytes / t
    host = table.param_count * dev.shard_param_host_s
    sharded = cfg.shard != "none" and cfg.data > 1
    if sharded:
        ag = np.array([collective_time(coll["shard"]["allgather"], x * table.gather_scale)
                       for x in pb]) + host
        rs = np.array([collective_time(coll["shard"]["reducescatter"], x) for x in pb]) + host
        if cfg.replicate > 1:
            rs += np.array([collective_time(coll["replicate"]["allreduce"], x / len(g["shard"]))
                            for x in pb])
    else:
        ag = rs = np.zeros_like(pb)
    f_s = np.bincount(stage, weights=f_u, minlength=p)
    b_s = np.bincount(stage, weights=b_u, minlength=p)
    exposed = 0.0
    if sharded and p == 1 and cfg.shard == "fsdp":  # gathered per microbatch, unit by unit
        over_f = ag[0] + np.maximum(f_u, np.r_[ag[1:], 0.0]).sum() - f_u.sum()
        over_b = rs[0] + np.maximum(b_u, ag + rs).sum() - b_u.sum()
        exposed = m * (over_f + over_b)
    elif sharded:  # gathered once a step and kept; gradients reduced once after the last
        ex = []
        for s in range(p):
            on = stage == s
            ex.append(ag[on][:1].sum() + max(0.0, ag[on].sum() - f_s[s])
                      + rs[on][-1:].sum() + max(0.0, rs[on].sum() - b_s[s]))
        exposed = max(ex)
    elif cfg.data > 1:  # DDP: all-reduce in buckets while backward runs
        ar = [collective_time(coll["dp"]["allreduce"], x) for x in
              np.bincount(stage, weights=pb, minlength=p)]
        last = collective_time(coll["dp"]["allreduce"], min(BUCKET_BYTES, float(pb.sum())))
        exposed = max(last + max(0.0, a - b_s[s] * m) for s, a in enumerate(ar))
    send = 0.0
    if p > 1:
        bound = float(np.max(act_b[1:-1])) / t  # activations forward, gradients back
        send = 2 * send_recv_s(cluster, bound, *g["p2p"])
    per = f_s + b_s + send
    compute = float(per.sum() + (m - 1) * per.max()) if p > 1 else float(m * per[0])
    stage_params = np.bincount(stage, weights=pb, minlength=p)
    upd = max(update_time(x, dev.memory_bandwidth, cfg.data if sharded else 1,
                          cfg.shard if sharded else "none") for x in stage_params)
    step = compute + exposed + upd
    # memory of each stage's GPU
    held = inflight_microbatches("gpipe" if p == 1 else cfg.schedule, p, m)
    if p == 1:
        held = [1]
    mem_other = fit.compile_activation if cfg.compile else 1.0
    kept = np.array([table.kept[a][i] for i, a in enumerate(modes)])
    kept = kept - table.kept_other * (1.0 - mem_other) * np.array([a == "none" for a in modes])
    if whole:
        kept = kept + (t - 1) * np.array([sv[f"kept_{a}"][i] * (mem_other if a == "none"
                                                                 else 1.0)
                                          for i, a in enumerate(modes)])
    ratio = share / t
    peak, worst, peaks = 0.0, {}, []
    shard_d = len(g["shard"]) if sharded else 1
    for s in range(p):
        on = stage == s
        idx = np.flatnonzero(on)
        units = pb[idx[(idx > 0) & (idx < nb + 1)]]
        root = float(pb[on].sum() - units.sum())
        mode = cfg.shard if sharded else "none"
        if mode == "fsdp" and p > 1:
            mode = "zero2"  # kept gathered between forward and backward
        st = state_memory(float(pb[on].sum()), shard_d, mode,
                          float(units.max()) if units.size else 0.0, table.gather_scale,
                          root_bytes=root)
        if sharded and p > 1 and m > 1:  # gradients accumulate unsharded until the last
            st.grads += table.gather_scale * float(pb[on].sum())  # microbatch's backward
        act = float(kept[on].sum()) * ratio * held[s] * fit.activation_scale
        rc = mem_other * max((table.full_act[i] for i in np.flatnonzero(on)
                              if modes[i] != "none"), default=0.0)
        trans = (float(table.transient[on].max()) + rc) * ratio
        total = st.total + act + trans + fit.memory_overhead_bytes
        peaks.append(total)
        if total > peak:
            peak = total
            worst = {"stage": s, "params": st.params, "grads": st.grads,
                     "optimizer": st.optimizer, "activations": act, "transient": trans,
                     "overhead": fit.memory_overhead_bytes}
    tokens = batch * table.tokens_per_sample
    return MeshResult(
        step_time_s=step, tokens_per_s_per_gpu=tokens / step / n_gpu, peak_memory_bytes=peak,
        oom=peak > dev.usable_memory_bytes, num_gpus=n_gpu,
        breakdown_s={"pipeline_compute": compute, "tp_per_microbatch": float(tp_f.sum()
                     + tp_b.sum()), "param_collectives_exposed": exposed, "update": upd,
                     "bubble": float((p - 1) * per.max()) if p > 1 else 0.0},
        memory_bytes=worst, stage_peak_bytes=peaks)


def mesh_config(graph: OpGraph, plan: Plan, *, batch_size: int = 0) -> MeshConfig:
    """The :class:`MeshConfig` a plan describes: each block's stage is the local device of
    its first op, its checkpoint mode ``full`` when that op's group is in ``recompute``,
    ``selective`` when in ``selective``."""
    regions = block_regions(graph)
    firsts: dict[str, str] = {}
    for name, r in zip(graph.order, regions):
        if r and r not in firsts and graph[name].kind not in ("input", "param"):
            firsts[r] = name
    stages, modes = [], []
    for name in firsts.values():
        gid = plan.groups[name]
        stages.append(plan.placement[gid] if plan.parallel.pipeline > 1 else 0)
        modes.append("full" if gid in plan.recompute else
                     "selective" if gid in plan.selective else "none")
    par = plan.parallel
    return MeshConfig(data=par.data, tensor=par.tensor, pipeline=par.pipeline,
                      microbatches=par.microbatches, schedule=par.schedule, shard=par.shard,
                      replicate=par.replicate, stage_of_block=tuple(stages),
                      ac_of_block=tuple(modes), compile=par.compile, batch_size=batch_size,
                      sequence_parallel=par.sequence_parallel)


def estimate(graph: OpGraph, plan: Plan, cluster: Cluster, *, batch_size: int = 0,
             fit: MeshFit | None = None, float8: bool = False,
             async_tp: bool = False) -> MeshResult:
    """Predicted step time, tokens/s per GPU and peak memory per GPU of ``plan``.

    Args:
        graph: the captured graph (costs filled for the cluster's device kind if missing).
        plan: a plan whose pipeline stages are contiguous runs of blocks.
        cluster: the cluster (one node or many).
        batch_size: global batch in samples (0: the graph's).
        fit: fitted constants (:func:`default_fit` of the cluster by default).
        float8: Linear matmuls in float8 (outside the plan space).
        async_tp: tensor-parallel collectives overlapped with compute (outside it too).
    """
    return estimate_config(block_table(graph, cluster), mesh_config(graph, plan,
                           batch_size=batch_size), cluster, fit=fit, float8=float8,
                           async_tp=async_tp)
