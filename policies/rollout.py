"""What one REINFORCE update samples and reads back, shared by the trainer
(:mod:`autoplace.policies.reinforce`) and the planners that score a policy's plans.

:func:`_rollout` plays a batch of episodes with the envs in lockstep (some with a forced
hybrid split, :func:`_forced_splits`); :func:`_outcome` ranks an env step (a plan that
fails ranks after every plan that runs); :func:`_sample_steps` summarises a batch as step
times for the learning curve; :func:`_best_log_prob` is the self-imitation term's
log-probability of each graph's best plan so far.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from .base import PlacementPolicy, batch_obs


def _outcome(info: dict[str, Any], reward: float) -> tuple[tuple, float, Any, bool]:
    """``(rank, step_time_s, plan, measured)`` of an env step; a lower rank is better."""
    plan = info.get("plan")
    step = info.get("step_time_s")
    if step is None and plan is not None:
        pred = plan.get("predicted") if isinstance(plan, dict) else getattr(plan, "predicted", None)
        step = (pred or {}).get("step_time_s")
    step = float(step) if step is not None and math.isfinite(float(step)) else math.inf
    failed = bool(info.get("oom")) or bool(info.get("invalid")) or bool(info.get("error"))
    score = float(info.get("score", reward))  # incremental rewards are score differences
    return (failed, step, -score), step, plan, bool(info.get("measured"))


def _plan_text(plan: Any, step: float, measured: bool, planner: dict[str, Any]) -> str | None:
    """The plan as JSON text, naming the policy that found it and its step time."""
    if plan is None:
        return None
    data = dict(plan if isinstance(plan, dict) else plan.to_json())
    data["planner"] = {**planner, "env": data.get("planner", {})}
    if math.isfinite(step):
        data["measured" if measured else "predicted"] = {"step_time_s": step}
    return json.dumps(data, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else
                      o.item() if hasattr(o, "item") else str(o))


def _valid_splits(env: Any, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    fn = getattr(getattr(env, "unwrapped", env), "valid_splits", None)
    splits = [tuple(s) for s in fn()] if fn is not None else []
    if not splits:  # an env without the method: every combination
        grids = np.meshgrid(*(np.arange(n) for n in sizes), indexing="ij")
        splits = [tuple(int(x) for x in row) for row in np.stack(grids, -1).reshape(-1, len(sizes))]
    return splits


def _forced_splits(envs, policy, cfg, update, first_episode) -> dict[int, tuple[int, ...]]:
    """Episode index -> forced split for the last ``split_explore`` share of a batch: the
    valid splits of that episode's env in turn, continuing where the previous update
    stopped (a deterministic function of the update, so resumed runs agree)."""
    sizes = tuple(getattr(policy, "hybrid_sizes", ()))
    if policy.mode != "oneshot" or not sizes or cfg.split_explore <= 0:
        return {}
    batch_size = cfg.batch_size
    n_forced = min(batch_size, int(round(cfg.split_explore * batch_size)))
    out = {}
    for i, j in enumerate(range(batch_size - n_forced, batch_size)):
        splits = _valid_splits(envs[(first_episode + j) % len(envs)], sizes)
        split = splits[(update * n_forced + i) % len(splits)]
        out[j] = split + (-1,) * (len(sizes) - len(split))  # a compile choice: sampled
    return out


def _rollout(envs, policy, first_episode, batch_size, seed, generator, forced=None):
    """Play ``batch_size`` episodes, envs in lockstep. Returns transitions and episodes.
    ``forced`` maps an episode's index in the batch to the hybrid split it must use."""
    transitions, episodes = [], []
    forced = forced or {}
    n = len(envs)
    for start in range(0, batch_size, n):
        alive, obs = [], {}
        for j in range(start, min(start + n, batch_size)):
            env = (first_episode + j) % n
            obs[len(episodes)], _ = envs[env].reset(seed=(seed * 1_000_003 + first_episode + j)
                                                    % 2**31)
            alive.append(len(episodes))
            episodes.append({"env": env, "return": 0.0, "outcomes": [], "split": forced.get(j)})
        t = 0
        while alive:
            hybrid = None
            if any(episodes[e]["split"] is not None for e in alive):
                k = len(policy.hybrid_sizes)
                hybrid = torch.tensor([list(episodes[e]["split"] or (-1,) * k) for e in alive],
                                      dtype=torch.long)
            with torch.no_grad():
                out = policy(batch_obs([obs[e] for e in alive]), generator=generator,
                             hybrid=hybrid)
            still = []
            for row, e in enumerate(alive):
                ep = episodes[e]
                act = out.action[row].numpy()
                env_action = int(act[0]) if policy.mode == "incremental" else act
                next_obs, r, terminated, truncated, info = envs[ep["env"]].step(env_action)
                ep["return"] += float(r)
                ep["outcomes"].append(_outcome(info, float(r)))
                ep.setdefault("actions", []).append(act)
                transitions.append({
                    "obs": obs[e], "action": out.action[row], "reward": float(r), "t": t,
                    "episode": e, "env": ep["env"], "split": ep["split"],
                    "latent": {k: v[row] for k, v in out.latent.items()},
                })
                if not (terminated or truncated):
                    obs[e] = next_obs
                    still.append(e)
            alive, t = still, t + 1
    return transitions, episodes


def _best_log_prob(policy: PlacementPolicy, trans: list[dict[str, Any]], keys: list[str],
                   best: dict[str, dict[str, Any]]) -> torch.Tensor:
    """Mean log-probability, under the policy, of the best plan so far of every graph in the
    batch whose action is known (the self-imitation term; 0 when none is)."""
    obs, actions = [], []
    for key in dict.fromkeys(keys[tr["env"]] for tr in trans):
        action = best.get(key, {}).get("action")
        if action is not None and not best[key]["rank"][0]:  # never imitate a failed plan
            obs.append(next(tr["obs"] for tr in trans if keys[tr["env"]] == key))
            actions.append(action)
    if not obs:
        return torch.zeros(())
    batch = batch_obs(obs)
    target = torch.as_tensor(actions, dtype=torch.long)
    latent = policy.imitation_latent(batch, target) or None
    return policy(batch, target, latent).log_prob.mean()


def _sample_steps(eps: list[dict[str, Any]], keys: list[str], key: str) -> dict[str, float]:
    """The batch's plans of graph ``key`` (the first graph): ``sample_mean_step_s``, the mean
    step time of the on-policy ones that ran (a forced split is not the policy's choice),
    ``sample_ran_frac``, the share of on-policy ones that ran (not out of memory or
    invalid), and ``sample_best_step_s``, the fastest of all; ``inf`` where none ran."""
    ran, policy_ran, policy_n = [], [], 0
    for ep in eps:
        if keys[ep["env"]] != key:
            continue
        rank, step = min(ep["outcomes"], key=lambda o: o[0])[:2]
        policy_n += ep["split"] is None
        if not rank[0] and math.isfinite(step):
            ran.append(step)
            if ep["split"] is None:
                policy_ran.append(step)
    return {"sample_mean_step_s": float(np.mean(policy_ran)) if policy_ran else math.inf,
            "sample_ran_frac": len(policy_ran) / policy_n if policy_n else 0.0,
            "sample_best_step_s": min(ran, default=math.inf)}
