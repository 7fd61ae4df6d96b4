"""Recurrent modules under FSDP2 (``executor.data.keep_rnns_unpacked``): every step runs on
the weights FSDP2 gathered for it, and nothing of them stays allocated between steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autoplace.executor.data import keep_rnns_unpacked, wrap_data_parallel
from autoplace.executor.offload import one_rank_group, one_rank_mesh


class Tagger(nn.Module):
    """A two-layer LSTM and a head: its loss moves with every LSTM weight."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0]).square().mean()


def test_packing_becomes_a_no_op_for_every_rnn():
    model = nn.Sequential(nn.LSTM(8, 8), nn.GRU(8, 8), nn.Linear(8, 8))
    assert keep_rnns_unpacked(model) == 2
    for m in model[:2]:
        before = [w.data_ptr() for w in m._flat_weights]
        m._init_flat_weights()  # what an RNN's forward does with weights it has not seen
        assert [w.data_ptr() for w in m._flat_weights] == before
    assert keep_rnns_unpacked(nn.Linear(2, 2)) == 0


def train(model: nn.Module, xs: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x in xs:
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sharded_lstm_trains_on_each_steps_gathered_weights():
    """cuDNN's packing on the first forward would leave FSDP2's gathered parameters viewing
    a copy of the first step's weights: the loss would leave the reference's from the
    second step on (SGD at lr 0.5 moves the weights far), and the copy would stay
    allocated between steps."""
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    ref = Tagger(512).to(dev)
    model = copy.deepcopy(ref)
    lstm_bytes = sum(p.numel() * p.element_size() for p in ref.lstm.parameters())
    xs = [torch.randn(16, 12, 512, device=dev) for _ in range(4)]
    with torch.backends.cudnn.flags(deterministic=True, allow_tf32=False), \
            one_rank_group(dev):
        want = train(ref, xs)
        del ref
        wrap_data_parallel(model, {}, "fsdp", mesh=one_rank_mesh(dev), device=dev)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        got = train(model, xs)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    assert got == pytest.approx(want, rel=1e-4)
    assert after - before < lstm_bytes / 4, (after - before, lstm_bytes)
