"""The zero-shot search of the pre-trained GNN (:mod:`autoplace.policies.pretrained`): its
fixed plans, its samples for the time left, and the best plans' shard, compile and
execution-level variants, all scored on the simulator."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from autoplace.envs.levers import compile_pays
from autoplace.plan import Plan

from .base import batch_obs
from .plan_variants import outcome_variants
from .reinforce import _outcome
from .shard_variant import best_shard_variant

__all__ = ["SHARD_TOP", "SPLIT_SAMPLES", "VARIANT_SHARE"]

#: sampled placements scored under every valid split (after the free samples)
SPLIT_SAMPLES = 2
#: data-parallel plans among the best this many also tried with ZeRO-2 and FSDP sharding
SHARD_TOP = 4
#: share of the time limit kept for the best plans' execution-level variants
#: (:func:`~autoplace.policies.plan_variants.outcome_variants`)
VARIANT_SHARE = 1 / 3


def _zero_shot(env: Any, policy: Any, samples: int, seed: int,
               time_limit_s: float) -> tuple[tuple, float, Any, int]:
    """Best ``(rank, step_time_s, plan JSON, scored)`` of the greedy plan, the greedy
    placement under every valid split, ``samples`` sampled plans and a sampled placement
    under every valid split per ``SPLIT_SAMPLES`` (all of them scored), then further
    sampled placements under every valid split in turn until ``1 - VARIANT_SHARE`` of
    ``time_limit_s`` (a small graph's plan scores in well under a millisecond: thousands of
    the policy's samples), then the best plans' execution-level variants until
    ``time_limit_s`` (:func:`~autoplace.policies.plan_variants.outcome_variants`: stage
    counts and cuts the samples rarely reach, microbatch counts, compilation). With
    ``samples=0`` only the greedy plans, until ``time_limit_s`` (the first always).

    Raises:
        ValueError: ``time_limit_s`` is not finite (the samples run until it is spent)."""
    if not math.isfinite(time_limit_s):
        raise ValueError(f"zero-shot samples until its time limit is spent; give a finite "
                         f"time_limit_s (the shipped search's is ZERO_SHOT_S), not {time_limit_s}")
    t0 = time.perf_counter()
    obs, _ = env.reset(seed=seed)
    splits = torch.tensor(env.unwrapped.valid_splits(), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        actions = [policy(batch_obs([obs]), greedy=True).action,
                   policy(batch_obs([obs] * len(splits)), greedy=True, hybrid=splits).action]
        if samples:
            actions.append(policy(batch_obs([obs] * samples), generator=generator).action)
            forced = splits.repeat(SPLIT_SAMPLES, 1)
            actions.append(policy(batch_obs([obs] * len(forced)), generator=generator,
                                  hybrid=forced).action)
    outcomes: list[tuple] = []
    sample_s = time_limit_s * (1 - VARIANT_SHARE) if samples else time_limit_s

    def score(rows: torch.Tensor, limited: bool = True) -> bool:
        for row in rows.numpy():
            if limited and outcomes and time.perf_counter() - t0 > sample_s:
                return False
            env.reset(seed=seed)
            _, reward, _, _, info = env.step(row)
            outcomes.append(_outcome(info, reward))
        return True

    more = score(torch.cat(actions), limited=not samples)
    while samples and more:  # the time left: more samples, every split in turn
        with torch.no_grad():
            batch = policy(batch_obs([obs] * len(splits)), generator=generator,
                           hybrid=splits).action
        more = score(batch)
    if samples:  # their share of the time even where the samples ran late
        deadline = max(t0 + time_limit_s, time.perf_counter() + time_limit_s - sample_s)
        outcomes += outcome_variants(env, outcomes, compile=compile_pays(env.unwrapped.cluster),
                                     deadline=deadline)
    rank, step, plan, _ = _best_sharded(env, outcomes)
    return rank, step, plan, len(outcomes)


def _best_sharded(env: Any, outcomes: list[tuple]) -> tuple:
    """The best of ``outcomes`` (``_outcome`` tuples) and, for the :data:`SHARD_TOP` best
    ones, the same plan with ZeRO-2 or FSDP sharding (data-parallel plans) and, on GPUs
    (:func:`~autoplace.envs.levers.compile_pays`), compiled: the shipped policy's action
    space has neither a shard mode nor the compile lever, so both are chosen here on the
    simulator (:func:`~autoplace.policies.shard_variant.best_shard_variant`)."""
    e = env.unwrapped
    ranked = sorted(outcomes, key=lambda o: o[0])
    best = ranked[0]
    compiles = compile_pays(e.cluster)
    for rank, _, plan, _ in ranked[:SHARD_TOP]:
        if rank[0] or plan is None:
            continue
        base = plan if isinstance(plan, Plan) else Plan.from_json(plan)
        variant, step = best_shard_variant(e.graph, base, e.cluster, compile=compiles,
                                           beat_s=math.inf if best[0][0] else best[1])
        if variant is not base:
            best = ((False, step, 0.0), step, variant, False)
    return best
