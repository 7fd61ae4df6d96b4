"""The stages of :func:`autoplace.policies.train`: REINFORCE on the simulator, on measured
step times, or the first then the second with the same policy.

``sim,real`` trains on the simulator for ``1 - real_share`` of the budget (in the budget's
unit: updates, episodes or seconds) with its files in ``DIR/sim/``, measures its best plans
and corrects the trainer state (:mod:`autoplace.policies.finetune`), then continues the same
policy, Adam state and baselines on the real backend in ``DIR``, sampling fewer plans per
update (each is a run on the devices), reusing measured plans and never running one the
simulator puts far past a device's memory. ``DIR/finetune.json`` records the switch and
both stages' best plans, measured; ``DIR/best_plan.json`` is the faster.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from autoplace.envs import PlacementEnv
from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic
from autoplace.graph import OpGraph
from autoplace.plan import Plan

from . import checkpoint as ckpt
from .finetune import carry, check_fit, switch
from .registry import make
from .reinforce import ReinforceConfig, ReinforceResult, _graph_key, parse_budget, reinforce

__all__ = ["TrainingRun", "make_envs", "split_budget"]

#: measured plans a real stage remembers (a plan sampled again is not run again)
REAL_CACHE_SIZE = 4096


def make_envs(specs: list[Any], cluster: Any, backend: str, copies: int,
              options: dict[str, Any]) -> list[Any]:
    """One env per spec (``copies`` per spec on the simulator, sharing its captured graph)."""
    envs = []
    for spec in specs:
        if isinstance(spec, OpGraph):
            first = PlacementEnv(graph=spec, cluster=cluster, backend=backend, **options)
        else:
            first = PlacementEnv(workload=spec, cluster=cluster, backend=backend, **options)
        envs.append(first)
        if backend == "sim":  # cheap copies sharing the captured graph
            envs += [PlacementEnv(graph=first.graph, cluster=first.cluster, backend=backend,
                                  **options) for _ in range(copies - 1)]
    return envs


def split_budget(budget: str | int, real_share: float) -> tuple[str, str]:
    """``budget`` cut into the simulator stage's and the real stage's, in its unit (at
    least one update or episode each)."""
    unit, amount = parse_budget(budget)
    sim, real = amount * (1 - real_share), amount * real_share
    if unit == "seconds":
        return f"{max(sim, 0.001):.3f}s", f"{max(real, 0.001):.3f}s"
    suffix = "up" if unit == "updates" else "ep"
    return f"{max(1, round(sim))}{suffix}", f"{max(1, round(real))}{suffix}"


def _describe_spec(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "name", type(spec).__name__)


class TrainingRun:
    """One :func:`~autoplace.policies.train` call: its envs' options, its policy (built at
    the first env, or continued from an ``init`` checkpoint) and its stages."""

    def __init__(self, specs: list[Any], cluster: Any, env_options: dict[str, Any],
                 config: ReinforceConfig, policy: str | None,
                 policy_options: dict[str, Any] | None, init: dict[str, Any] | None,
                 init_path: Any, *,
                 on_update: Callable[[int, dict[str, float]], None] | None = None) -> None:
        self.specs, self.cluster, self.env_options, self.config = specs, cluster, \
            env_options, config
        self.names = [_describe_spec(s) for s in specs]
        self.policy_name, self.policy_options = policy, policy_options
        self.init, self.init_path = init, init_path
        self.policy: Any = None
        self.elapsed_s = 0.0  # of the stages before the last
        self.warm: dict[str, Any] = {}
        self.start_samples: dict[str, float] = {}  # the first stage's, before any training
        self.on_update = on_update  # every stage's per-update callback
        self.earlier: dict[str, list[float]] | None = None  # the simulator stage's history

    # ------------------------------------------------------------------ pieces
    def envs(self, backend: str, copies: int, **more: Any) -> list[Any]:
        """The envs of a stage; the policy is built (or checked against ``init``) at the first."""
        envs = make_envs(self.specs, self.cluster, backend, copies,
                         {**self.env_options, **more})
        try:
            self._policy_for(envs[0])
        except BaseException:
            for env in envs:
                env.close()
            raise
        return envs

    def _policy_for(self, env: Any) -> None:
        layout = getattr(env, "action_layout", None)
        oneshot = self.env_options.get("mode", "oneshot") == "oneshot"
        lever_sizes = layout.policy_sizes() if layout is not None and oneshot else {}
        if self.init is not None:
            check_fit(self.init, self.init_path, env=env, lever_sizes=lever_sizes,
                      graph_key=_graph_key(env, 0))
        if self.policy is not None:
            return
        if self.init is not None:
            self.policy, _ = ckpt.load_policy(self.init)
        else:
            torch.manual_seed(self.config.seed)  # the policy's initial weights
            self.policy = make(self.policy_name or "seq2seq", env.observation_space,
                               env.action_space, **{**lever_sizes, **(self.policy_options or {})})

    def _extra(self, backend: str, envs: list[Any]) -> dict[str, Any]:
        return {"env_options": {k: list(v) if isinstance(v, tuple) else v
                                for k, v in self.env_options.items()},
                "cluster": self.cluster.to_json(), "models": self.names, "backend": backend,
                "graphs": sorted({_graph_key(e, i) for i, e in enumerate(envs)})}

    def stage(self, backend: str, config: ReinforceConfig, *, start: dict[str, Any] | None,
              oom_margin: float | None = None, envs: list[Any] | None = None) -> ReinforceResult:
        """REINFORCE on ``backend``'s envs (built here and closed after, unless given)."""
        own = envs is None
        if envs is None:
            more = {"real_cache_size": REAL_CACHE_SIZE, "oom_margin": oom_margin} \
                if backend == "real" else {}
            copies = max(1, math.ceil(config.batch_size / len(self.specs)))
            envs = self.envs(backend, copies, **more)
        try:
            result = reinforce(envs, self.policy, config, extra=self._extra(backend, envs),
                               start=start, on_update=self.on_update)
        finally:
            if own:
                for env in envs:
                    env.close()
        self.warm = self.warm or result.warm_start
        self.start_samples = self.start_samples or result.start_samples
        return result

    def real_config(self, config: ReinforceConfig, budget: str | int,
                    batch_size: int) -> ReinforceConfig:
        """A real stage's options: fewer plans per update, a checkpoint after every update."""
        if batch_size < 1:
            raise AutoplaceError(f"real_batch_size must be >= 1, got {batch_size}")
        return replace(config, budget=budget, batch_size=min(batch_size, config.batch_size),
                       checkpoint_every=1, warm_start=False)

    def history(self, result: ReinforceResult) -> dict[str, list[float]]:
        """The last stage's history, after the simulator stage's when there was one
        (episodes and elapsed time counted from the run's start; ``stage`` 0 or 1)."""
        if self.earlier is None:
            return result.history
        first, last = self.earlier, result.history
        n0, n1 = len(first["reward_mean"]), len(last["reward_mean"])
        shift = {"episodes": first["episodes"][-1] if n0 else 0.0,
                 "elapsed_s": first["elapsed_s"][-1] if n0 else 0.0}
        out = {k: list(first.get(k, [])) + [v + shift.get(k, 0.0) for v in last[k]]
               for k in last}
        out["stage"] = [0.0] * n0 + [1.0] * n1
        return out

    # ------------------------------------------------------------ two stages
    def sim_then_real(self, backend: str, real_share: float, real_batch_size: int,
                      top: int, oom_margin: float | None) -> tuple[ReinforceResult, dict]:
        """The simulator stage (or the ``init`` checkpoint as its result), the switch, and the
        real stage. Returns the real stage's result and the record of both stages."""
        if len(self.specs) != 1:
            raise AutoplaceError(f"fine-tuning on measured step times takes one model, got "
                                 f"{len(self.specs)}: {', '.join(self.names)}")
        cfg = self.config
        out = Path(cfg.out_dir) if cfg.out_dir else None
        path = out / "finetune.json" if out is not None else None
        # a resumed run whose real stage has begun goes on there: the switch is not redone
        in_real = bool(cfg.resume and path is not None and path.exists()
                       and (out / "checkpoint.pt").exists())
        if in_real:
            if backend == "sim,real" and (out / "sim" / "checkpoint.pt").exists():
                sim_data = ckpt.load(out / "sim" / "checkpoint.pt")
                self.earlier, self.elapsed_s = sim_data["history"], float(sim_data["elapsed_s"])
            real_budget = split_budget(cfg.budget, real_share)[1] if backend == "sim,real" \
                else cfg.budget
            state, sim_envs = None, []
        elif backend == "sim,real":
            sim_budget, real_budget = split_budget(cfg.budget, real_share)
            sim_cfg = replace(cfg, budget=sim_budget,
                              out_dir=str(out / "sim") if out is not None else None)
            sim_envs = self.envs("sim", max(1, cfg.batch_size))
            try:
                sim_result = self.stage("sim", sim_cfg, start=self.init, envs=sim_envs)
            except BaseException:
                for env in sim_envs:
                    env.close()
                raise
            state, self.earlier = sim_result.state, sim_result.history
            self.elapsed_s = sim_result.elapsed_s
        else:  # real, from a checkpoint trained on the simulator
            real_budget, state, sim_envs = cfg.budget, self.init, self.envs("sim", 1)
        try:
            real_envs = self.envs("real", 1, real_cache_size=REAL_CACHE_SIZE,
                                  oom_margin=oom_margin)
        except BaseException:
            for env in sim_envs:
                env.close()
            raise
        real = real_envs[0]
        key = _graph_key(real, 0)
        try:
            if in_real:
                record, start = json.loads(path.read_text())["switch"], None
            else:
                best = (state or {}).get("best", {}).get(key, {}).get("plan")
                record = switch(self.policy, sim_envs[0], real,
                                Plan.loads(best) if best else None, top=top, seed=cfg.seed)
                start = carry(state, record, real, key, {
                    "name": self.policy.name, "trainer": "reinforce", "stage": "sim",
                    "seed": cfg.seed})
                if path is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    write_json_atomic(path, {"switch": record})
                    _switch_scalars(out / "tb", record)
        finally:
            for env in sim_envs:
                env.close()
        unit, amount = parse_budget(real_budget)
        if unit == "seconds":  # the switch's measurements count against the real stage
            real_budget = f"{max(amount - record['measure_s'], 0.001):.3f}s"
        try:
            result = self.stage("real", self.real_config(cfg, real_budget, real_batch_size),
                                start=start, envs=real_envs)
            counts = dict(real.backend.counts)
        finally:
            real.close()
        stages = _summary(record, result, key, counts)
        if path is not None:
            write_json_atomic(path, stages)
        return result, stages


