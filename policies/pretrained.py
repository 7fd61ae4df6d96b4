"""The pre-trained GNN placer shipped with the package: zero-shot placement of a new graph,
and a short fine-tune of it on that graph.

``scripts/train_pretrained.py`` trains one :class:`~autoplace.policies.gnn.GNNPolicy` per
device count (2, 4, 8) with warm start and REINFORCE on the simulator, over many graphs
of the zoo's architecture families and random DAGs under several memory caps; the
weights ship as ``pretrained/gnn.pt`` (one state dict, a prefix per device count, read
with ``torch.load(weights_only=True)``) beside ``pretrained/gnn.json``, its card: how it
was trained, on what, which families were held out, what it scored.

The policy sees the env's group features plus two of :class:`MemoryPressure`: how the
whole graph's one-device peak memory compares with a device's usable memory, so the same
weights place a graph differently under a memory cap.

* :func:`place_pretrained`: zero-shot. The greedy plan, the greedy placement under every
  valid hybrid split and the policy's sampled plans (under every split in turn), then the
  best plans' execution-level variants (:mod:`~autoplace.policies.plan_variants`: stage
  counts and cuts, microbatch counts, compilation), for :data:`ZERO_SHOT_S` in all, are
  scored on the simulator; the fastest that fits is returned (no gradient step on the
  graph). The env's action space has no shard mode, so the best data-parallel plans are
  also tried with ZeRO-2 and FSDP.
* :func:`finetune_pretrained`: the same policy trained further on the graph
  (REINFORCE from the pre-trained weights; warm start keeps the best heuristic plan the env
  can reach as a floor), never returning a plan slower than the zero-shot one.
* :func:`pretrained_candidates`: both, as extra candidates for the ``auto`` search.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from autoplace.cluster import resolve
from autoplace.envs import PlacementEnv
from autoplace.errors import AutoplaceError
from autoplace.graph import OpGraph
from autoplace.plan import Plan
from autoplace.sim import simulate

from .gnn import GNNPolicy
from .reinforce import ReinforceConfig, reinforce
from .zero_shot import _best_sharded, _zero_shot

__all__ = ["CARD_PATH", "DEVICE_COUNTS", "EXTRA_FEATURES", "FineTuneResult", "MemoryPressure",
           "WEIGHTS_PATH", "card", "env_options", "finetune_pretrained", "load_pretrained",
           "make_env", "place_pretrained", "pretrained_candidates"]

WEIGHTS_PATH = Path(__file__).with_name("pretrained") / "gnn.pt"
CARD_PATH = Path(__file__).with_name("pretrained") / "gnn.json"
#: device counts the shipped weights place on (one policy each)
DEVICE_COUNTS = (2, 4, 8)
#: groups every graph is coarsened to, in training and when placing
MAX_GROUPS = 32
#: most updates of the fine-tune :func:`pretrained_candidates` runs
AUTO_FINETUNE_UPDATES = 40
#: seconds a zero-shot placement scores the policy's plans and their variants for
ZERO_SHOT_S = 0.6
#: features :class:`MemoryPressure` appends to the env's group features
EXTRA_FEATURES = ("log2_one_device_memory_ratio", "fits_one_device")


class MemoryPressure(gym.ObservationWrapper):
    """Appends :data:`EXTRA_FEATURES` to every real group's features: ``log2(1 + r)`` and
    ``r <= 1``, where ``r`` is the simulated peak memory of the whole graph on one device
    over the smallest usable device memory (the cap, when one is set). The env's own
    features do not change with a cap; these do.

    Args:
        env: a :class:`~autoplace.envs.PlacementEnv`.
    """

    def __init__(self, env: PlacementEnv) -> None:
        super().__init__(env)
        e = env.unwrapped
        peak = max(simulate(e.graph, Plan.single(e.graph, cluster=e.cluster),
                            e.cluster).peak_memory_bytes)
        usable = min(d.usable_memory_bytes for d in e.cluster.devices)
        ratio = peak / max(usable, 1)
        self.memory_ratio = float(ratio)
        self._extra = np.array([math.log2(1.0 + ratio), float(ratio <= 1.0)], dtype=np.float32)
        box = env.observation_space["node_features"]
        g, f = box.shape
        self.observation_space = spaces.Dict({
            **env.observation_space.spaces,
            "node_features": spaces.Box(0.0, np.finfo(np.float32).max,
                                        shape=(g, f + len(EXTRA_FEATURES)), dtype=np.float32)})

    def observation(self, observation: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = observation["node_features"]
        extra = np.zeros((x.shape[0], len(EXTRA_FEATURES)), dtype=np.float32)
        extra[observation["node_mask"].astype(bool)] = self._extra
        return {**observation, "node_features": np.concatenate([x, extra], axis=1)}


def env_options(num_devices: int) -> dict[str, Any]:
    """The env options the pre-trained policy was trained with for ``num_devices``: branch
    grouping into :data:`MAX_GROUPS` groups, data and pipeline degrees that divide the device
    count, 1-8 microbatches."""
    divisors = tuple(k for k in range(1, num_devices + 1) if num_devices % k == 0)
    return {"grouping": "branch", "max_groups": MAX_GROUPS, "data_options": divisors,
            "pipeline_options": divisors, "microbatch_options": (1, 2, 4, 8)}


def make_env(spec: Any, cluster: Any, *, memory_cap: str | int | None = None,
             max_edges: int | None = None, graph: OpGraph | None = None) -> MemoryPressure:
    """A simulator env of ``spec`` (an OpGraph, Workload or zoo name) with the pre-trained
    policy's options and features. ``graph``: a captured graph to share (env copies)."""
    cl = resolve(cluster, memory_cap)
    opts = {**env_options(cl.num_devices), "max_edges": max_edges, "backend": "sim"}
    if graph is None and isinstance(spec, OpGraph):
        graph = spec
    env = PlacementEnv(graph=graph, cluster=cl, **opts) if graph is not None else \
        PlacementEnv(workload=spec, cluster=cl, **opts)
    return MemoryPressure(env)


