"""A block profiled on the card (:mod:`autoplace.executor.profile_block`) in the simulator:
checkpointing's host time, and the device time left under CUDA graphs.

Checkpointing.
A recomputed op's forward runs again in backward: its device time is added there by the
replica's event simulation (:func:`autoplace.sim.local.op_times`). What that leaves out
is host time: the forward issued a second time, ``torch.utils.checkpoint``'s saved-tensor
hooks, and under a selective policy a Python dispatch mode that every op of the region
passes through, in the forward and in the recompute. On a launch-bound model that is
the whole cost: a 1,005-op residual MLP on one H200 measured 116 ms a step eagerly,
359 ms with every block checkpointed and 506 ms with every block under the selective
policy, where device time alone adds a few ms.

:func:`autoplace.executor.profile_block.profile_block` measures it on the model's first
block and the first blocks in turn (``profile_info[kind]["recompute"]``: ``full_host_s``
and ``selective_host_s`` per working op, ``full_call_host_s`` and ``selective_call_host_s``
per checkpoint call: :func:`autoplace.costs.block_costs.checkpoint_costs`);
:func:`recompute_host_tables` adds the full prices to the backward host time of a
recomputed group (per working op, and per call on its last op) and the selective ones to
a selective group, half to its forward and half to its backward. In a compiled plan torch.compile
traces the checkpoint into the piece's graph, whose recompute runs no Python hooks (the same
MLP: 184 ms with every block checkpointed and compiled): there a recomputed group's ops get
``compiled_full_host_s``, the block checkpointed and compiled against compiled alone
(none where it was not measured), and a selective one nothing. On a GPU kind without a
measurement an eager plan's selective regions get :data:`SELECTIVE_HOST_S` once per region
(checkpoint call), half on its first op's forward and half on its last op's backward (and
its fully recomputed ones :data:`RECOMPUTE_HOST_S`, which is 0: see there); on a CPU the
tables are left as they are (its ops' host time is their time).

CUDA graphs. Per-op times are profiled eagerly: on a launch-bound model an op's measured
time is mostly the time to issue it, and a plan replayed as CUDA graphs
(``parallel.graphs``) does not pay it (the same MLP: 21-24 ms a step graphed). The
profiled graph share (``profile_info[kind]["graphs"]["device_share"]``, at most 1: a graph
of several blocks' time per added block over those blocks' profiled op times, or one
block's graph over its eager time where the model has one block) scales every op's device
time in a graphed plan (:func:`graphed_tables`): a device-bound model measures about 1 and
keeps its times. The profiled blocks stand for the whole model's ops. Measured over several
blocks the share also holds their parameters' replay work (the autograd call's inputs, the
gradients' accumulation), which a graphed piece otherwise adds per parameter tensor
(``GRAPH_PARAM_HOST_S``); the simulator then adds only the piece's fixed cost.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.sim.model import CostTables, GraphArrays, rerun_ops

__all__ = ["RECOMPUTE_HOST_S", "SELECTIVE_HOST_S", "block_tables", "block_values",
           "checkpoint_prices", "default_recompute_host", "filled_host", "gpu_kinds",
           "graphed_tables",
           "needs_scalar", "profiled", "recompute_host_tables", "region_ends",
           "reissued_forward"]

#: host seconds one checkpointed region (a ``torch.utils.checkpoint`` call: a recomputed
#: group, per microbatch) adds to an eager step on a GPU kind whose block was not
#: profiled: none. The profiled blocks' price (the median over the five blocks profiled on
#: one H200 of ``full_host_s`` times the block's ops: 1.75 ms a region) changed no held-out
#: measurement's error (the 2x H200 suites' and a GPT-2-medium-size model's checkpointed
#: plans are device-bound: -10..+6% either way, Inception-v3 -39%), while it made the
#: simulator rank recomputation far lower on graphs of small groups (GNMT-4's DDP with a
#: few LSTMs recomputed 2.5x its step, never measured); per op (314 us) it put the
#: GPT-2-size model's step 74% over measured (docs/simulator.md)
RECOMPUTE_HOST_S = 0.0
#: the same for a region under the selective policy, whose Python dispatch mode every op
#: of the region passes through, forward and recompute: the median over the same five
#: blocks of ``selective_host_s`` times the block's ops (a 1,005-op residual MLP's 5-op
#: blocks: 2.42-3.21 ms, a small U-Net's 6-op blocks: 3.32-4.61 ms; 2026-11-29 levers
#: runs). Held out: branchy-mlp's and gpt-1b's selective blocks on 2x H200 from -37% and
#: -20% to -7% and -14% (Inception-v3's -67% to -57%)
SELECTIVE_HOST_S = 3.21e-3


def block_values(graph: OpGraph, kinds: list[str], part: str, key: str,
                 default: float) -> np.ndarray:
    """Per device kind of ``kinds``, ``profile_info[kind][part][key]`` of the graph's
    profiled block (``part``: compiled, recompute or graphs), else ``default``."""
    info = getattr(graph, "profile_info", None) or {}
    return np.array([float(((info.get(k) or {}).get(part) or {}).get(key, default))
                     for k in kinds])


def profiled(graph: OpGraph, kinds: list[str], part: str) -> np.ndarray:
    """bool per device kind of ``kinds``: whether the graph's profiled block has ``part``."""
    info = getattr(graph, "profile_info", None) or {}
    return np.array([bool((info.get(k) or {}).get(part)) for k in kinds], dtype=bool)


