"""Analytical op costs: a roofline per device kind, for graphs no device has profiled.

For an op on a device (``peak_flops``, ``memory_bandwidth``, ``launch_overhead_s``
from :class:`~autoplace.cluster.Device`)::

    fwd = max(flops / peak_flops, bytes_fwd / memory_bandwidth) + launch_overhead_s + casts
    bwd = BWD_FACTOR_* x (fwd - casts) + casts + sums   (matmuls, convolutions, RNNs,
                                                          attention)
    bwd = max(flops / peak_flops, bytes_bwd / memory_bandwidth) + launch_overhead_s
          + casts + sums                                (every other op: memory-bound)

``bytes_fwd`` = the op's inputs (its in-edges) + outputs + owned parameters, in the
dtypes the capture recorded (under autocast the GPUs' policy: ``pow``, ``exp``, norms
and ``softmax`` in float32, and type promotion after them). ``bytes_bwd``: the gradient
of the outputs and what the op saved (``activation_bytes``, ``shared_saves``) read, the
gradient of each floating input that carries one written; an op with parameters (a
norm) reads the first two again for the parameters' gradients; an ``add`` hands its
gradient on and only casts it for an input of another dtype. ``casts``: autocast's cast
kernels, a matmul-like op's input not in the autocast dtype cast down (a float32
LayerNorm output), an input a float32-list op widens cast up, and in backward their
gradients cast back; parameters' casts are not counted. ``sums``: autograd adds the
gradients of a tensor several ops read, one kernel (two reads, a write) per extra
reader. Attention runs at :data:`ATTENTION_EFFICIENCY` of ``peak_flops``; the capture
counts a causal attention's FLOPs at half (:func:`autoplace.capture.op_rules.work_fraction`).
Ops made from graph inputs only (masks, positions) carry no gradient and have no
backward. The constants below are the only knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autoplace.capture.op_rules import (
    ATTENTION_KINDS,
    CONV_KINDS,
    MATMUL_KINDS,
    METADATA_KINDS,
    RNN_GATES,
    VIEW_KINDS,
)

if TYPE_CHECKING:
    from autoplace.cluster import Cluster, Device
    from autoplace.graph import OpGraph, OpNode

__all__ = ["estimate_costs", "op_cost", "op_traffic", "OpTraffic", "BWD_FACTOR_PARAM",
           "BWD_FACTOR_ATTENTION", "ATTENTION_EFFICIENCY", "VIEW_OVERHEAD_FRACTION",
           "FREE_KINDS", "PASS_THROUGH_KINDS"]

#: backward / forward time of ops with parameters or matmul-like compute (two matmuls:
#: grad of input and grad of weight)
BWD_FACTOR_PARAM = 2.0
#: attention kernels' FLOP rate / the device's ``peak_flops`` (a GEMM reaches about the
#: preset's figure): gpt-1b's causal FlashAttention on an H200 (its stored 4x H200 suite
#: profile, docs/simulator.md: estimated op costs) did 387 TFLOP/s of the work it does
#: (half the scores) against the preset's 600, its Linears 620-725
ATTENTION_EFFICIENCY = 0.64
#: backward / forward time of attention: five matmuls to two (2.5x the FLOPs; Dao et al.
#: 2022), at a lower rate: 3.6x measured in the same profile
BWD_FACTOR_ATTENTION = 3.6
#: ops that do no work: graph inputs, parameter fetches, the output (0 s both ways)
FREE_KINDS = frozenset({"input", "param", "output"})
#: metadata ops (views, getitem, size) move no bytes; they cost this fraction of a launch
VIEW_OVERHEAD_FRACTION = 0.2

_MATMUL_LIKE = MATMUL_KINDS | CONV_KINDS | ATTENTION_KINDS | frozenset(RNN_GATES)
#: ops whose backward hands the output gradient to their inputs as it is (no kernel),
#: cast where an input's dtype differs from the output's (a bf16 branch into a float32
#: residual sum)
PASS_THROUGH_KINDS = frozenset({"add", "add_", "iadd"})
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8}


@dataclass(frozen=True)
class OpTraffic:
    """What an op's backward and autocast's casts move besides its inputs and outputs.

    Attributes:
        grad_in_bytes: bytes of the floating inputs that carry a gradient (the backward
            writes a gradient as large as each).
        cast_bytes: bytes autocast's casts of the op's inputs read and write, forward;
            the backward's casts of their gradients move as much.
        casts: cast kernels, forward (as many again in backward).
        grad_out: whether the op's outputs carry a gradient (else it has no backward).
        pass_through: the backward only casts the gradient for the inputs of another
            dtype (:data:`PASS_THROUGH_KINDS`); ``grad_in_bytes`` is then those casts'.
        sum_bytes: bytes the backward's additions of this op's output gradients move
            (autograd sums the gradients of a tensor several ops read: two read, one
            written per addition).
        sums: those additions (kernels).
    """

    grad_in_bytes: int = 0
    cast_bytes: int = 0
    casts: int = 0
    grad_out: bool = True
    pass_through: bool = False
    sum_bytes: int = 0
    sums: int = 0


def op_cost(op: OpNode, in_bytes: int, device: Device,
            traffic: OpTraffic | None = None) -> tuple[float, float]:
    """``(fwd_s, bwd_s)`` of ``op`` on ``device`` given the bytes of its inputs and, from
    :func:`op_traffic`, what its backward and autocast's casts move (without it: every
    input carries a gradient, no casts)."""
    if op.kind in FREE_KINDS:
        return 0.0, 0.0
    traffic = traffic or OpTraffic(grad_in_bytes=in_bytes)
    bw, launch = device.memory_bandwidth, device.launch_overhead_s
    sum_s = traffic.sum_bytes / bw + traffic.sums * launch if traffic.grad_out else 0.0
    if op.kind in METADATA_KINDS and op.flops == 0:
        t = VIEW_OVERHEAD_FRACTION * launch
        return t, t + sum_s
    cast_s = traffic.cast_bytes / bw + traffic.casts * launch
    compute = op.flops / device.peak_flops
    if op.kind in ATTENTION_KINDS:
        compute /= ATTENTION_EFFICIENCY
    fwd = max(compute, (in_bytes + op.output_bytes + op.param_bytes) / bw) + launch + cast_s
    if not traffic.grad_out:
        return fwd, 0.0
    if op.kind in ATTENTION_KINDS:
        return fwd, (fwd - cast_s) * BWD_FACTOR_ATTENTION + cast_s + sum_s
    has_params = op.param_bytes > 0 or bool(op.param_names)
    if op.kind in _MATMUL_LIKE or (has_params and op.flops > 0
                                   and compute * bw > in_bytes + op.output_bytes):
        return fwd, (fwd - cast_s) * BWD_FACTOR_PARAM + cast_s + sum_s
    if traffic.pass_through:
        cast_back = traffic.grad_in_bytes / bw + (launch if traffic.grad_in_bytes else 0.0)
        return fwd, cast_back + sum_s
    saved = op.activation_bytes + sum(b for _, b in op.shared_saves)
    reads = op.output_bytes + saved
    bwd_bytes = reads * (2 if has_params else 1) + traffic.grad_in_bytes + op.param_bytes
    return fwd, max(compute, bwd_bytes / bw) + launch + cast_s + sum_s


def _float_itemsize(op: OpNode) -> int | None:
    """Bytes per element of ``op``'s first floating output; None where it has none. An op
    without recorded dtypes (a hand-made or synthetic graph) counts as float32."""
    if not op.output_dtypes:
        return 4
    sizes = [_ITEMSIZE[d] for d in op.output_dtypes if d in _ITEMSIZE]
    return sizes[0] if sizes else None


def _casts(op: OpNode, feeds: list[tuple[OpNode, int]], low: int | None) -> tuple[int, int]:
    """``(bytes, kernels)`` of autocast's casts of ``op``'s inputs: a matmul-like op casts
    each input not in the autocast dtype down; an op whose floating output is wider than
    every floating input it reads (``pow`` on CUDA's float32 list) cast them up (type
    promotion of mixed inputs, as in an ``add``, reads them in place)."""
    if not low or op.kind in VIEW_KINDS or op.kind in FREE_KINDS:
        return 0, 0
    sized = [(src, b, _float_itemsize(src)) for src, b in feeds if src.kind != "param"]
    sized = [(src, b, size) for src, b, size in sized if size]
    if op.kind in _MATMUL_LIKE:
        target, cast = low, [(b, size) for src, b, size in sized
                             if src.kind != "input" and size != low]
    else:
        target = _float_itemsize(op)
        widest = max((size for _, _, size in sized), default=None)
        cast = [(b, size) for _, b, size in sized] if target and widest \
            and target > widest else []
    return sum(b + b * target // size for b, size in cast), len(cast)


def op_traffic(graph: OpGraph) -> dict[str, OpTraffic]:
    """Per op name, what its backward writes, autocast's casts move and the backward's
    gradient sums cost (see module docstring). A tensor carries a gradient when it is
    floating and made from a parameter (graph inputs carry none)."""
    low = _ITEMSIZE.get(getattr(graph, "autocast_dtype", None) or "")
    ins: dict[str, list[tuple[str, int]]] = {name: [] for name in graph.order}
    for src, dst, nbytes in graph.edges:
        ins[dst].append((src, nbytes))
    grad: dict[str, bool] = {}
    out: dict[str, OpTraffic] = {}
    for op in graph:
        size = _float_itemsize(op)
        feeds = [(graph[s], b) for s, b in ins[op.name]]
        carried = [(src, b) for src, b in feeds if grad.get(src.name)]
        grad[op.name] = size is not None and (op.kind == "param" or bool(carried)
                                              or op.param_bytes > 0 or bool(op.param_names))
        cast_bytes, casts = _casts(op, feeds, low)
        grad_in = [(b, _float_itemsize(src)) for src, b in carried if _float_itemsize(src)]
        passes = op.kind in PASS_THROUGH_KINDS and size is not None
        if passes:  # read the output's gradient, write the input's, per input of another dtype
            grad_in = [(b // s_in * size + b, s_in) for b, s_in in grad_in if s_in != size]
        out[op.name] = OpTraffic(grad_in_bytes=sum(b for b, _ in grad_in),
                                 cast_bytes=cast_bytes, casts=casts, grad_out=grad[op.name],
                                 pass_through=passes)
    # gradient sums: a tensor read by k ops that send it a gradient gets k - 1 additions
    # (the outputs of a multi-output op, picked apart by getitem, are separate tensors)
    readers: dict[str, int] = dict.fromkeys(graph.order, 0)
    for src, dst, _ in graph.edges:
        if grad[dst] and not (graph[dst].kind == "getitem"
                              and len(graph[src].output_shapes) > 1):
            readers[src] += 1
    for op in graph:
        k = readers[op.name]
        if grad[op.name] and k > 1:
            out[op.name] = replace(out[op.name], sum_bytes=(k - 1) * 3 * op.output_bytes,
                                   sums=k - 1)
    return out


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
    traffic = op_traffic(graph)
    for kind, device in devices.items():
        for op in graph:
            if kind in op.fwd_time_s and kind in op.bwd_time_s:
                continue
            fwd, bwd = op_cost(op, in_bytes[op.name], device, traffic[op.name])
            op.fwd_time_s.setdefault(kind, fwd)
            op.bwd_time_s.setdefault(kind, bwd)
    return graph
