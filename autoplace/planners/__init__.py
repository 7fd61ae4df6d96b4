"""Baseline planners: classic heuristics and the plain options a practitioner writes.

Every planner is called as ``get(name)(graph, cluster, **options) -> Plan``; the plan
records the planner's name and its search time in ``plan.planner["search_time_s"]``.
Families (one module each): trivial (``single``, ``round-robin``, ``random``), hashing
(``hash``), critical path (``critical-path``, ``critical-path-mo``), min-cut
(``mincut``), expert (``expert``), Baechi (``m-topo``, ``m-etf``, ``m-sct``),
pipeline / data-parallel search (``hybrid-dp``, ``ddp``, ``zero1``, ``zero2``, ``fsdp``,
``pipeline``), local search (``anneal``) and the device-mesh search for multi-node
clusters (``mesh``).
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

# name -> entry point "module:function"; a planner's module is imported only when
# get() is called, so planner modules can import this registry at the top
_REGISTRY: dict[str, str] = {
    "single": "autoplace.planners.trivial:single",
    "round-robin": "autoplace.planners.trivial:round_robin",
    "random": "autoplace.planners.trivial:random_placement",
    "hash": "autoplace.planners.hashing:hash_placement",
    "critical-path": "autoplace.planners.critical_path:critical_path",
    "critical-path-mo": "autoplace.planners.critical_path:critical_path_mo",
    "mincut": "autoplace.planners.mincut:mincut",
    "expert": "autoplace.planners.expert:expert",
    "m-topo": "autoplace.planners.baechi:m_topo",
    "m-etf": "autoplace.planners.baechi:m_etf",
    "m-sct": "autoplace.planners.baechi:m_sct",
    "hybrid-dp": "autoplace.planners.pipeline_dp:hybrid_dp",
    "ddp": "autoplace.planners.pipeline_dp:ddp",
    "zero1": "autoplace.planners.pipeline_dp:zero1",
    "zero2": "autoplace.planners.pipeline_dp:zero2",
    "fsdp": "autoplace.planners.pipeline_dp:fsdp",
    "pipeline": "autoplace.planners.pipeline_dp:pipeline",
    "anneal": "autoplace.planners.anneal:anneal",
    "mesh": "autoplace.planners.mesh:mesh",
}


def _load(entry_point: str) -> Callable[..., Plan]:
    """The function an entry point ``"package.module:function"`` names."""
    module, func = entry_point.split(":")
    return getattr(importlib.import_module(module), func)


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
    fn = _load(_REGISTRY[key])
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
