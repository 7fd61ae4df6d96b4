"""estimate_costs under autocast: the GPUs' dtypes, autocast's casts, the backward's bytes
and gradient sums, and the work causal attention skips."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplace.capture import capture
from autoplace.cluster import Cluster, Device
from autoplace.costs.estimate import ATTENTION_EFFICIENCY, estimate_costs, op_traffic
from autoplace.graph import OpGraph, OpNode
from tests.helpers.capture_models import CausalAttention

BW, LAUNCH = 1e9, 1e-6


def _cluster() -> Cluster:
    dev = Device(name="d0", kind="toy", memory_bytes=2**30, peak_flops=1e15,
                 memory_bandwidth=BW, launch_overhead_s=LAUNCH)
    return Cluster.uniform("toy", dev, 1, alpha_s=1e-5, bandwidth=1e9)


class GeluNew(nn.Module):
    """A Linear and Hugging Face GPT-2's ``gelu_new`` written out (``pow`` first)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        inner = math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))
        return 0.5 * h * (1.0 + torch.tanh(inner))


def test_an_op_gpu_autocast_runs_in_float32_is_estimated_at_float32_bytes():
    g = capture(GeluNew(), (torch.randn(8, 64),), autocast_dtype="bfloat16")
    ops = {op.kind: op for op in g}
    assert g["fc"].output_dtypes == ("bfloat16",)
    # CUDA autocast runs pow in float32; everything it feeds follows by type promotion
    assert ops["pow"].output_dtypes == ("float32",)
    assert ops["tanh"].output_dtypes == ("float32",)
    estimate_costs(g, _cluster())
    pw = ops["pow"]
    n = 8 * 256
    assert pw.output_bytes == 4 * n
    # reads the bf16 Linear output and writes float32, after a cast kernel that reads
    # bf16 and writes float32
    cast = (2 * n + 4 * n) / BW + LAUNCH
    assert pw.fwd_time_s["toy"] == pytest.approx((2 * n + 4 * n) / BW + LAUNCH + cast)


def test_softmax_is_float32_under_autocast_and_the_cpu_policy_is_not_used():
    g = capture(CausalAttention(), (torch.randn(2, 8, 16),), autocast_dtype="bfloat16")
    kinds = {op.kind: op.output_dtypes for op in g}
    assert kinds["matmul"] == ("bfloat16",)
    assert kinds["softmax"] == ("float32",)


def _sdpa_flops(**kw) -> float:
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    q = torch.randn(2, 4, 32, 16)
    g = capture(Attn(), (q, q, q))
    return next(op.flops for op in g if op.kind == "scaled_dot_product_attention")


def test_causal_attention_does_half_the_work_a_masked_one_does_all():
    full = 2 * (2 * 4 * 32 * 16) * 32 * 2  # QK^T and PV
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    assert _sdpa_flops() == pytest.approx(full)
    assert _sdpa_flops(is_causal=True) == pytest.approx(full / 2)
    assert _sdpa_flops(attn_mask=mask) == pytest.approx(full)


def _graph(autocast: str | None = "bfloat16") -> OpGraph:
    """w (a parameter) -> h (float32, read by three ops) -> lin (matmul) / m (mul) /
    s (mul); x is a data input, mask an op of the data only."""
    nodes = [
        OpNode(name="x", kind="input", output_bytes=4000, output_dtypes=("float32",)),
        OpNode(name="w", kind="param", output_bytes=400, output_dtypes=("float32",)),
        OpNode(name="h", kind="mul", output_bytes=4000, output_dtypes=("float32",),
               activation_bytes=4000),
        OpNode(name="mask", kind="gt", output_bytes=1000, output_dtypes=("bool",)),
        OpNode(name="lin", kind="linear", output_bytes=2000, output_dtypes=("bfloat16",),
               flops=1e3),
        OpNode(name="m", kind="mul", output_bytes=4000, output_dtypes=("float32",),
               activation_bytes=4000),
        OpNode(name="s", kind="mul", output_bytes=4000, output_dtypes=("float32",)),
        OpNode(name="out", kind="output"),
    ]
    edges = [("x", "h", 4000), ("w", "h", 400), ("x", "mask", 4000), ("h", "lin", 4000),
             ("h", "m", 4000), ("mask", "m", 1000), ("h", "s", 4000), ("lin", "out", 2000),
             ("m", "out", 4000), ("s", "out", 4000)]
    g = OpGraph("toy", nodes, edges)
    g.autocast_dtype = autocast
    return g


