"""Peak memory of one training step: the order in which activations and gradients come
and go on each device.

A step's memory is not the sum of its parts. The executor clears gradients with
``zero_grad(set_to_none=True)``, so an op's gradient is allocated during its first
backward and lives to the update, while the activations autograd kept for that backward
are freed as it runs: on a one-pass step the peak is where the activations still held
and the gradients already made add up highest (at the loss, for a transformer), never
all of both. With several microbatches the first backward of an op comes while the
other microbatches still hold their activations, and every microbatch keeps what its
loss saved (a cross-entropy's float32 log-softmax) until its own backward.

The step is a list of events per device, in the order the device sees them: each event
adds or frees activation bytes (``delta``), makes gradient bytes (``grad``), holds bytes
that are freed right after it (``hold``: an op's kept activations during its own
backward) and needs a transient (``trans``: an output or its gradient, the loss's
workspace in forward and the gradients it makes in backward (:func:`loss_backward_bytes`),
a recomputed block's activations). :func:`timeline_peak` takes the running
sums per device and returns the highest point; the static part (parameters, optimizer
state, autocast's weight copies, sharded or bucketed gradients) is added by the caller.

A one-process replica's events are its forward in issue order, then its backward in the
reverse order (:func:`replica_events`); a pipeline stage's follow its schedule's actions
(:func:`stage_events`). The scalar and the batched simulator build the same events and
call the same function, so they agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplace.graph import OpGraph, OpNode
from autoplace.lowering import pipeline_actions

__all__ = ["Peak", "cast_copy_bytes", "loss_backward_bytes", "loss_keep_bytes", "replica_events",
           "stage_events", "timeline_peak"]


@dataclass
class Peak:
    """Per device cell: the highest bytes of the events and what they were at that point."""

    total: np.ndarray
    activations: np.ndarray
    grads: np.ndarray
    transient: np.ndarray


def timeline_peak(dev: np.ndarray, delta: np.ndarray, grad: np.ndarray, hold: np.ndarray,
                  trans: np.ndarray, kk: int) -> Peak:
    """Highest running memory per ``(plan, device)`` cell ``p * kk + device`` of events
    ``[P, E]`` (one row per plan, in the order they happen; see the module docstring).

    At an event the device holds the activations added so far (this event's ``delta``
    included), the gradients made so far (this one's too), ``hold`` and ``trans``."""
    dev = np.atleast_2d(dev)
    num, e = dev.shape
    size = num * kk
    zeros = np.zeros(size)
    if e == 0:
        return Peak(zeros, zeros.copy(), zeros.copy(), zeros.copy())
    # each row's events grouped by device, in event order within a device
    idx = np.argsort(dev * e + np.arange(e), axis=1, kind="stable")
    d = np.take_along_axis(dev, idx, 1)
    cols = [np.take_along_axis(np.broadcast_to(np.atleast_2d(x), dev.shape), idx, 1)
            for x in (delta, grad, hold, trans)]
    start = np.ones(dev.shape, dtype=bool)
    start[:, 1:] = d[:, 1:] != d[:, :-1]
    first = np.maximum.accumulate(np.where(start, np.arange(e), 0), axis=1)
    running = []
    for x in cols[:2]:  # activations, gradients: sums within each device's run of events
        c = np.cumsum(x, axis=1)
        running.append(c - np.take_along_axis(c - x, first, 1))
    acts = running[0] + cols[2]
    value = acts + running[1] + cols[3]
    cell = (np.arange(num)[:, None] * kk + d).reshape(-1)
    flat = value.reshape(-1)
    total = np.full(size, -np.inf)
    np.maximum.at(total, cell, flat)
    at = np.full(size, len(flat))  # the first event where each cell peaks
    hit = flat == total[cell]
    np.minimum.at(at, cell[hit], np.flatnonzero(hit))
    seen = at < len(flat)
    out = Peak(zeros.copy(), zeros.copy(), zeros.copy(), zeros.copy())
    for dst, src in ((out.total, flat), (out.activations, acts.reshape(-1)),
                     (out.grads, running[1].reshape(-1)), (out.transient, cols[3].reshape(-1))):
        dst[seen] = src[at[seen]]
    # a device never goes below nothing: a peak under 0 (impossible) reads as 0
    out.total = np.maximum(out.total, 0.0)
    return out


def replica_events(n: int, dev: np.ndarray, order: np.ndarray, kept: np.ndarray,
                   back: np.ndarray, fwd_out: np.ndarray, grad: np.ndarray, share: np.ndarray,
                   once: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Events ``(dev, delta, grad, hold, trans)`` ``[P, 2L]`` of one-process replicas: the
    forward of items ``order`` ``[P, L]`` (``microbatch * n + op``) in issue order, then
    their backward in the reverse order.

    Per op (``[P, n]`` or ``[n]``): ``kept`` bytes of activations it keeps for backward,
    ``back`` its transient in backward (its output's gradient; a recomputed block's
    activations), ``fwd_out`` its transient in forward (its output; the loss's workspace),
    ``grad`` the gradient bytes its first backward makes (0 where they are counted
    statically), ``once`` a transient at that first backward, whole (a sharded unit's
    reduce-scatter buffers), the larger of it and ``back`` counting. ``share`` ``[P]``:
    each item's share of the batch (``1 / (m d)``)."""
    order = np.atleast_2d(order)
    num, length = order.shape
    op = order % n
    rows = np.arange(num)[:, None]
    sh = np.asarray(share, dtype=np.float64).reshape(-1, 1)

    def per_item(x: np.ndarray) -> np.ndarray:
        x = np.broadcast_to(np.atleast_2d(x), (num, n))
        return x[rows, op]

    d = np.take_along_axis(np.broadcast_to(np.atleast_2d(dev), (num, n)), op, 1)
    a = per_item(kept) * sh
    # an op's gradient comes at its first backward: its last item in forward order
    last = np.zeros((num, n), dtype=np.int64)
    np.maximum.at(last, (np.broadcast_to(rows, op.shape), op),
                  np.broadcast_to(np.arange(length), op.shape))
    first = np.take_along_axis(last, op, 1) == np.arange(length)
    g = np.where(first, per_item(grad), 0.0)
    tb = per_item(back) * sh
    if once is not None:
        tb = np.maximum(tb, np.where(first, per_item(once), 0.0))
    zero = np.zeros_like(a)
    rev = slice(None, None, -1)
    return (np.concatenate([d, d[:, rev]], 1),
            np.concatenate([a, -a[:, rev]], 1),
            np.concatenate([zero, g[:, rev]], 1),
            np.concatenate([zero, a[:, rev]], 1),
            np.concatenate([per_item(fwd_out) * sh, tb[:, rev]], 1))


def stage_events(stage: np.ndarray, schedule: str, p: int, m: int, kept: np.ndarray,
                 back: np.ndarray, fwd_out: np.ndarray, grad: np.ndarray, share: float,
                 sent: list[float], outputs: np.ndarray, once: np.ndarray | None = None
                 ) -> tuple[np.ndarray, ...]:
    """Events ``(dev, delta, grad, hold, trans)`` ``[1, E]`` of one replica's pipeline
    stages: per stage its schedule's actions (:func:`autoplace.lowering.pipeline_actions`),
    an ``F`` its ops in order, a ``B`` in reverse. Beyond the ops (``kept``, ``back``,
    ``fwd_out``, ``grad``, ``once`` as in :func:`replica_events`): a stage keeps each microbatch's
    output sent on (``sent[s]`` bytes of the whole batch) until that microbatch's backward,
    and the last stage each microbatch's model output (``outputs``: per op, the bytes of
    the values the graph's output reads) until that microbatch's backward ends (its
    ``fwd_cache``). The executor steps the schedule with ``return_outputs=False``, so no
    stage keeps its outputs to the step's end nor concatenates them (with outputs
    returned, on 2x H200 GNMT-4's last 1F1B stage, 8 microbatches of float32 logits of
    0.76 GiB a batch, peaked at 2.50 GiB: its state, receive buffers and two copies of
    the logits)."""
    cols: list[list[float]] = [[], [], [], [], []]

    def add(s: int, delta: float, g: float, hold: float, trans: float) -> None:
        for c, v in zip(cols, (s, delta, g, hold, trans)):
            c.append(v)

    for s in range(p):
        ops = np.flatnonzero(stage == s)
        held = float(outputs[ops].sum()) * share  # a microbatch's model output (last stage)
        made = False
        for act in pipeline_actions(schedule, p, m, s):
            if act[0] == "F":
                for i in ops:
                    add(s, kept[i] * share + outputs[i] * share, 0.0, 0.0, fwd_out[i] * share)
                if s < p - 1:
                    add(s, sent[s] * share, 0.0, 0.0, 0.0)
            else:
                for i in ops[::-1]:
                    t = back[i] * share
                    if once is not None and not made:
                        t = max(t, float(once[i]))
                    add(s, -kept[i] * share, 0.0 if made else grad[i], kept[i] * share, t)
                made = True
                if s < p - 1:
                    add(s, -sent[s] * share, 0.0, 0.0, sent[s] * share)
                if held:
                    add(s, -held, 0.0, 0.0, 0.0)
    dev, delta, g, hold, trans = (np.array([c], dtype=np.float64) for c in cols)
    return dev.astype(np.int64), delta, g, hold, trans


def cast_weight_bytes(ga) -> np.ndarray:
    """``[n]`` bytes of the low-precision copy autocast makes of each op's weights (the
    ``saved`` kinds: matmuls, convolutions, recurrent layers; an exported graph's weight
    ops where a matmul reads them); zeros without autocast."""
    # an exported graph's weights are ops of their own ("param", no inputs) that the
    # matmul reads
    fed = np.zeros(ga.n, dtype=bool)
    fed[ga.edge_src[ga.saved[ga.edge_dst]]] = True
    has_input = np.zeros(ga.n, dtype=bool)
    has_input[ga.edge_dst] = True
    return np.where(ga.saved | (fed & ~has_input), ga.param_bytes, 0.0) * ga.cast_scale


def cast_copy_bytes(ga, dev: np.ndarray, size: int) -> np.ndarray:
    """``[size]`` bytes of autocast's low-precision weight copies per device cell, where
    they are held from first use to the end of the step.

    A pipeline's schedule, and a one-process plan with selective checkpointing, run their
    forward and backward in one autocast region with its cast cache on, so each weight
    autocast casts (matmuls, convolutions, recurrent layers: the ``saved`` kinds) keeps a
    bf16 / fp16 copy from its first use to the end of the backward (an exported graph's
    weight ops count where a matmul reads them). Other one-process plans run the backward
    outside the region: their copies live in the ops' saved tensors
    (``replica_memory.casts_saved``). Without autocast there are none, nor in a compiled
    plan, whose pieces cast inside their graphs and keep the copies per call
    (``GraphArrays.call_keep``). ``dev``: ``[n]`` or ``[P, n]`` cell of every op."""
    if ga.call_keep is not None:  # compiled: each call keeps its own copies (op_memory)
        return np.zeros(size)
    w = cast_weight_bytes(ga)
    dev = np.atleast_2d(dev)
    return np.bincount(dev.reshape(-1), weights=np.broadcast_to(w, dev.shape).reshape(-1),
                       minlength=size)[:size]


def _float_outputs(graph: OpGraph, op: OpNode) -> tuple[float, float]:
    """``(as made, in float32)``: bytes of the floating values the graph's output ``op``
    reads, at the dtype the model made them and as float32 copies."""
    made = f32 = 0.0
    for u in graph.preds(op.name):
        src = graph[u]
        for shape, dt in zip(src.output_shapes, src.output_dtypes):
            if "float" in dt:
                numel = float(np.prod(shape, dtype=np.float64))
                f32 += 4.0 * numel
                made += numel * (2.0 if dt in ("bfloat16", "float16") else 8.0
                                 if dt == "float64" else 4.0)
    return made, f32


def loss_keep_bytes(graph: OpGraph, op: OpNode) -> float:
    """On the graph's output op, the bytes the workload's loss keeps for its backward: a
    float32 tensor the size of each floating model output (autocast runs losses in
    float32; a cross-entropy keeps its log-softmax, a mean-squared error the difference),
    at most the loss's workspace; 0 on every other op."""
    if op.kind != "output":
        return 0.0
    return min(_float_outputs(graph, op)[1], float(op.transient_bytes))


def loss_backward_bytes(graph: OpGraph, op: OpNode) -> float:
    """On the graph's output op, the loss's transient in its backward beyond what it keeps
    (:func:`loss_keep_bytes`); 0 on every other op.

    The loss's first backward receives the gradient of the tensor it kept, as large as it
    (a cross-entropy's ``nll_loss_backward`` makes a dense float32 gradient of the
    log-softmax), and from it makes the gradient of its float32 input, as large again
    (``_log_softmax_backward_data``), while the kept tensor is still held: autograd frees
    a node's saved tensors and the gradient it received only after the node ran. So the
    loss's backward holds three float32 tensors of the output's size (measured on a CPU,
    a GPT whose logits dominate: the step peaks there, in float32 and under bfloat16
    autocast alike). The model's output as it made it is gone by then (the executor
    drops it after the loss, and nothing saves it). The captured workspace, less that
    output (``loss_workspace_bytes`` counts it held throughout), is the floor."""
    keep = loss_keep_bytes(graph, op)
    if keep <= 0.0:
        return 0.0
    made, _ = _float_outputs(graph, op)
    return max(2.0 * keep, float(op.transient_bytes) - made - keep)
