"""Per-op-kind rules used by capture: activation bytes kept for backward, and FLOPs
for ops ``FlopCounterMode`` does not count.

Kinds are module class names (fx path: ``Linear``, ``LSTM``) or function / method /
aten op names (``linear``, ``matmul``, ``add_``, ``scaled_dot_product_attention``).
FLOPs: a multiply-add is 2. Counted FLOPs (matmul, conv, attention) come from
``torch.utils.flop_counter``; when it reports 0 the hand formulas below apply:

* Linear / matmul family: ``2 * numel(out) * K`` (K the contracted size)
* Conv: ``2 * numel(out) * Cin/groups * prod(kernel)``
* LSTM / GRU / RNN: ``2 * T * B * (numel(W_ih) + numel(W_hh))`` summed over layers and
  directions (gates of every step)
* scaled-dot-product attention: ``2 * numel(q) * S + 2 * numel(out) * S``; a causal one
  (``is_causal=True``, no mask) half of it, counted or not: its kernels skip the masked
  half of the scores, which the counter ignores (an explicit mask is computed whole; a
  causal one an exported graph builds from shapes is given back as ``is_causal`` first,
  :mod:`autoplace.capture.attention`)
* Embedding and data movement (views, cat, copies, factories): 0
* anything else: ``numel(out) * per-element factor`` (1, or :data:`ELEMENT_FLOPS`)

Activation bytes (what autograd keeps for backward; a per-kind estimate):

* view-like and data-movement ops, ``add``/``sub``, factories: 0
* matmul / linear / conv / attention: the non-parameter inputs (at the autocast
  dtype when one is given: autocast keeps the cast copy)
* ``relu``, ``sigmoid``, ``tanh``, softmax: the output
* normalisation, ``mul``/``div``, average pooling, and activations whose derivative reads the
  input (``gelu``, ``silu``, ``leaky_relu``...): the inputs (under autocast, an op on
  the GPUs' float32 list keeps float32 copies of them); ``mul``/``div`` by a number:
  nothing
* max pooling: the input and an int64 index per output element; adaptive average pooling
  to one element per channel (a mean): nothing
* Embedding: the indices; dropout: a one-byte mask per element
* LSTM / GRU / RNN: the input plus, per layer and direction and step, the gates and
  the cell / hidden state (``T * B * (G + 2) * H`` elements, G = 4 / 3 / 1)
* unknown modules: their inputs; unknown functions: their output
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoplace.capture.gpu_autocast import GPU_FP32_OPS

VIEW_KINDS = frozenset({
    "getitem", "getattr", "size", "dim", "numel", "view", "reshape", "permute", "transpose",
    "t", "expand", "expand_as", "view_as", "unsqueeze", "squeeze", "flatten", "unflatten",
    "split", "split_with_sizes", "chunk", "unbind", "contiguous", "detach", "narrow", "slice",
    "select", "alias", "as_strided", "_unsafe_view", "Flatten", "Unflatten", "Identity",
    "movedim", "swapaxes", "sym_size", "type_as", "to", "_to_copy", "clone", "copy_", "float",
    "half", "bfloat16", "type", "lift_fresh_copy", "cat", "stack", "zeros", "ones", "empty",
    "full", "arange", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "tensor", "scalar_tensor", "repeat", "index_select",
    "roll", "pad", "floordiv", "_assert_tensor_metadata", "gather", "index", "scatter",
})
#: pure metadata ops: no kernel, no bytes moved (a subset of VIEW_KINDS; the rest copy)
METADATA_KINDS = frozenset({
    "getitem", "getattr", "size", "dim", "numel", "view", "reshape", "permute", "transpose",
    "t", "expand", "expand_as", "view_as", "unsqueeze", "squeeze", "flatten", "unflatten",
    "split", "split_with_sizes", "chunk", "unbind", "detach", "narrow", "slice", "select",
    "alias", "as_strided", "_unsafe_view", "Flatten", "Unflatten", "Identity", "movedim",
    "swapaxes", "sym_size", "_assert_tensor_metadata",
})
#: compute ops whose backward needs no saved tensor (only shapes or a mask)
NO_SAVE_KINDS = frozenset({
    "add", "iadd", "sub", "isub", "neg", "cumsum", "masked_fill", "where", "eq", "ne", "lt",
    "le", "gt", "ge", "and_", "__and__", "or_", "__or__", "invert", "logical_not", "tril",
    "triu", "mean", "sum", "diff",
})
#: products and quotients: by a Python number they keep nothing for backward
_SCALED_KINDS = frozenset({"mul", "imul", "div", "truediv", "itruediv"})
ZERO_FLOP_KINDS = VIEW_KINDS | {
    "Embedding", "embedding", "EmbeddingBag", "Dropout", "dropout", "native_dropout",
}
MATMUL_KINDS = frozenset({"Linear", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm",
                          "einsum", "Bilinear", "mv", "addmv", "dot", "LazyLinear"})
CONV_KINDS = frozenset({"Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                        "ConvTranspose3d", "conv1d", "conv2d", "conv3d", "convolution",
                        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                        "_convolution"})
RNN_GATES = {"LSTM": 4, "lstm": 4, "GRU": 3, "gru": 3, "RNN": 1, "rnn_tanh": 1, "rnn_relu": 1}
ATTENTION_KINDS = frozenset({"scaled_dot_product_attention", "MultiheadAttention",
                             "_scaled_dot_product_flash_attention",
                             "_scaled_dot_product_efficient_attention"})
#: activations whose backward reads their output (``relu``, ``sigmoid``, ``tanh``, softmax)
SAVE_OUTPUT_KINDS = frozenset({
    "relu", "ReLU", "relu_", "sigmoid", "Sigmoid", "tanh", "Tanh", "softmax", "Softmax",
    "log_softmax", "LogSoftmax", "_softmax", "exp",
})
#: ops whose backward reads their input: norms, products, pooling, losses, and the
#: activations whose derivative is a function of the input (``gelu_backward(grad, self)``,
#: ``silu_backward(grad, self)``: the next matmul saves the output, another tensor)
SAVE_INPUT_KINDS = frozenset({
    "gelu", "GELU", "silu", "SiLU", "elu", "ELU", "leaky_relu", "LeakyReLU", "hardtanh",
    "ReLU6", "Mish", "mish", "softplus", "Softplus", "hardswish", "Hardswish",
    "LayerNorm", "layer_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "batch_norm",
    "GroupNorm", "group_norm", "RMSNorm", "rms_norm", "InstanceNorm2d", "instance_norm",
    "mul", "imul", "div", "pow", "rsqrt", "sqrt", "var",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "AvgPool2d", "avg_pool2d", "norm",
    "cross_entropy", "mse_loss", "nll_loss", "CrossEntropyLoss", "MSELoss",
})
#: max pooling: its backward reads the input and the argmax of every output element,
#: which it keeps as int64 (``max_pool2d_with_indices``)
MAX_POOL_KINDS = frozenset({
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "max_pool1d", "max_pool2d", "max_pool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d",
})
#: adaptive average pooling, whose output of one element per channel is a mean: its
#: backward needs only the input's shape
ADAPTIVE_AVG_KINDS = frozenset({
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d",
})
#: forward FLOPs per output element of elementwise / reduction ops the counter misses
ELEMENT_FLOPS = {
    "softmax": 5, "Softmax": 5, "log_softmax": 5, "LogSoftmax": 5, "_softmax": 5,
    "layer_norm": 8, "LayerNorm": 8, "batch_norm": 8, "BatchNorm1d": 8, "BatchNorm2d": 8,
    "BatchNorm3d": 8, "group_norm": 8, "GroupNorm": 8, "RMSNorm": 6, "rms_norm": 6,
    "gelu": 8, "GELU": 8, "silu": 4, "SiLU": 4, "tanh": 4, "Tanh": 4, "sigmoid": 4,
    "Sigmoid": 4,
}


@dataclass
class OpContext:
    """What the rules may look at for one op (tensors are fake: shapes and dtypes only)."""

    kind: str
    node: Any
    submod: nn.Module | None
    args: Any
    kwargs: Any
    outputs: list[torch.Tensor]
    act_inputs: list[torch.Tensor]  # tensor inputs not produced by a parameter fetch
    low_itemsize: int | None  # element size of the autocast dtype, or None


def _base(kind: str) -> str:
    """In-place variants (``add_``) follow their op's rule."""
    if kind.endswith("_") and not kind.startswith("_") and kind not in VIEW_KINDS:
        return kind[:-1]
    return kind


