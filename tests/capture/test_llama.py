"""The Llama-3 zoo: the tiny model captures and trains on CPU; the published sizes build on
the meta device (no memory) with their parameter counts and capture at full depth."""

from __future__ import annotations

import pytest
import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.lowering import block_regions
from autoplace.zoo.llama import (
    LlamaConfig,
    apply_rope,
    llama3_8b,
    llama3_70b,
    llama3_405b,
    rope_tables,
)


def test_tiny_llama_captures_and_trains_on_cpu(one_thread):
    wl = workloads.get("llama3-tiny")
    g = capture_workload(wl)
    assert g.capture_method == "fx"
    n_params = sum(p.numel() for p in wl.model.parameters())
    assert n_params == wl.model.config.num_parameters()
    assert g.param_bytes == 4 * n_params  # float32 weights
    kinds = {op.kind for op in g}
    assert {"RMSNorm", "Linear", "scaled_dot_product_attention", "silu", "Embedding"} <= kinds
    assert sorted(set(r for r in block_regions(g) if r)) == ["layers.0", "layers.1"]
    (tokens,), targets = wl.make_batch(2, "cpu")
    logits = wl.model(tokens)
    assert logits.shape == (2, 32, 256)
    loss = wl.loss_fn(logits, targets)
    loss.backward()
    assert torch.isfinite(loss) and wl.model.layers[0].attention.wk.weight.grad is not None


def test_rotary_positions_rotate_pairs():
    cos, sin = rope_tables(4, 8, 10000.0)
    x = torch.randn(1, 4, 2, 8)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y[:, 0], x[:, 0])  # position 0: angle 0
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # rotations keep norms


@pytest.mark.parametrize("preset, billions", [(llama3_8b, 8.03), (llama3_70b, 70.55),
                                              (llama3_405b, 405.85)])
def test_published_sizes_build_on_meta(preset, billions):
    cfg = preset()
    assert cfg.vocab_size == 128256 and cfg.seq_len == 8192 and cfg.rope_theta == 500000.0
    assert cfg.n_kv_heads == 8 and cfg.n_heads % cfg.n_kv_heads == 0
    name = {4096: "llama3-8b", 8192: "llama3-70b", 16384: "llama3-405b"}[cfg.dim]
    wl = workloads.get(name, device="meta")
    params = list(wl.model.parameters())
    assert all(p.is_meta for p in params)  # nothing allocated
    total = sum(p.numel() for p in params)
    assert total == cfg.num_parameters()
    assert abs(total / 1e9 - billions) < 0.01


def test_llama3_8b_captures_on_meta_at_full_depth():
    g = capture_workload(workloads.get("llama3-8b", device="meta", batch_size=1))
    blocks = [r for r in dict.fromkeys(block_regions(g)) if r]
    assert len(blocks) == 32
    assert g.param_bytes == 4 * llama3_8b().num_parameters()
    assert g.autocast_dtype == "bfloat16"
    sdpa = [op for op in g if op.kind == "scaled_dot_product_attention"]
    assert len(sdpa) == 32 and sdpa[0].output_shapes[0] == (1, 32, 8192, 128)
    head = next(op for op in g if op.target == "output")
    assert head.output_shapes[0] == (1, 8192, 128256)


def test_bad_config_names_the_problem():
    with pytest.raises(Exception, match="n_kv_heads"):
        LlamaConfig(n_heads=32, n_kv_heads=5)
