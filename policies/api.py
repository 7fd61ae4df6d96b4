"""What the CLI calls: :func:`train` a policy on one model (or a family of graphs) and
:func:`place` a graph, possibly never seen in training, with a trained checkpoint.

``train`` builds ``PlacementEnv`` instances (the simulator backend gets one env per
episode of an update, all sharing one captured graph), a policy from the registry,
and runs :func:`~autoplace.policies.reinforce.reinforce`. It writes
``DIR/checkpoint.pt``, ``DIR/tb/``, ``DIR/best_plan.json`` and ``DIR/curve.png``. With
``backend="sim,real"`` the simulator trains first and the same policy continues on
measured step times (:mod:`autoplace.policies.stages`, :mod:`autoplace.policies.finetune`).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.envs.levers import compile_pays
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph
from autoplace.grouping import auto_group_count
from autoplace.plan import Plan

from . import checkpoint as ckpt
from .base import batch_obs
from .finetune import check_init
from .reinforce import ReinforceConfig, _outcome
from .stages import TrainingRun, make_envs

__all__ = ["TrainResult", "train", "place", "default_env_options", "BACKENDS"]


@dataclass
class TrainResult:
    """What :func:`train` found.

    Attributes:
        best_plan: the fastest plan seen for the (first) model, as a ``Plan``.
        best_step_time_s: its step time (simulated, or measured with ``backend="real"``).
        history: per-update series (``reward_mean``, ``best_step_time_s``, ``entropy``...).
        checkpoint_path: ``DIR/checkpoint.pt`` (None without ``out_dir``).
        best_plans: the best plan per graph when several were trained on.
        elapsed_s: training wall time.
        warm_start: what the warm start did (``done``, ``steps``, ``matched``, and per
            graph the ``source`` planner and ``step_time_s`` of the plan imitated).
        stages: a run that went from the simulator to the devices (``sim,real``, or
            ``real`` from a simulator checkpoint): ``switch`` (the plans measured there,
            the measured/simulated ratios per split, the baseline factors), ``sim`` (the
            simulator stage's best plan, simulated and measured), ``real`` (the best plan
            sampled on the devices, measured), ``best`` (``best_plan``, the faster of
            them), ``faster`` (``"sim"`` or ``"real"``) and ``why``; else empty.
        start_samples: the new policy's sampled plans before any training: their mean and
            fastest step and the share that ran (``ReinforceResult.start_samples``; empty
            for a run continued from a checkpoint).
    """

    best_plan: Any
    best_step_time_s: float
    history: dict[str, list[float]]
    checkpoint_path: Path | None
    best_plans: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    warm_start: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)
    start_samples: dict[str, float] = field(default_factory=dict)


def default_env_options(num_devices: int, *, compile: bool = False) -> dict[str, Any]:
    """The env options policies train with by default: structure-aware groups
    (``grouping="branch"``, so parallel branches can go to different devices), data and
    pipeline degrees that divide the device count, and 1-8 microbatches; with ``compile``
    (GPU clusters: :func:`autoplace.envs.levers.compile_pays`) also the plan-wide
    ``compile`` lever, the choice anneal wins most of its lead with (on Inception-v3 and
    T5 over four H100s, compiling the one-device plan takes 28-39% off its step)."""
    divisors = tuple(k for k in range(1, num_devices + 1) if num_devices % k == 0)
    out: dict[str, Any] = {"grouping": "branch", "data_options": divisors,
                           "pipeline_options": divisors, "microbatch_options": (1, 2, 4, 8)}
    if compile:
        out["levers"] = ("compile",)
    return out


def _auto_groups(spec: Any) -> int:
    """:func:`autoplace.grouping.auto_group_count` of a spec's captured graph."""
    if isinstance(spec, OpGraph):
        return auto_group_count(spec)
    wl = workloads.get(spec, device="meta") if isinstance(spec, str) else spec
    return auto_group_count(capture_workload(wl))


#: what a training run writes in its ``out_dir``
RUN_FILES = ("checkpoint.pt", "best_plan.json", "best_plans.json", "tb", "curve.png", "sim",
             "finetune.json")