def _bytes(ts: list[torch.Tensor], itemsize: int | None = None) -> int:
    total = 0
    for t in ts:
        size = itemsize if (itemsize and t.is_floating_point()) else t.element_size()
        total += int(t.numel()) * size
    return total


def _numel(ts: list[torch.Tensor]) -> int:
    return sum(int(t.numel()) for t in ts)


def _rnn_shape(ctx: OpContext) -> tuple[int, list[tuple[int, int]], int, int] | None:
    """(steps x batch, [(numel W_ih, numel W_hh)], hidden, gates) of an RNN op, or None."""
    gates = RNN_GATES.get(ctx.kind)
    x = ctx.args[0] if ctx.args else None
    if gates is None or not isinstance(x, torch.Tensor):
        return None
    if isinstance(ctx.submod, nn.RNNBase):
        m = ctx.submod
        weights = dict(m.named_parameters())
        pairs = [(weights[f"weight_ih_l{k}{s}"].numel(), weights[f"weight_hh_l{k}{s}"].numel())
                 for k in range(m.num_layers)
                 for s in ([""] + (["_reverse"] if m.bidirectional else []))]
        return x.numel() // m.input_size, pairs, m.hidden_size, gates
    # aten.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, ...)
    params = ctx.args[2] if len(ctx.args) > 2 else []
    has_bias = bool(ctx.args[3]) if len(ctx.args) > 3 else True
    stride = 4 if has_bias else 2
    ws = [p for p in params if isinstance(p, torch.Tensor)]
    if len(ws) < 2:
        return None
    pairs = [(ws[i].numel(), ws[i + 1].numel()) for i in range(0, len(ws) - 1, stride)]
    hidden = ws[1].shape[-1]
    return x.numel() // ws[0].shape[-1], pairs, hidden, gates