def card() -> dict[str, Any]:
    """The shipped weights' card (``pretrained/gnn.json``): training command, commit, data,
    held-out families, results, and the policy config per device count."""
    if not CARD_PATH.is_file():
        raise AutoplaceError(f"the pre-trained policy's card {CARD_PATH} is missing; "
                             "scripts/train_pretrained.py writes it")
    return json.loads(CARD_PATH.read_text())


def load_pretrained(num_devices: int, max_groups: int = MAX_GROUPS,
                    weights: str | Path | None = None) -> GNNPolicy:
    """The pre-trained GNN for ``num_devices`` devices (eval mode), sized for an env of
    ``max_groups`` groups (the weights do not depend on it).

    Args:
        num_devices: one of :data:`DEVICE_COUNTS`.
        max_groups: the env's padded group count.
        weights: a weights file written by ``scripts/train_pretrained.py`` (default: the
            shipped one, with its card).
    """
    path = Path(weights) if weights is not None else WEIGHTS_PATH
    info = card() if weights is None else json.loads(path.with_suffix(".json").read_text())
    configs = info.get("policies", {})
    key = f"devices{num_devices}"
    if key not in configs:
        valid = ", ".join(k.removeprefix("devices") for k in configs) or "none"
        raise AutoplaceError(
            f"the pre-trained GNN places on {valid} devices, not {num_devices}; train a "
            f"policy for {num_devices} devices with autoplace train --policy gnn")
    state = torch.load(path, map_location="cpu", weights_only=True)
    prefix = key + "."
    own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    policy = GNNPolicy(**{**configs[key], "max_groups": max_groups})
    policy.load_state_dict(own)
    policy.eval()
    return policy


