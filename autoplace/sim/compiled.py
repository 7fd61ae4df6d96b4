"""Op costs and kept activations of a plan whose pieces run compiled (``parallel.compile``).

torch.compile (inductor) leaves a piece's matmuls, convolutions, attention and recurrent
kernels to the same libraries as eager PyTorch and fuses the rest (norms, activations,
residual adds, casts, dropout) into few generated kernels that read and write each
tensor once. The heavy kernels keep their profiled or estimated times. The fused ops:

- **Chains** (:func:`fused_chains`): a chain is a connected run of fused ops of one group
  (a piece); inductor makes it one kernel that reads the tensors entering the chain and
  writes those leaving it, once. Its forward is priced at those bytes over the device's
  memory bandwidth, its backward at twice the entering bytes (saved inputs and their
  gradients) plus the leaving ones (their gradients), each at least a launch and never
  more than the chain's eager time, shared among its ops in proportion to their eager
  times. Nothing fitted: the device's bandwidth and launch overhead. Host times: one
  factor (:data:`COMPILED_FUSED_TIME`) on the fused ops' eager issue time.
- **Profiled** (a device kind whose profile has a compiled block,
  :mod:`autoplace.executor.profile_block`): the measured factor on the fused ops' device
  and host times instead.

Memory: inductor's partitioner keeps for backward the inputs of a chain of fused ops
and recomputes the chain's inside, where eager PyTorch keeps what every op of the chain
saves (a tanh-approximated GELU written out keeps five tensors eagerly, one compiled).
:func:`compiled_arrays` keeps the activations of a fused op only where it starts a chain
in its piece (an input from a heavy op, from outside its group, or a parameter) and of
every normalization (its input is needed whole: recomputing it would recompute the
chain before it). Checked on two models, nothing fitted: kept memory falls by 0 GiB on
gpt-1b (measured 0.5) and by 21.8 GiB on a GPT-2-medium-size Hugging Face model
(measured 18.0; 1x H200: docs/simulator.md, compiled pieces).

Under autocast an eager step casts each weight once (the executor's one autocast region
caches the copy for every microbatch), while a compiled piece casts inside its graph and
keeps its own low-precision copies for its backward, per call: each microbatch in flight
holds the piece's weights at bf16 (``GraphArrays.call_keep``, in place of the one shared
copy). gpt-1b's 2-stage GPipe on 2x H200 held 0.73 / 1.55 GiB more compiled than eager
on its first stage with 2 / 4 microbatches (its weights at bf16: 0.77 GiB), the two halves
with 2 microbatches 0.80 / 0.88 GiB (0.81 / 0.88); nothing fitted (docs/simulator.md).

The host factor comes from kernel traces on one NVIDIA H200 (torch 2.11, bf16 autocast):
gpt-1b with each block compiled by hand spent 18 ms a step in kernels other than
matmuls, attention and the optimizer's against 34 ms eagerly. The chains are checked on
the levers benchmark's runs (docs/simulator.md, compiled pieces): the GPT-2-medium-size
model's float32 ``gelu_new`` chain, one kernel compiled, is what one factor on eager
costs could not price.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.sim.block_profile import (
    block_values,
    filled_host,
    gpu_kinds,
    profiled,
    region_ends,
)
from autoplace.sim.memory import cast_weight_bytes
from autoplace.sim.model import CostTables, GraphArrays

__all__ = ["COMPILED_CALL_HOST_S", "COMPILED_FUSED_TIME", "compiled_arrays",
           "compiled_tables", "fused_chains", "fused_times", "profiled_kinds"]

#: device and host time of a fused (non-matmul) op in a compiled piece over its eager time
COMPILED_FUSED_TIME = 0.55
#: host seconds one call of a compiled piece costs beyond its ops, forward and backward
#: (dynamo's guards, the compiled wrapper, autograd's compiled function), on a GPU kind.
#: Fitted on a small U-Net's blocks of 1-6 ops on one H200 (each block added to a chain
#: of compiled pieces cost 0.279 ms more than added eagerly, 2026-11-29 levers-unet-2).
#: Held out: gpt-1b's annealed placement of 165 one-op groups, compiled, 2 microbatches
#: on 2x H200: simulated 75.4 ms without it, 108.8 with it, measured 165.8
#: (suite-levers-gpt1b-capped-retries)
COMPILED_CALL_HOST_S = 0.279e-3


def fused_times(graph: OpGraph, kinds: list[str]) -> np.ndarray:
    """Per device kind, the fused ops' factor: measured on the machine where the graph's
    profile has a compiled block (``profile_info[kind]["compiled"]["fused_time"]``,
    :mod:`autoplace.executor.profile_block`), else :data:`COMPILED_FUSED_TIME`."""
    return block_values(graph, kinds, "compiled", "fused_time", COMPILED_FUSED_TIME)


def profiled_kinds(graph: OpGraph, kinds: list[str]) -> np.ndarray:
    """bool per device kind: whether the graph's profile has a compiled block for it."""
    return profiled(graph, kinds, "compiled")


