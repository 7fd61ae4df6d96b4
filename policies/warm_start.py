"""Warm start: the policy imitates the best plan the heuristics find before REINFORCE.

Doppler (ICLR 2026) and GDP start reinforcement learning from a good heuristic rather
than from a random policy. Here the baseline planners (:mod:`autoplace.planners`: the
hybrid DP, critical path, expert, DDP...) plan the env's graph on its cluster; each plan
becomes an env action (:func:`plan_to_action`: every env group takes the device most of
its ops have in the plan, the split its nearest option), every such action and a few
plain ones (everything on device 0 under each valid split) are scored by the env itself,
and the best is the target (:func:`heuristic_target`). In an env with levers the action
also carries the plan's recompute choice per group (most of its ops' mode), its compile
flag, and priorities derived from the plan's issue order (groups issued first get the
lowest levels), and the plain candidates include everything on device 0 recomputed; with
the compile lever every candidate is also scored compiled (``<source>+compile``): no
heuristic compiles, and on GPUs a compiled plan is the first thing anneal finds.
Scoring through the env matters:
the env cannot express everything a planner can (ZeRO sharding, a 1F1B schedule, groups
that cut across the env's), so the target is the best plan *the env can reach*.

:func:`warm_start` then maximises the target action's log-probability under the policy
(behaviour cloning on the env's own action space) with Adam, until the greedy action is
the target or the step budget runs out. The trainer starts its best-so-far from the
target, so a trained policy's best plan is never slower than it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from autoplace import planners
from autoplace.envs.levers import Levers
from autoplace.errors import AutoplaceError
from autoplace.lowering import issue_order

from .base import PlacementPolicy, batch_obs

__all__ = ["WARM_START_PLANNERS", "WarmStartTarget", "plan_to_action", "heuristic_target",
           "order_priority", "supports_warm_start", "warm_start"]

#: planners whose plans are warm-start candidates (fast on every graph)
WARM_START_PLANNERS = ("hybrid-dp", "pipeline", "critical-path", "m-etf", "expert", "ddp",
                       "single")


@dataclass
class WarmStartTarget:
    """The action a policy imitates and what the env made of it.

    Attributes:
        action: the env action (``[max_groups + 3]`` int64; longer with levers).
        step_time_s: the env's step time of ``action``.
        source: the planner whose plan it is (``"device0"`` for a plain candidate).
        info: the env's ``info`` after stepping ``action`` (its ``plan``, ``score``...).
        reward: the env's reward of ``action``.
        candidates: step time of every candidate scored, by source.
    """

    action: np.ndarray
    step_time_s: float
    source: str
    info: dict[str, Any]
    reward: float
    candidates: dict[str, float] = field(default_factory=dict)


def _nearest(options: tuple[int, ...], value: int, exact: bool) -> int | None:
    """Index of ``value`` in ``options``, else (unless ``exact``) of the nearest option."""
    if value in options:
        return options.index(value)
    if exact:
        return None
    return int(np.argmin([abs(math.log(o) - math.log(max(value, 1))) for o in options]))


def plan_to_action(env: Any, plan: Any) -> np.ndarray | None:
    """The oneshot action of ``env`` closest to ``plan`` (a :class:`~autoplace.plan.Plan`).

    Each env group takes the device (local to a replica) most of its ops have in the
    plan; the data and pipeline degrees must be among the env's options (else None: the
    plan is not expressible), the microbatch count takes the nearest option.
    """
    e = getattr(env, "unwrapped", env)
    data = _nearest(tuple(e.data_options), plan.parallel.data, exact=True)
    pipe = _nearest(tuple(e.pipeline_options), plan.parallel.pipeline, exact=True)
    micro = _nearest(tuple(e.microbatch_options), plan.parallel.microbatches, exact=False)
    if data is None or pipe is None:
        return None
    votes: list[Counter] = [Counter() for _ in range(e.num_groups)]
    modes: list[Counter] = [Counter() for _ in range(e.num_groups)]
    for op, group in e.groups.items():
        gid = plan.groups.get(op)
        if gid is not None:
            votes[group][int(plan.placement[gid])] += 1
            modes[group][1 if gid in plan.recompute else 2 if gid in plan.selective else 0] += 1
    local = e.num_devices // e.data_options[data]
    devices = [(c.most_common(1)[0][0] if c else 0) % max(local, 1) for c in votes]
    layout = getattr(e, "action_layout", None)
    if layout is None:  # an env without levers' layout: devices, then the split
        action = np.zeros(e.action_space.shape, dtype=np.int64)
        action[: len(devices)] = devices
        action[e.config.max_groups:] = (data, pipe, micro)
        return action
    levers = Levers(
        priority=order_priority(e, plan) if layout.priority_levels else (),
        recompute=tuple(min(c, key=lambda m, c=c: (-c[m], m)) if c else 0 for c in modes)
        if layout.recompute_choices else (),
        compile=plan.parallel.compile)
    return layout.encode(devices, (data, pipe, micro), levers)


def order_priority(env: Any, plan: Any) -> tuple[int, ...]:
    """Each env group's priority level from ``plan``'s issue order
    (:func:`autoplace.lowering.issue_order`): groups ranked by when their first op is
    issued, the ranks cut into ``priority_levels`` equal bands (first issued: 0)."""
    e = getattr(env, "unwrapped", env)
    try:
        pos = {op: i for i, (mb, op) in enumerate(issue_order(e.graph, plan)) if mb == 0}
    except AutoplaceError:  # a plan whose order cannot be lowered: program order
        pos = {op: i for i, op in enumerate(e.graph.order)}
    first = [len(pos)] * e.num_groups
    for op, group in e.groups.items():
        first[group] = min(first[group], pos.get(op, len(pos)))
    rank = sorted(range(e.num_groups), key=lambda g: (first[g], g))
    levels = e.action_layout.priority_levels
    out = [0] * e.num_groups
    for r, g in enumerate(rank):
        out[g] = r * levels // e.num_groups
    return tuple(out)


def _score(env: Any, action: np.ndarray) -> tuple[tuple[bool, float], float, dict[str, Any]]:
    """``((failed, step_time_s), reward, info)`` of one env step of ``action``."""
    env.reset(seed=0)
    _, reward, _, _, info = env.step(action)
    step = float(info.get("step_time_s", math.inf))
    failed = bool(info.get("oom") or info.get("error")) or not math.isfinite(step)
    return (failed, step if math.isfinite(step) else math.inf), float(reward), info


def supports_warm_start(env: Any) -> bool:
    """Whether ``env`` is a oneshot PlacementEnv whose graph the planners can plan."""
    e = getattr(env, "unwrapped", env)
    return (all(hasattr(e, k) for k in ("graph", "cluster", "groups", "data_options"))
            and getattr(getattr(e, "config", None), "mode", None) == "oneshot")


def heuristic_target(env: Any, names: tuple[str, ...] = WARM_START_PLANNERS
                     ) -> WarmStartTarget | None:
    """The best env action among the planners' plans and the plain candidates.

    Every candidate is scored by stepping ``env`` (after a reset); a planner that fails
    on the graph is skipped. None when nothing can be scored (not a oneshot env).
    """
    if not supports_warm_start(env):
        return None
    e = getattr(env, "unwrapped", env)
    candidates: list[tuple[str, np.ndarray]] = []
    for name in names:
        try:
            plan = planners.get(name)(e.graph, e.cluster)
        except AutoplaceError:
            continue
        action = plan_to_action(e, plan)
        if action is not None:
            candidates.append((name, action))
    layout = getattr(e, "action_layout", None)
    for split in e.valid_splits():
        action = np.zeros(e.action_space.shape, dtype=np.int64)
        action[layout.slices["split"] if layout else slice(e.config.max_groups, None)] = split
        candidates.append(("device0", action))
        if layout is not None and layout.recompute_choices:  # all on device 0, recomputed
            candidates.append(("device0-recompute", layout.encode(
                [0] * e.num_groups, split, Levers(recompute=(1,) * e.num_groups))))
    if layout is not None and layout.compile_choices:  # every candidate compiled too
        at = layout.slices["compile"].start
        for source, action in list(candidates):
            if not action[at]:
                twin = action.copy()
                twin[at] = 1
                candidates.append((f"{source}+compile", twin))
    best = None
    times: dict[str, float] = {}
    for source, action in candidates:
        rank, reward, info = _score(env, action)
        times[source] = min(times.get(source, math.inf), rank[1])
        if best is None or rank < best[0]:
            best = (rank, source, action, reward, info)
    if best is None:
        return None
    rank, source, action, reward, info = best
    return WarmStartTarget(action=action, step_time_s=rank[1], source=source, info=info,
                           reward=reward, candidates=times)


def _greedy_matches(policy: PlacementPolicy, obs: dict[str, torch.Tensor],
                    target: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the policy's greedy action is the target on every real group."""
    with torch.no_grad():
        greedy = policy(obs, greedy=True).action
    real = policy.real_entries(obs["node_mask"], target.shape[1])
    return ((greedy == target) | ~real).all(1)


