"""The built-in model zoo: every workload builds, trains a step, traces, and has the right size."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from autoplace import workloads
from autoplace.errors import AutoplaceError
from autoplace.zoo import GNMT, GNMTConfig, GPTConfig, gpt_1b
from autoplace.zoo.gpt import Block
from tests.helpers import ROOT

ZOO_NAMES = [
    "gpt-tiny",
    "gpt-small",
    "gpt-medium",
    "gpt-1b",
    "rnnlm",
    "gnmt-2",
    "gnmt-4",
    "gnmt-8",
    "inception-v3",
    "resnet50",
    "branchy-mlp",
    "llama3-tiny",
]
#: built on the meta device only (their shapes and capture: tests/capture/test_llama.py)
META_ONLY = ["llama3-8b", "llama3-70b", "llama3-405b"]
# shrink the big presets so every name runs in well under a second on a CPU
SMALL = {
    "gpt-small": dict(d_model=32, n_layers=2, n_heads=2, vocab_size=64, seq_len=16),
    "gpt-medium": dict(d_model=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=16),
    "gpt-1b": dict(d_model=32, n_layers=1, n_heads=2, vocab_size=64, seq_len=16),
    "inception-v3": dict(width=0.125),
    "resnet50": dict(width=0.125, image_size=32, blocks=(1, 1, 1, 1)),
}
BATCH = 2


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def small(name: str, **kwargs) -> workloads.Workload:
    return workloads.get(name, batch_size=BATCH, **{**SMALL.get(name, {}), **kwargs})


def test_names_are_the_documented_zoo():
    assert sorted(workloads.names()) == sorted(ZOO_NAMES + META_ONLY)
    for name in ZOO_NAMES + META_ONLY:
        factory, defaults, description = workloads.ZOO[name]
        assert description and "batch_size" in defaults


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_forward_backward_finite(name):
    wl = small(name)
    inputs, targets = wl.make_batch(BATCH, "cpu")
    for t in (*inputs, targets):
        assert t.shape[0] == BATCH and t.device.type == "cpu"
    loss = wl.loss_fn(wl.model(*inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in wl.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert wl.spec["spec"] == name and wl.spec["options"]["batch_size"] == BATCH


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_fx_trace_matches_model(name):
    wl = small(name)
    traced = torch.fx.symbolic_trace(wl.model)
    inputs = wl.example_inputs(BATCH)
    expected = wl.model(*inputs)
    torch.testing.assert_close(traced(*inputs), expected, rtol=0, atol=0)
    # every nn.LSTM / nn.Linear / nn.Conv2d is one node (a leaf), never inlined
    leaves = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    for mod_name, mod in wl.model.named_modules():
        if isinstance(mod, (nn.LSTM, nn.Linear, nn.Conv2d)):
            assert mod_name in leaves, mod_name


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_meta_build_at_default_size(name):
    wl = workloads.get(name, device="meta")
    assert all(p.is_meta for p in wl.model.parameters())
    inputs, targets = wl.make_batch(BATCH, "meta")
    assert all(t.is_meta and t.shape[0] == BATCH for t in (*inputs, targets))
    # the batch maker's fixed tensors were made on the CPU despite the meta context
    cpu_inputs, _ = wl.make_batch(BATCH, "cpu")
    assert all(t.device.type == "cpu" for t in cpu_inputs)


def test_gpt_1b_is_the_measured_workload():
    wl = workloads.get("gpt-1b", device="meta")
    d, layers, vocab, seq = 2048, 16, 50304, 1024
    expected = layers * (12 * d * d + 13 * d) + 2 * vocab * d + seq * d + 2 * d
    assert n_params(wl.model) == expected == 1_013_878_784
    assert wl.batch_size == 8 and wl.autocast_dtype == "bfloat16"
    assert wl.model.head.bias is None
    assert wl.model.head.weight is not wl.model.tok_emb.weight
    inputs = wl.example_inputs(device="meta")
    assert inputs[0].shape == (8, 1024) and inputs[0].dtype == torch.int64
    assert wl.model(*inputs).shape == (8, 1024, vocab)
    assert gpt_1b() == GPTConfig(
        vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=16
    )


def test_hand_counted_layer_sizes():
    d = 48
    assert n_params(Block(GPTConfig(d_model=d, n_heads=4))) == 12 * d * d + 13 * d

    cfg = GNMTConfig(hidden=32, vocab_size=50, layers=4)
    model = GNMT(cfg)
    h = 32

    def lstm(i: int, hidden: int) -> int:  # weight_ih, weight_hh, bias_ih, bias_hh
        return 4 * (hidden * (i + hidden) + 2 * hidden)

    assert n_params(model.encoder.lstms[0]) == 2 * lstm(h, h // 2)  # bidirectional
    assert n_params(model.encoder.lstms[1]) == lstm(h, h)
    assert n_params(model.decoder.lstms[1]) == lstm(2 * h, h)  # reads [h, context]

    rnnlm = workloads.get("rnnlm", hidden=16, vocab_size=30).model
    assert n_params(rnnlm) == 30 * 16 + 2 * lstm(16, 16) + 16 * 30 + 30

    resnet = workloads.get("resnet50", device="meta", width=1.0, num_classes=1000).model
    assert resnet.stem[0].weight.shape == (64, 3, 7, 7)
    assert n_params(resnet) == 25_557_032  # torchvision resnet50

    inception = workloads.get(
        "inception-v3", device="meta", width=1.0, num_classes=1000, image_size=299
    ).model
    conv = inception.blocks[4].b7_2.conv  # first InceptionC's 1x7 conv, 128 -> 128
    assert conv.weight.numel() == 128 * 128 * 1 * 7
    assert n_params(inception) == 23_834_568  # torchvision inception_v3 minus aux head

    mlp = workloads.get(
        "branchy-mlp", in_dim=8, hidden=16, branches=3, depth=2, num_classes=5
    ).model
    assert n_params(mlp) == (8 * 16 + 16) + 3 * 2 * (16 * 16 + 16) + (3 * 16 * 5 + 5)


def test_sizes_follow_options():
    wl = workloads.get(
        "gnmt-8",
        device="meta",
        hidden=1024,
        vocab_size=32000,
        src_len=50,
        tgt_len=50,
        batch_size=128,
    )
    assert len(wl.model.encoder.lstms) == 8 and len(wl.model.decoder.lstms) == 8
    assert wl.batch_size == 128
    (src, tgt_in), tgt_out = wl.make_batch(4, "meta")
    assert src.shape == tgt_in.shape == tgt_out.shape == (4, 50)
    assert wl.model(src, tgt_in).shape == (4, 50, 32000)
    assert len(workloads.get("rnnlm", layers=3).model.lstms) == 3
    images = workloads.get("inception-v3", image_size=299).example_inputs(1, "meta")[0]
    assert images.shape == (1, 3, 299, 299)


def test_batches_are_deterministic_and_learnable_shapes():
    wl = workloads.get("gnmt-2")
    torch.manual_seed(3)
    (src, tgt_in), tgt_out = wl.make_batch(4, "cpu")
    torch.manual_seed(3)
    (src2, _), _ = wl.make_batch(4, "cpu")
    assert torch.equal(src, src2)
    assert torch.equal(tgt_out, src.flip(1))  # the reversal task
    assert (tgt_in[:, 0] == 0).all() and torch.equal(tgt_in[:, 1:], tgt_out[:, :-1])
    (tokens,), nxt = workloads.get("gpt-tiny").make_batch(4, "cpu")
    assert torch.equal(tokens[:, 1:], nxt[:, :-1])


def test_weights_depend_only_on_seed():
    a = workloads.get("branchy-mlp", seed=1).model.state_dict()
    b = workloads.get("branchy-mlp", seed=1).model.state_dict()
    c = workloads.get("branchy-mlp", seed=2).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["proj.weight"], c["proj.weight"])


def test_gpt_tiny_learns():
    wl = workloads.get("gpt-tiny")
    opt = torch.optim.AdamW(wl.model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    losses = []
    for _ in range(40):
        inputs, targets = wl.make_batch(16, "cpu")
        loss = wl.loss_fn(wl.model(*inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.2)
    assert losses[-1] < losses[0] - 0.5


def test_unknown_name_lists_valid_names():
    with pytest.raises(AutoplaceError) as e:
        workloads.get("nope")
    assert "'nope'" in str(e.value)
    for name in ZOO_NAMES:
        assert name in str(e.value)


def test_unknown_option_lists_valid_options():
    with pytest.raises(AutoplaceError, match="d_modle.*valid:.*d_model"):
        workloads.get("gpt-tiny", d_modle=32)
    with pytest.raises(AutoplaceError, match="not divisible"):
        workloads.get("gpt-tiny", d_model=30, n_heads=4)
    with pytest.raises(AutoplaceError, match="attention"):
        workloads.get("gnmt-2", attention="luong")


def test_additive_attention_traces():
    wl = workloads.get("gnmt-4", attention="additive")
    traced = torch.fx.symbolic_trace(wl.model)
    inputs = wl.example_inputs(2)
    torch.testing.assert_close(traced(*inputs), wl.model(*inputs), rtol=0, atol=0)


def test_user_factory_by_module_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    wl = workloads.get("tests.helpers.zoo_user_workload:tiny_regression", features=5)
    assert wl.name == "tiny-regression" and wl.model.in_features == 5
    assert wl.spec == {
        "spec": "tests.helpers.zoo_user_workload:tiny_regression",
        "options": {"features": 5},
    }
    inputs, targets = wl.make_batch(3, "cpu")
    assert torch.isfinite(wl.loss_fn(wl.model(*inputs), targets))


def test_user_factory_errors(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    with pytest.raises(AutoplaceError, match="cannot import workload module 'no_such_pkg.mod'"):
        workloads.get("no_such_pkg.mod:factory")
    with pytest.raises(AutoplaceError, match="no callable 'missing'"):
        workloads.get("tests.helpers.zoo_user_workload:missing")
