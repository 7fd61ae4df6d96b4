"""A model with a ``no_grad`` method that turns autocast off where it is on, as
transformers 5.17's Llama rotary embedding does (``tests/capture/test_export_regions.py``); a
``module:factory`` workload, so that the executor's worker processes import it too."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.workloads import Workload


def _autocast_off(device_type: str):
    """transformers' ``maybe_autocast``: turn autocast off only where it is on."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


class Rotary(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freq = self.inv_freq[None, :, None].float().expand(pos.shape[0], -1, 1)
        with _autocast_off(x.device.type):
            angles = (freq.float() @ pos[:, None, :].float()).transpose(1, 2)
            return angles.cos().to(x.dtype)


class Net(nn.Module):
    def __init__(self, seq: int = 256, dim: int = 16) -> None:
        super().__init__()
        self.seq = seq
        self.inp = nn.Linear(dim, dim // 2)
        self.rotary = Rotary(dim)
        self.out = nn.Linear(dim // 2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(self.seq, device=x.device).expand(x.shape[0], -1) + 700
        h = self.inp(x)
        return self.out(h * self.rotary(h, pos))


def rotary_net(batch_size: int = 4, seq: int = 256, autocast_dtype: str | None = None,
               seed: int = 0, device: str = "cpu") -> Workload:
    torch.manual_seed(seed)
    model = Net(seq).to(device)

    def make_batch(bs, dev):
        return (torch.randn(bs, seq, 16, device=dev),), torch.randn(bs, seq, 4, device=dev)

    return Workload(name="rotary-net", model=model, make_batch=make_batch, loss_fn=F.mse_loss,
                    batch_size=batch_size, autocast_dtype=autocast_dtype)