def fallback_flops(ctx: OpContext) -> float:
    """Forward FLOPs of an op ``FlopCounterMode`` reported 0 for (see module docstring)."""
    kind, out = ctx.kind, ctx.outputs
    base = _base(kind)
    if base in ZERO_FLOP_KINDS or not out:
        return 0.0
    a = ctx.args
    if base in MATMUL_KINDS:
        if isinstance(ctx.submod, nn.Linear):
            return 2.0 * _numel(out) * ctx.submod.in_features
        x = next((t for t in a if isinstance(t, torch.Tensor)), None)
        if base in ("linear",) and len(a) > 1 and isinstance(a[1], torch.Tensor):
            return 2.0 * _numel(out) * a[1].shape[-1]
        if x is not None and x.dim() > 0 and base != "einsum":
            k = x.shape[-1] if base not in ("addmm", "baddbmm", "addmv") else a[1].shape[-1]
            return 2.0 * _numel(out) * k
    if base in CONV_KINDS:
        w = ctx.submod.weight if isinstance(ctx.submod, nn.modules.conv._ConvNd) else (
            a[1] if len(a) > 1 and isinstance(a[1], torch.Tensor) else None)
        if w is not None:
            per_out = math.prod(w.shape[1:])
            if "Transpose" in kind or "transpose" in kind:  # weight is [Cin, Cout/g, k...]
                return 2.0 * _numel(ctx.act_inputs[:1]) * math.prod(w.shape[1:])
            return 2.0 * _numel(out) * per_out
    rnn = _rnn_shape(ctx)
    if rnn is not None:
        tb, pairs, _, _ = rnn
        return 2.0 * tb * sum(wi + wh for wi, wh in pairs)
    if base in ATTENTION_KINDS and len(a) >= 3 and all(isinstance(t, torch.Tensor) for t in a[:3]):
        q, k = a[0], a[1]
        s = k.shape[-2]
        return 2.0 * q.numel() * s + 2.0 * out[0].numel() * s
    return float(_numel(out) * ELEMENT_FLOPS.get(kind, 1))


def work_fraction(ctx: OpContext) -> float:
    """The share of an op's FLOPs its kernels do: 0.5 for causal attention without a mask
    (flash and memory-efficient kernels skip the masked half of the scores), else 1."""
    if _base(ctx.kind) not in ATTENTION_KINDS or ctx.submod is not None:
        return 1.0
    a, kw = ctx.args, ctx.kwargs or {}
    mask = kw.get("attn_mask", a[3] if len(a) > 3 else None)
    causal = kw.get("is_causal", a[5] if len(a) > 5 else False)
    return 0.5 if causal is True and mask is None else 1.0


