"""An exported graph's causal mask built from shapes becomes ``is_causal`` (capture.attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplace.capture import capture_workload
from autoplace.capture.attention import causal_from_shapes
from autoplace.capture.tracing import _export

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def sdpa_calls(gm):
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function" and n.target is SDPA]


def mask_and_causal(node):
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return mask, causal


class Attention(nn.Module):
    """One attention over ``x [B, S, D]`` with a mask made by ``make_mask(x)``;
    ``data.item()``-free: export must keep the mask as graph ops."""

    def __init__(self, make_mask, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads = heads
        self.make_mask = make_mask

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(x))
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def causal_bool(x):
    s = x.shape[1]
    i = torch.arange(s, device=x.device)
    return (i[None, :] <= i[:, None])[None, None].expand(x.shape[0], 1, s, s)


def causal_float(x):
    allowed = causal_bool(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(allowed, zero, torch.finfo(x.dtype).min)


def everything(x):
    s = x.shape[1]
    return torch.ones(x.shape[0], 1, s, s, dtype=torch.bool, device=x.device)


def window(x):  # a sliding window of 2: causal and more
    s = x.shape[1]
    i = torch.arange(s, device=x.device)
    return ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2))[None, None]


def from_data(x):  # padding read from the input's values
    keep = x[..., 0] > 0
    return keep[:, None, None, :].expand(-1, 1, x.shape[1], -1)


@pytest.mark.parametrize("make_mask,kind", [(causal_bool, "causal"), (causal_float, "causal"),
                                            (everything, "none"), (window, None),
                                            (from_data, None)])
def test_a_mask_built_from_shapes_becomes_is_causal_or_goes_and_others_stay(make_mask, kind):
    torch.manual_seed(0)
    model = Attention(make_mask)
    x = torch.randn(4, 8, 16)
    gm = _export(model, (x,))
    (node,) = sdpa_calls(gm)
    mask, causal = mask_and_causal(node)
    if kind is None:
        assert isinstance(mask, torch.fx.Node) and not causal
    else:
        assert mask is None and causal is (kind == "causal")
    # the rewritten graph computes what the model does, at a batch size not exported
    x5 = torch.randn(5, 8, 16)
    torch.testing.assert_close(gm(x5), model(x5), rtol=1e-5, atol=1e-5)
    # nothing left that only built the mask
    if kind is not None:
        assert not any(n.target in (torch.ops.aten.arange.default, torch.ops.aten.expand.default)
                       for n in gm.graph.nodes if n.op == "call_function")


def test_a_mask_too_long_to_compute_stays(monkeypatch):
    """A mask of more elements than ``_MAX_MASK`` is not computed: it stays, and the graph
    still computes what the model does; likewise a key repeated per head."""
    import autoplace.capture.attention as attention

    monkeypatch.setattr(attention, "_MAX_MASK", 8 * 8)  # the test's sequence of 8, batch 2
    model = Attention(causal_bool)
    gm = _export(model, (torch.randn(4, 8, 16),))
    (node,) = sdpa_calls(gm)
    assert isinstance(mask_and_causal(node)[0], torch.fx.Node)
    x = torch.randn(3, 8, 16)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    # nor is a repeated key of more elements: it stays repeated
    grouped = GroupedQuery(interleave=True)
    (node,) = sdpa_calls(_export(grouped, (torch.randn(4, 8, 16),)))
    assert not node.kwargs.get("enable_gqa")


class GroupedQuery(nn.Module):
    """4 query heads over 2 key/value heads, the keys and values repeated to 4 heads first,
    each head twice in turn (``interleave``, as transformers' and torchtitan's repeat_kv)
    or the two heads tiled (not what grouped-query attention means)."""

    def __init__(self, interleave: bool, padded: bool = False, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim)
        self.interleave = interleave
        self.padded = padded

    def forward(self, x):
        b, s, d = x.shape
        q = self.q(x).view(b, s, 4, d // 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, d // 4).permute(2, 0, 3, 1, 4)
        if self.interleave:
            k, v = (t[:, :, None].expand(b, 2, 2, s, d // 4).reshape(b, 4, s, d // 4)
                    for t in (k, v))
        else:
            k, v = (t[:, None].expand(b, 2, 2, s, d // 4).reshape(b, 4, s, d // 4)
                    for t in (k, v))
        if self.padded:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=from_data(x))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, d)


@pytest.mark.parametrize("interleave,padded", [(True, False), (False, False), (True, True)])
def test_keys_and_values_repeated_per_head_go_to_attention_as_grouped_query(interleave, padded):
    """Repeated per head, without a mask: grouped. Tiled: not grouped-query attention, left.
    With a mask read from the data: left too (grouped with a mask, attention has no fused
    kernel)."""
    torch.manual_seed(0)
    model = GroupedQuery(interleave, padded)
    gm = _export(model, (torch.randn(4, 8, 16),))
    (node,) = sdpa_calls(gm)
    heads = [a.meta["val"].shape[1] for a in node.args[1:3]]
    if interleave and not padded:
        assert node.kwargs.get("enable_gqa") is True and heads == [2, 2]
        assert not any(n.target is torch.ops.aten.expand.default for n in gm.graph.nodes)
    else:
        assert not node.kwargs.get("enable_gqa") and heads == [4, 4]
    x5 = torch.randn(5, 8, 16)
    torch.testing.assert_close(gm(x5), model(x5), rtol=1e-5, atol=1e-5)


def test_a_hugging_face_llama_is_captured_without_its_mask_and_trains_alike():
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import llama

    torch.manual_seed(0)
    wl = llama(layers=2, hidden=64, seq=16, batch_size=4)
    g = capture_workload(wl)
    assert g.capture_method == "export"
    attention = [op for op in g.ops if op.kind == "scaled_dot_product_attention"]
    assert len(attention) == 2
    assert all(len(g.preds(op.name)) == 3 for op in attention)  # query, key, value
    assert causal_from_shapes(g.module) == 0  # nothing left to rewrite


def test_a_hugging_face_llama_exported_computes_what_the_model_does():
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import llama

    torch.manual_seed(0)
    wl = llama(layers=2, hidden=64, seq=16, batch_size=4)
    (ids,), _ = wl.make_batch(4, "cpu")
    gm = _export(wl.model, (ids,))
    calls = sdpa_calls(gm)
    assert len(calls) == 2
    assert all(mask_and_causal(n) == (None, True) for n in calls)
    # its keys and values go in with their 2 heads, not repeated to the queries' 4
    assert all(n.kwargs.get("enable_gqa") and n.args[1].meta["val"].shape[1] == 2
               for n in calls)
    ids3 = ids[:3]  # another batch size than exported
    out = gm(ids3)
    logits = out.logits if hasattr(out, "logits") else out[0]
    torch.testing.assert_close(logits, wl.model(ids3).logits, rtol=1e-5, atol=1e-5)


def saved_for_backward(fn):
    """Bytes of the distinct storages autograd keeps for backward while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_an_exported_llama_keeps_for_backward_what_the_model_run_by_hand_keeps(monkeypatch):
    """As traced, the graph's attention keeps the mask's and the per-head repeated keys'
    and values' storages; rewritten, exactly what transformers' own forward keeps."""
    pytest.importorskip("transformers")
    import autoplace.capture.tracing as tracing
    from tests.helpers.hf_models import llama

    torch.manual_seed(0)
    wl = llama(layers=2, hidden=128, heads=8, kv_heads=2, seq=64, batch_size=2)
    (ids,), _ = wl.make_batch(2, "cpu")
    rewritten = _export(wl.model, (ids,))
    monkeypatch.setattr(tracing, "causal_from_shapes", lambda gm: 0)
    traced = _export(wl.model, (ids,))
    by_hand = saved_for_backward(lambda: wl.model(ids))
    assert saved_for_backward(lambda: rewritten(ids)) == by_hand
    assert saved_for_backward(lambda: traced(ids)) > by_hand