def check_run_folder(out_dir: str | Path, *, resume: bool, force: bool) -> None:
    """Refuse ``out_dir`` when it holds an earlier run and neither ``resume`` nor ``force``
    says what to do with it (``train`` checks it before any work; with ``force`` it then
    removes that run's files, so no events of two runs mix)."""
    out = Path(out_dir)
    if resume and force:
        raise AutoplaceError("resume continues the run in the output folder and force "
                             "replaces it: pass one of them")
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not (resume or force):
        raise AutoplaceError(
            f"{out} holds an earlier run ({', '.join(found)}): resume it (--resume), start "
            "over there (--force), or name another output folder")
    if resume and not (out / "checkpoint.pt").exists():
        raise AutoplaceError(f"nothing to resume: no checkpoint.pt in {out}")


#: reward backends of :func:`train`: one stage, or the simulator then the devices
BACKENDS = ("sim", "real", "sim,real")


def train(
    model_spec: Any,
    cluster: Any,
    policy: str | None = None,
    backend: str = "sim",
    budget: str | int = "2000ep",
    out_dir: str | Path | None = None,
    seed: int = 0,
    max_groups: int | str = "auto",
    resume: bool = False,
    progress: bool = True,
    *,
    force: bool = False,
    mode: str = "oneshot",
    memory_cap: str | int | None = None,
    policy_options: dict[str, Any] | None = None,
    env_options: dict[str, Any] | None = None,
    warm_start: bool = True,
    init: str | Path | None = None,
    real_share: float = 0.3,
    real_batch_size: int = 4,
    real_top_plans: int = 3,
    oom_margin: float | None = 1.25,
    on_update: Callable[[int, dict[str, float]], None] | None = None,
    **reinforce_options: Any,
) -> TrainResult:
    """Train a placement policy with REINFORCE and return the best plan it found.

    Args:
        model_spec: zoo name, ``module:factory``, a Workload, an OpGraph, or a list of
            them (one policy trained on all: a family of graphs for zero-shot placement).
        cluster: preset name, JSON path, ``"detect"`` or a Cluster.
        policy: ``seq2seq`` (default), ``hierarchical`` or ``gnn``; with ``init``, the
            checkpoint's (naming another is refused).
        backend: ``sim`` (simulated step time), ``real`` (measured), or ``sim,real``: the
            simulator for ``1 - real_share`` of the budget, then the same policy (weights,
            optimizer state, baselines) on measured step times, the baselines and the best
            so far corrected at the switch (:mod:`autoplace.policies.finetune`).
        budget: updates (``"200"``), episodes (``"2000ep"``) or wall time (``"5m"``); with
            ``sim,real`` the whole run's, shared between the stages in its unit.
        out_dir: where checkpoint.pt, tb/, best_plan.json and curve.png go; ``sim,real``
            puts the simulator stage's in ``sim/`` and writes ``finetune.json``. None:
            nothing is written (the policy and its plans are kept in memory only).
        seed: seeds the policy's weights, its sampling and the env resets.
        max_groups: groups each graph is coarsened to, or ``"auto"``: the largest
            :func:`autoplace.grouping.auto_group_count` of the graphs (16 for a chain, more
            for graphs of many parallel-branch blocks, 8 for a small fork-join graph); with
            ``init``, the checkpoint's.
        resume: continue from ``out_dir/checkpoint.pt`` (``sim,real``: from the stage it
            stopped in).
        progress: show a progress bar.
        force: start over in an ``out_dir`` of an earlier run (its checkpoint, plans and
            TensorBoard events removed). Without ``resume`` or ``force`` such a folder is
            refused (:func:`check_run_folder`): an earlier run is never overwritten.
        mode: ``oneshot`` or ``incremental`` (gnn only).
        memory_cap: cap every device's memory (``"16GB"``).
        policy_options: the policy's own options (``hidden``, ``conv``...).
        env_options: PlacementEnv options (default hybrid choices:
            :func:`default_env_options`; with ``init``, the checkpoint's); ``levers``
            (``priority``, ``recompute``, ``compile``) gives the policy a head for each.
        warm_start: first imitate the best plan of the heuristics and the hybrid DP
            (:mod:`autoplace.policies.warm_start`), which also starts the best plan so
            far, so the result is never slower than it (oneshot mode; not with ``init``).
        init: a ``checkpoint.pt`` of an earlier run to start from (its weights, optimizer
            state and baselines), trained on the same graph, cluster and levers. A
            simulator-trained one continued on ``real`` goes through the same switch as
            ``sim,real``.
        real_share: ``sim,real``: the share of the budget the measured stage gets.
        real_batch_size: plans sampled per update on measured step times (each costs a run).
        real_top_plans: plans of the simulator stage measured at the switch, its best first.
        oom_margin: measured stages never run a plan the simulator puts above this many
            times a device's usable memory: it is reported out of memory (None: all run).
        on_update: the trainer's per-update callback (:func:`reinforce`): update 0 with
            the new policy's samples before any training, then every update with its
            history row (each stage's updates from 1).
        **reinforce_options: fields of :class:`ReinforceConfig` (``batch_size``, ``lr``...).
    """
    if backend not in BACKENDS:
        raise AutoplaceError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "sim,real" and not 0 < real_share < 1:
        raise AutoplaceError(f"real_share must be between 0 and 1 (exclusive), got {real_share!r}")
    if out_dir is not None:
        check_run_folder(out_dir, resume=resume, force=force)
        if force:  # start over: the earlier run's files go, before any work
            for name in ("tb", "sim"):
                shutil.rmtree(Path(out_dir) / name, ignore_errors=True)
            for name in RUN_FILES:
                if not (Path(out_dir) / name).is_dir():
                    (Path(out_dir) / name).unlink(missing_ok=True)
    cl = resolve(cluster, memory_cap)
    specs = list(model_spec) if isinstance(model_spec, (list, tuple)) else [model_spec]
    data = ckpt.load(init) if init is not None else None
    if data is not None:
        check_init(data, init, policy=policy, cluster=cl)
    if data is not None and policy_options:
        raise AutoplaceError("policy_options do not apply with init: the checkpoint's policy "
                             "is continued as it was built")
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in
             (data or {}).get("extra", {}).get("env_options", {}).items()}
    if max_groups == "auto":
        max_groups = saved.get("max_groups") or max(_auto_groups(s) for s in specs)
    elif not isinstance(max_groups, int) or max_groups < 1:
        raise AutoplaceError(f"max_groups must be a positive number or 'auto', got {max_groups!r}")
    # compile is offered on GPUs to a new oneshot run (a checkpoint keeps its own levers)
    offer_compile = compile_pays(cl) and mode == "oneshot" and data is None
    env_opts = {**default_env_options(cl.num_devices, compile=offer_compile),
                "max_groups": max_groups, "mode": mode, **saved, **(env_options or {})}
    if data is None or max_groups != saved.get("max_groups"):
        env_opts["max_groups"] = max_groups
    cfg = ReinforceConfig(budget=budget, seed=seed, resume=resume, progress=progress,
                          out_dir=str(out_dir) if out_dir is not None else None,
                          warm_start=warm_start and data is None, **reinforce_options)
    run = TrainingRun(specs, cl, env_opts, cfg, policy, policy_options, data, init,
                      on_update=on_update)
    if backend == "sim":
        result = run.stage("sim", cfg, start=data)
        stages: dict[str, Any] = {}
    elif backend == "real" and (data is None or data.get("extra", {}).get("backend") == "real"):
        result = run.stage("real", run.real_config(cfg, budget, real_batch_size),
                           start=data, oom_margin=oom_margin)
        stages = {}
    else:
        result, stages = run.sim_then_real(backend, real_share, real_batch_size,
                                           real_top_plans, oom_margin)
    history = run.history(result)
    if out_dir is not None:
        _plot(history, Path(out_dir) / "curve.png", f"{run.policy.name} on "
              f"{', '.join(run.names[:3])} ({cl.name}, {backend})")
    plans = {k: Plan.loads(v["plan"]) for k, v in result.best.items() if v.get("plan")}
    return TrainResult(best_plan=result.best_plan, best_step_time_s=result.best_step_time_s,
                       history=history, checkpoint_path=result.checkpoint_path,
                       best_plans=plans, elapsed_s=run.elapsed_s + result.elapsed_s,
                       warm_start=run.warm or result.warm_start, stages=stages,
                       start_samples=run.start_samples)