def _op_kinds(graph: OpGraph, n: int) -> list[str]:
    """The graph's op kinds in order (cached on the graph)."""
    kinds = graph.__dict__.get("_sim_kinds")
    if kinds is None or len(kinds) != n:
        kinds = graph.__dict__["_sim_kinds"] = [op.kind for op in graph.ops]
    return kinds


def fused_chains(graph: OpGraph, ga: GraphArrays, plan: Plan
                 ) -> tuple[np.ndarray, dict[int, float], dict[int, float]]:
    """The chains of fused ops of ``plan``'s pieces: per op its chain (a root op index, -1
    for an op that is not fused), and per chain the bytes entering it (each producer
    counted once) and leaving it (each op's output read outside the chain, or the
    graph's output)."""
    kinds = _op_kinds(graph, ga.n)
    fused = ~ga.saved & np.array([k not in ("input", "param", "output") for k in kinds])
    group = np.array([plan.groups.get(name, -1) for name in ga.names])
    parent = list(range(ga.n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    src, dst = ga.edge_src.tolist(), ga.edge_dst.tolist()
    for u, v in zip(src, dst):
        if fused[u] and fused[v] and group[u] == group[v]:
            parent[find(u)] = find(v)
    root = np.array([find(i) if fused[i] else -1 for i in range(ga.n)], dtype=np.int64)
    entering: dict[int, float] = {}
    leaving: dict[int, float] = {}
    seen_in: set[tuple[int, int]] = set()
    seen_out: set[int] = set()
    for u, v, b in zip(src, dst, ga.edge_bytes.tolist()):
        cu, cv = int(root[u]), int(root[v])
        if cv >= 0 and cu != cv and (u, cv) not in seen_in:
            seen_in.add((u, cv))
            entering[cv] = entering.get(cv, 0.0) + b
        if cu >= 0 and cu != cv and u not in seen_out:
            seen_out.add(u)
            leaving[cu] = leaving.get(cu, 0.0) + float(ga.out_bytes[u])
    for i in np.nonzero(root >= 0)[0].tolist():
        if not ga.succs[i] and i not in seen_out:
            leaving[int(root[i])] = leaving.get(int(root[i]), 0.0) + float(ga.out_bytes[i])
    return root, entering, leaving


def _chain_device_times(tables: CostTables, chains: tuple, kinds: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """fwd, bwd and their fixed parts with every chain priced by its bytes on the device
    kinds ``kinds`` (bool per kind; see the module docstring)."""
    root, entering, leaving = chains
    fwd, bwd = tables.fwd.copy(), tables.bwd.copy()
    fwd_fixed, bwd_fixed = tables.fwd_fixed.copy(), tables.bwd_fixed.copy()
    ops = np.nonzero(root >= 0)[0]
    if not len(ops):
        return fwd, bwd, fwd_fixed, bwd_fixed
    roots, chain = np.unique(root[ops], return_inverse=True)  # chain index of each op
    e_in = np.array([entering.get(int(r), 0.0) for r in roots])
    e_out = np.array([leaving.get(int(r), 0.0) for r in roots])
    for k in np.nonzero(kinds)[0].tolist():
        devs = tables.kind_of_device == k
        if not devs.any():
            continue
        bw, launch = float(tables.mem_bandwidth[devs].max()), float(tables.overhead[devs].max())
        for t, fixed, nbytes in ((fwd, fwd_fixed, e_in + e_out),
                                 (bwd, bwd_fixed, 2 * e_in + e_out)):
            eager = t[k, ops]
            total = np.bincount(chain, weights=eager, minlength=len(roots))
            priced = np.minimum(total, np.maximum(launch, nbytes / bw))
            share = np.divide(priced, total, out=np.ones_like(total), where=total > 0)
            t[k, ops] = eager * share[chain]
            fixed[k, ops] = np.minimum(np.nan_to_num(fixed[k, ops], nan=launch), t[k, ops])
    return fwd, bwd, fwd_fixed, bwd_fixed


def compiled_tables(tables: CostTables, ga: GraphArrays,
                    fused_time: float | np.ndarray = COMPILED_FUSED_TIME, *,
                    graph: OpGraph | None = None, plan: Plan | None = None) -> CostTables:
    """``tables`` with the ops a compiled piece fuses (those not in
    :data:`autoplace.lowering.SELECTIVE_SAVED_KINDS`) at ``fused_time`` of their eager
    device and host times (one factor, or one per device kind of ``tables.kinds``:
    :func:`fused_times`). With ``graph`` and ``plan``, the device times on the kinds
    without a profiled compiled block (:func:`profiled_kinds`) are priced by chain
    instead (:func:`fused_chains`). Host times the profile lacks (NaN: the device's
    ``host_dispatch_s``) are filled in first, so the fused ops' issue cost falls too."""
    per_kind = np.broadcast_to(np.asarray(fused_time, dtype=np.float64),
                               (len(tables.kinds),))[:, None]
    scale = np.where(ga.saved[None, :], 1.0, per_kind)
    host_fwd, host_bwd = filled_host(tables)
    out = replace(
        tables, fwd=tables.fwd * scale, bwd=tables.bwd * scale,
        fwd_fixed=tables.fwd_fixed * scale, bwd_fixed=tables.bwd_fixed * scale,
        host_fwd=host_fwd * scale, host_bwd=host_bwd * scale,
        host_fwd_fixed=tables.host_fwd_fixed * scale, host_bwd_fixed=tables.host_bwd_fixed * scale)
    if graph is None or plan is None:
        return out
    out = _with_calls(out, ga, graph, plan)
    by_chain = ~profiled_kinds(graph, tables.kinds)
    if not by_chain.any():
        return out
    fwd, bwd, fwd_fixed, bwd_fixed = _chain_device_times(
        tables, fused_chains(graph, ga, plan), by_chain)
    keep = by_chain[:, None]
    return replace(out, fwd=np.where(keep, fwd, out.fwd), bwd=np.where(keep, bwd, out.bwd),
                   fwd_fixed=np.where(keep, fwd_fixed, out.fwd_fixed),
                   bwd_fixed=np.where(keep, bwd_fixed, out.bwd_fixed))


def _with_calls(tables: CostTables, ga: GraphArrays, graph: OpGraph, plan: Plan
                ) -> CostTables:
    """``tables`` with each compiled piece's call (:data:`COMPILED_CALL_HOST_S`) on GPU
    kinds: half before its first op's forward, half after its last op's backward. A piece
    is a group's ops (``autoplace.executor.local.build_local``). Where the kind has a
    profiled block, its ratio already holds one call per block, spread over the block's
    ops: a piece of ``n`` ops pays ``1 - n / block_ops`` of a call beyond it (a piece of
    a block or more, none)."""
    gpu = gpu_kinds(tables.kinds)
    if not gpu.any() or COMPILED_CALL_HOST_S <= 0:
        return tables
    group = np.array([plan.groups.get(n, -1) for n in ga.names])
    _, inv, size = np.unique(group, return_inverse=True, return_counts=True)
    ops = size[inv].astype(np.float64)  # [n] ops of the op's piece
    block = block_values(graph, tables.kinds, "compiled", "block_ops", 0.0)[:, None]
    share = np.where(block > 0, np.clip(1.0 - ops[None, :] / np.maximum(block, 1.0), 0, 1),
                     1.0)
    half = np.where(gpu[:, None], COMPILED_CALL_HOST_S / 2 * share, 0.0)
    first, last = region_ends(group)
    add_f, add_b = np.where(first[None, :], half, 0.0), np.where(last[None, :], half, 0.0)
    return replace(tables, host_fwd=tables.host_fwd + add_f, host_bwd=tables.host_bwd + add_b,
                   host_fwd_fixed=tables.host_fwd_fixed + add_f,
                   host_bwd_fixed=tables.host_bwd_fixed + add_b)


def compiled_arrays(graph: OpGraph, ga: GraphArrays, plan: Plan) -> GraphArrays:
    """``ga`` with the activations a compiled plan's pieces keep (see the module
    docstring): a fused op inside a chain of fused ops of its own group keeps none."""
    kinds = _op_kinds(graph, ga.n)
    norm = np.array(["norm" in k.lower() for k in kinds], dtype=bool)
    source = ga.saved | np.array([k in ("input", "param") for k in kinds], dtype=bool)
    group = np.array([plan.groups.get(name, -1) for name in ga.names], dtype=np.int64)
    src, dst = ga.edge_src, ga.edge_dst
    # an edge that starts a chain: from a heavy op, an input or parameter, or another group
    starts = source[src] | (group[src] != group[dst])
    head = np.zeros(ga.n, dtype=bool)
    np.logical_or.at(head, dst, starts)
    has_pred = np.zeros(ga.n, dtype=bool)
    has_pred[dst] = True
    keep = ga.saved | norm | head | ~has_pred
    cast = cast_weight_bytes(ga)
    return replace(ga, act_bytes=np.where(keep, ga.act_bytes, 0.0),
                   call_keep=cast if cast.any() else None)
