"""Recurrent workloads: an LSTM language model and GNMT-style translation.

RNNLM: Zaremba et al., "Recurrent Neural Network Regularization", 2014 (no dropout here).
GNMT: Wu et al., "Google's Neural Machine Translation System", 2016
(https://arxiv.org/abs/1609.08144) - the workload of the placement papers
(Mirhoseini et al. 2017/2018, Placeto, GDP).

Every LSTM layer is its own single-layer ``nn.LSTM`` so a planner can put layers
on different devices (each is one op of the captured graph). The GNMT decoder
runs with teacher forcing: its bottom layer reads the whole shifted target at
once, attention over the encoder outputs is computed for all target steps in one
go, and the upper layers read ``[hidden, context]``; no Python loop over time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload, register
from autoplace.zoo._common import (
    split_options,
    token_batch,
    token_cross_entropy,
    translation_batch,
    zoo_defaults,
)

__all__ = [
    "GNMT",
    "GNMTConfig",
    "RNNLM",
    "RNNLMConfig",
    "gnmt_paper",
    "gnmt_small",
    "gnmt_workload",
    "rnnlm_small",
    "rnnlm_workload",
]


# ---------------------------------------------------------------- RNNLM


@dataclass(kw_only=True)
class RNNLMConfig:
    """Size of an LSTM language model."""

    vocab_size: int = 1000
    """Number of token ids."""
    seq_len: int = 20
    """Tokens per sequence."""
    hidden: int = 64
    """Embedding and LSTM width."""
    layers: int = 2
    """Number of stacked single-layer LSTMs."""


def rnnlm_small() -> RNNLMConfig:
    """vocab 1000, seq 20, hidden 64, 2 LSTM layers."""
    return RNNLMConfig()


class RNNLM(nn.Module):
    """Embedding, a stack of separate one-layer LSTMs, linear head.

    Shapes:
        input token ids ``[B, T]`` int64 -> logits ``[B, T, vocab_size]``.
    """

    def __init__(self, config: RNNLMConfig) -> None:
        super().__init__()
        h = config.hidden
        self.embed = nn.Embedding(config.vocab_size, h)
        self.lstms = nn.ModuleList(nn.LSTM(h, h, batch_first=True) for _ in range(config.layers))
        self.head = nn.Linear(h, config.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for lstm in self.lstms:
            x = lstm(x)[0]
        return self.head(x)


def rnnlm_workload(
    config: RNNLMConfig,
    *,
    batch_size: int = 8,
    lr: float = 1e-3,
    autocast_dtype: str | None = None,
    name: str = "rnnlm",
) -> Workload:
    """An LSTM language-modelling workload on synthetic token streams."""
    return Workload(
        name=name,
        model=RNNLM(config),
        make_batch=partial(token_batch, seq_len=config.seq_len, vocab_size=config.vocab_size),
        loss_fn=token_cross_entropy,
        batch_size=batch_size,
        autocast_dtype=autocast_dtype,
        lr=lr,
    )


@register(
    "rnnlm",
    "LSTM language model: embedding, 2 separate LSTM layers, linear head",
    **zoo_defaults(rnnlm_small(), batch_size=8),
)
def rnnlm(**options: Any) -> Workload:
    """LSTM language model (options: the fields of :class:`RNNLMConfig`, batch_size, lr)."""
    config, rest = split_options("rnnlm", rnnlm_small(), options)
    return rnnlm_workload(config, **rest)


# ---------------------------------------------------------------- GNMT


@dataclass(kw_only=True)
class GNMTConfig:
    """Size of a GNMT-style encoder-decoder (the paper: hidden 1024, vocab 32000, len 50)."""

    vocab_size: int = 1000
    """Shared source/target vocabulary size."""
    src_len: int = 12
    """Source tokens per sentence."""
    tgt_len: int = 12
    """Target tokens per sentence."""
    hidden: int = 64
    """Embedding and LSTM width."""
    layers: int = 4
    """LSTM layers in the encoder and in the decoder (at least 2)."""
    bidirectional_first: bool = True
    """Make the first encoder layer bidirectional (hidden/2 per direction)."""
    attention: str = "dot"
    """``"dot"`` (scaled dot product) or ``"additive"`` (Bahdanau)."""
    residual_from: int = 3
    """1-based index of the first layer with a residual connection."""

    def __post_init__(self) -> None:
        if self.layers < 2:
            raise AutoplaceError(f"GNMTConfig: layers={self.layers}; need at least 2")
        if self.attention not in ("dot", "additive"):
            raise AutoplaceError(
                f"GNMTConfig: attention={self.attention!r}; valid: 'dot', 'additive'"
            )
        if self.bidirectional_first and self.hidden % 2:
            raise AutoplaceError(
                f"GNMTConfig: hidden={self.hidden} must be even for a bidirectional first layer"
            )


def gnmt_small(layers: int = 4) -> GNMTConfig:
    """hidden 64, vocab 1000, length 12: runs in milliseconds on a CPU."""
    return GNMTConfig(layers=layers)


def gnmt_paper(layers: int = 8) -> GNMTConfig:
    """The papers' regime: hidden 1024, vocab 32000, length 50 (use batch_size=128)."""
    return GNMTConfig(layers=layers, hidden=1024, vocab_size=32000, src_len=50, tgt_len=50)


