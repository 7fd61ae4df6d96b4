"""REINFORCE for placement policies: one trainer, read top to bottom.

Every update samples ``batch_size`` episodes with the policy (envs step in lockstep so
the policy runs once per step for all of them), turns rewards into returns, subtracts
a moving-average baseline (one per graph and step), normalises the advantages, and
takes one Adam step on ``-(log_prob * advantage) - entropy_coef * entropy`` with the
gradient norm clipped and the learning rate following a schedule. The best plan seen
(``info["plan"]`` of an env step) is kept; unless ``warm_start`` is off, the policy first
imitates the best heuristic plan (:mod:`~autoplace.policies.warm_start`), which starts the
best so far. Checkpoints hold every piece of state, so a run killed at any moment resumes
from its last checkpoint to the same result.

Reproducibility: ``random``, numpy and torch are seeded, the policy samples with a
``torch.Generator`` seeded here, and every env reset gets a seed derived from the run
seed and the episode number.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoplace.errors import AutoplaceError
from autoplace.files import write_atomic, write_json_atomic
from autoplace.plan import Plan

from . import checkpoint as ckpt
from .base import PlacementPolicy, batch_obs
from .rollout import (
    _best_log_prob,
    _forced_splits,
    _outcome,
    _plan_text,
    _rollout,
    _sample_steps,
)
from .warm_start import heuristic_target, supports_warm_start, warm_start

__all__ = ["ReinforceConfig", "ReinforceResult", "reinforce", "parse_budget", "LR_SCHEDULES"]

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(kw_only=True)
class ReinforceConfig:
    """Options of :func:`reinforce`."""

    budget: str | int = "200"
    """how long to train: updates ("200"), episodes ("2000ep") or wall time ("90s", "5m", "1h")"""
    time_limit_s: float | None = None
    """stop after this much wall time whatever the budget (None: no limit)"""
    batch_size: int = 16
    """episodes (sampled plans) per update"""
    lr: float = 3e-3
    """peak learning rate of Adam"""
    lr_schedule: str = "cosine"
    """learning-rate schedule over the budget: constant, linear or cosine"""
    lr_final: float = 0.1
    """final learning rate as a fraction of lr (linear and cosine schedules)"""
    entropy_coef: float = 1e-2
    """weight of the entropy bonus"""
    split_explore: float = 0.5
    """oneshot with a hybrid split: fraction of each batch's episodes whose split is forced,
    cycling through the env's valid splits (stratified), so the placement keeps learning
    under every split however sure the split head becomes. Those episodes train the
    placement conditioned on their split (against a baseline per split), not the split
    head, whose gradient stays on-policy"""
    hybrid_entropy_coef: float = 5e-2
    """extra entropy bonus on the split head (slows its collapse onto one split)"""
    baseline_decay: float = 0.9
    """moving-average factor of the reward baseline"""
    normalize_advantages: bool = True
    """scale advantages to zero mean and unit variance within each batch"""
    gamma: float = 1.0
    """discount of later rewards (incremental mode)"""
    max_grad_norm: float = 1.0
    """gradient norm clip"""
    seed: int = 0
    """seed of random, numpy, torch, the sampling generator and env resets"""
    out_dir: str | None = None
    """where checkpoint.pt, tb/ and best_plan.json go (None: nothing written)"""
    checkpoint_every: int = 10
    """updates between checkpoints (0: only at the end)"""
    resume: bool = False
    """continue from out_dir/checkpoint.pt when it exists"""
    progress: bool = True
    """show a tqdm progress bar"""
    tensorboard: bool = True
    """write TensorBoard scalars to out_dir/tb"""
    warm_start: bool = True
    """before REINFORCE, imitate the best plan of the heuristics and the hybrid DP (oneshot
    PlacementEnvs; see autoplace.policies.warm_start); that plan starts the best so far"""
    warm_start_steps: int = 300
    """most Adam steps of the warm start (it stops once the greedy plan is the target)"""
    measure_start: bool = True
    """a fresh run first samples one batch with the untrained (or pre-trained) policy, before
    the warm start and without a gradient step, so its learning curve has a start
    (``ReinforceResult.start_samples``; not counted in the episodes)"""
    self_imitation_coef: float = 0.3
    """oneshot: weight of a behaviour-cloning term on the best plan so far of each graph (the
    warm start's target until REINFORCE samples a faster one; self-imitation, Oh et al. 2018).
    Without it a batch whose sampled plans are all the imitated one carries no advantage, and
    Adam turns the entropy bonuses alone into full-size steps off that plan; with it the
    policy explores around the fastest plan it knows and follows it when it improves"""


@dataclass
class ReinforceResult:
    """What a run found: the best plan per graph and the training history."""

    best_plan: Any
    best_step_time_s: float
    best_reward: float
    best: dict[str, dict[str, Any]]
    history: dict[str, list[float]]
    updates: int
    episodes: int
    elapsed_s: float
    checkpoint_path: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    warm_start: dict[str, Any] = field(default_factory=dict)
    sampled_best: dict[str, dict[str, Any]] = field(default_factory=dict)
    """per graph, the best plan sampled in this run (``best`` may hold a plan carried from
    ``start`` or the warm start instead)"""
    state: dict[str, Any] = field(default_factory=dict)
    """the trainer state at the end, as the checkpoint holds it (what ``start`` takes)"""
    start_samples: dict[str, float] = field(default_factory=dict)
    """``sample_mean_step_s``, ``sample_ran_frac`` and ``sample_best_step_s`` of one batch
    sampled before any training (``measure_start``); empty for a resumed or continued run"""


def parse_budget(budget: str | int) -> tuple[str, float]:
    """``200`` / ``"200"`` / ``"100up"`` -> updates, ``"2000ep"`` -> episodes, ``"90s"``/``"5m"``/``"1h"``
    -> seconds. Returns ``(unit, amount)`` with unit ``updates``, ``episodes`` or ``seconds``."""
    text = str(budget).strip().lower()
    units = (("episodes", "episodes", 1), ("episode", "episodes", 1), ("ep", "episodes", 1),
             ("updates", "updates", 1), ("update", "updates", 1), ("up", "updates", 1),
             ("u", "updates", 1), ("s", "seconds", 1),
             ("m", "seconds", 60), ("h", "seconds", 3600))
    for suffix, unit, scale in (("", "updates", 1), *units):
        number = text[: len(text) - len(suffix)] if suffix else text
        if (not suffix or text.endswith(suffix)) and number.replace(".", "", 1).isdigit():
            amount = float(number) * scale
            if amount > 0:
                return unit, amount
    raise AutoplaceError(
        f"cannot read a budget from {budget!r}; write updates (100up), episodes (2000ep) or "
        "wall time (90s, 5m, 1h)"
    )


def _lr_factor(schedule: str, frac: float, final: float) -> float:
    frac = min(max(frac, 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - (1.0 - final) * frac
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _graph_key(env: Any, index: int) -> str:
    graph = getattr(getattr(env, "unwrapped", env), "graph", None)
    fp = getattr(graph, "fingerprint", None)
    return f"{getattr(graph, 'name', 'graph')}-{fp}" if fp else f"env{index}"












def reinforce(
    envs: list[Any],
    policy: PlacementPolicy,
    config: ReinforceConfig | None = None,
    *,
    extra: dict[str, Any] | None = None,
    start: dict[str, Any] | None = None,
    on_update: Callable[[int, dict[str, float]], None] | None = None,
    **overrides: Any,
) -> ReinforceResult:
    """Train ``policy`` with REINFORCE on ``envs`` (env instances or zero-argument factories).

    Args:
        envs: environments following the PlacementEnv contract; several graphs may be
            mixed (their padded shapes must agree). Episodes of one update are spread
            over them round-robin and stepped in lockstep.
        policy: a policy from :mod:`autoplace.policies` sized for the envs' spaces.
        config: options (see :class:`ReinforceConfig`); ``overrides`` replace fields.
        extra: plain data saved in the checkpoint beside the trainer state.
        start: trainer state to continue from instead of a fresh one: a checkpoint payload
            (``policy_state``, ``optimizer``, ``baselines``, ``best``), e.g. a simulator
            stage's with its baselines and best plan corrected for measured step times
            (:mod:`autoplace.policies.finetune`). The weights, Adam's moments, the baselines
            and the best so far carry over; counters, history and budget start at zero,
            and there is no warm start. A resumed run ignores it.
        on_update: called after every update with its number (from 1) and its history row
            (and, with ``measure_start``, with 0 and the samples before any training)
            (``sample_mean_step_s``: mean simulated or measured step of the batch's on-policy
            plans that ran; ``sample_best_step_s``: the batch's fastest; ``best_step_time_s``:
            the best so far...), e.g. to print a learning curve as it is drawn.
    """
    cfg = replace(config or ReinforceConfig(), **overrides)
    if cfg.out_dir is not None:
        cfg = replace(cfg, out_dir=str(cfg.out_dir))
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise AutoplaceError(
            f"unknown lr_schedule {cfg.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    unit, amount = parse_budget(cfg.budget)
    envs = [e if hasattr(e, "step") else e() for e in envs]
    if not envs:
        raise AutoplaceError("reinforce needs at least one env")
    shapes = {(e.observation_space["node_features"].shape, str(e.action_space)) for e in envs}
    if len(shapes) > 1:
        raise AutoplaceError(
            f"envs must share padded sizes (same max_groups, devices and hybrid options); "
            f"got {sorted(shapes)}")
    keys = [_graph_key(e, i) for i, e in enumerate(envs)]
    out_dir = Path(cfg.out_dir) if cfg.out_dir else None
    ckpt_path = out_dir / "checkpoint.pt" if out_dir else None

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    update, episodes_done, elapsed_before = 0, 0, 0.0
    baselines: dict[str, list[float]] = {}
    best: dict[str, dict[str, Any]] = {}
    sampled: dict[str, dict[str, Any]] = {}
    history: dict[str, list[float]] = {k: [] for k in (
        "reward_mean", "reward_max", "best_step_time_s", "best_reward", "entropy", "loss", "lr",
        "episodes", "elapsed_s", "sample_mean_step_s", "sample_ran_frac", "sample_best_step_s")}

    warm: dict[str, Any] | None = None  # what the warm start did; None: not yet decided
    if cfg.resume and ckpt_path is not None and ckpt_path.exists():
        data = ckpt.load(ckpt_path)
        if data["policy"]["name"] != policy.name or data["policy"]["config"] != policy.config:
            raise AutoplaceError(
                f"{ckpt_path} holds a {data['policy']['name']!r} policy with config "
                f"{data['policy']['config']}, not this {policy.name!r} {policy.config}")
        policy.load_state_dict(data["policy_state"])
        optimizer.load_state_dict(data["optimizer"])
        ckpt.set_rng_state(data["rng"], generator)
        update, episodes_done = int(data["update"]), int(data["episodes"])
        elapsed_before = float(data["elapsed_s"])
        baselines, best, history = data["baselines"], data["best"], data["history"]
        sampled = data.get("sampled", {})
        # a resumed run never redoes the warm start (nor adds one to a run without it)
        warm = data.get("warm_start") or {"done": False, "why": "resumed a run without it"}
    elif start is not None:
        policy.load_state_dict(start["policy_state"])
        optimizer.load_state_dict(start["optimizer"])
        baselines = {k: [float(x) for x in v] for k, v in start.get("baselines", {}).items()}
        best = {k: dict(v) for k, v in start.get("best", {}).items()}
        warm = {"done": False, "why": "continued from an earlier stage's state"}

    def elapsed_s() -> float:
        return elapsed_before + time.perf_counter() - t0

    def progress() -> float:
        """Amount of the budget spent, in its unit."""
        return {"updates": update, "episodes": episodes_done, "seconds": elapsed_s()}[unit]

    def payload(elapsed_s: float) -> dict[str, Any]:
        return {
            "policy": {"name": policy.name, "config": policy.config},
            "policy_state": policy.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": ckpt.rng_state(generator), "update": update, "episodes": episodes_done,
            "elapsed_s": elapsed_s, "baselines": baselines, "best": best, "history": history,
            "config": {k: v for k, v in asdict(cfg).items() if k != "resume"},
            "extra": extra or {}, "warm_start": warm, "sampled": sampled,
        }

    def save_checkpoint(elapsed_s: float) -> None:
        if ckpt_path is not None:
            ckpt.save(ckpt_path, payload(elapsed_s))

    t0 = time.perf_counter()
    start_samples: dict[str, float] = {}
    if warm is None and cfg.measure_start:  # a fresh run: the policy before any training
        policy.eval()
        _, eps = _rollout(envs, policy, -cfg.batch_size, cfg.batch_size, cfg.seed,
                          torch.Generator().manual_seed(cfg.seed + 1))
        start_samples = _sample_steps(eps, keys, keys[0])
        if on_update is not None:
            on_update(0, {**start_samples, "elapsed_s": elapsed_s(),
                          "best_step_time_s": start_samples["sample_best_step_s"]})
    if warm is None:
        warm = _warm_start(envs, keys, policy, cfg, best)
        if warm["done"]:  # a run killed from here on resumes without redoing it
            save_checkpoint(elapsed_s())
    writer = None
    if out_dir is not None and cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out_dir / "tb"), purge_step=update or None)
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=int(amount), initial=int(min(amount, progress())), desc=policy.name,
                   unit={"updates": "upd", "episodes": "ep", "seconds": "s"}[unit],
                   mininterval=1.0)

    limit_s = cfg.time_limit_s if cfg.time_limit_s is not None else math.inf
    while progress() < amount and elapsed_s() < limit_s:
        lr = cfg.lr * _lr_factor(cfg.lr_schedule, progress() / amount, cfg.lr_final)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # 1. sample a batch of episodes
        policy.eval()
        forced = _forced_splits(envs, policy, cfg, update, episodes_done)
        trans, eps = _rollout(envs, policy, episodes_done, cfg.batch_size, cfg.seed, generator,
                              forced)
        for ep in eps:
            key = keys[ep["env"]]
            rank, step, plan, measured = min(ep["outcomes"], key=lambda o: o[0])
            planner = {"name": policy.name, "trainer": "reinforce", "update": update,
                       "seed": cfg.seed}
            action = [int(x) for x in ep["actions"][-1]] if policy.mode == "oneshot" else None
            for kept in (best, sampled):
                old = kept.get(key)
                if old is None or list(rank) < list(old["rank"]):
                    kept[key] = {"rank": list(rank), "step_time_s": step, "reward": -rank[2],
                                 "plan": _plan_text(plan, step, measured, planner),
                                 "update": update, "action": action}

        # 2. returns-to-go, minus a moving-average baseline per (graph, step)
        returns = np.zeros(len(trans))
        running: dict[int, float] = {}
        for i in reversed(range(len(trans))):
            e = trans[i]["episode"]
            running[e] = trans[i]["reward"] + cfg.gamma * running.get(e, 0.0)
            returns[i] = running[e]
        advantages = np.zeros(len(trans))
        by_slot: dict[tuple[str, int], list[int]] = {}
        for i, tr in enumerate(trans):  # forced splits: a baseline per split
            split = tr.get("split")
            key = keys[tr["env"]] if split is None else \
                f"{keys[tr['env']]}#split{'-'.join(map(str, split))}"
            by_slot.setdefault((key, tr["t"]), []).append(i)
        for (key, t), idx in by_slot.items():
            b = baselines.setdefault(key, [])
            mean = float(returns[idx].mean())
            if t >= len(b):
                b.append(mean)
            advantages[idx] = returns[idx] - b[t]
            b[t] = cfg.baseline_decay * b[t] + (1 - cfg.baseline_decay) * mean
        if cfg.normalize_advantages and len(trans) > 1:
            std = advantages.std()
            advantages = (advantages - advantages.mean()) / std if std > 1e-8 else advantages * 0

        # 3. one gradient step on the recomputed log-probabilities
        policy.train()
        latent = {k: torch.stack([tr["latent"][k] for tr in trans]) for k in trans[0]["latent"]}
        out = policy(batch_obs([tr["obs"] for tr in trans]),
                     torch.stack([tr["action"] for tr in trans]), latent or None)
        adv = torch.as_tensor(advantages, dtype=torch.float32)
        entropy = out.entropy.mean()
        log_prob = out.log_prob
        bonus = cfg.entropy_coef * entropy
        if out.hybrid_log_prob is not None:
            # a forced split was not the policy's choice: only the placement learns from it
            was_forced = torch.tensor([tr.get("split") is not None for tr in trans])
            log_prob = log_prob - out.hybrid_log_prob * was_forced
            bonus = bonus + cfg.hybrid_entropy_coef * out.hybrid_entropy.mean()
        loss = -(log_prob * adv).mean() - bonus
        if cfg.self_imitation_coef > 0 and policy.mode == "oneshot":
            loss = loss - cfg.self_imitation_coef * _best_log_prob(policy, trans, keys, best)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        optimizer.step()

        # 4. bookkeeping
        update += 1
        episodes_done += len(eps)
        elapsed = elapsed_s()
        ep_returns = [ep["return"] for ep in eps]
        first = best.get(keys[0], {})
        row = {"reward_mean": float(np.mean(ep_returns)), "reward_max": float(np.max(ep_returns)),
               "best_step_time_s": float(first.get("step_time_s", math.inf)),
               "best_reward": float(first.get("reward", -math.inf)), "entropy": entropy.item(),
               "loss": loss.item(), "lr": lr, "episodes": float(episodes_done),
               "elapsed_s": elapsed, **_sample_steps(eps, keys, keys[0])}
        for k, v in row.items():
            history.setdefault(k, []).append(v)  # a resumed older run lacks newer series
        if writer is not None:
            for k in ("reward_mean", "reward_max", "best_step_time_s", "entropy", "loss", "lr"):
                if math.isfinite(row[k]):
                    writer.add_scalar(k.replace("_", "/", 1) if k.startswith("reward") else k,
                                      row[k], update)
        if bar is not None:
            bar.n = int(min(amount, progress()))
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}",
                            mean_ms=f"{row['sample_mean_step_s'] * 1e3:.4g}",
                            best_ms=f"{row['best_step_time_s'] * 1e3:.4g}", refresh=False)
            bar.update(0)  # redraws at most every mininterval
        if on_update is not None:
            on_update(update, row)
        if cfg.checkpoint_every and update % cfg.checkpoint_every == 0:
            save_checkpoint(elapsed)

    elapsed = elapsed_s()
    save_checkpoint(elapsed)
    if bar is not None:
        bar.close()
    if writer is not None:
        writer.close()
    result = _result(best, keys, history, update, episodes_done, elapsed, ckpt_path, out_dir,
                     cfg, warm)
    result.sampled_best, result.state = sampled, payload(elapsed)
    result.start_samples = start_samples
    return result






def _warm_start(envs, keys, policy, cfg, best) -> dict[str, Any]:
    """Clone the best heuristic plan of every graph into ``policy`` and start ``best`` from
    it (see :mod:`autoplace.policies.warm_start`). Returns what was done, as plain data."""
    if not cfg.warm_start:
        return {"done": False, "why": "warm_start=False"}
    if policy.mode != "oneshot":
        return {"done": False, "why": f"{policy.mode} mode: warm start clones oneshot actions"}
    first = {}
    for env, key in zip(envs, keys):
        first.setdefault(key, env)
    if not all(supports_warm_start(env) for env in first.values()):
        return {"done": False, "why": "the envs are not oneshot PlacementEnvs"}
    targets = {key: heuristic_target(env) for key, env in first.items()}
    if any(t is None for t in targets.values()):
        return {"done": False, "why": "no heuristic plan could be scored"}
    stats = warm_start(policy, list(first.values()), [t.action for t in targets.values()],
                       steps=cfg.warm_start_steps, lr=cfg.lr)
    for key, target in targets.items():
        rank, step, plan, measured = _outcome(target.info, target.reward)
        planner = {"name": policy.name, "trainer": "warm-start", "source": target.source,
                   "seed": cfg.seed}
        best[key] = {"rank": list(rank), "step_time_s": step, "reward": -rank[2],
                     "plan": _plan_text(plan, step, measured, planner), "update": 0,
                     "action": [int(x) for x in target.action]}
    return {"done": True, **stats, "targets": {
        key: {"source": t.source, "step_time_s": t.step_time_s,
              "fits": not _outcome(t.info, t.reward)[0][0],
              "action": [int(x) for x in t.action], "candidates": t.candidates}
        for key, t in targets.items()}}


def _result(best, keys, history, update, episodes, elapsed, ckpt_path, out_dir, cfg, warm):
    first = best.get(keys[0], {})
    plan = _load_plan(first.get("plan"))
    if out_dir is not None and plan is not None:
        write_atomic(out_dir / "best_plan.json", first["plan"])
        if len(set(keys)) > 1:
            write_json_atomic(out_dir / "best_plans.json",
                              {k: json.loads(v["plan"]) for k, v in best.items() if v.get("plan")})
    return ReinforceResult(
        best_plan=plan, best_step_time_s=float(first.get("step_time_s", math.inf)),
        best_reward=float(first.get("reward", -math.inf)), best=best, history=history,
        updates=update, episodes=episodes, elapsed_s=elapsed, checkpoint_path=ckpt_path,
        config=asdict(cfg), warm_start=warm or {})


def _load_plan(text: str | None) -> Any:
    if text is None:
        return None
    data = json.loads(text)
    try:
        return Plan.from_json(data)
    except AutoplaceError:
        return data