def filled_host(tables: CostTables) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward host times per kind and op, those the profile lacks (NaN)
    filled in with the device's ``host_dispatch_s`` (what the simulator uses for them)."""
    host_of_kind = np.array([
        tables.host[tables.kind_of_device == k].max() if (tables.kind_of_device == k).any()
        else 0.0 for k in range(len(tables.kinds))])[:, None]
    return (np.where(np.isnan(tables.host_fwd), host_of_kind, tables.host_fwd),
            np.where(np.isnan(tables.host_bwd), host_of_kind, tables.host_bwd))


def _has(graph: OpGraph, part: str) -> bool:
    info = getattr(graph, "profile_info", None) or {}
    return any(isinstance(v, dict) and v.get(part) for v in info.values())


def gpu_kinds(kinds: list[str]) -> np.ndarray:
    """bool per device kind: a GPU's (where the host issues work the device then runs; on
    a CPU an op's host time is its time)."""
    return np.array([k != "cpu" for k in kinds])


def default_recompute_host(kinds: list[str]) -> np.ndarray:
    """Per device kind, the host seconds a checkpointed region adds where no block was
    profiled: :data:`RECOMPUTE_HOST_S` on a GPU kind, 0 on a CPU (the batched simulator's
    price; a profiled graph's recompute plans are simulated one by one)."""
    return np.where(gpu_kinds(kinds), RECOMPUTE_HOST_S, 0.0)


def needs_scalar(graph: OpGraph, plan: Plan) -> bool:
    """Whether ``plan`` uses a lever ``graph``'s profiled block prices (recompute or CUDA
    graphs): the batched simulator leaves such plans to the one-plan path."""
    return (bool(plan.recompute or plan.selective) and _has(graph, "recompute")) or \
        (plan.parallel.graphs and _has(graph, "graphs"))


def block_tables(graph: OpGraph, tables: CostTables, ga: GraphArrays,
                 plan: Plan) -> CostTables:
    """``tables`` with the profiled block's prices of ``plan``'s levers applied."""
    return graphed_tables(graph, recompute_host_tables(graph, tables, ga, plan), plan)


def graphed_tables(graph: OpGraph, tables: CostTables, plan: Plan) -> CostTables:
    """``tables`` with every op's device time at the profiled graphed share, for a plan
    replayed as CUDA graphs (see the module docstring)."""
    if not (plan.parallel.graphs and _has(graph, "graphs")):
        return tables
    share = np.clip(block_values(graph, tables.kinds, "graphs", "device_share", 1.0),
                    0.01, 1.0)[:, None]
    # a share timed on a graph of several blocks holds their parameters' replay work too
    blocks = block_values(graph, tables.kinds, "graphs", "blocks", 1.0)
    return replace(tables, fwd=tables.fwd * share, bwd=tables.bwd * share,
                   fwd_fixed=tables.fwd_fixed * share, bwd_fixed=tables.bwd_fixed * share,
                   graph_param_host=np.where(blocks > 1, 0.0, tables.graph_param_host))


def _work_ops(graph: OpGraph, n: int) -> np.ndarray:
    """bool per op (graph order): an op that does work (not an input, a parameter fetch or
    the output), as the block profile counts a block's ops (cached on the graph)."""
    mask = graph.__dict__.get("_sim_work_ops")
    if mask is None or len(mask) != n:
        mask = graph.__dict__["_sim_work_ops"] = np.array(
            [op.kind not in ("input", "param", "output") for op in graph.ops], dtype=bool)
    return mask


