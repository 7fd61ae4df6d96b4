"""Llama-3-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Llama Team, "The Llama 3 Herd of Models", 2024 (arXiv:2407.21783), Table 3; written the
way torchtitan's ``models/llama3/model.py`` is (no biases, untied output head, key and
value heads repeated to the query heads before attention, RoPE theta 500000, vocabulary
128256). Traces with ``torch.fx.symbolic_trace``: no shapes read from inputs (heads are
split with ``unflatten``), the rotary tables are buffers of length ``seq_len`` so the
model expects exactly ``seq_len`` tokens.

Presets (sequence 8192): :func:`llama3_8b` (dim 4096, 32 layers, 32 heads, 8 KV heads,
FFN 14336; 8.03B parameters), :func:`llama3_70b` (8192, 80, 64, 8, 28672; 70.6B),
:func:`llama3_405b` (16384, 126, 128, 8, 53248; 405.9B), and :func:`llama3_tiny` for
tests. Build the large ones on the ``meta`` device (``workloads.get(name,
device="meta")``): nothing is allocated, and capture runs on fake tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload
from autoplace.zoo._common import register_presets, token_workload

__all__ = [
    "Llama",
    "LlamaConfig",
    "llama3_405b",
    "llama3_70b",
    "llama3_8b",
    "llama3_tiny",
    "llama_workload",
]


@dataclass(kw_only=True)
class LlamaConfig:
    """Size of a Llama-3-style decoder."""

    vocab_size: int = 128256
    """Number of token ids (input and output)."""
    seq_len: int = 8192
    """Tokens per sequence; the model takes exactly this many."""
    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads per block; must divide ``dim``."""
    n_kv_heads: int = 8
    """Key / value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int = 14336
    """Hidden width of the SwiGLU feed-forward."""
    rope_theta: float = 500000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise AutoplaceError(f"LlamaConfig: dim={self.dim} is not divisible by "
                                 f"n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise AutoplaceError(f"LlamaConfig: n_heads={self.n_heads} is not divisible by "
                                 f"n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise AutoplaceError(f"LlamaConfig: the head width dim/n_heads="
                                 f"{self.dim // self.n_heads} must be even (rotary pairs)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_parameters(self) -> int:
        """Parameters of the model (embedding and output head counted separately)."""
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        block = attn + 3 * d * self.ffn_dim + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * block + d


def llama3_tiny() -> LlamaConfig:
    """dim 64, 2 layers, 4 heads, 2 KV heads, FFN 192, vocab 256, seq 32: CPU tests."""
    return LlamaConfig(vocab_size=256, seq_len=32, dim=64, n_layers=2, n_heads=4,
                       n_kv_heads=2, ffn_dim=192)


def llama3_8b() -> LlamaConfig:
    """dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256, seq 8192 (8.03B)."""
    return LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)


def llama3_70b() -> LlamaConfig:
    """dim 8192, 80 layers, 64 heads, 8 KV heads, FFN 28672, vocab 128256, seq 8192 (70.6B)."""
    return LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672)


def llama3_405b() -> LlamaConfig:
    """dim 16384, 126 layers, 128 heads, 8 KV heads, FFN 53248, vocab 128256, seq 8192
    (405.9B)."""
    return LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` of the rotary angles, each ``[seq_len, 1, head_dim / 2]`` float32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair of ``x[B, T, H, Dh]`` by the angle of its position.

    The pairs are ``(x[2i], x[2i+1])``, as Llama's complex-number form reads them.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions.

    Shapes:
        input ``[B, T, dim]`` -> output ``[B, T, dim]``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = apply_rope(self.wq(x).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.wk(x).unflatten(-1, (self.n_kv_heads, self.head_dim)), cos, sin)
        v = self.wv(x).unflatten(-1, (self.n_kv_heads, self.head_dim))
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # each KV head serves `rep` query heads (a copy, as torchtitan makes)
            k = k.unsqueeze(3).expand(-1, -1, -1, rep, -1).flatten(2, 3)
            v = v.unsqueeze(3).expand(-1, -1, -1, rep, -1).flatten(2, 3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))`` then ``x + feed_forward(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama decoder: token embedding, blocks, final RMSNorm, untied output head.

    Shapes:
        input token ids ``[B, seq_len]`` int64 -> logits ``[B, seq_len, vocab_size]``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        cos, sin = rope_tables(config.seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's initialisation (depth-scaled output projections); also refills the
        rotary tables (after ``to_empty``)."""
        c = self.config
        cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight)
        depth_std = 0.02 / math.sqrt(2 * c.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and name != "output":
                std = depth_std if name.endswith(("wo", "w2", "w3")) else 0.02
                nn.init.trunc_normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        std = c.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def llama_workload(
    config: LlamaConfig,
    *,
    batch_size: int = 8,
    lr: float = 3e-4,
    autocast_dtype: str | None = "bfloat16",
    name: str = "llama",
) -> Workload:
    """A Llama language-modelling workload: next-token cross entropy on synthetic tokens."""
    return token_workload(name, Llama(config), seq_len=config.seq_len,
                          vocab_size=config.vocab_size, batch_size=batch_size, lr=lr,
                          autocast_dtype=autocast_dtype)


_WORKLOADS = {
    "llama3-tiny": (llama3_tiny, dict(batch_size=4, lr=1e-3, autocast_dtype=None)),
    "llama3-8b": (llama3_8b, dict(batch_size=8, lr=3e-4, autocast_dtype="bfloat16")),
    "llama3-70b": (llama3_70b, dict(batch_size=8, lr=1.5e-4, autocast_dtype="bfloat16")),
    "llama3-405b": (llama3_405b, dict(batch_size=8, lr=8e-5, autocast_dtype="bfloat16")),
}
register_presets("Llama-3 decoder", llama_workload, _WORKLOADS)