def test_backward_reads_the_output_gradient_and_saved_tensors_and_writes_input_gradients():
    g = estimate_costs(_graph(), _cluster())
    m = g["m"]
    # grad of out (4000) + saved (4000) + grad of h (4000; the mask carries none)
    assert m.bwd_time_s["toy"] == pytest.approx(12000 / BW + LAUNCH)
    assert m.fwd_time_s["toy"] == pytest.approx((5000 + 4000) / BW + LAUNCH)
    assert g["mask"].bwd_time_s["toy"] == 0.0  # made from data only: no backward


def test_a_tensor_read_by_three_ops_gets_two_gradient_sums():
    traffic = op_traffic(_graph())
    assert traffic["h"].sums == 2 and traffic["h"].sum_bytes == 2 * 3 * 4000
    assert traffic["m"].sums == 0 and traffic["x"].sums == 0  # x carries no gradient
    g = estimate_costs(_graph(), _cluster())
    # h: grad of out + saved + grad of w, and the two sums with a launch each
    assert g["h"].bwd_time_s["toy"] == pytest.approx(
        (4000 + 4000 + 400) / BW + LAUNCH + 24000 / BW + 2 * LAUNCH)


def test_a_matmul_casts_its_float32_input_down_under_autocast_only():
    cast = (4000 + 2000) / BW + LAUNCH  # read float32, write bfloat16
    with_cast = estimate_costs(_graph(), _cluster())["lin"]
    without = estimate_costs(_graph(None), _cluster())["lin"]
    assert op_traffic(_graph())["lin"].casts == 1
    assert with_cast.fwd_time_s["toy"] - without.fwd_time_s["toy"] == pytest.approx(cast)
    assert with_cast.bwd_time_s["toy"] - without.bwd_time_s["toy"] == pytest.approx(cast)


def test_a_residual_add_only_casts_the_gradient_of_its_bfloat16_input():
    nodes = [
        OpNode(name="w", kind="param", output_bytes=400, output_dtypes=("float32",)),
        OpNode(name="r", kind="mul", output_bytes=4000, output_dtypes=("float32",)),
        OpNode(name="b", kind="linear", output_bytes=2000, output_dtypes=("bfloat16",),
               flops=1e3),
        OpNode(name="sum", kind="add", output_bytes=4000, output_dtypes=("float32",)),
        OpNode(name="same", kind="add", output_bytes=4000, output_dtypes=("float32",)),
        OpNode(name="out", kind="output"),
    ]
    edges = [("w", "r", 400), ("r", "b", 4000), ("r", "sum", 4000), ("b", "sum", 2000),
             ("sum", "same", 4000), ("r", "same", 4000), ("same", "out", 4000)]
    g = estimate_costs(OpGraph("res", nodes, edges), _cluster())
    # the float32 input takes the gradient as it is; the bf16 one's is read in float32
    # and written in bf16
    assert g["sum"].bwd_time_s["toy"] == pytest.approx((4000 + 2000) / BW + LAUNCH)
    assert g["same"].bwd_time_s["toy"] == 0.0  # both inputs float32: no kernel


def test_attention_runs_at_its_measured_share_of_peak():
    q = torch.randn(2, 4, 32, 16)

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    g = capture(Attn(), (q, q, q))
    dev = Device(name="d0", kind="fast", memory_bytes=2**30, peak_flops=1e9,
                 memory_bandwidth=1e15, launch_overhead_s=LAUNCH)
    estimate_costs(g, Cluster.uniform("fast", dev, 1, alpha_s=1e-5, bandwidth=1e9))
    op = next(op for op in g if op.kind == "scaled_dot_product_attention")
    assert op.fwd_time_s["fast"] == pytest.approx(
        op.flops / (1e9 * ATTENTION_EFFICIENCY) + LAUNCH, rel=1e-6)
