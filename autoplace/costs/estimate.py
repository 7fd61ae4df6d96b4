"""Analytical op costs: a roofline per device kind, for graphs no device has profiled.

For an op on a device (``peak_flops``, ``memory_bandwidth``, ``launch_overhead_s``
from :class:`~autoplace.cluster.Device`)::

    fwd = max(flops / peak_flops, bytes_moved / memory_bandwidth) + launch_overhead_s
    bwd = BWD_FACTOR_* x fwd

``bytes_moved`` = bytes of the op's inputs (its in-edges) + outputs + owned
parameters. The constants below are the only knobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplace.capture.op_rules import (
    ATTENTION_KINDS,
    CONV_KINDS,
    MATMUL_KINDS,
    METADATA_KINDS,
    RNN_GATES,
)

if TYPE_CHECKING:
    from autoplace.cluster import Cluster, Device
    from autoplace.graph import OpGraph, OpNode

__all__ = ["estimate_costs", "op_cost", "BWD_FACTOR_PARAM", "BWD_FACTOR_ELEMENTWISE",
           "VIEW_OVERHEAD_FRACTION", "FREE_KINDS"]

#: backward / forward time of ops with parameters or matmul-like compute (two matmuls:
#: grad of input and grad of weight)
BWD_FACTOR_PARAM = 2.0
#: backward / forward time of elementwise, normalisation, pooling and other ops
BWD_FACTOR_ELEMENTWISE = 1.0
#: ops that do no work: graph inputs, parameter fetches, the output (0 s both ways)
FREE_KINDS = frozenset({"input", "param", "output"})
#: metadata ops (views, getitem, size) move no bytes; they cost this fraction of a launch
VIEW_OVERHEAD_FRACTION = 0.2

_MATMUL_LIKE = MATMUL_KINDS | CONV_KINDS | ATTENTION_KINDS | frozenset(RNN_GATES)


def op_cost(op: OpNode, in_bytes: int, device: Device) -> tuple[float, float]:
    """``(fwd_s, bwd_s)`` of ``op`` on ``device`` given the bytes of its inputs."""
    if op.kind in FREE_KINDS:
        return 0.0, 0.0
    if op.kind in METADATA_KINDS and op.flops == 0:
        t = VIEW_OVERHEAD_FRACTION * device.launch_overhead_s
        return t, t
    bytes_moved = in_bytes + op.output_bytes + op.param_bytes
    fwd = max(op.flops / device.peak_flops, bytes_moved / device.memory_bandwidth)
    fwd += device.launch_overhead_s
    heavy = op.param_bytes > 0 or bool(op.param_names) or op.kind in _MATMUL_LIKE
    return fwd, fwd * (BWD_FACTOR_PARAM if heavy else BWD_FACTOR_ELEMENTWISE)


def estimate_costs(graph: OpGraph, cluster: Cluster) -> OpGraph:
    """Fill ``fwd_time_s`` / ``bwd_time_s`` for every device kind of ``cluster`` an op lacks.

    Times already on the graph (profiled, or estimated before) are kept. Works in
    place and returns ``graph``.
    """
    devices: dict[str, Device] = {}
    for d in cluster.devices:
        devices.setdefault(d.kind, d)
    in_bytes = {name: 0 for name in graph.order}
    for _, dst, nbytes in graph.edges:
        in_bytes[dst] += nbytes
    for kind, device in devices.items():
        for op in graph:
            if kind in op.fwd_time_s and kind in op.bwd_time_s:
                continue
            fwd, bwd = op_cost(op, in_bytes[op.name], device)
            op.fwd_time_s.setdefault(kind, fwd)
            op.bwd_time_s.setdefault(kind, bwd)
    return graph
