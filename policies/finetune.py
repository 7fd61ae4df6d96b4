"""Continuing a simulator-trained policy on measured step times.

At the switch from the simulator to the devices (:func:`switch`) the simulator stage's best
plan and a few more of the trained policy's top plans (its greedy plan under every hybrid
split and sampled plans, fastest on the simulator first) are measured through the real
env's backend, whose cache the real stage then reuses. Per plan, measured / simulated step
time is its *time ratio*. The real env scores a plan by its step time over a *measured*
single-device time, the simulator env over a simulated one, so what moves a plan's reward
is its *reward factor*: its time ratio over the single-device reference's. Ratios are kept
per hybrid split (:meth:`autoplace.plan.Plan.split`), the finest grouping the REINFORCE
baselines use (the per-family calibration of ``autoplace.search`` is a layer above the
policies).

:func:`carry` then rescales the simulator stage's trainer state so that the first measured
rewards read as neither a collapse nor a jump: every baseline (a moving average of scores)
becomes the score of its step-time ratio times the reward factor of its split (a
forced-split baseline: the plans measured under that split; the policy's own: its best
plan's; else the median of all), and the best so far becomes the fastest plan measured at
the switch, with its measured time and score.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import torch

from autoplace.cluster import Cluster
from autoplace.envs.backends import plan_key
from autoplace.errors import AutoplaceError
from autoplace.plan import Plan

from .base import batch_obs, describe_spaces

__all__ = ["score_of_ratio", "ratio_of_score", "rescale_score", "switch", "carry",
           "check_init", "check_fit"]


def score_of_ratio(reward: str, r: float) -> float:
    """The env's score of a step-time ratio ``r`` (``t / t1``) under reward kind ``reward``."""
    if reward == "neg_sqrt":
        return -math.sqrt(r)
    if reward == "improvement":
        return 1.0 - r
    return -r


def ratio_of_score(reward: str, score: float) -> float:
    """The step-time ratio whose score is ``score`` (the inverse of :func:`score_of_ratio`)."""
    if reward == "neg_sqrt":
        return score * score
    if reward == "improvement":
        return 1.0 - score
    return -score


def rescale_score(score: float, factor: float, env: Any) -> float:
    """``score`` (of ``env``'s reward) for a step time ``factor`` times longer. Scores at or
    below the env's floor (failed plans, or averages dominated by them) keep their value:
    no step time stands behind them."""
    env = getattr(env, "unwrapped", env)
    floor, cfg = env.score_floor, env.config
    if not math.isfinite(score) or score <= floor:
        return score
    r = min(ratio_of_score(cfg.reward, score) * factor, float(cfg.max_slowdown))
    return max(score_of_ratio(cfg.reward, r), floor)


def _score(env: Any, step_time_s: float) -> float:
    env = getattr(env, "unwrapped", env)
    r = min(step_time_s / env.single_device_step_time_s, float(env.config.max_slowdown))
    return max(score_of_ratio(env.config.reward, r), env.score_floor)


def _top_plans(policy: Any, sim_env: Any, best: Plan | None, count: int, samples: int,
               seed: int) -> list[tuple[str, Plan]]:
    """``best`` then the policy's distinct plans that fit on the simulator, fastest first:
    the greedy plan, the greedy plan under each valid split, ``samples`` sampled plans."""
    env = getattr(sim_env, "unwrapped", sim_env)
    found: dict[tuple, tuple[float, str, Plan]] = {}
    if best is not None:
        found[plan_key(best)] = (-math.inf, "simulator stage's best", best)
    if policy.mode == "oneshot" and count > len(found):
        obs, _ = env.reset(seed=seed)
        sizes = tuple(policy.hybrid_sizes)
        splits = [tuple(s) + (-1,) * (len(sizes) - len(s)) for s in env.valid_splits()] \
            if sizes else []
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            rows = [("greedy", policy(batch_obs([obs]), greedy=True).action)]
            if splits:
                rows.append(("greedy under its split", policy(
                    batch_obs([obs] * len(splits)), greedy=True,
                    hybrid=torch.tensor(splits, dtype=torch.long)).action))
            if samples:
                rows.append(("sampled", policy(batch_obs([obs] * samples),
                                               generator=generator).action))
        for source, actions in rows:
            for action in actions.numpy():
                env.reset(seed=seed)
                _, _, _, _, info = env.step(action)
                if info["oom"] or info["error"] or not math.isfinite(info["step_time_s"]):
                    continue
                plan = Plan.from_json(info["plan"])
                key = plan_key(plan)
                if key not in found or info["step_time_s"] < found[key][0]:
                    found[key] = (info["step_time_s"], found.get(key, (0, source))[1], plan)
    ranked = sorted(found.values(), key=lambda x: x[0])[:count]
    return [(source, plan) for _, source, plan in ranked]


