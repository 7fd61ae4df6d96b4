"""Simulator throughput: plans per CPU-second, batched vs one at a time, per placement family.

    python scripts/bench/bench_sim.py --graph residual-mlp --ops 1003 --devices 4 8 512 \
        --plans 256 --save

For each cluster size (``h200xN`` presets up to 8 devices, ``h200x8-nK`` nodes of 8
beyond) and each placement family — ``critical-path``, ``round-robin``, ``hash`` (each
planner's plan with its devices relabelled at random, so the batch holds as many
cross-device edges as the family makes) and ``random`` (seeded random placements, what an
RL policy samples early) — a batch of plans is simulated with
:func:`autoplace.sim.simulate_batch`, and a subset with :func:`autoplace.sim.simulate`;
both must agree (step time to 1e-9 relative, memory exactly). The process is pinned to one
CPU and numpy to one thread; rates are per CPU second of this process. With ``--save``
writes ``sim-throughput.json`` and ``sim-throughput.png`` (plans/s against devices, per
family) to a new run folder ``bench/results/<date>-cpux1-sim-throughput/`` (or ``--out``).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from results import write_run  # noqa: E402
from run_folder import output_folder  # noqa: E402

from autoplace import planners  # noqa: E402
from autoplace.cluster import Cluster, preset  # noqa: E402
from autoplace.graph import OpGraph, OpNode, random_dag  # noqa: E402
from autoplace.plan import ParallelConfig, Plan  # noqa: E402
from autoplace.sim import simulate, simulate_batch  # noqa: E402

FAMILIES = ("critical-path", "round-robin", "hash", "random")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--graph", default="random-dag", choices=["random-dag", "residual-mlp"],
                    help="a random layered DAG, or a residual MLP (4 ops a block + 3)")
parser.add_argument("--ops", type=int, default=1000, help="ops in the graph (about, for the MLP)")
parser.add_argument("--devices", type=int, nargs="+", default=[2],
                    help="cluster sizes (1, 2, 4, 8, or a multiple of 8)")
parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES,
                    help="placement families")
parser.add_argument("--plans", type=int, default=256, help="plans per batch")
parser.add_argument("--microbatches", type=int, default=1, help="microbatches per plan")
parser.add_argument("--scalar-plans", type=int, default=8, help="plans timed on the scalar path")
parser.add_argument("--repeats", type=int, default=2, help="batch timings (the best is kept)")
parser.add_argument("--seed", type=int, default=0, help="seed of the graph and the plans")
parser.add_argument("--save", action="store_true",
                    help="write the results to a new run folder under bench/results")
parser.add_argument("--out", default=None, help="write the results to this folder")
args = parser.parse_args()

if hasattr(os, "sched_setaffinity"):  # one core, as the rates claim
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def residual_mlp(num_ops: int) -> OpGraph:
    """``x = x + down(relu(up(x)))`` blocks between an input and a head, costs for H200s
    (d=1024, hidden 4096, 8k tokens in bf16): 4 ops a block, ``num_ops`` about."""
    blocks = max(1, (num_ops - 3) // 4)
    act = 8192 * 1024 * 2
    nodes = [OpNode(name="x", kind="input", output_bytes=act)]
    edges = []
    prev = "x"
    for b in range(blocks):
        up, relu, down, add = (f"up{b}", f"relu{b}", f"down{b}", f"add{b}")
        mm = {"h200": 0.11e-3}
        nodes += [OpNode(name=up, kind="Linear", module_path=f"ups.{b}", output_bytes=4 * act,
                         param_bytes=2 * 1024 * 4096, activation_bytes=act,
                         fwd_time_s=mm, bwd_time_s={"h200": 0.22e-3}),
                  OpNode(name=relu, kind="relu", output_bytes=4 * act, activation_bytes=4 * act,
                         fwd_time_s={"h200": 0.02e-3}, bwd_time_s={"h200": 0.03e-3}),
                  OpNode(name=down, kind="Linear", module_path=f"downs.{b}", output_bytes=act,
                         param_bytes=2 * 1024 * 4096, activation_bytes=4 * act,
                         fwd_time_s=mm, bwd_time_s={"h200": 0.22e-3}),
                  OpNode(name=add, kind="add", output_bytes=act,
                         fwd_time_s={"h200": 0.01e-3}, bwd_time_s={"h200": 0.01e-3})]
        edges += [(prev, up, act), (up, relu, 4 * act), (relu, down, 4 * act),
                  (down, add, act), (prev, add, act)]
        prev = add
    nodes += [OpNode(name="head", kind="Linear", module_path="head", output_bytes=8192 * 8,
                     param_bytes=2 * 1024 * 4, fwd_time_s={"h200": 0.01e-3},
                     bwd_time_s={"h200": 0.02e-3}),
              OpNode(name="output", kind="output", output_bytes=8192 * 8)]
    edges += [(prev, "head", act), ("head", "output", 8192 * 8)]
    return OpGraph(f"residual-mlp-{len(nodes)}", nodes, edges)


def cluster_of(devices: int) -> Cluster:
    """``h200xN`` up to 8 devices, nodes of 8 H200s (``h200x8-nK``) beyond."""
    return preset(f"h200x{devices}" if devices <= 8 else f"h200x8-n{devices // 8}")


def family_plans(graph: OpGraph, cluster: Cluster, family: str, num: int,
                 rng: random.Random) -> list[Plan]:
    """``num`` plans of one placement family (see the module docstring)."""
    parallel = ParallelConfig(microbatches=args.microbatches)
    if family == "random":
        return [planners.get("random")(graph, cluster, seed=rng.randrange(2**31))
                .with_parallel(microbatches=args.microbatches) for _ in range(num)]
    base = planners.get(family)(graph, cluster)
    k = cluster.num_devices
    out = []
    for _ in range(num):
        perm = list(range(k))
        rng.shuffle(perm)
        out.append(Plan.from_groups(graph, base.groups, [perm[x] for x in base.placement],
                                    parallel=parallel))
    return out


random.seed(args.seed)
np.random.seed(args.seed)
graph = random_dag(args.ops, seed=args.seed, device_kind="h200") if args.graph == "random-dag" \
    else residual_mlp(args.ops)
rows = []
for devices in args.devices:
    cluster = cluster_of(devices)
    for family in args.families:
        rng = random.Random(args.seed * 1000 + devices)
        plans = family_plans(graph, cluster, family, args.plans, rng)
        cross = np.mean([sum(p.device_of(u) != p.device_of(v) for u, v, _ in graph.edges)
                         for p in plans[:8]])
        simulate_batch(graph, plans[:2], cluster)  # warm the graph's caches
        cpu, wall = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            result = simulate_batch(graph, plans, cluster)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        subset = plans[: args.scalar_plans]
        c0 = time.process_time()
        scalar = [simulate(graph, p, cluster) for p in subset]
        scalar_s = time.process_time() - c0
        steps = np.array([r.step_time_s for r in scalar])
        rel = float(np.max(np.abs(steps - result.step_time_s[: len(subset)]) / steps))
        same_memory = bool(np.array_equal([r.peak_memory_bytes for r in scalar],
                                          result.peak_memory_bytes[: len(subset)]))
        row = {
            "devices": devices, "cluster": cluster.name, "family": family,
            "plans": args.plans, "devices_used": max(p.devices_per_replica for p in plans),
            "cross_device_edges": float(cross),
            "batch_plans_per_s": args.plans / min(cpu),
            "batch_plans_per_wall_s": args.plans / min(wall),
            "scalar_plans_per_s": len(subset) / scalar_s,
            "batch_vs_scalar_max_rel_diff": rel, "memory_equal": same_memory,
            "median_step_time_s": float(np.median(result.step_time_s)),
        }
        rows.append(row)
        print(f"{devices:4d} dev {family:14s} batch: {row['batch_plans_per_s']:7.0f} plans/s CPU "
              f"({row['devices_used']} devices used, {cross:.0f} cross-device edges)   scalar: "
              f"{row['scalar_plans_per_s']:6.1f} plans/s   (max rel diff to batch {rel:.1e}, "
              f"memory {'equal' if same_memory else 'DIFFERENT'})")

worst = max(r["batch_vs_scalar_max_rel_diff"] for r in rows)
print(f"all: max rel diff to batch {worst:.1e}")
summary_row = {
    "benchmark": "sim_throughput", "graph": args.graph, "ops": len(graph),
    "plans": args.plans, "microbatches": args.microbatches,
    "batch_plans_per_s": min(r["batch_plans_per_s"] for r in rows),
    "rows": rows,
    "cpu": platform.processor() or platform.machine(), "cores_used": 1,
    "threads": os.environ.get("OMP_NUM_THREADS"), "numpy": np.__version__,
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
}
if args.save or args.out:
    folder = output_folder(args.out, "sim-throughput")
    path = folder / "sim-throughput.json"
    path.write_text(json.dumps(summary_row, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None and len(args.devices) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for family in args.families:
            fam = [r for r in rows if r["family"] == family]
            ax.plot([r["devices"] for r in fam], [r["batch_plans_per_s"] for r in fam], "o-",
                    label=family)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1000, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("devices")
        ax.set_ylabel("plans per CPU-second (batched)")
        ax.set_title(f"simulate_batch, {len(graph)}-op {args.graph}, {args.plans} plans a batch")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "sim-throughput.png", dpi=120)
    by_dev = {d: min(r["batch_plans_per_s"] for r in rows if r["devices"] == d)
              for d in args.devices}
    write_run(folder, tag="sim-throughput",
              scenarios=[f"sim:{len(graph)}ops-{d}dev" for d in args.devices],
              kind="experiment", script="scripts/bench/bench_sim.py",
              summary=f"Simulator speed, {len(graph)}-op graph, {args.plans} plans a batch, "
                      "slowest placement family: " + ", ".join(
                          f"{v:,.0f} plans per CPU-second at {d} devices"
                          for d, v in by_dev.items()) + ".")
    print(f"wrote {path}")
