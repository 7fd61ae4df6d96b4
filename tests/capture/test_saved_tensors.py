"""A tensor several ops save for backward counts once per device that holds it."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from autoplace.capture import capture
from autoplace.sim.model import graph_arrays, shared_save_bytes


class TwoBranches(nn.Module):
    """ReLU output read by two linear branches (an Inception module's shape, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(x)
        return self.a(h) + self.b(h)


def test_relu_output_read_by_two_branches_counts_once():
    g = capture(TwoBranches(), (torch.randn(4, 16),), name="branches")
    h = 4 * 16 * 4  # the ReLU output, fp32
    assert g["relu"].activation_bytes == h  # the ReLU saves its output: counted there
    assert g["a"].activation_bytes == 0 and g["b"].activation_bytes == 0
    assert g["a"].shared_saves == (("relu", h),) and g["b"].shared_saves == (("relu", h),)
    assert g.activation_bytes == h  # it was 3 * h when each saver counted it

    ga = graph_arrays(g)
    idx = g.index
    kept = np.ones(len(g), bool)
    dev = np.zeros(len(g), np.int64)
    assert shared_save_bytes(ga, dev, kept, 2).tolist() == [0.0, 0.0]  # one device: once
    dev[idx["a"]] = dev[idx["b"]] = 1  # both branches apart from the ReLU: one copy there
    assert shared_save_bytes(ga, dev, kept, 2).tolist() == [0.0, h]
    kept[idx["a"]] = kept[idx["b"]] = False  # recomputed branches keep nothing
    assert shared_save_bytes(ga, dev, kept, 2).tolist() == [0.0, 0.0]
    # two plans at once (slots p * k + device), as the batched simulator asks
    cells = np.stack([np.zeros(len(g), np.int64), 2 + dev])
    both = shared_save_bytes(ga, cells, np.ones((2, len(g)), bool), 4)
    assert both.tolist() == [0.0, 0.0, 0.0, h]


def test_a_view_of_a_saved_tensor_is_the_same_one():
    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 8)

        def forward(self, x):
            h = torch.relu(x)
            return self.lin(h.view(2, 2, 16))

    g = capture(Viewed(), (torch.randn(4, 16),), name="viewed")
    assert g["lin"].activation_bytes == 0 and g.activation_bytes == 4 * 16 * 4


def autograd_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for ``model``'s backward on ``x``: every tensor its saved-tensor
    hooks see, once per storage, parameters and the input left out."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


class Pools(nn.Module):
    """Max pooling (module and function, which keep an int64 index per output element)
    and adaptive average pooling to one element per channel (a mean: nothing kept) and to
    two (the input kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.avg2 = nn.AdaptiveAvgPool2d(2)
        self.avg1 = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        h = self.pool(self.conv(x).sigmoid())
        h = nn.functional.max_pool1d(h.flatten(2) * 2.0, 2).view(h.shape[0], 8, 4, 2)
        return self.avg1(self.avg2(h.exp())).flatten(1)


def test_pooling_keeps_what_autograd_keeps():
    model, x = Pools(), torch.randn(2, 3, 8, 8)
    g = capture(model, (x,), name="pools")
    assert g["pool"].activation_bytes == 2 * 8 * 4 * 4 * 8  # its input is the sigmoid's
    # mul by a number keeps nothing: the function keeps its input and the indices
    assert g["max_pool1d"].activation_bytes == 2 * 8 * 16 * 4 + 2 * 8 * 8 * 8
    assert g["avg2"].shared_saves == (("exp", 2 * 8 * 4 * 2 * 4),)  # exp's output
    assert g["avg1"].activation_bytes == 0 and not g["avg1"].shared_saves
    assert g.activation_bytes == autograd_saved_bytes(model, x) + 2 * 3 * 8 * 8 * 4  # + x


class Block(nn.Module):
    """A transformer MLP's shape: matmul, GELU, matmul, dropout, residual add."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


def test_a_dropout_keeps_a_mask_only_where_it_draws_one():
    """Dropout with p = 0 returns its input: no mask kept, and a checkpoint's recompute
    of the block stops before the last matmul (which keeps only its input); with p > 0 the
    mask is drawn in the recompute too, so the matmul before it runs again."""
    from autoplace.sim.model import rerun_ops

    for p, mask in ((0.0, 0), (0.1, 4 * 16)):
        g = capture(Block(p).train(), (torch.randn(4, 16),), name="block")
        assert g["drop"].activation_bytes == mask
        ga = graph_arrays(g)
        group = [0 if op.kind not in ("input", "output") else 1 for op in g]
        ran = {op.name for op, r in zip(g, rerun_ops(ga, group, frozenset({0}), frozenset()))
               if r}
        assert {"up", "gelu"} <= ran and "add" not in ran
        assert ("down" in ran) == (p > 0) and ("drop" in ran) == (p > 0)