def warm_start(
    policy: PlacementPolicy,
    envs: list[Any],
    target_actions: list[np.ndarray] | np.ndarray,
    steps: int = 300,
    lr: float = 1e-2,
) -> dict[str, Any]:
    """Behaviour cloning: maximise the log-probability of ``target_actions[i]`` under the
    policy in ``envs[i]``'s first observation, until the greedy action of every env is
    its target or ``steps`` Adam steps are spent.

    Args:
        policy: an oneshot policy sized for the envs.
        envs: one env per target (oneshot mode).
        target_actions: the env actions to imitate, one per env.
        steps: most Adam steps.
        lr: Adam's learning rate.

    Returns:
        ``steps`` (taken), ``matched`` (greedy equals target everywhere), ``log_prob``
        (the targets' mean log-probability at the end).
    """
    if policy.mode != "oneshot":
        raise AutoplaceError(f"warm start clones oneshot actions; the policy is in "
                             f"{policy.mode!r} mode")
    if len(envs) != len(target_actions) or not envs:
        raise AutoplaceError(f"warm start needs one target action per env, got "
                             f"{len(target_actions)} for {len(envs)} envs")
    obs = batch_obs([env.reset(seed=0)[0] for env in envs])
    target = torch.as_tensor(np.stack([np.asarray(a) for a in target_actions]),
                             dtype=torch.long)
    latent = policy.imitation_latent(obs, target) or None
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    taken, matched = 0, False
    for taken in range(steps + 1):
        policy.eval()
        if bool(_greedy_matches(policy, obs, target).all()):
            matched = True
            break
        if taken == steps:
            break
        policy.train()
        out = policy(obs, target, latent)
        loss = -out.log_prob.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.eval()
    with torch.no_grad():
        log_prob = float(policy(obs, target, latent).log_prob.mean())
    return {"steps": taken, "matched": matched, "log_prob": log_prob}