def switch(policy: Any, sim_env: Any, real_env: Any, sim_best: Plan | None, *,
           top: int = 3, samples: int = 16, seed: int = 0) -> dict[str, Any]:
    """Measure the simulator stage's best plan and its next ``top - 1`` plans on the devices.

    Returns the record (plain data): ``single_device`` (simulated and measured times, their
    ratio), ``plans`` (per plan: its source, split, simulated and measured step time, time
    ratio and reward factor, or why it failed), ``ratios`` and ``reward_factors`` per split,
    ``reward_factor`` (median of all), ``sim_best`` (the simulator stage's best plan,
    simulated and measured) and ``measure_s``.
    """
    t0 = time.perf_counter()
    sim, real = getattr(sim_env, "unwrapped", sim_env), getattr(real_env, "unwrapped", real_env)
    # a fresh measuring worker's first run is slow throughout (gpt-tiny on a 2-core CPU:
    # 0.96 s a step, then 2-7 ms): one run to discard before the reward's reference
    real.backend.evaluate(Plan.single(real.graph, cluster=real.cluster), uncapped=True,
                          key="worker warm-up")
    one_sim, one_real = sim.single_device_step_time_s, real.single_device_step_time_s
    single_ratio = one_real / one_sim
    rows = []
    for source, plan in _top_plans(policy, sim, sim_best, top, samples, seed):
        s = sim.backend.evaluate(plan)
        m = real.backend.evaluate(plan)
        row = {"source": source, "split": plan.split(), "plan": plan.describe(),
               "parallel": plan.parallel.to_json(),
               "simulated_step_time_s": float(s.step_time_s),
               "measured_step_time_s": float(m.step_time_s) if not m.failed else None,
               "oom": bool(m.oom), "skipped": bool(m.extra.get("skipped")), "error": m.error,
               "ratio": None, "reward_factor": None, "json": plan.to_json()}
        if not m.failed and not s.failed and s.step_time_s > 0:
            row["ratio"] = m.step_time_s / s.step_time_s
            row["reward_factor"] = row["ratio"] / single_ratio
        rows.append(row)

    def medians(field: str) -> dict[str, float]:
        by: dict[str, list[float]] = {}
        for r in rows:
            if r[field] is not None:
                by.setdefault(r["split"], []).append(r[field])
        return {k: statistics.median(v) for k, v in by.items()}

    factors = [r["reward_factor"] for r in rows if r["reward_factor"] is not None]
    first = rows[0] if rows and rows[0]["source"] == "simulator stage's best" else None
    return {
        "single_device": {"simulated_step_time_s": one_sim, "measured_step_time_s": one_real,
                          "ratio": single_ratio},
        "plans": rows, "ratios": medians("ratio"), "reward_factors": medians("reward_factor"),
        "reward_factor": statistics.median(factors) if factors else None,
        "sim_best": None if first is None else {
            k: first[k] for k in ("plan", "split", "simulated_step_time_s",
                                  "measured_step_time_s", "oom", "error", "json")},
        "measure_s": time.perf_counter() - t0,
    }


def _baseline_factor(key: str, record: dict[str, Any], env: Any) -> float:
    """The reward factor a baseline's split takes (module docstring)."""
    rows = [r for r in record["plans"] if r["reward_factor"] is not None]
    overall = record["reward_factor"] or 1.0
    if "#split" not in key:  # the policy's own choices: its best plan's factor
        first = record["plans"][0] if record["plans"] else {}
        return first.get("reward_factor") or overall
    try:
        idx = [int(x) for x in key.rsplit("#split", 1)[1].split("-")[:3]]
        want = (env.data_options[idx[0]], env.pipeline_options[idx[1]],
                env.microbatch_options[idx[2]])
    except (ValueError, IndexError):
        return overall
    same = [r["reward_factor"] for r in rows if (r["parallel"]["data"], r["parallel"][
        "pipeline"], r["parallel"]["microbatches"]) == want]
    return statistics.median(same) if same else overall


