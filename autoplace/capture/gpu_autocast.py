"""The GPUs' autocast policy on CPU fake tensors, so a capture records the dtypes a plan's
ops have where it trains.

CPU and CUDA autocast cast the same ops down (matmuls, convolutions, attention), but
only CUDA's runs a list of ops in float32: ``pow``, ``exp``, ``rsqrt``, the norms,
``softmax``, ``sum``, the losses (ATen's ``AT_FORALL_FP32`` and
``AT_FORALL_FP32_SET_OPT_DTYPE`` in ``ATen/autocast_mode.h``, torch 2.11-2.13). A
Hugging Face GPT-2's ``gelu_new`` starts with ``pow(x, 3.0)``: under CUDA autocast the
whole chain after it (four multiplies and adds, a ``tanh``) is float32, under CPU
autocast bfloat16, half the bytes. Fake tensors on a ``cuda`` device would follow the
CUDA policy by themselves, but torch built without CUDA refuses to index them or record
their autograd graph; :class:`GpuAutocastPolicy` instead runs under CPU autocast as a
dispatch mode below it and casts the inputs of those ops to float32, as CUDA autocast
does before calling them. Ops that CPU autocast runs in float32 and CUDA's does not
(a few pooling, FFT and linear-algebra ops) keep CPU's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GPU_FP32_OPS", "GpuAutocastPolicy"]

#: aten ops CUDA autocast runs in float32 (their low-precision floating inputs cast up);
#: the ``fp32_set_opt_dtype`` ones (``softmax``, ``sum``...) output float32 likewise
#: where no dtype is asked for. Names as a dispatch mode sees them: ``layer_norm`` and
#: ``softmax`` arrive decomposed as ``native_layer_norm`` and ``_softmax``.
GPU_FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "nll_loss_forward",
    "nll_loss2d_forward", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
})
_FP32_UNLESS_DTYPE = frozenset({
    "prod", "softmax", "_softmax", "log_softmax", "_log_softmax", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "sum",
})


class GpuAutocastPolicy(TorchDispatchMode):
    """A dispatch mode that runs :data:`GPU_FP32_OPS` (and ``softmax``, ``sum`` and the
    other ops CUDA autocast gives a float32 dtype) on float32 copies of their ``low``
    dtype inputs. Enter it inside ``torch.autocast("cpu", low)`` and the fake mode."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "_opname", "")
        if name in GPU_FP32_OPS or (name in _FP32_UNLESS_DTYPE
                                    and kwargs.get("dtype") is None):
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._up, (args, kwargs))
        return func(*args, **kwargs)

    def _up(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if t.dtype == self.low else t
