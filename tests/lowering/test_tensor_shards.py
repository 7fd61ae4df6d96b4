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


class EmbeddedLlamaLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.body = LlamaLike()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens))


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


class GroupedQueryLayer(LlamaLikeLayer):
    """Hugging Face's grouped-query attention: 2 key/value heads for 4 query heads, repeated
    by ``expand`` with explicit sizes then ``reshape`` (``repeat_kv``), or by
    ``repeat_interleave``."""

    def __init__(self, repeat: str, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__(dim, heads)
        self.repeat, self.kv_heads = repeat, kv_heads
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        if self.repeat == "expand":
            k = k[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(
                b, self.heads, t, self.head_dim)
            v = v[:, :, None].expand(b, self.kv_heads, rep, t, self.head_dim).reshape(
                b, self.heads, t, self.head_dim)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class GroupedQuery(nn.Module):
    def __init__(self, repeat: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GroupedQueryLayer(repeat)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


@pytest.mark.parametrize("repeat", ["expand", "repeat_interleave"])
def test_grouped_query_attention_splits_the_kv_heads(repeat):
    graph = capture(GroupedQuery(repeat), (torch.randn(2, 8, 32),))
    attn = find_tensor_shards(graph, 2).pairs[0]
    assert attn.columns == ("layers_0_q_proj", "layers_0_k_proj", "layers_0_v_proj")
    assert attn.rows == ("layers_0_o_proj",)
    assert 2 in attn.split_sizes  # the key/value heads
    expands = [op for op, _ in attn.reshapes if op.startswith("expand")]
    assert len(expands) == (2 if repeat == "expand" else 0)  # explicit sizes: rewritten
    with pytest.raises(PlanError, match=r"does not divide the split sizes \[2, 4"):
        find_tensor_shards(graph, 4)  # 4 query heads, but 2 key/value heads


def test_llama3_grouped_query_attention_with_rotary_embeddings():
    graph = capture_graph(workloads.get("llama3-tiny"))
    shards = find_tensor_shards(graph, 2)
    assert [(p.columns, p.rows) for p in shards.pairs[:2]] == [
        (("layers_0_attention_wq", "layers_0_attention_wk", "layers_0_attention_wv"),
         ("layers_0_attention_wo",)),
        (("layers_0_feed_forward_w1", "layers_0_feed_forward_w3"),
         ("layers_0_feed_forward_w2",))]
    assert "stack" in shards.pairs[0].inner  # the rotary pairs, on each rank's heads
    with pytest.raises(PlanError, match=r"parallel.tensor=4 does not divide .* \[2, 4, 32, 64\]"):
        find_tensor_shards(graph, 4)


def test_sequence_parallel_stream(gpt):
    seq = lower(gpt, single(gpt, tensor=2, sequence_parallel=True), device_type="cpu") \
        .tensor.sequence
    assert seq.seq_len == 32
    assert seq.stream == ("blocks_0_ln1", "add_1", "blocks_0_ln2", "add_2",
                          "blocks_1_ln1", "add_3", "blocks_1_ln2", "add_4")
    assert seq.entries == ("add",)  # token + position embeddings, scattered
    assert seq.exits == ("add_4",)  # gathered before the final norm and the head
    assert seq.gathers == seq.modules == ("blocks_0_ln1", "blocks_0_ln2", "blocks_1_ln1",
                                          "blocks_1_ln2")
    assert lower(gpt, single(gpt, tensor=2), device_type="cpu").tensor.sequence is None


def test_sequence_parallel_refusals(gpt):
    # the stream starts at the model's input: no op of the program makes it to scatter
    graph = capture(LlamaLike(), (torch.randn(2, 8, 32),))
    with pytest.raises(PlanError, match=r"sequence_parallel: \w+ on the residual stream reads "
                                        r"x \(placeholder\)"):
        validate(graph, single(graph, tensor=2, sequence_parallel=True))
    # embeddings read by the stream and by a shape read outside it (``b, t, _ = x.shape``)
    graph = capture(EmbeddedLlamaLike(), (torch.randint(0, 64, (2, 8)),))
    with pytest.raises(PlanError, match=r"embed feeds the residual stream \(\w+\) and ops "
                                        "outside it"):
        validate(graph, single(graph, tensor=2, sequence_parallel=True))
    with pytest.raises(PlanError, match="needs parallel.tensor > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(PlanError, match="parallel.pipeline = 1"):
        ParallelConfig(tensor=2, pipeline=2, microbatches=2, sequence_parallel=True)
    par = ParallelConfig(tensor=2, sequence_parallel=True)
    assert par.to_json()["sequence_parallel"] is True
    assert ParallelConfig.from_json(par.to_json()) == par
    assert "sequence_parallel" not in ParallelConfig(tensor=2).to_json()
    assert par.describe() == "tp=2/sp"


def test_exported_graph_is_refused_with_the_reason():
    hf_models = pytest.importorskip("tests.helpers.hf_models")
    graph = capture_graph(hf_models.gpt2(layers=1))
    assert graph.capture_method == "export"
    with pytest.raises(PlanError, match="captured by torch.export, whose program calls no "
                                        "modules"):
        validate(graph, single(graph, tensor=2))