def carry(state: dict[str, Any], record: dict[str, Any], real_env: Any, key: str,
          planner: dict[str, Any]) -> dict[str, Any]:
    """The simulator stage's trainer ``state`` for the real stage (module docstring): its
    baselines rescaled (the factors go to ``record["baseline_factors"]``) and its best so
    far for graph ``key`` replaced by the fastest plan measured at the switch."""
    env = getattr(real_env, "unwrapped", real_env)
    baselines, factors = {}, {}
    for k, values in state.get("baselines", {}).items():
        factors[k] = _baseline_factor(k, record, env)
        baselines[k] = [rescale_score(float(v), factors[k], env) for v in values]
    record["baseline_factors"] = factors
    best = {}
    fits = [r for r in record["plans"] if r["measured_step_time_s"] is not None]
    if fits:
        row = min(fits, key=lambda r: r["measured_step_time_s"])
        step, score = row["measured_step_time_s"], _score(env, row["measured_step_time_s"])
        plan = {**row["json"], "measured": {"step_time_s": step},
                "predicted": {"step_time_s": row["simulated_step_time_s"]},
                "planner": {**planner, "source": row["source"], "env": row["json"]["planner"]}}
        best[key] = {"rank": [False, step, -score], "step_time_s": step, "reward": score,
                     "plan": json.dumps(plan), "update": 0}
    return {**state, "baselines": baselines, "best": best}


def check_init(data: dict[str, Any], path: Any, *, policy: str | None,
               cluster: Cluster) -> None:
    """Refuse to continue checkpoint ``data`` (from ``path``) with another policy than it
    holds or on another cluster (device count, kinds, usable memory) than it was trained on."""
    name = data["policy"]["name"]
    where = f"--init {path}"
    if policy is not None and policy != name:
        raise AutoplaceError(f"{where} holds a {name!r} policy, not {policy!r}: pass policy "
                             f"{name!r} (or none) to continue it")
    saved = data.get("extra", {}).get("cluster")
    if saved:
        trained = Cluster.from_json(saved)
        if _devices(trained) != _devices(cluster):
            raise AutoplaceError(
                f"{where} was trained on cluster {trained.name!r} ({_devices(trained)}); this "
                f"run's is {cluster.name!r} ({_devices(cluster)}): the device count, kinds "
                "and usable memory must be the same")


def check_fit(data: dict[str, Any], path: Any, *, env: Any, lever_sizes: dict[str, int],
              graph_key: str) -> None:
    """Refuse to continue checkpoint ``data`` in ``env``: another graph, other levers or
    other padded sizes than it was trained with; the error names both."""
    env = getattr(env, "unwrapped", env)
    where = f"--init {path}"
    extra = data.get("extra", {})
    graphs = extra.get("graphs") or sorted(set(data.get("best", {})) | {
        k.split("#split")[0] for k in data.get("baselines", {})})
    if graphs and graph_key not in graphs:
        raise AutoplaceError(f"{where} was trained on graph(s) {', '.join(graphs)}; this run "
                             f"places {graph_key}: continue a policy on its own graph (place "
                             "another graph zero-shot with autoplace.policies.place)")
    levers = tuple(extra.get("env_options", {}).get("levers", ()))
    if levers != tuple(env.config.levers):
        raise AutoplaceError(f"{where} was trained with levers {list(levers)}; this run's env "
                             f"has {list(env.config.levers)}")
    want = describe_spaces(env.observation_space, env.action_space, **lever_sizes)
    config = data["policy"]["config"]
    diff = {k: (config.get(k), v) for k, v in want.items()
            if (list(v) if isinstance(v, tuple) else v) != (
                list(config[k]) if isinstance(config.get(k), (tuple, list)) else config.get(k))}
    if diff:
        raise AutoplaceError(f"{where}'s policy does not fit this run's env: " + ", ".join(
            f"{k} {a!r} in the checkpoint, {b!r} here" for k, (a, b) in diff.items()))


def _devices(cluster: Cluster) -> str:
    kinds = sorted({d.kind for d in cluster.devices})
    usable = sorted({d.usable_memory_bytes for d in cluster.devices})
    return f"{cluster.num_devices} x {'/'.join(kinds)}, usable " + "/".join(
        f"{b / 2**30:.4g} GiB" for b in usable)
