"""The simulator: step time and memory of a plan, computed from its lowering; the RL reward.

Modules: ``step`` (:func:`simulate`, :func:`simulate_batch`, :func:`lower_bound`), ``model``
(cost tables and the memory model), ``local`` (one-process replicas), ``pipeline`` (GPipe /
1F1B stages), ``fsdp`` (FSDP2 and ZeRO-2 collectives), ``batch`` (many plans at once).
"""

from __future__ import annotations

from autoplace.sim.model import Event
from autoplace.sim.step import (
    BatchResult,
    SimResult,
    lower_bound,
    sharded_host_s,
    simulate,
    simulate_batch,
)

__all__ = ["BatchResult", "Event", "SimResult", "lower_bound", "sharded_host_s", "simulate",
           "simulate_batch"]
