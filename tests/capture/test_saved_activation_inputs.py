"""Activations whose backward reads their input (``gelu_backward(grad, self)``) keep the
input; the matmul after them keeps their output: two tensors, not one shared."""

from __future__ import annotations

import torch
from torch import nn

from autoplace.capture import capture


class _Mlp(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(32, 64), act, nn.Linear(64, 32)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def test_gelu_keeps_its_input_relu_its_output():
    x = torch.randn(8, 32)
    out = 8 * 64 * 4  # one [8, 64] float32 tensor
    gelu = capture(_Mlp(nn.GELU()), (x,))
    assert gelu["act"].activation_bytes == out  # the up projection's output
    assert gelu["down"].activation_bytes == out and not gelu["down"].shared_saves
    relu = capture(_Mlp(nn.ReLU()), (x,))
    assert relu["act"].activation_bytes == out  # its output, which down saves too
    assert relu["down"].activation_bytes == 0 and relu["down"].shared_saves == (("act", out),)
