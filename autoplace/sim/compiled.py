"""Op costs and kept activations of a plan whose pieces run compiled (``parallel.compile``).

torch.compile (inductor) leaves a piece's matmuls, convolutions, attention and recurrent
kernels to the same libraries as eager PyTorch and fuses the rest (norms, activations,
residual adds, casts, dropout) into few generated kernels that read and write each
tensor once. The simulator prices that with one factor on the device time and the host
time of the fused ops (:data:`COMPILED_FUSED_TIME`); the heavy kernels keep their
profiled or estimated times.

Memory: inductor's partitioner keeps for backward the inputs of a chain of fused ops
and recomputes the chain's inside, where eager PyTorch keeps what every op of the chain
saves (a tanh-approximated GELU written out keeps five tensors eagerly, one compiled).
:func:`compiled_arrays` keeps the activations of a fused op only where it starts a chain
in its piece (an input from a heavy op, from outside its group, or a parameter) and of
every normalization (its input is needed whole: recomputing it would recompute the
chain before it). Checked on two models, nothing fitted: kept memory falls by 0 GiB on
gpt-1b (measured 0.5) and by 21.8 GiB on a GPT-2-medium-size Hugging Face model
(measured 18.0; 1x H200: docs/simulator.md, compiled pieces).

The factor comes from kernel traces on one NVIDIA H200 (torch 2.11, bf16 autocast):
gpt-1b with each block compiled by hand spent 18 ms a step in kernels other than
matmuls, attention and the optimizer's against 34 ms eagerly (the loss and embedding,
never compiled, taken out of both). It is checked on models it was not fitted on in the
levers benchmark (docs/simulator.md, compiled pieces).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.sim.model import CostTables, GraphArrays

__all__ = ["COMPILED_FUSED_TIME", "compiled_arrays", "compiled_tables", "filled_host",
           "fused_times"]

#: device and host time of a fused (non-matmul) op in a compiled piece over its eager time
COMPILED_FUSED_TIME = 0.55


def fused_times(graph: OpGraph, kinds: list[str]) -> np.ndarray:
    """Per device kind, the fused ops' factor: measured on the machine where the graph's
    profile has a compiled block (``profile_info[kind]["compiled"]["fused_time"]``,
    :mod:`autoplace.executor.profile_block`), else :data:`COMPILED_FUSED_TIME`."""
    info = getattr(graph, "profile_info", None) or {}
    return np.array([float(((info.get(k) or {}).get("compiled") or {}).get(
        "fused_time", COMPILED_FUSED_TIME)) for k in kinds])


def compiled_tables(tables: CostTables, ga: GraphArrays,
                    fused_time: float | np.ndarray = COMPILED_FUSED_TIME) -> CostTables:
    """``tables`` with the ops a compiled piece fuses (those not in
    :data:`autoplace.lowering.SELECTIVE_SAVED_KINDS`) at ``fused_time`` of their eager
    device and host times (one factor, or one per device kind of ``tables.kinds``:
    :func:`fused_times`). Host times the profile lacks (NaN: the device's
    ``host_dispatch_s``) are filled in first, so the fused ops' issue cost falls too."""
    per_kind = np.broadcast_to(np.asarray(fused_time, dtype=np.float64),
                               (len(tables.kinds),))[:, None]
    scale = np.where(ga.saved[None, :], 1.0, per_kind)
    host_fwd, host_bwd = filled_host(tables)
    return replace(
        tables, fwd=tables.fwd * scale, bwd=tables.bwd * scale,
        fwd_fixed=tables.fwd_fixed * scale, bwd_fixed=tables.bwd_fixed * scale,
        host_fwd=host_fwd * scale, host_bwd=host_bwd * scale,
        host_fwd_fixed=tables.host_fwd_fixed * scale, host_bwd_fixed=tables.host_bwd_fixed * scale)


def filled_host(tables: CostTables) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward host times per kind and op, those the profile lacks (NaN)
    filled in with the device's ``host_dispatch_s`` (what the simulator uses for them)."""
    host_of_kind = np.array([
        tables.host[tables.kind_of_device == k].max() if (tables.kind_of_device == k).any()
        else 0.0 for k in range(len(tables.kinds))])[:, None]
    return (np.where(np.isnan(tables.host_fwd), host_of_kind, tables.host_fwd),
            np.where(np.isnan(tables.host_bwd), host_of_kind, tables.host_bwd))


def compiled_arrays(graph: OpGraph, ga: GraphArrays, plan: Plan) -> GraphArrays:
    """``ga`` with the activations a compiled plan's pieces keep (see the module
    docstring): a fused op inside a chain of fused ops of its own group keeps none."""
    kinds = graph.__dict__.get("_sim_kinds")
    if kinds is None or len(kinds) != ga.n:
        kinds = graph.__dict__["_sim_kinds"] = [op.kind for op in graph.ops]
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
    return replace(ga, act_bytes=np.where(keep, ga.act_bytes, 0.0))
