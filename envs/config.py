"""Options of :class:`~autoplace.envs.PlacementEnv` and turning them into a graph to place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph

from .backends import BACKENDS
from .levers import check_levers

__all__ = ["EnvConfig", "MODES", "REWARDS", "check_config", "resolve_workload"]

MODES = ("oneshot", "incremental")
REWARDS = ("neg_sqrt", "improvement", "neg_time")


@dataclass(kw_only=True)
class EnvConfig:
    """Options of :class:`PlacementEnv` (keyword arguments of the constructor)."""

    backend: str = "sim"  #: "sim" (simulator) or "real" (measured in a worker subprocess)
    mode: str = "oneshot"  #: "oneshot" or "incremental" (Placeto)
    max_groups: int = 64  #: groups the graph is coarsened to (and observation padding)
    max_edges: int | None = None  #: edge padding; None: max(4 * max_groups, edges present)
    grouping: str = "contiguous"  #: coarsening method of autoplace.grouping.coarsen
    memory_cap: str | int | None = None  #: cap every device's memory ("16GB")
    reward: str = "neg_sqrt"  #: "neg_sqrt", "improvement" or "neg_time"
    max_slowdown: float = 100.0  #: step-time ratio t / t1 past which a valid plan's score stops falling
    fail_reward: float | None = None  #: score of an OOM, invalid or crashed plan (None: see env doc)
    data_options: tuple[int, ...] = (1,)  #: data-parallel degrees an action may pick
    pipeline_options: tuple[int, ...] = (1,)  #: pipeline stage counts an action may pick
    microbatch_options: tuple[int, ...] = (1,)  #: microbatch counts an action may pick
    schedule: str = "gpipe"  #: pipeline schedule, "gpipe" or "1f1b"
    levers: tuple[str, ...] = ()  #: oneshot: also choose "priority", "recompute", "compile"
    priority_levels: int = 4  #: issue priority levels a group may take (lever "priority")
    passes: int = 1  #: incremental mode: times every group is visited per episode
    initial_placement: str = "single"  #: "single" (all on device 0) or "random"
    workload_options: dict[str, Any] = field(default_factory=dict)  #: factory options
    batch_size: int | None = None  #: global batch size (None: the workload's)
    seed: int = 0  #: weight-init seed of the workload
    steps: int = 5  #: real backend: steps per measurement, warm-up included
    warmup: int = 2  #: real backend: steps not timed
    timeout_s: float = 300.0  #: real backend: seconds before a hung run is killed
    worker_threads: int | None = None  #: real backend: CPU threads of the worker (None: default)
    real_cache_size: int = 0  #: real backend: measured plans remembered and reused (0: none)
    oom_margin: float | None = None  #: real backend: OOM without running past this x simulated peak/usable
    cache_size: int = 4096  #: sim backend: plans whose results are remembered


def check_config(cfg: EnvConfig, num_devices: int) -> None:
    """Raise :class:`AutoplaceError` naming the first option that is not valid."""
    checks = [("backend", cfg.backend, BACKENDS), ("mode", cfg.mode, MODES),
              ("reward", cfg.reward, REWARDS),
              ("initial_placement", cfg.initial_placement, ("single", "random"))]
    for name, value, valid in checks:
        if value not in valid:
            raise AutoplaceError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
    for name in ("data_options", "pipeline_options", "microbatch_options"):
        values = getattr(cfg, name)
        limit = num_devices if name != "microbatch_options" else math.inf
        if not values or any(v < 1 or v > limit for v in values):
            raise AutoplaceError(
                f"{name} must be a non-empty list of integers in 1..{limit}, got {list(values)}")
    if not (isinstance(cfg.max_slowdown, (int, float)) and math.isfinite(cfg.max_slowdown)
            and cfg.max_slowdown > 1):
        raise AutoplaceError(f"max_slowdown must be a finite number > 1, got {cfg.max_slowdown!r}")
    if cfg.fail_reward is not None and not (isinstance(cfg.fail_reward, (int, float))
                                            and math.isfinite(cfg.fail_reward)):
        raise AutoplaceError(f"fail_reward must be a finite number or None, got "
                             f"{cfg.fail_reward!r}")
    check_levers(tuple(cfg.levers), cfg.priority_levels, cfg.mode)
    if cfg.max_groups < 1 or cfg.passes < 1:
        raise AutoplaceError(f"max_groups and passes must be >= 1, got {cfg.max_groups}, "
                             f"{cfg.passes}")


def resolve_workload(
    workload: Any, graph: OpGraph | None, cfg: EnvConfig
) -> tuple[dict[str, Any] | None, OpGraph]:
    """The worker's workload spec (None without a workload) and the graph to place."""
    from autoplace.workloads import Workload, get

    if workload is None:
        if graph is None:
            raise AutoplaceError("PlacementEnv needs a workload (zoo name or module:factory) "
                                 "or a graph")
        if cfg.backend == "real":
            raise AutoplaceError("backend='real' needs a workload to execute, not only a graph")
        return None, graph
    options = dict(cfg.workload_options)
    if cfg.batch_size is not None:
        options["batch_size"] = cfg.batch_size
    if isinstance(workload, Workload):
        spec = {"spec": workload.spec.get("spec", workload.name),
                "options": {**workload.spec.get("options", {}), **options},
                "seed": workload.spec.get("seed", cfg.seed)}
        wl = workload
    else:
        spec = {"spec": str(workload), "options": options, "seed": cfg.seed}
        wl = None
    if graph is None:
        from autoplace.capture import capture_workload

        if wl is None:  # on the meta device: the planner needs shapes, not memory
            wl = get(spec["spec"], device="meta", seed=spec["seed"], **options)
        graph = capture_workload(wl, batch_size=cfg.batch_size)
    return spec, graph