class Attention(nn.Module):
    """Attention of every decoder step over all encoder outputs at once.

    Shapes:
        query ``[B, T, H]``, memory ``[B, S, H]`` -> context ``[B, T, H]``.
    """

    def __init__(self, hidden: int, kind: str = "dot") -> None:
        super().__init__()
        self.kind = kind
        if kind == "additive":
            self.query = nn.Linear(hidden, hidden, bias=False)
            self.key = nn.Linear(hidden, hidden)
            self.score = nn.Linear(hidden, 1, bias=False)

    def forward(self, query: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        if self.kind == "dot":
            return F.scaled_dot_product_attention(query, memory, memory)
        energy = torch.tanh(self.query(query).unsqueeze(2) + self.key(memory).unsqueeze(1))
        weights = torch.softmax(self.score(energy).squeeze(-1), dim=-1)  # [B, T, S]
        return torch.bmm(weights, memory)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


class GNMTEncoder(nn.Module):
    """Embedding and a stack of one-layer LSTMs, residual from ``residual_from`` on."""

    def __init__(self, config: GNMTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.residual_from = config.residual_from
        self.embed = nn.Embedding(config.vocab_size, h)
        first = (
            nn.LSTM(h, h // 2, batch_first=True, bidirectional=True)
            if config.bidirectional_first
            else nn.LSTM(h, h, batch_first=True)
        )
        rest = [nn.LSTM(h, h, batch_first=True) for _ in range(config.layers - 1)]
        self.lstms = nn.ModuleList([first, *rest])

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        x = self.embed(src)
        for i, lstm in enumerate(self.lstms):
            y = lstm(x)[0]
            x = x + y if i + 1 >= self.residual_from else y
        return x


class GNMTDecoder(nn.Module):
    """Bottom LSTM -> attention -> upper LSTMs reading ``[h, context]`` -> vocabulary."""

    def __init__(self, config: GNMTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.residual_from = config.residual_from
        self.embed = nn.Embedding(config.vocab_size, h)
        self.lstms = nn.ModuleList(
            [nn.LSTM(h, h, batch_first=True)]
            + [nn.LSTM(2 * h, h, batch_first=True) for _ in range(config.layers - 1)]
        )
        self.attention = Attention(h, config.attention)
        self.head = nn.Linear(h, config.vocab_size)

    def forward(self, tgt_in: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.lstms[0](self.embed(tgt_in))[0]
        context = self.attention(x, memory)
        for i, lstm in enumerate(self.lstms[1:], start=1):
            y = lstm(torch.cat([x, context], dim=-1))[0]
            x = x + y if i + 1 >= self.residual_from else y
        return self.head(x)


class GNMT(nn.Module):
    """GNMT-style encoder-decoder with attention, trained with teacher forcing.

    Shapes:
        src ``[B, S]``, tgt_in ``[B, T]`` int64 -> logits ``[B, T, vocab_size]``.
    """

    def __init__(self, config: GNMTConfig) -> None:
        super().__init__()
        self.encoder = GNMTEncoder(config)
        self.decoder = GNMTDecoder(config)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.decoder(tgt_in, self.encoder(src))


def gnmt_workload(
    config: GNMTConfig,
    *,
    batch_size: int = 8,
    lr: float = 1e-3,
    autocast_dtype: str | None = None,
    name: str = "gnmt",
) -> Workload:
    """A GNMT translation workload on a synthetic reversal task."""
    return Workload(
        name=name,
        model=GNMT(config),
        make_batch=partial(
            translation_batch,
            src_len=config.src_len,
            tgt_len=config.tgt_len,
            vocab_size=config.vocab_size,
        ),
        loss_fn=token_cross_entropy,
        batch_size=batch_size,
        autocast_dtype=autocast_dtype,
        lr=lr,
    )


def _gnmt_factory(layers: int) -> None:
    name = f"gnmt-{layers}"

    def factory(**options: Any) -> Workload:
        config, rest = split_options(name, gnmt_small(layers), options)
        return gnmt_workload(config, name=name, **rest)

    factory.__name__ = factory.__qualname__ = f"gnmt_{layers}"
    factory.__doc__ = (
        f"GNMT-style LSTM encoder-decoder with attention, {layers}+{layers} layers "
        "(paper size: hidden=1024, vocab_size=32000, src_len=tgt_len=50, "
        "batch_size=128)"
    )
    register(name, factory.__doc__, **zoo_defaults(gnmt_small(layers), batch_size=8))(factory)


for _layers in (2, 4, 8):
    _gnmt_factory(_layers)