def _policy_for(env: MemoryPressure, weights: str | Path | None) -> GNNPolicy:
    e = env.unwrapped
    policy = load_pretrained(e.num_devices, e.config.max_groups, weights)
    features = env.observation_space["node_features"].shape[1]
    if features != policy.num_features:
        raise AutoplaceError(f"the pre-trained GNN reads {policy.num_features} group features; "
                             f"this env gives {features}")
    return policy


def _as_plan(plan: Any, step: float, planner: dict[str, Any]) -> Plan:
    data = plan if isinstance(plan, dict) else plan.to_json()
    return Plan.from_json({**data, "predicted": {"step_time_s": step}, "planner": planner})


def place_pretrained(
    graph_or_workload: Any,
    cluster: Any,
    *,
    memory_cap: str | int | None = None,
    samples: int = 16,
    seed: int = 0,
    time_limit_s: float = ZERO_SHOT_S,
    weights: str | Path | None = None,
) -> Plan:
    """Place a graph with the pre-trained GNN, without training on it (zero-shot).

    Args:
        graph_or_workload: OpGraph, Workload or zoo name.
        cluster: preset name, JSON path, ``"detect"`` or a Cluster of 2, 4 or 8 devices.
        memory_cap: cap every device's memory.
        samples: sampled plans scored beside the greedy ones before the rest of
            ``time_limit_s`` goes to more of them (0: the greedy plans only).
        seed: seed of the sampling.
        time_limit_s: score further samples, then (the last third) the best plans'
            execution-level variants, until this long after the start of scoring (the
            greedy plans and ``samples`` always; loading the weights and the shard
            variants take about 0.1 s more).
        weights: another weights file (default: the shipped one).

    Returns:
        The fastest plan scored (``predicted`` and ``planner`` filled in; ``planner["failed"]``
        when every plan scored ran out of memory).
    """
    t0 = time.perf_counter()
    env = make_env(graph_or_workload, cluster, memory_cap=memory_cap)
    try:
        policy = _policy_for(env, weights)
        rank, step, plan, scored = _zero_shot(env, policy, samples, seed, time_limit_s)
    finally:
        env.close()
    planner = {"name": "pretrained", "weights": str(weights or "pretrained/gnn.pt"),
               "samples": samples, "scored": scored, "failed": bool(rank[0]),
               "search_time_s": time.perf_counter() - t0}
    return _as_plan(plan, step, planner)


@dataclass
class FineTuneResult:
    """What :func:`finetune_pretrained` found.

    Attributes:
        plan: the fastest plan (zero-shot, warm-start floor or fine-tuned).
        step_time_s: its simulated step time.
        zero_shot_step_time_s: the zero-shot plan's step time (before any training).
        history: the trainer's per-update series (``best_step_time_s``, ``elapsed_s``...).
        warm_start: what the warm start did.
        elapsed_s: wall time, zero-shot scoring included.
        start_samples: the pre-trained policy's sampled plans on the graph before any
            training (``ReinforceResult.start_samples``).
    """

    plan: Plan
    step_time_s: float
    zero_shot_step_time_s: float
    history: dict[str, list[float]] = field(default_factory=dict)
    warm_start: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    start_samples: dict[str, float] = field(default_factory=dict)


