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
