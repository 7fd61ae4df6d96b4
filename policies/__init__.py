"""Placement policies and the REINFORCE trainer (``autoplace.policies``).

* :class:`Seq2SeqPolicy` (Mirhoseini et al. 2017), :class:`HierarchicalPolicy`
  (Mirhoseini et al. 2018), :class:`GNNPolicy` (Placeto / GDP), by name through
  :func:`get` / :func:`make`;
* :func:`reinforce`: one trainer for all of them, over any env that follows the
  ``PlacementEnv`` observation/action contract;
* :func:`train` / :func:`place`: what the CLI calls.
"""

from __future__ import annotations

from typing import Any

from autoplace.errors import AutoplaceError

from .base import PlacementPolicy, PolicyOutput, batch_obs, describe_spaces
from .gnn import GNNPolicy
from .hierarchical import HierarchicalPolicy
from .reinforce import ReinforceConfig, ReinforceResult, reinforce
from .seq2seq import Seq2SeqPolicy

__all__ = [
    "GNNPolicy", "HierarchicalPolicy", "PlacementPolicy", "PolicyOutput", "Seq2SeqPolicy",
    "ReinforceConfig", "ReinforceResult", "TrainResult", "batch_obs", "describe_spaces", "get",
    "make", "names", "place", "reinforce", "train",
]

_REGISTRY: dict[str, type[PlacementPolicy]] = {
    "seq2seq": Seq2SeqPolicy,
    "hierarchical": HierarchicalPolicy,
    "gnn": GNNPolicy,
}


def names() -> list[str]:
    """Registered policy names."""
    return list(_REGISTRY)


def get(name: str) -> type[PlacementPolicy]:
    """The policy class registered as ``name``; the error lists the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AutoplaceError(
            f"unknown policy {name!r}; valid: {', '.join(_REGISTRY)}"
        ) from None


def make(name: str, observation_space: Any, action_space: Any, **options: Any) -> PlacementPolicy:
    """A policy sized for an env's (single, unbatched) spaces."""
    return get(name).from_spaces(observation_space, action_space, **options)


def __getattr__(name: str) -> Any:
    # train / place pull in the env and the simulator: load on first use
    if name in ("train", "place", "TrainResult"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'autoplace.policies' has no attribute {name!r}")
