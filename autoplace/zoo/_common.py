"""Shared pieces of the zoo: option handling, synthetic data and losses.

Data is synthetic but learnable (a loss curve that falls says training works):
token streams are noisy arithmetic sequences, images are noise around a class
prototype, MLP targets come from a fixed random linear map. Every batch is drawn
from the global torch RNG on the CPU and then moved to the requested device, so a
seeded process (or a reference run) sees the same data on any device. Fixed
"world" tensors (prototypes, maps) come from a private generator with a constant
seed, not from the global RNG.

Batch makers and losses are module-level functions (bound with
:func:`functools.partial`) so workloads pickle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload, register

__all__ = [
    "WORKLOAD_OPTIONS",
    "class_cross_entropy",
    "fixed_generator",
    "image_batch",
    "image_prototypes",
    "split_options",
    "token_batch",
    "token_cross_entropy",
    "translation_batch",
    "zoo_defaults",
]

#: options every zoo factory accepts beside its model config's fields.
WORKLOAD_OPTIONS = ("batch_size", "lr", "autocast_dtype")

C = TypeVar("C")


def zoo_defaults(config: Any, **workload: Any) -> dict[str, Any]:
    """Default options to :func:`~autoplace.workloads.register`: config fields + workload ones."""
    return {**dataclasses.asdict(config), **workload}


def split_options(name: str, config: C, options: dict[str, Any]) -> tuple[C, dict[str, Any]]:
    """Split factory options into a config (``config`` with its fields replaced) and the rest.

    Raises:
        AutoplaceError: an option that is neither a config field nor a workload option,
            with the list of valid ones.
    """
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(options) - fields - set(WORKLOAD_OPTIONS))
    if unknown:
        valid = ", ".join(sorted(fields | set(WORKLOAD_OPTIONS)))
        raise AutoplaceError(f"workload {name!r}: unknown option(s) {unknown}; valid: {valid}")
    model = {k: v for k, v in options.items() if k in fields}
    rest = {k: v for k, v in options.items() if k in WORKLOAD_OPTIONS}
    return dataclasses.replace(config, **model), rest


def fixed_generator(seed: int) -> torch.Generator:
    """A CPU generator with a constant seed, for data that must not touch the global RNG."""
    return torch.Generator(device="cpu").manual_seed(seed)


# ---------------------------------------------------------------- tokens


def _arithmetic_tokens(batch_size: int, length: int, vocab_size: int, low: int = 0):
    """Noisy arithmetic sequences ``(a + b*t) mod V``: learnable in context."""
    span = vocab_size - low
    start = torch.randint(0, span, (batch_size, 1), device="cpu")
    step = torch.randint(1, max(2, min(17, span)), (batch_size, 1), device="cpu")
    seq = (start + step * torch.arange(length, device="cpu")) % span
    noise = torch.randint(0, span, (batch_size, length), device="cpu")
    noisy = torch.rand(batch_size, length, device="cpu") < 0.1
    return torch.where(noisy, noise, seq) + low


def token_batch(batch_size: int, device: Any, *, seq_len: int, vocab_size: int):
    """Language-model batch: ``((tokens[B, T],), next_tokens[B, T])``, int64."""
    seq = _arithmetic_tokens(batch_size, seq_len + 1, vocab_size)
    inputs = seq[:, :-1].contiguous().to(device)
    targets = seq[:, 1:].contiguous().to(device)
    return (inputs,), targets


def translation_batch(batch_size: int, device: Any, *, src_len: int, tgt_len: int, vocab_size: int):
    """Seq2seq batch: ``((src[B, S], tgt_in[B, T]), tgt_out[B, T])``.

    The target is the source reversed (cycled if ``T > S``); ``tgt_in`` is the
    target shifted right behind a begin token 0 (teacher forcing). Tokens are 1..V-1.
    """
    src = _arithmetic_tokens(batch_size, src_len, vocab_size, low=1)
    index = (src_len - 1 - torch.arange(tgt_len, device="cpu")) % src_len
    tgt_out = src[:, index]
    bos = torch.zeros(batch_size, 1, dtype=torch.long, device="cpu")
    tgt_in = torch.cat([bos, tgt_out[:, :-1]], dim=1)
    return (src.to(device), tgt_in.to(device)), tgt_out.to(device)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits[B, T, V]`` against ``targets[B, T]`` (in float32)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


# ---------------------------------------------------------------- images


def image_prototypes(num_classes: int, seed: int = 1234) -> torch.Tensor:
    """One coarse 3x8x8 pattern per class, ``[C, 3, 8, 8]`` on the CPU."""
    return torch.randn(num_classes, 3, 8, 8, generator=fixed_generator(seed), device="cpu")


def image_batch(batch_size: int, device: Any, *, image_size: int, prototypes: torch.Tensor):
    """Classification batch: ``((images[B, 3, H, W],), labels[B])``: noise + class pattern."""
    labels = torch.randint(0, prototypes.shape[0], (batch_size,), device="cpu")
    pattern = F.interpolate(prototypes[labels], size=(image_size, image_size), mode="nearest")
    images = torch.randn(batch_size, 3, image_size, image_size, device="cpu") + pattern
    return (images.to(device),), labels.to(device)


def class_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits[B, C]`` against ``targets[B]`` (in float32)."""
    return F.cross_entropy(logits.float(), targets)


def image_workload(
    name: str,
    model: Any,
    *,
    image_size: int,
    num_classes: int,
    batch_size: int,
    lr: float = 1e-3,
    autocast_dtype: str | None = None,
) -> Any:
    """An image-classification workload on synthetic images (noise around class patterns)."""
    return Workload(
        name=name,
        model=model,
        make_batch=partial(image_batch, image_size=image_size,
                           prototypes=image_prototypes(num_classes)),
        loss_fn=class_cross_entropy,
        batch_size=batch_size,
        autocast_dtype=autocast_dtype,
        lr=lr,
    )


def token_workload(name: str, model: Any, *, seq_len: int, vocab_size: int, batch_size: int,
                   lr: float = 3e-4, autocast_dtype: str | None = "bfloat16") -> Workload:
    """A language-modelling workload: next-token cross entropy on synthetic tokens."""
    return Workload(
        name=name,
        model=model,
        make_batch=partial(token_batch, seq_len=seq_len, vocab_size=vocab_size),
        loss_fn=token_cross_entropy,
        batch_size=batch_size,
        autocast_dtype=autocast_dtype,
        lr=lr,
    )


def register_presets(family: str, workload: Callable[..., Workload],
                     presets: dict[str, tuple[Callable[[], Any], dict[str, Any]]]) -> None:
    """Register a zoo name per preset: ``presets[name] = (config preset, workload defaults)``;
    the factory takes the config's fields and :data:`WORKLOAD_OPTIONS` as options and
    builds ``workload(config, name=name, **workload_options)``."""
    for name, (preset, defaults) in presets.items():
        factory = _preset_factory(name, preset, defaults, workload)
        factory.__doc__ = f"{name}: {family}, {preset.__doc__}"
        register(name, factory.__doc__, **zoo_defaults(preset(), **defaults))(factory)


def _preset_factory(name: str, preset: Callable[[], Any], defaults: dict[str, Any],
                    workload: Callable[..., Workload]) -> Callable[..., Workload]:
    def factory(**options: Any) -> Workload:
        config, rest = split_options(name, preset(), options)
        return workload(config, name=name, **{**defaults, **rest})

    factory.__name__ = factory.__qualname__ = name.replace("-", "_")
    return factory
