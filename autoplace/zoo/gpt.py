"""GPT-style decoder-only transformer (pre-LN, learned positions, untied head).

Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019.
Written to trace with ``torch.fx.symbolic_trace``: no control flow on tensors, no
shapes read from inputs (heads are split with ``unflatten``), positions are a
buffer of length ``seq_len`` so the model expects exactly ``seq_len`` tokens.

Presets: :func:`gpt_tiny` (~0.13M parameters), :func:`gpt_small` (~7.4M),
:func:`gpt_medium` (~102M), :func:`gpt_1b` (~1.01B, the workload of
shared/MEASURED.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload
from autoplace.zoo._common import register_presets, token_workload

__all__ = [
    "GPT",
    "GPTConfig",
    "gpt_1b",
    "gpt_medium",
    "gpt_small",
    "gpt_tiny",
    "gpt_workload",
]


@dataclass(kw_only=True)
class GPTConfig:
    """Size of a GPT decoder."""

    vocab_size: int = 256
    """Number of token ids (input and output)."""
    seq_len: int = 32
    """Tokens per sequence; the model takes exactly this many."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 2
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise AutoplaceError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )


def gpt_tiny() -> GPTConfig:
    """d=64, 2 layers, 2 heads, vocab 256, seq 32: runs in milliseconds on a CPU."""
    return GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=2)


def gpt_small() -> GPTConfig:
    """d=256, 4 layers, 4 heads, vocab 8192, seq 128 (~7.4M parameters)."""
    return GPTConfig(vocab_size=8192, seq_len=128, d_model=256, n_layers=4, n_heads=4)


def gpt_medium() -> GPTConfig:
    """d=512, 16 layers, 8 heads, vocab 50304, seq 512 (~102M parameters)."""
    return GPTConfig(vocab_size=50304, seq_len=512, d_model=512, n_layers=16, n_heads=8)


def gpt_1b() -> GPTConfig:
    """d=2048, 16 layers, 16 heads, vocab 50304, seq 1024 (~1.01B parameters)."""
    return GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=16, n_heads=16)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    Shapes:
        input ``[B, T, d_model]`` -> output ``[B, T, d_model]``.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, 3*d] -> [3, B, H, T, Dh] without reading B or T
        qkv = self.qkv(x).unflatten(-1, (3, self.n_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}"


class MLP(nn.Module):
    """Position-wise feed-forward: Linear, GELU, Linear."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Parameters: ``12 d^2 + 13 d`` for ``mlp_ratio=4``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, config.n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, config.mlp_ratio * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT decoder: token + position embeddings, blocks, final LayerNorm, untied head.

    Shapes:
        input token ids ``[B, seq_len]`` int64 -> logits ``[B, seq_len, vocab_size]``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.register_buffer("positions", torch.arange(config.seq_len), persistent=False)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation; also refills the position buffer (after ``to_empty``)."""
        self.positions.copy_(torch.arange(self.config.seq_len, device=self.positions.device))
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(self.positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_workload(
    config: GPTConfig,
    *,
    batch_size: int = 8,
    lr: float = 3e-4,
    autocast_dtype: str | None = "bfloat16",
    name: str = "gpt",
) -> Workload:
    """A GPT language-modelling workload: next-token cross entropy on synthetic tokens."""
    return token_workload(name, GPT(config), seq_len=config.seq_len,
                          vocab_size=config.vocab_size, batch_size=batch_size, lr=lr,
                          autocast_dtype=autocast_dtype)


_WORKLOADS = {
    "gpt-tiny": (gpt_tiny, dict(batch_size=4, lr=1e-3, autocast_dtype=None)),
    "gpt-small": (gpt_small, dict(batch_size=8, lr=1e-3, autocast_dtype=None)),
    "gpt-medium": (gpt_medium, dict(batch_size=8, lr=3e-4, autocast_dtype="bfloat16")),
    "gpt-1b": (gpt_1b, dict(batch_size=8, lr=3e-4, autocast_dtype="bfloat16")),
}
register_presets("GPT decoder", gpt_workload, _WORKLOADS)
