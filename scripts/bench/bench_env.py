"""Env throughput: PlacementEnv steps per second, sim backend and (with GPUs) real backend.

    python scripts/bench/bench_env.py --ops 1000 --steps 500 --save

Sim: ``random_dag(--ops)`` on ``cpu-x2`` (``--max-groups`` groups), uniformly random
actions, the plan cache off (a policy rarely repeats a plan), oneshot and
incremental mode. Real (only when at least 2 CUDA GPUs are visible): ``gpt-small``
on the first two GPUs, oneshot, ``--real-steps`` env steps, each measuring
``--measure-steps`` training steps. With ``--save`` writes ``env-steps.json`` to a new run
folder ``bench/results/<date>-<card>x<n>-env-steps/`` (or to ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import gymnasium as gym
import numpy as np
import torch
from results import write_run
from run_folder import output_folder

import autoplace.envs  # noqa: F401  (registers the id)
from autoplace.cluster import Cluster
from autoplace.graph import random_dag

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--ops", type=int, default=1000, help="ops in the random DAG")
parser.add_argument("--max-groups", type=int, default=64, help="groups the graph is coarsened to")
parser.add_argument("--steps", type=int, default=500, help="env steps timed per sim mode")
parser.add_argument("--real-steps", type=int, default=10, help="env steps timed on real GPUs")
parser.add_argument("--measure-steps", type=int, default=5,
                    help="training steps per real measurement (2 of them warm-up)")
parser.add_argument("--seed", type=int, default=0, help="seed of the graph and the actions")
parser.add_argument("--save", action="store_true",
                    help="write env-steps.json to a new run folder under bench/results")
parser.add_argument("--out", default=None, help="write env-steps.json to this folder")
args = parser.parse_args()


def steps_per_s(env: gym.Env, steps: int) -> tuple[float, float]:
    """Env steps/s over ``steps`` random actions, and the mean reward."""
    env.reset(seed=args.seed)
    env.action_space.seed(args.seed)
    env.step(env.action_space.sample())  # first step measures the single-device normaliser
    rewards = []
    start = time.perf_counter()
    for _ in range(steps):
        _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        rewards.append(reward)
        if terminated or truncated:
            env.reset()
    elapsed = time.perf_counter() - start
    return steps / elapsed, float(np.mean(rewards))


results: dict = {
    "benchmark": "env_steps_per_s",
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "torch": torch.__version__,
    "cpu": platform.processor() or platform.machine(),
    "sim": {},
}
graph = random_dag(args.ops, seed=args.seed)
for mode in ("oneshot", "incremental"):
    env = gym.make("autoplace/Placement-v0", graph=graph, cluster="cpu-x2", mode=mode,
                   max_groups=args.max_groups, cache_size=0)
    rate, mean_reward = steps_per_s(env, args.steps)
    env.close()
    results["sim"][mode] = {"ops": args.ops, "groups": env.unwrapped.num_groups,
                            "steps_per_s": round(rate, 1), "mean_reward": round(mean_reward, 4)}
    print(f"sim  {mode:<11} random_dag({args.ops}), {env.unwrapped.num_groups} groups: "
          f"{rate:8.1f} steps/s")

if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
    cluster = Cluster.detect().subset([0, 1])
    env = gym.make("autoplace/Placement-v0", workload="gpt-small", cluster=cluster,
                   backend="real", max_groups=16, steps=args.measure_steps, warmup=2)
    rate, mean_reward = steps_per_s(env, args.real_steps)
    env.close()
    results["real"] = {"workload": "gpt-small", "gpu": torch.cuda.get_device_name(0),
                       "devices": 2, "steps_per_s": round(rate, 3),
                       "measure_steps": args.measure_steps, "mean_reward": round(mean_reward, 4)}
    print(f"real oneshot     gpt-small on 2x {torch.cuda.get_device_name(0)}: "
          f"{rate:8.3f} steps/s")
else:
    print("real: skipped (needs 2 CUDA GPUs)")

if args.save or args.out:
    real = results.get("real")
    folder = output_folder(args.out, "env-steps", card=real["gpu"] if real else "cpu",
                           gpus=2 if real else 1)
    path = folder / "env-steps.json"
    path.write_text(json.dumps(results, indent=1))
    sim = results["sim"]
    write_run(folder, tag="env-steps", scenarios=[f"env:{args.ops}ops"], kind="experiment",
              script="scripts/bench/bench_env.py",
              summary=f"PlacementEnv on random_dag({args.ops}): "
                      f"{sim['oneshot']['steps_per_s']:,.0f} steps/s oneshot, "
                      f"{sim['incremental']['steps_per_s']:,.0f} incremental (simulator)"
                      + (f", {real['steps_per_s']:.2f} on 2 GPUs." if real else "."))
    print(f"wrote {path}")