def finetune_pretrained(
    graph_or_workload: Any,
    cluster: Any,
    *,
    budget: str | int = "30s",
    memory_cap: str | int | None = None,
    seed: int = 0,
    warm_start: bool = True,
    progress: bool = False,
    weights: str | Path | None = None,
    on_update: Callable[[int, dict[str, float]], None] | None = None,
    **reinforce_options: Any,
) -> FineTuneResult:
    """Train the pre-trained GNN further on one graph and return the best plan seen.

    REINFORCE starts from the pre-trained weights; with ``warm_start`` the policy first
    imitates the best plan the heuristics reach in the env (the trainer's floor). The
    zero-shot plan is scored first and competes too, so the result is never slower than
    either.

    Args:
        graph_or_workload: OpGraph, Workload or zoo name.
        cluster: preset name, JSON path, ``"detect"`` or a Cluster of 2, 4 or 8 devices.
        budget: training budget (``"30s"``, ``"500ep"``, ``"40up"``).
        memory_cap: cap every device's memory.
        seed: seeds the sampling and the env resets.
        warm_start: imitate the best heuristic plan first.
        progress: show the trainer's progress bar.
        weights: another weights file (default: the shipped one).
        on_update: the trainer's per-update callback (:func:`reinforce`).
        **reinforce_options: fields of :class:`ReinforceConfig` (``batch_size``, ``lr``...).
    """
    t0 = time.perf_counter()
    cfg = ReinforceConfig(budget=budget, seed=seed, warm_start=warm_start, progress=progress,
                          tensorboard=False, checkpoint_every=0, **reinforce_options)
    first = make_env(graph_or_workload, cluster, memory_cap=memory_cap)
    e = first.unwrapped
    envs = [first] + [make_env(e.graph, e.cluster, graph=e.graph)
                      for _ in range(cfg.batch_size - 1)]
    try:
        policy = _policy_for(first, weights)
        rank0, step0, plan0, _ = _zero_shot(first, policy, 16, seed, ZERO_SHOT_S)
        torch.manual_seed(seed)
        result = reinforce(envs, policy, cfg, on_update=on_update)
    finally:
        for env in envs:
            env.close()
    tuned = next(iter(result.best.values()), None)
    planner = {"name": "pretrained+finetune", "budget": str(budget), "seed": seed,
               "warm_start": result.warm_start.get("done", False),
               "updates": result.updates, "episodes": result.episodes}
    rank = None
    if tuned is not None and tuned.get("plan"):  # its shard mode and compile chosen after it
        step, plan = float(tuned["step_time_s"]), json.loads(tuned["plan"])
        rank, sharded_step, sharded, _ = _best_sharded(first, [
            (tuple(tuned["rank"]), step, plan, False)])
        trainer = plan.get("planner", {}).get("trainer")
        source = {"warm-start": "warm-start"}.get(trainer, "finetune")
        heuristic = plan["planner"].get("source") if trainer == "warm-start" else None
        if sharded_step < step:
            step, plan = sharded_step, sharded
            source += "".join(f" + {x}" for x, on in (
                (sharded.parallel.shard, sharded.parallel.shard != "none"),
                ("compile", sharded.parallel.compile)) if on)
    if rank is not None and list(rank) < list(rank0):
        planner["source"] = source
        if heuristic is not None:
            planner["heuristic"] = heuristic
    else:
        step, plan = step0, plan0
        planner["source"] = "zero-shot"
    planner["search_time_s"] = time.perf_counter() - t0
    return FineTuneResult(plan=_as_plan(plan, step, planner), step_time_s=step,
                          zero_shot_step_time_s=step0, history=result.history,
                          warm_start=result.warm_start, elapsed_s=planner["search_time_s"],
                          start_samples=result.start_samples)


def pretrained_candidates(graph: OpGraph, cluster: Any, *, finetune_s: float = 0.0,
                          seed: int = 0) -> dict[str, Plan]:
    """The zero-shot plan and (with ``finetune_s`` of at least a second) the one fine-tuned
    for :data:`AUTO_FINETUNE_UPDATES` updates or ``finetune_s``, whichever ends first, by
    name, for a search that considers plans made elsewhere (``auto``). Empty where the
    shipped policy does not place on this cluster's device count or cannot place this
    graph; a plan that does not fit is left out."""
    cl = resolve(cluster)
    if cl.num_devices not in DEVICE_COUNTS or not WEIGHTS_PATH.is_file():
        return {}
    try:
        out = {"pretrained": place_pretrained(graph, cl, seed=seed)}
        if finetune_s >= 1:
            out["pretrained+finetune"] = finetune_pretrained(
                graph, cl, budget=AUTO_FINETUNE_UPDATES, time_limit_s=finetune_s,
                seed=seed).plan
    except AutoplaceError:  # a graph the env cannot coarsen, say: the search goes on
        return {}
    return {k: p for k, p in out.items() if not p.planner.get("failed")}
