"""The Linear pairs tensor parallelism splits, found from the captured graph alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplace import workloads
from autoplace.capture import capture
from autoplace.errors import PlanError
from autoplace.executor.runner import capture_graph
from autoplace.lowering import lower, validate
from autoplace.plan import ParallelConfig, Plan
from autoplace.tensor_shards import find_tensor_shards
from tests.helpers.capture_models import ResidualMLP
from tests.helpers.plans import single


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaLikeLayer(nn.Module):
    """A Hugging Face Llama-style decoder layer: separate q/k/v projections viewed with
    sizes read from the input, an explicit softmax attention, a SwiGLU MLP."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        att = F.softmax(q @ k.transpose(-2, -1) / self.head_dim ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o_proj(y)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaLike(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaLikeLayer() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def gpt():
    return capture_graph(workloads.get("gpt-tiny"))


def test_gpt_attention_and_mlp_pairs(gpt):
    shards = find_tensor_shards(gpt, 2)
    assert [(p.columns, p.rows) for p in shards.pairs] == [
        (("blocks_0_attn_qkv",), ("blocks_0_attn_proj",)),
        (("blocks_0_mlp_fc",), ("blocks_0_mlp_proj",)),
        (("blocks_1_attn_qkv",), ("blocks_1_attn_proj",)),
        (("blocks_1_mlp_fc",), ("blocks_1_mlp_proj",))]
    attn = shards.pairs[0]
    # fused qkv: [3, heads, head_dim], split on heads, so its rows are regrouped by rank
    assert attn.regroup == (("blocks_0_attn_qkv", 3, 2, 32),)
    assert dict(attn.reshapes) == {"unflatten": 3, "flatten": 2}
    assert "scaled_dot_product_attention" in attn.inner
    assert shards.norms == ("blocks_0_ln1", "blocks_0_ln2", "blocks_1_ln1", "blocks_1_ln2")
    assert "head" not in shards.split_ops  # outside any block: stays whole


def test_hugging_face_like_layer_separate_qkv_and_swiglu():
    graph = capture(LlamaLike(), (torch.randn(2, 8, 32),))
    shards = find_tensor_shards(graph, 4)
    pairs = [(p.columns, p.rows) for p in shards.pairs]
    assert pairs[0] == (("layers_0_q_proj", "layers_0_k_proj", "layers_0_v_proj"),
                        ("layers_0_o_proj",))
    assert pairs[1] == (("layers_0_gate_proj", "layers_0_up_proj"), ("layers_0_down_proj",))
    assert len(pairs) == 4
    assert not shards.pairs[0].regroup  # each projection's heads are its outer factor
    with pytest.raises(PlanError, match=r"does not divide the split sizes \[4, 32"):
        find_tensor_shards(graph, 8)  # 4 heads


def test_no_pair_is_a_clear_error():
    # a residual MLP's Linears are not in a block (no integer module index)
    graph = capture(ResidualMLP(), (torch.randn(4, 16),))
    with pytest.raises(PlanError, match="no Linear pair to split"):
        validate(graph, single(graph, tensor=2))


def test_degree_not_dividing_heads_is_refused(gpt):
    with pytest.raises(PlanError, match=r"parallel.tensor=4 does not divide .* \[2, 64, 192\]"):
        validate(gpt, single(gpt, tensor=4))


def test_lowering_exposes_the_shards_and_refuses_a_cut_inside_a_unit(gpt):
    low = lower(gpt, single(gpt, tensor=2), device_type="cpu")
    assert low.tensor is not None and len(low.tensor.pairs) == 4
    assert lower(gpt, single(gpt), device_type="cpu").tensor is None
    cut = gpt.order.index("blocks_0_attn_proj")  # qkv on stage 0, its row on stage 1
    groups = {op: int(i >= cut) for i, op in enumerate(gpt.order)}
    plan = Plan.from_groups(gpt, groups, [0, 1],
                            parallel=ParallelConfig(pipeline=2, microbatches=2, tensor=2))
    with pytest.raises(PlanError, match="tensor-parallel unit of block 'blocks.0'"):
        validate(gpt, plan)