def _plot(history: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(1, len(history["reward_mean"]) + 1))
    ax1.plot(x, history["reward_mean"], label="mean reward")
    ax1.plot(x, history["reward_max"], alpha=0.5, label="max reward")
    ax1.set_xlabel("update")
    ax1.legend()
    best = [v * 1e3 if math.isfinite(v) else float("nan") for v in history["best_step_time_s"]]
    ax2.plot(x, best, color="C2")
    if "stage" in history and 1.0 in history["stage"]:  # the switch to measured step times
        switch = history["stage"].index(1.0) + 0.5
        for ax in (ax1, ax2):
            ax.axvline(switch, color="grey", linestyle="--", linewidth=1)
        ax2.set_ylabel("best step time (ms): simulated | measured")
    ax2.set_xlabel("update")
    if "stage" not in history:
        ax2.set_ylabel("best step time (ms)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def place(
    checkpoint: str | Path,
    graph_or_workload: Any,
    cluster: Any,
    *,
    samples: int = 16,
    seed: int = 0,
    memory_cap: str | int | None = None,
    max_groups: int | None = None,
) -> Any:
    """Place a graph with a trained policy, without training on it (zero-shot).

    The policy's most likely plan, its most likely placement under each hybrid split
    the env offers, and ``samples`` sampled plans are scored on the simulator (no
    gradient step: the policy is not trained on the graph); the fastest is returned (``predicted`` and ``planner`` filled in, with
    the search time). The graph may differ from those trained on; the cluster must
    have as many devices as the training cluster.

    Args:
        checkpoint: a ``checkpoint.pt`` written by :func:`train`.
        graph_or_workload: OpGraph, Workload, zoo name or ``module:factory``.
        cluster: preset name, JSON path, ``"detect"`` or a Cluster.
        samples: sampled plans scored beside the greedy one (0: greedy only).
        seed: seed of the sampling generator.
        memory_cap: cap every device's memory.
        max_groups: coarsening of the graph (default: the one trained with).
    """
    t0 = time.perf_counter()
    policy, data = ckpt.load_policy(checkpoint)
    cl = resolve(cluster, memory_cap)
    opts = {k: tuple(v) if isinstance(v, list) else v
            for k, v in data.get("extra", {}).get("env_options", {}).items()}
    if max_groups is not None:
        opts["max_groups"] = max_groups
    env = make_envs([graph_or_workload], cl, "sim", 1, opts)[0]
    try:
        f, d = env.observation_space["node_features"].shape[1], env.num_devices
        if (f, d) != (policy.num_features, policy.num_devices):
            raise AutoplaceError(
                f"checkpoint {checkpoint} was trained for {policy.num_devices} devices and "
                f"{policy.num_features} features; this cluster has {d} devices and the env "
                f"{f} features")
        rank, step, plan, _ = _search(env, policy, samples, seed)
    finally:
        env.close()
    planner = {"name": f"policy:{policy.name}", "checkpoint": str(checkpoint),
               "samples": samples, "search_time_s": time.perf_counter() - t0,
               "failed": bool(rank[0])}
    return Plan.from_json({**plan, "predicted": {"step_time_s": step}, "planner": planner})


