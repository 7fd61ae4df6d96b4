"""Baseline planners: classic heuristics and the plain options a practitioner writes.

Every planner is called as ``get(name)(graph, cluster, **options) -> Plan``; the plan
records the planner's name and its search time in ``plan.planner["search_time_s"]``.
Families (one module each): trivial (``single``, ``round-robin``, ``random``), hashing
(``hash``), critical path (``critical-path``, ``critical-path-mo``), min-cut
(``mincut``), expert (``expert``), Baechi (``m-topo``, ``m-etf``, ``m-sct``),
pipeline / data-parallel search (``hybrid-dp``, ``ddp``, ``zero2``, ``fsdp``,
``pipeline``) and local search (``anneal``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autoplace.errors import AutoplaceError

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.graph import OpGraph
    from autoplace.plan import Plan

__all__ = ["get", "names", "Planner"]

Planner = Callable[..., "Plan"]

# name -> (module, function); modules load on first use
_REGISTRY: dict[str, tuple[str, str]] = {
    "single": ("trivial", "single"),
    "round-robin": ("trivial", "round_robin"),
    "random": ("trivial", "random_placement"),
    "hash": ("hashing", "hash_placement"),
    "critical-path": ("critical_path", "critical_path"),
    "critical-path-mo": ("critical_path", "critical_path_mo"),
    "mincut": ("mincut", "mincut"),
    "expert": ("expert", "expert"),
    "m-topo": ("baechi", "m_topo"),
    "m-etf": ("baechi", "m_etf"),
    "m-sct": ("baechi", "m_sct"),
    "hybrid-dp": ("pipeline_dp", "hybrid_dp"),
    "ddp": ("pipeline_dp", "ddp"),
    "zero2": ("pipeline_dp", "zero2"),
    "fsdp": ("pipeline_dp", "fsdp"),
    "pipeline": ("pipeline_dp", "pipeline"),
    "anneal": ("anneal", "anneal"),
}


def names() -> list[str]:
    """Names of every baseline planner, in registry order."""
    return list(_REGISTRY)


def get(name: str) -> Callable[..., Plan]:
    """The planner called ``name`` (``_`` and ``-`` are interchangeable).

    Raises:
        AutoplaceError: the name is unknown; the message lists the valid names.
    """
    key = str(name).strip().lower().replace("_", "-")
    if key not in _REGISTRY:
        raise AutoplaceError(f"unknown planner {name!r}; valid: {', '.join(_REGISTRY)}")
    module, func = _REGISTRY[key]
    fn = getattr(importlib.import_module(f"autoplace.planners.{module}"), func)
    valid = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]

    @functools.wraps(fn)
    def planner(graph: OpGraph, cluster: Cluster, **options: Any) -> Plan:
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise AutoplaceError(
                f"planner {key!r}: unknown option(s) {unknown}; valid: {', '.join(valid) or 'none'}"
            )
        return fn(graph, cluster, **options)

    planner.options = valid  # type: ignore[attr-defined]
    return planner


def plan(name: str, graph: OpGraph, cluster: Cluster, **options: Any) -> Plan:
    """Shorthand for ``get(name)(graph, cluster, **options)``."""
    return get(name)(graph, cluster, **options)
