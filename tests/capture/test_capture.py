"""capture: fx and export paths, sizes and FLOPs against hand-computed values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplace import workloads
from autoplace.capture import capture, capture_workload
from autoplace.errors import CaptureError
from autoplace.workloads import Workload
from tests.helpers.capture_models import (
    CausalAttention,
    ConvNet,
    DataDependent,
    LSTMTagger,
    ResidualMLP,
    TiedLM,
)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _check_structure(graph, model) -> None:
    """Invariants every capture must satisfy."""
    gm = graph.module
    assert [n.name for n in gm.graph.nodes] == graph.order
    kinds = {op.kind for op in graph}
    assert "input" in kinds and "output" in kinds
    assert graph.param_bytes == _param_bytes(model)
    for node in gm.graph.nodes:  # one edge per data dependency, bytes of the producer
        for src in node.all_input_nodes:
            assert graph.edge_bytes(src.name, node.name) == graph[src.name].output_bytes
    for op in graph:
        assert op.output_bytes >= 0 and op.activation_bytes >= 0 and op.flops >= 0
        assert len(op.output_shapes) == len(op.output_dtypes)


def test_residual_mlp_fx_sizes_flops_and_outputs():
    torch.manual_seed(0)
    model = ResidualMLP(dim=16, hidden=32)
    x = torch.randn(4, 16)
    g = capture(model, (x,), name="mlp")
    assert g.capture_method == "fx" and g.name == "mlp"
    _check_structure(g, model)
    up = g["ups_0"]  # Linear(16, 32) on [4, 16]
    assert up.kind == "Linear" and up.target == "ups.0" and up.module_path == "ups.0"
    assert up.output_shapes == ((4, 32),) and up.output_dtypes == ("float32",)
    assert up.output_bytes == 4 * 32 * 4
    assert up.param_bytes == (16 * 32 + 32) * 4
    assert up.param_names == ("ups.0.weight", "ups.0.bias")
    assert up.flops == 2 * 4 * 16 * 32
    assert up.activation_bytes == 4 * 16 * 4  # the input
    relu = g["relu"]
    assert relu.kind == "relu" and relu.activation_bytes == 4 * 32 * 4 and relu.flops == 4 * 32
    add = g["add"]
    assert add.kind == "add" and add.activation_bytes == 0
    assert g.preds("add") == ["x", "downs_0"]
    assert g.edge_bytes("x", "ups_0") == 4 * 16 * 4
    assert g["output"].kind == "output" and g["x"].kind == "input"
    torch.testing.assert_close(g.module(x), model(x))


def test_lstm_and_embedding_hand_values():
    torch.manual_seed(0)
    model = LSTMTagger(vocab=100, dim=8, hidden=16)
    tokens = torch.randint(0, 100, (2, 5))
    g = capture(model, (tokens,))
    _check_structure(g, model)
    emb = g["emb"]
    assert emb.kind == "Embedding" and emb.output_shapes == ((2, 5, 8),)
    assert emb.output_bytes == 2 * 5 * 8 * 4 and emb.param_bytes == 100 * 8 * 4
    assert emb.flops == 0 and emb.activation_bytes == 2 * 5 * 8  # int64 indices
    lstm = g["lstm"]
    assert lstm.kind == "LSTM"
    assert lstm.output_shapes == ((2, 5, 16), (2, 2, 16), (2, 2, 16))
    # 2 layers: 2 * T*B * 4H * (I + H), I = 8 then 16
    assert lstm.flops == 2 * 10 * 64 * (8 + 16) + 2 * 10 * 64 * (16 + 16)
    # input + per layer per step: 4 gates + c + h
    assert lstm.activation_bytes == 2 * 5 * 8 * 4 + 2 * 10 * 6 * 16 * 4
    assert lstm.param_bytes == 4 * (64 * 8 + 64 * 16 + 2 * 64 + 64 * 16 + 64 * 16 + 2 * 64)
    torch.testing.assert_close(g.module(tokens), model(tokens))


def test_conv_hand_values():
    torch.manual_seed(0)
    model = ConvNet()
    x = torch.randn(2, 3, 8, 8)
    g = capture(model, (x,))
    _check_structure(g, model)
    conv = g["conv"]
    assert conv.kind == "Conv2d" and conv.output_shapes == ((2, 8, 8, 8),)
    assert conv.output_bytes == 2 * 8 * 8 * 8 * 4
    assert conv.flops == 2 * (2 * 8 * 8 * 8) * 3 * 3 * 3
    assert conv.param_bytes == (8 * 3 * 9 + 8) * 4
    assert conv.activation_bytes == 2 * 3 * 8 * 8 * 4
    assert g["bn"].param_bytes == 16 * 4  # running stats are buffers, not parameters
    model.eval()
    g.module.eval()
    torch.testing.assert_close(g.module(x), model(x))


def test_shape_dependent_python_falls_back_to_export():
    torch.manual_seed(0)
    model = CausalAttention(dim=16)
    x = torch.randn(2, 6, 16)
    g = capture(model, (x,), name="attn")
    assert g.capture_method == "export"
    _check_structure(g, model)
    qkv = g["linear"]
    assert qkv.kind == "linear" and qkv.module_path == "qkv"
    assert qkv.flops == 2 * 2 * 6 * 16 * 48
    assert g["linear_1"].module_path == "proj"
    assert g["qkv_weight"].kind == "param" and g["qkv_weight"].param_bytes == 16 * 48 * 4
    mm = g["matmul"]  # q @ k^T: [2, 6, 16] x [2, 16, 6]
    assert mm.kind == "matmul" and mm.output_shapes == ((2, 6, 6),)
    assert mm.flops == 2 * (2 * 6 * 6) * 16
    torch.testing.assert_close(g.module(x), model(x))
    # the exported module holds the model's own parameters and trains with autograd
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in g.module.parameters()} == own
    g.module(x).square().mean().backward()
    assert model.qkv.weight.grad is not None and model.qkv.weight.grad.abs().sum() > 0
    g.module.train()  # allowed (the graph stays the training graph)
    torch.testing.assert_close(g.module(x[:1]), model(x[:1]))  # batch is symbolic


def test_untraceable_model_raises_capture_error_naming_the_line():
    with pytest.raises(CaptureError, match=r"if x\.sum\(\) > 0"):
        capture(DataDependent(), (torch.randn(2, 4),), name="dd")


def test_tied_weights_counted_once():
    model = TiedLM(vocab=50, dim=8)
    g = capture(model, (torch.randint(0, 50, (2, 3)),))
    assert g.param_bytes == 50 * 8 * 4
    assert g["emb"].param_bytes == 50 * 8 * 4 and g["head"].param_bytes == 0
    assert g["head"].param_names == ("emb.weight",)


def test_autocast_counts_matmul_outputs_at_bf16():
    model = ResidualMLP(dim=16, hidden=32)
    x = torch.randn(4, 16)
    g32 = capture(model, (x,))
    g16 = capture(model, (x,), autocast_dtype="bfloat16")
    assert g16["ups_0"].output_dtypes == ("bfloat16",)
    assert g16["ups_0"].output_bytes == g32["ups_0"].output_bytes // 2
    assert g16["ups_0"].activation_bytes == g32["ups_0"].activation_bytes // 2
    assert g16.edge_bytes("ups_0", "relu") == 4 * 32 * 2
    assert g16["x"].output_bytes == g32["x"].output_bytes  # inputs keep their dtype
    assert g16.param_bytes == g32.param_bytes


def test_meta_model_captures_without_memory():
    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.ln(x))))

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(50000, 2048), *[Block(2048) for _ in range(24)])
        tokens = torch.randint(0, 50000, (8, 1024))
    g = capture(model, (tokens,), autocast_dtype="bfloat16")
    assert g.param_bytes == _param_bytes(model) > 3 * 2**30
    assert next(op for op in g if op.target == "1.up").flops == 2 * 8 * 1024 * 2048 * 8192
    assert next(op for op in g if op.target == "1.up").output_bytes == 8 * 1024 * 8192 * 2


def test_capture_workload_sets_spec_and_batch_size():
    wl = Workload(
        name="tiny",
        model=ResidualMLP(),
        make_batch=lambda bs, dev: ((torch.randn(bs, 16, device=dev),), torch.zeros(bs, 4)),
        loss_fn=F.mse_loss,
        batch_size=8,
        spec={"spec": "tiny", "options": {"a": 1}},
    )
    g = capture_workload(wl, batch_size=6)
    assert g.name == "tiny" and g.batch_size == 6
    assert g.spec == {"spec": "tiny", "options": {"a": 1}} and g.spec is not wl.spec
    assert g["x"].output_shapes == ((6, 16),)


def test_hf_gpt2_via_export():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    g = capture(model, (ids,), name="gpt2")
    assert g.capture_method == "export"
    assert g.param_bytes == _param_bytes(model)  # wte and lm_head are tied: once
    kinds = {op.kind for op in g}
    assert {"embedding", "layer_norm", "scaled_dot_product_attention"} <= kinds
    paths = {op.module_path for op in g if op.kind == "layer_norm"}
    assert "transformer.h.0.ln_1" in paths and "transformer.ln_f" in paths
    torch.testing.assert_close(g.module(ids).logits, model(ids).logits)


def test_torchvision_resnet18():
    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    g = capture(model, (x,))
    _check_structure(g, model)
    g.module.eval()
    torch.testing.assert_close(g.module(x), model(x))


def _zoo_names() -> list[str]:
    try:
        return workloads.names()
    except Exception:  # the zoo is optional for this test file
        return []


@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_captures_on_meta(name):
    wl = workloads.get(name, device="meta")
    g = capture_workload(wl)  # (how long it takes is a benchmark's business, not a test's)
    assert g.name == wl.name and g.spec["spec"] == name and g.batch_size == wl.batch_size
    assert g.param_bytes == _param_bytes(wl.model)
    assert g.flops > 0 and len(g) > 3


class _Head(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(16, vocab)

    def forward(self, x):
        return self.proj(x)


def _classifier(vocab: int, loss_fn) -> Workload:
    return Workload(
        name="head", model=_Head(vocab),
        make_batch=lambda bs, dev: ((torch.randn(bs, 16, device=dev),),
                                    torch.randint(0, vocab, (bs,), device=dev)),
        loss_fn=loss_fn, batch_size=64)


def test_loss_workspace_is_the_cross_entropy_peak_on_the_output_op():
    g = capture_workload(_classifier(1000, F.cross_entropy))
    out = next(op for op in g if op.kind == "output")
    logits = 64 * 1000 * 4
    # logits, their float32 log-softmax (kept for backward), the gradient of the
    # log-softmax and the gradient of the logits: at most four logits-sized tensors
    assert 2.5 * logits <= out.workspace_bytes <= 4 * logits
    assert out.transient_bytes == out.workspace_bytes
    assert all(op.workspace_bytes == 0 for op in g if op.kind != "output")


def test_loss_that_cannot_run_on_meta_has_no_workspace():
    def host_loss(output, target):  # reads values: impossible on meta
        return output.sum() * float(target.float().mean())

    g = capture_workload(_classifier(10, host_loss))
    assert next(op for op in g if op.kind == "output").workspace_bytes == 0
