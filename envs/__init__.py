"""Gymnasium environments of autoplace; importing this registers ``autoplace/Placement-v0``.

Example::

    import gymnasium as gym
    import autoplace.envs  # noqa: F401  (registers the id)

    env = gym.make("autoplace/Placement-v0", workload="gpt-tiny", cluster="h100x2",
                   backend="sim", mode="oneshot", max_groups=64)
"""

from __future__ import annotations

import gymnasium as gym

from .config import EnvConfig
from .observation import GROUP_FEATURES, obs_batch_to_pyg, obs_to_pyg
from .placement_env import InvalidActionError, PlacementEnv

__all__ = ["ENV_ID", "EnvConfig", "GROUP_FEATURES", "InvalidActionError", "PlacementEnv", "obs_batch_to_pyg",
           "obs_to_pyg"]

ENV_ID = "autoplace/Placement-v0"

if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="autoplace.envs.placement_env:PlacementEnv")
