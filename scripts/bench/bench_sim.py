"""Simulator throughput: plans per second, scalar vs vectorised, on a random DAG.

    python scripts/bench/bench_sim.py --ops 1000 --devices 2 --plans 1000 --save

Random placements of a fixed grouping (what an RL policy samples), simulated with
:func:`autoplace.sim.simulate_batch` and, on a subset, :func:`autoplace.sim.simulate`;
checks that both agree. Plans/s are per CPU second of this
process (one core; numpy single-threaded); with ``--save`` writes ``sim-throughput.json``
to a new run folder ``bench/results/<date>-cpux1-sim-throughput/`` (or to ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time

import numpy as np
from results import write_run
from run_folder import output_folder

from autoplace.cluster import preset
from autoplace.graph import random_dag
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--ops", type=int, default=1000, help="ops in the random DAG")
parser.add_argument("--devices", type=int, default=2, help="CPU devices in the cluster (1, 2 or 4)")
parser.add_argument("--groups", type=int, default=0,
                    help="contiguous op groups a plan places (0: one group per op)")
parser.add_argument("--plans", type=int, default=1000, help="plans per batch")
parser.add_argument("--microbatches", type=int, default=1, help="microbatches per plan")
parser.add_argument("--data", type=int, default=1, help="data-parallel degree of every plan")
parser.add_argument("--scalar-plans", type=int, default=50, help="plans timed on the scalar path")
parser.add_argument("--repeats", type=int, default=3, help="batch timings (the best is kept)")
parser.add_argument("--seed", type=int, default=0, help="seed of the graph and the plans")
parser.add_argument("--save", action="store_true",
                    help="write sim-throughput.json to a new run folder under bench/results")
parser.add_argument("--out", default=None, help="write sim-throughput.json to this folder")
args = parser.parse_args()

random.seed(args.seed)
np.random.seed(args.seed)
graph = random_dag(args.ops, seed=args.seed)
cluster = preset(f"cpu-x{args.devices}")
num_groups = args.groups or len(graph)
groups = {op.name: i * num_groups // len(graph) for i, op in enumerate(graph)}
local = args.devices // args.data
parallel = ParallelConfig(data=args.data, microbatches=args.microbatches)
plans = [
    Plan.from_groups(graph, groups, [random.randrange(local) for _ in range(num_groups)],
                     parallel=parallel)
    for _ in range(args.plans)
]

simulate_batch(graph, plans[:8], cluster)  # warm caches (graph arrays, lower bound)
batch_wall, batch_cpu = [], []
for _ in range(args.repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate_batch(graph, plans, cluster)
    batch_wall.append(time.perf_counter() - t0)
    batch_cpu.append(time.process_time() - c0)
batch_s = min(batch_cpu)  # CPU seconds: one core, robust to other load on the machine

subset = plans[: args.scalar_plans]
c0 = time.process_time()
scalar = [simulate(graph, p, cluster) for p in subset]
scalar_s = time.process_time() - c0
scalar_steps = np.array([r.step_time_s for r in scalar])
max_rel_diff = float(np.max(np.abs(scalar_steps - result.step_time_s[: len(subset)]) / scalar_steps))

row = {
    "benchmark": "sim_throughput",
    "ops": args.ops, "devices": args.devices, "groups": num_groups, "plans": args.plans,
    "microbatches": args.microbatches, "data": args.data,
    "batch_plans_per_s": args.plans / batch_s,
    "batch_plans_per_wall_s": args.plans / min(batch_wall),
    "scalar_plans_per_s": len(subset) / scalar_s,
    "batch_vs_scalar_max_rel_diff": max_rel_diff,
    "median_step_time_s": float(np.median(result.step_time_s)),
    "lower_bound_s": result.lower_bound_s,
    "cpu": platform.processor() or platform.machine(),
    "threads": os.environ.get("OMP_NUM_THREADS", "unset"),
    "numpy": np.__version__,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
}
print(f"batch : {row['batch_plans_per_s']:9.0f} plans/s CPU, "
      f"{row['batch_plans_per_wall_s']:.0f} wall  ({args.plans} plans, {args.ops} ops, "
      f"{args.devices} devices, {num_groups} groups, mb={args.microbatches}, dp={args.data})")
print(f"scalar: {row['scalar_plans_per_s']:9.0f} plans/s CPU  (max rel diff to batch {max_rel_diff:.1e})")
if args.save or args.out:
    folder = output_folder(args.out, "sim-throughput")
    path = folder / "sim-throughput.json"
    path.write_text(json.dumps(row, indent=1))
    write_run(folder, tag="sim-throughput", scenarios=[f"sim:{args.ops}ops-{args.devices}dev"],
              kind="experiment", script="scripts/bench/bench_sim.py",
              summary=f"Simulator speed, {args.ops}-op graph on {args.devices} devices: "
                      f"{row['batch_plans_per_s']:,.0f} plans per CPU-second batched, "
                      f"{row['scalar_plans_per_s']:,.0f} one at a time.")
    print(f"wrote {path}")
