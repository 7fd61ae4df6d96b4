"""The policy registry: names mapped to entry points ``"package.module:Class"``, each
imported only when :func:`get` is called, so any module of the package (the trainer's
checkpoints among them) can import the registry at the top."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autoplace.errors import AutoplaceError

if TYPE_CHECKING:
    from .base import PlacementPolicy

__all__ = ["get", "make", "names"]

_REGISTRY: dict[str, str] = {
    "seq2seq": "autoplace.policies.seq2seq:Seq2SeqPolicy",
    "hierarchical": "autoplace.policies.hierarchical:HierarchicalPolicy",
    "gnn": "autoplace.policies.gnn:GNNPolicy",
}


def names() -> list[str]:
    """Registered policy names."""
    return list(_REGISTRY)


def get(name: str) -> type[PlacementPolicy]:
    """The policy class registered as ``name``; the error lists the valid names."""
    try:
        entry_point = _REGISTRY[name]
    except KeyError:
        raise AutoplaceError(
            f"unknown policy {name!r}; valid: {', '.join(_REGISTRY)}"
        ) from None
    module, cls = entry_point.split(":")
    return getattr(importlib.import_module(module), cls)


def make(name: str, observation_space: Any, action_space: Any, **options: Any) -> PlacementPolicy:
    """A policy sized for an env's (single, unbatched) spaces."""
    return get(name).from_spaces(observation_space, action_space, **options)
