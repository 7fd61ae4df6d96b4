"""Local search: simulated annealing over group placements, judged by the simulator.

Starts from the best (by simulation) of a few heuristic plans, or from plans given,
and proposes batches of neighbours — one group moved to another device, two groups
swapped, a run of consecutive groups moved together, the microbatch count halved or
doubled — evaluated together with :func:`autoplace.sim.simulate_batch`. The best
proposal of a batch is accepted by the Metropolis rule on the relative change of
cost (step time, with a penalty proportional to the memory overflow for plans that
run out of memory); the temperature falls geometrically over the time budget. Proposals also change
the data-parallel degree (the rest of the devices form each replica), the shard mode
and recomputation of a group; pipeline seeds are searched as one-process placements.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.planners import get
from autoplace.planners._common import ensure_costs, make_plan, working_groups
from autoplace.planners._evaluate import evaluate, overflow

__all__ = ["anneal"]

DEFAULT_SEEDS = ("single", "expert", "critical-path-mo", "m-etf", "mincut", "ddp")


def _cost(step_s: np.ndarray, over: np.ndarray, oom: np.ndarray) -> np.ndarray:
    return np.where(oom, step_s * (2.0 + 10.0 * np.maximum(over - 1.0, 0.0)), step_s)


def _project(plan: Plan, groups: dict[str, int], n_groups: int, k: int) -> list[int]:
    """Device of every group of ``groups`` under ``plan`` (majority of its ops)."""
    votes = np.zeros((n_groups, k), dtype=np.int64)
    dm = plan.device_map()
    for op, g in groups.items():
        votes[g, min(dm[op], k - 1)] += 1
    return [int(x) for x in votes.argmax(axis=1)]


def _microbatch_ok(graph: OpGraph, data: int, m: int) -> bool:
    batch = getattr(graph, "batch_size", None)
    return m >= 1 and (not batch or batch % (data * m) == 0)


def anneal(
    graph: OpGraph,
    cluster: Cluster,
    *,
    time_budget_s: float = 5.0,
    max_evaluations: int | None = None,
    batch: int = 32,
    seed: int = 0,
    seeds: tuple[str, ...] = DEFAULT_SEEDS,
    seed_plans: list[Plan] | None = None,
    max_groups: int = 1024,
    initial_temperature: float = 0.05,
    final_temperature: float = 0.002,
) -> Plan:
    """Simulated annealing over group placements, seeded from the best heuristic; its
    moves also change the split (data degree, sharding, microbatches), recompute a group
    whole or selectively, and (on GPUs) compile the plan's pieces.

    Args:
        time_budget_s: wall-clock seconds of search (seeding included).
        max_evaluations: stop after this many simulated proposals (None: time only).
        batch: proposals simulated together per step.
        seed: random seed.
        seeds: planners whose plans seed the search.
        seed_plans: extra seed plans (e.g. the best plan found so far).
        max_groups: groups moved by the search (co-location groups, coarsened if more).
        initial_temperature, final_temperature: Metropolis temperature, as a fraction of
            the current cost, at the start and at the end of the budget.
    """
    t0 = time.perf_counter()
    rng = random.Random(seed)
    ensure_costs(graph, cluster)
    groups = working_groups(graph, max_groups)
    n_groups = max(groups.values()) + 1
    n_dev = cluster.num_devices

    candidates: list[tuple[str, Plan]] = [(p.planner.get("name", "given"), p)
                                          for p in (seed_plans or [])]
    for name in seeds:
        candidates.append((name, get(name)(graph, cluster)))
    starts: list[Plan] = []
    for _, p in candidates:
        par = p.parallel
        k = max(1, n_dev // par.data)
        if par.pipeline > 1:
            par = replace(par, pipeline=1)
        placement = _project(p, groups, n_groups, k)
        starts.append(Plan.from_groups(graph, groups, placement, parallel=par,
                                       recompute=_project_recompute(p, groups), planner="anneal",
                                       cluster=cluster))
    # the seeds as they are, and projected on the search's groups (what the moves edit)
    everything = starts + [p for _, p in candidates]
    step_s, peak, oom = evaluate(graph, everything, cluster)
    costs = _cost(step_s, overflow(peak, cluster), oom)
    n = len(starts)
    i = int(np.argmin(costs[:n]))
    current, cur_cost = starts[i], float(costs[i])
    j = int(np.argmin(costs))
    best, best_cost, best_oom = everything[j], float(costs[j]), bool(oom[j])
    seed_name, seed_cost = candidates[j % n][0], best_cost
    evaluations, steps, accepted = len(costs), 0, 0
    degrees = [d for d in range(1, n_dev + 1) if n_dev % d == 0 and _microbatch_ok(graph, d, 1)]
    # torch.compile is a choice on GPUs (on CPUs inductor's compile outlasts what it saves)
    compilable = all(d.kind != "cpu" for d in cluster.devices)

    def propose(plan: Plan) -> Plan:
        place = list(plan.placement)
        par = plan.parallel
        k = max(1, n_dev // par.data)
        r = rng.random()
        if r < 0.06:
            m = par.microbatches * 2 if rng.random() < 0.5 else par.microbatches // 2
            if _microbatch_ok(graph, par.data, m) and m <= 64:
                return replace(plan, parallel=replace(par, microbatches=m))
        elif r < 0.1 and len(degrees) > 1:
            d = rng.choice([x for x in degrees if x != par.data])
            k_new = n_dev // d
            m = par.microbatches if _microbatch_ok(graph, d, par.microbatches) else 1
            if k_new == k:
                new_place = place
            elif k == 1:  # spread contiguously in topological order of groups
                new_place = [min(g * k_new // n_groups, k_new - 1) for g in range(n_groups)]
            else:
                new_place = [min(x * k_new // k, k_new - 1) for x in place]
            shard = par.shard if d > 1 and k_new == 1 else "none"  # FSDP2: a device a rank
            return replace(plan, placement=tuple(new_place),
                           parallel=replace(par, data=d, microbatches=m, shard=shard))
        elif r < 0.13 and par.data > 1 and k == 1:
            shard = rng.choice([x for x in ("none", "zero2", "fsdp") if x != par.shard])
            return replace(plan, parallel=replace(par, shard=shard))
        elif r < 0.17 and par.pipeline == 1:  # a pipeline stage is recomputed whole
            g = rng.randrange(n_groups)
            return replace(plan, recompute=plan.recompute ^ {g}, selective=plan.selective - {g})
        elif r < 0.19 and par.pipeline == 1:  # or selectively: matmuls' outputs kept
            g = rng.randrange(n_groups)
            return replace(plan, selective=plan.selective ^ {g}, recompute=plan.recompute - {g})
        elif r < 0.2 and compilable and not par.graphs:  # every group a compiled piece
            return replace(plan, parallel=replace(par, compile=not par.compile))
        if k == 1:
            return plan
        if r < 0.6:
            g = rng.randrange(n_groups)
            place[g] = rng.choice([d for d in range(k) if d != place[g]])
        elif r < 0.78:
            a, b = rng.randrange(n_groups), rng.randrange(n_groups)
            place[a], place[b] = place[b], place[a]
        else:
            a = rng.randrange(n_groups)
            b = min(n_groups, a + rng.randint(2, 8))
            d = rng.randrange(k)
            place[a:b] = [d] * (b - a)
        return replace(plan, placement=tuple(place))

    while time.perf_counter() - t0 < time_budget_s:
        if max_evaluations is not None and evaluations >= max_evaluations:
            break
        frac = min((time.perf_counter() - t0) / max(time_budget_s, 1e-9), 1.0)
        temp = initial_temperature * (final_temperature / initial_temperature) ** frac
        props = [propose(current) for _ in range(batch)]
        props = [p for p in props if p != current] or props
        step_s, peak, oom = evaluate(graph, props, cluster)
        costs = _cost(step_s, overflow(peak, cluster), oom)
        evaluations += len(props)
        steps += 1
        j = int(np.argmin(costs))
        c = float(costs[j])
        if c < best_cost:
            best, best_cost, best_oom = props[j], c, bool(oom[j])
        delta = (c - cur_cost) / max(cur_cost, 1e-12)
        if delta <= 0 or rng.random() < math.exp(-delta / max(temp, 1e-12)):
            current, cur_cost = props[j], c
            accepted += 1
    return make_plan(
        graph, cluster, "anneal", t0, best.groups, list(best.placement),
        parallel=best.parallel, recompute=best.recompute, selective=best.selective,
        seed_planner=seed_name,
        seed_cost_s=seed_cost, cost_s=best_cost, oom=best_oom, evaluations=evaluations,
        steps=steps, accepted=accepted, seed=seed,
    )


def _project_recompute(plan: Plan, groups: dict[str, int]) -> set[int]:
    """Groups any of whose ops the seed recomputes."""
    if not plan.recompute:
        return set()
    return {g for op, g in groups.items() if plan.groups[op] in plan.recompute}