def _switch_scalars(tb: Path, record: dict[str, Any]) -> None:
    """The switch's ratios as TensorBoard scalars (step 0 of the real stage)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tb)) as writer:
        writer.add_scalar("switch/single_device_ratio", record["single_device"]["ratio"], 0)
        for name in ("ratios", "reward_factors"):
            for split, value in record[name].items():
                writer.add_scalar(f"switch/{name[:-1]}/{re.sub(r'[^A-Za-z0-9=]+', '_', split)}",
                                  value, 0)
        best = record.get("sim_best") or {}
        for key in ("simulated_step_time_s", "measured_step_time_s"):
            if best.get(key) is not None:
                writer.add_scalar(f"switch/sim_best_{key.split('_')[0]}_ms", best[key] * 1e3, 0)


def _summary(record: dict[str, Any], result: ReinforceResult, key: str,
             counts: dict[str, int]) -> dict[str, Any]:
    """Both stages' best plans, measured, and which is faster (or why the real stage found
    nothing faster)."""
    sim_best = record.get("sim_best") or {}
    sim_ms = sim_best.get("measured_step_time_s")
    sampled = result.sampled_best.get(key, {})
    real_s = sampled.get("step_time_s")
    real_s = real_s if real_s is not None and math.isfinite(real_s) else None
    real_plan = Plan.loads(sampled["plan"]) if sampled.get("plan") and real_s else None
    best = result.best.get(key, {})
    faster = None
    if real_s is not None and (sim_ms is None or real_s < sim_ms):
        faster, why = "real", "the real stage sampled a plan measured faster"
    elif sim_ms is not None:
        faster = "sim"
        why = ("the real stage sampled no plan measured faster than the simulator stage's "
               f"best ({sim_ms * 1e3:.3f} ms) in {result.episodes} episodes: "
               f"{counts['measured']} run, {counts['cached']} from the cache, "
               f"{counts['skipped']} failed without running (out of memory by the simulator's "
               "estimate, or a batch that does not split)")
    else:
        why = "no plan of either stage ran on the devices"
    return {
        "switch": record,
        "sim": {"plan": sim_best.get("plan"),
                "simulated_step_time_s": sim_best.get("simulated_step_time_s"),
                "measured_step_time_s": sim_ms, "error": sim_best.get("error")},
        "real": {"plan": real_plan.describe() if real_plan is not None else None,
                 "measured_step_time_s": real_s, "updates": result.updates,
                 "episodes": result.episodes, **{f"plans_{k}": v for k, v in counts.items()}},
        "best": {"plan": result.best_plan.describe() if isinstance(result.best_plan, Plan)
                 else None, "measured_step_time_s": best.get("step_time_s")},
        "faster": faster, "why": why,
    }