def checkpoint_prices(graph: OpGraph, kinds: list[str], form: str
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Per device kind, checkpointing's profiled host seconds per op and per checkpoint
    call in ``form`` (full, selective or compiled_full), as the block profile recorded
    them (:func:`autoplace.costs.block_costs.checkpoint_costs`; a profile from before the
    per-call price holds the per-op one alone); NaN per op where the kind has no profiled
    block."""
    return (block_values(graph, kinds, "recompute", f"{form}_host_s", np.nan),
            block_values(graph, kinds, "recompute", f"{form}_call_host_s", 0.0))


def region_ends(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bool per op: the first op of its group (where a checkpoint call's forward starts)
    and the last (where its recompute is issued in backward), ``group`` an id per op."""
    n = len(group)
    first, last = np.zeros(n, bool), np.zeros(n, bool)
    first[np.unique(group, return_index=True)[1]] = True
    last[n - 1 - np.unique(group[::-1], return_index=True)[1]] = True
    return first, last


def recompute_host_tables(graph: OpGraph, tables: CostTables, ga: GraphArrays,
                          plan: Plan) -> CostTables:
    """``tables`` with checkpointing's host time added to the recomputed ops of ``plan``
    (see the module docstring): per op where a block was profiled on the kind, per
    region (checkpoint call) on a GPU kind where none was."""
    if not (plan.recompute or plan.selective):
        return tables
    gpu = gpu_kinds(tables.kinds)  # where the defaults apply
    if not (_has(graph, "recompute") or gpu.any()):
        return tables

    def priced(form: str, default: float) -> tuple[np.ndarray, np.ndarray]:
        """Per kind [k, 1]: the profiled price per op, and per region (checkpoint call):
        the profiled one, or ``default`` on a GPU kind without a profiled block."""
        per_op, per_call = checkpoint_prices(graph, tables.kinds, form)
        return (np.nan_to_num(per_op)[:, None],
                np.where(np.isnan(per_op), np.where(gpu, default, 0.0),
                         np.nan_to_num(per_call))[:, None])

    if plan.parallel.compile:  # the checkpoint traced into the compiled piece's graph
        full, full_region = priced("compiled_full", 0.0)
        sel = sel_region = np.zeros((len(tables.kinds), 1))
    else:
        full, full_region = priced("full", RECOMPUTE_HOST_S)
        sel, sel_region = priced("selective", SELECTIVE_HOST_S)
    group = np.array([plan.groups.get(name, -1) for name in ga.names])
    first, last = region_ends(group)
    work = _work_ops(graph, ga.n)[None, :]  # inputs and parameter fetches issue nothing
    rec = np.isin(group, list(plan.recompute))[None, :]
    sel_ops = np.isin(group, list(plan.selective))[None, :]
    add_f = np.where(sel_ops & work, sel / 2, 0.0) + np.where(sel_ops & first, sel_region / 2,
                                                               0.0)
    add_b = (np.where(rec & work, full, 0.0) + np.where(rec & last, full_region, 0.0)
             + np.where(sel_ops & work, sel / 2, 0.0)
             + np.where(sel_ops & last, sel_region / 2, 0.0))
    host_fwd, host_bwd = filled_host(tables)
    add_b_fixed = add_b
    if not plan.parallel.compile:  # a compiled piece recomputes inside its graph
        reissue = reissued_forward(graph, tables, ga, group, plan.recompute)
        add_b = add_b + np.where(reissue, host_fwd, 0.0)
        add_b_fixed = add_b_fixed + np.where(reissue, np.where(
            np.isnan(tables.host_fwd_fixed), host_fwd, tables.host_fwd_fixed), 0.0)
    # a fixed part of NaN means the whole time is fixed; the added time is fixed too
    return replace(tables, host_fwd=host_fwd + add_f, host_bwd=host_bwd + add_b,
                   host_fwd_fixed=tables.host_fwd_fixed + add_f,
                   host_bwd_fixed=tables.host_bwd_fixed + add_b_fixed)


def reissued_forward(graph: OpGraph, tables: CostTables, ga: GraphArrays, group: np.ndarray,
                     recompute: frozenset[int]) -> np.ndarray:
    """bool ``[kinds, n]``: the ops whose forward the host issues again in an eager plan's
    backward, where nothing else prices that: the ops a full recompute runs again
    (:func:`autoplace.sim.model.rerun_ops`) on a GPU kind with no profiled block (a
    profiled block's price holds its recompute's issue; on a CPU an op's time is its host
    time, already added to the backward with the rerun). Their forward's own host time is
    added to the backward's: the same ops, issued once more."""
    unpriced = gpu_kinds(tables.kinds) & np.isnan(block_values(graph, tables.kinds, "recompute", "full_host_s",
                                           np.nan))
    if not (recompute and unpriced.any()):
        return np.zeros((len(tables.kinds), ga.n), bool)
    rerun = rerun_ops(ga, group.tolist(), frozenset(recompute), frozenset())
    return unpriced[:, None] & rerun[None, :]