def _search(env: Any, policy: Any, samples: int, seed: int) -> tuple:
    """Best outcome (see ``_outcome``) of the greedy plan, the greedy placement under every
    hybrid split the env offers (oneshot), and ``samples`` sampled plans."""
    generator = torch.Generator().manual_seed(seed)
    outcomes = []
    if policy.mode == "oneshot":
        obs, _ = env.reset(seed=seed)
        splits = torch.cartesian_prod(*(torch.arange(n) for n in policy.hybrid_sizes)) \
            if policy.hybrid_sizes else torch.zeros(0, 0, dtype=torch.long)
        splits = splits.view(-1, len(policy.hybrid_sizes))[:256]
        actions = []
        with torch.no_grad():
            actions.append(policy(batch_obs([obs]), greedy=True).action)
            if len(splits):
                actions.append(policy(batch_obs([obs] * len(splits)), greedy=True,
                                      hybrid=splits).action)
            if samples:
                actions.append(policy(batch_obs([obs] * samples), generator=generator).action)
        for row in torch.cat(actions).numpy():
            env.reset(seed=seed)
            _, r, _, _, info = env.step(row)
            outcomes.append(_outcome(info, r))
        return min(outcomes, key=lambda o: o[0])
    for greedy, n in ((True, 1), (False, samples)):
        for _ in range(n):
            obs, _ = env.reset(seed=seed)
            done = False
            while not done:
                with torch.no_grad():
                    out = policy(batch_obs([obs]), generator=generator, greedy=greedy)
                obs, r, term, trunc, info = env.step(int(out.action[0, 0]))
                outcomes.append(_outcome(info, r))
                done = term or trunc
    return min(outcomes, key=lambda o: o[0])
