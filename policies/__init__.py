"""Placement policies and the REINFORCE trainer (``autoplace.policies``).

* :class:`Seq2SeqPolicy` (Mirhoseini et al. 2017), :class:`HierarchicalPolicy`
  (Mirhoseini et al. 2018), :class:`GNNPolicy` (Placeto / GDP), by name through
  :func:`get` / :func:`make`;
* :func:`reinforce`: one trainer for all of them, over any env that follows the
  ``PlacementEnv`` observation/action contract;
* :func:`train` / :func:`place`: what the CLI calls;
* :func:`best_shard_variant`: a policy's plan with the shard mode (and compilation) its
  actions lack, chosen after it on the simulator.
"""

from __future__ import annotations

from .api import TrainResult, place, train
from .base import PlacementPolicy, PolicyOutput, batch_obs, describe_spaces
from .gnn import GNNPolicy
from .hierarchical import HierarchicalPolicy
from .registry import get, make, names
from .reinforce import ReinforceConfig, ReinforceResult, reinforce
from .seq2seq import Seq2SeqPolicy
from .shard_variant import best_shard_variant

__all__ = [
    "GNNPolicy", "HierarchicalPolicy", "PlacementPolicy", "PolicyOutput", "Seq2SeqPolicy",
    "ReinforceConfig", "ReinforceResult", "TrainResult", "batch_obs", "best_shard_variant",
    "describe_spaces", "get", "make", "names", "place", "reinforce", "train",
]