def _by_a_number(ctx: OpContext) -> bool:
    """Whether a product or quotient has one tensor operand (``0.5 * x``, ``x / 8.0``), the
    tensor first where it divides."""
    tensors = [isinstance(a, torch.Tensor) for a in ctx.args[:2]]
    return tensors.count(True) == 1 and (_base(ctx.kind) in ("mul", "imul") or tensors[0])


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                      "feature_alpha_dropout", "native_dropout", "feature_dropout"}


def draws_dropout(node: Any, submod: nn.Module | None) -> bool:
    """Whether an fx node is a dropout that draws random numbers in training (a module,
    ``F.dropout`` or ``aten.dropout`` / ``native_dropout``, with a nonzero probability, or
    one the graph does not give as a number): one with ``p == 0`` or ``training=False``
    returns its input and keeps no mask."""
    if submod is not None:
        return isinstance(submod, _DROPOUT_MODULES) and submod.p > 0
    if getattr(node, "op", None) != "call_function":
        return False
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name not in _DROPOUT_FUNCTIONS:
        return False
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    train = node.kwargs.get("training", node.kwargs.get(
        "train", node.args[2] if len(node.args) > 2 else True))
    return (not isinstance(p, (int, float)) or p > 0) and train is not False


def saved_parts(ctx: OpContext) -> tuple[list[tuple[torch.Tensor, int | None]], int]:
    """What autograd keeps for this op's backward (see module docstring): ``(tensors,
    fresh bytes)``. ``tensors`` are ``(tensor, itemsize)`` pairs, the tensor itself when
    ``itemsize`` is None, else a copy of it cast to ``itemsize`` bytes an element (autocast's);
    ``fresh`` counts what no other op can share (RNN gates, dropout masks, attention's
    extra outputs)."""
    kind, out, ins = ctx.kind, ctx.outputs, ctx.act_inputs
    base = _base(kind)

    def own(ts: list[torch.Tensor], itemsize: int | None = None):
        return [(t, itemsize if itemsize and t.is_floating_point()
                 and itemsize != t.element_size() else None) for t in ts]

    if base in VIEW_KINDS or base in NO_SAVE_KINDS:
        return [], 0
    if base in MATMUL_KINDS or base in CONV_KINDS:
        return own(ins, ctx.low_itemsize), 0
    if base in ATTENTION_KINDS:
        if kind == "MultiheadAttention" and out:
            extra = _bytes(out[1:]) if len(out) > 1 else 0
            return own(out[:1]), 4 * _bytes(ins[:1], ctx.low_itemsize) + extra
        return own(ins, ctx.low_itemsize) + own(out[:1]), 0
    rnn = _rnn_shape(ctx)
    if rnn is not None:
        tb, pairs, hidden, gates = rnn
        itemsize = out[0].element_size() if out else 4
        return own(ins[:1]), len(pairs) * tb * (gates + 2) * hidden * itemsize
    if base in SAVE_OUTPUT_KINDS:
        return own(out[:1]), 0
    if base in _SCALED_KINDS and _by_a_number(ctx):
        return [], 0  # autograd keeps the number, not the tensor
    if base in MAX_POOL_KINDS:
        return own(ins), _numel(out[:1]) * 8
    if base in ADAPTIVE_AVG_KINDS and out and all(
            s == 1 for s in out[0].shape[-_pool_dims(base):]):
        return [], 0  # a mean over the pooled dimensions
    if base in SAVE_INPUT_KINDS:
        # the GPUs' autocast runs its float32 list on float32 copies, and keeps those
        up = 4 if ctx.low_itemsize and base in GPU_FP32_OPS else None
        return own(ins, up), 0
    if base in ("Embedding", "embedding", "EmbeddingBag"):
        return own([t for t in ins if not t.is_floating_point()]), 0
    if base in ("Dropout", "dropout", "native_dropout", "Dropout1d", "Dropout2d"):
        # a mask of one byte an element, where it draws one (p = 0 returns the input)
        return [], _numel(out[:1]) if draws_dropout(ctx.node, ctx.submod) else 0
    if ctx.submod is not None:
        return own(ins), 0
    return own(out), 0


#: :func:`save_time`: the op keeps nothing for backward; only tensors it reads (autograd
#: packs them as the op is called, before its kernel runs); tensors it computes (packed
#: after it ran: its output, a norm's statistics, a dropout mask, attention's log-sum-exp)
SAVES_NOTHING, SAVES_INPUTS, SAVES_RESULTS = 0, 1, 2
#: view-like kinds whose backward reads an index tensor they are given
_INDEX_KINDS = frozenset({"index", "index_select", "gather", "scatter"})
#: kinds of :data:`SAVE_INPUT_KINDS` that keep something they compute as well
_SAVE_COMPUTED_TOO = frozenset({
    "LayerNorm", "layer_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "batch_norm",
    "GroupNorm", "group_norm", "RMSNorm", "rms_norm", "InstanceNorm2d", "instance_norm",
    "var", "norm", "sqrt", "rsqrt", "pow", "cross_entropy", "nll_loss", "CrossEntropyLoss",
})


def save_time(kind: str) -> int:
    """When autograd packs what an op of ``kind`` keeps for backward (:data:`SAVES_NOTHING`,
    :data:`SAVES_INPUTS`, :data:`SAVES_RESULTS`). A non-reentrant checkpoint's recompute
    stops once the region's last saved tensor is packed (``torch.utils.checkpoint``'s early
    stop): the region's trailing ops that keep nothing, and a last keeper that keeps only
    tensors it reads (a transformer block's last matmul), never run again. Kinds of no
    known rule keep what they compute (they run)."""
    base = _base(kind)
    if base in _INDEX_KINDS:
        return SAVES_INPUTS
    if base in VIEW_KINDS or base in NO_SAVE_KINDS:
        return SAVES_NOTHING
    if (base in MATMUL_KINDS or base in CONV_KINDS or base in ADAPTIVE_AVG_KINDS
            or base in ("Embedding", "embedding", "EmbeddingBag")
            or (base in SAVE_INPUT_KINDS and base not in _SAVE_COMPUTED_TOO)):
        return SAVES_INPUTS
    return SAVES_RESULTS


def _pool_dims(kind: str) -> int:
    """Dimensions an adaptive pooling kind pools over (the digit in its name)."""
    return next((int(c) for c in kind if c.isdigit()), 2)


def _part_bytes(t: torch.Tensor, itemsize: int | None) -> int:
    return int(t.numel()) * (itemsize or t.element_size())


def _tensor_key(t: torch.Tensor) -> tuple[int, int, int]:
    """What makes two tensors one allocation: storage, offset and element count."""
    try:
        return t.untyped_storage()._cdata, t.storage_offset(), int(t.numel())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return id(t), 0, int(t.numel())


def activation_bytes(ctx: OpContext) -> int:
    """Bytes autograd keeps for this op's backward, counting every saved tensor (see
    module docstring; :class:`SavedTensors` counts a tensor several ops save once)."""
    tensors, fresh = saved_parts(ctx)
    return fresh + sum(_part_bytes(t, s) for t, s in tensors)


class SavedTensors:
    """Activation bytes of a graph's ops, in topological order, each saved tensor counted
    once: at the first op that saves it (a convolution's input that the ReLU before it
    saves as its output, or one tensor every branch of an Inception module reads, is one
    allocation). A tensor is its storage, offset and size, so a view of a saved tensor
    is the same one, a chunk of it another. A cast copy (autocast) is the saving op's own."""

    def __init__(self) -> None:
        # key -> (tensor, the op that counts it); the tensor kept alive so that a
        # storage's address is not reused meanwhile
        self._seen: dict[tuple[int, int, int], tuple[torch.Tensor, str]] = {}

    def record(self, ctx: OpContext) -> tuple[int, tuple[tuple[str, int], ...]]:
        """``(bytes this op adds to what autograd keeps, (op, bytes) of the tensors it
        saves that an earlier op counts)``; the op is ``ctx.node.name``."""
        tensors, fresh = saved_parts(ctx)
        total = fresh
        shared: dict[tuple[str, int], None] = {}
        for t, itemsize in tensors:
            nbytes = _part_bytes(t, itemsize)
            if itemsize is None:
                key = _tensor_key(t)
                if key in self._seen:
                    shared[(self._seen[key][1], nbytes)] = None
                    continue
                self._seen[key] = (t, ctx.node.name)
            total += nbytes
        return total, tuple(shared)
