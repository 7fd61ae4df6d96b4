"""Simulator throughput: plans per CPU-second, batched vs one at a time, per placement family.

    python scripts/bench/bench_sim.py --graph residual-mlp --ops 1003 --devices 4 8 512 \
        --plans 256 --repeats 3 --baseline <rev> --save

For each cluster size (``h200xN`` presets up to 8 devices, ``h200x8-nK`` nodes of 8
beyond) and each placement family — ``critical-path``, ``round-robin``, ``hash`` (each
planner's plan with its devices relabelled at random, so the batch holds as many
cross-device edges as the family makes) and ``random`` (seeded random placements, what an
RL policy samples early) — a batch of plans is simulated with
:func:`autoplace.sim.simulate_batch`, and plans spread over it with
:func:`autoplace.sim.simulate`;
both must agree (step time to 1e-9 relative, memory exactly). The process is pinned to one
CPU and numpy to one thread; rates are per CPU second of this process, the best of
``--repeats`` timings, and every timing is kept (the spread: the machine may be shared).

With ``--baseline REV`` the package as it was at git revision ``REV`` (its ``autoplace/``
tree) times the same plans in a worker process pinned to the same CPU, each of its timings
taken right after one of this package's (before and after in one run, interleaved), and
its step times are compared with this batch's. With ``--save`` writes
``sim-throughput.json`` and ``sim-throughput.png`` (plans/s against devices, per family) to
a new run folder ``bench/results/<date>-cpux1-sim-throughput/`` (or ``--out``).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

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
parser.add_argument("--repeats", type=int, default=2,
                    help="batch timings (the best is the rate; all are kept)")
parser.add_argument("--seed", type=int, default=0, help="seed of the graph and the plans")
parser.add_argument("--save", action="store_true",
                    help="write the results to a new run folder under bench/results")
parser.add_argument("--out", default=None, help="write the results to this folder")
parser.add_argument("--baseline", default=None, metavar="REV",
                    help="also time the package at this git revision, interleaved (see above)")
parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
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


def timed_batch(graph: OpGraph, plans: list[Plan], cluster: Cluster):
    """``(result, CPU seconds, wall seconds)`` of one :func:`simulate_batch` call."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = simulate_batch(graph, plans, cluster)
    return result, time.process_time() - c0, time.perf_counter() - t0


def serve_baseline(graph: OpGraph) -> None:
    """Worker mode: for each JSON line on stdin (a plans file and a cluster size), warm
    once per file, time one batch and answer a JSON line (CPU seconds, step times)."""
    warm: set[str] = set()
    for line in sys.stdin:
        req = json.loads(line)
        plans = [Plan.from_json(d) for d in json.loads(Path(req["plans"]).read_text())]
        cluster = cluster_of(req["devices"])
        if req["plans"] not in warm:
            simulate_batch(graph, plans[:2], cluster)
            warm.add(req["plans"])
        result, cpu_s, wall_s = timed_batch(graph, plans, cluster)
        print(json.dumps({"cpu_s": cpu_s, "wall_s": wall_s,
                          "step_time_s": result.step_time_s.tolist()}), flush=True)


class Baseline:
    """The package at a git revision, timing plans in a worker process (this script in
    ``--worker`` mode with that revision's ``autoplace/`` first on its path)."""

    def __init__(self, rev: str, folder: Path):
        root = Path(__file__).resolve().parents[2]
        self.commit = subprocess.run(["git", "-C", str(root), "rev-parse", rev], check=True,
                                     capture_output=True, text=True).stdout.strip()
        tree = subprocess.run(["git", "-C", str(root), "archive", self.commit, "autoplace"],
                              check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.10.12
                tar.extractall(folder / "src", filter="data")
            else:
                tar.extractall(folder / "src")  # noqa: S202 - git's own archive
        self.folder = folder
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--graph",
                args.graph, "--ops", str(args.ops), "--seed", str(args.seed)]
        env = {**os.environ, "PYTHONPATH": str(folder / "src")}
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def time(self, plans_file: Path, devices: int) -> dict:
        self.proc.stdin.write(json.dumps({"plans": str(plans_file), "devices": devices}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the baseline worker ({self.commit[:10]}) stopped; see its "
                               "error above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


random.seed(args.seed)
np.random.seed(args.seed)
graph = random_dag(args.ops, seed=args.seed, device_kind="h200") if args.graph == "random-dag" \
    else residual_mlp(args.ops)
if args.worker:
    serve_baseline(graph)
    sys.exit(0)
scratch = tempfile.TemporaryDirectory(prefix="bench-sim-")
baseline = Baseline(args.baseline, Path(scratch.name)) if args.baseline else None
rows = []
for devices in args.devices:
    cluster = cluster_of(devices)
    for family in args.families:
        rng = random.Random(args.seed * 1000 + devices)
        plans = family_plans(graph, cluster, family, args.plans, rng)
        cross = np.mean([sum(p.device_of(u) != p.device_of(v) for u, v, _ in graph.edges)
                         for p in plans[:8]])
        simulate_batch(graph, plans[:2], cluster)  # warm the graph's caches
        plans_file = Path(scratch.name) / f"plans-{devices}-{family}.json"
        if baseline:
            plans_file.write_text(json.dumps([p.to_json() for p in plans]))
        cpu, wall, base_cpu, base_steps = [], [], [], None
        for _ in range(args.repeats):  # this package, then the baseline: interleaved
            result, cpu_s, wall_s = timed_batch(graph, plans, cluster)
            cpu.append(cpu_s)
            wall.append(wall_s)
            if baseline:
                answer = baseline.time(plans_file, devices)
                base_cpu.append(answer["cpu_s"])
                base_steps = np.asarray(answer["step_time_s"])
        # spread over the batch: its chunks and link groups all get checked
        picked = list(range(0, len(plans), max(1, len(plans) // args.scalar_plans)))
        picked = picked[: args.scalar_plans]
        subset = [plans[i] for i in picked]
        c0 = time.process_time()
        scalar = [simulate(graph, p, cluster) for p in subset]
        scalar_s = time.process_time() - c0
        steps = np.array([r.step_time_s for r in scalar])
        rel = float(np.max(np.abs(steps - result.step_time_s[picked]) / steps))
        same_memory = bool(np.array_equal([r.peak_memory_bytes for r in scalar],
                                          result.peak_memory_bytes[picked]))
        row = {
            "devices": devices, "cluster": cluster.name, "family": family,
            "plans": args.plans, "devices_used": max(p.devices_per_replica for p in plans),
            "cross_device_edges": float(cross),
            "batch_plans_per_s": args.plans / min(cpu),
            "batch_plans_per_s_runs": [args.plans / c for c in cpu],
            "batch_plans_per_wall_s": args.plans / min(wall),
            "scalar_plans_per_s": len(subset) / scalar_s,
            "batch_vs_scalar_max_rel_diff": rel, "memory_equal": same_memory,
            "median_step_time_s": float(np.median(result.step_time_s)),
        }
        spread = ""
        if baseline:
            base_rel = float(np.max(np.abs(base_steps - result.step_time_s) / result.step_time_s))
            row.update({"baseline_plans_per_s": args.plans / min(base_cpu),
                        "baseline_plans_per_s_runs": [args.plans / c for c in base_cpu],
                        "baseline_vs_batch_max_rel_diff": base_rel})
            spread = (f"   baseline {row['baseline_plans_per_s']:6.0f} plans/s CPU (x"
                      f"{row['batch_plans_per_s'] / row['baseline_plans_per_s']:.1f}; "
                      f"runs {', '.join(f'{r:.0f}' for r in row['baseline_plans_per_s_runs'])}"
                      f"; rel diff {base_rel:.1e})")
        rows.append(row)
        print(f"{devices:4d} dev {family:14s} batch: {row['batch_plans_per_s']:7.0f} plans/s CPU "
              f"(runs {', '.join(f'{r:.0f}' for r in row['batch_plans_per_s_runs'])}; "
              f"{row['devices_used']} devices used, {cross:.0f} cross-device edges)   scalar: "
              f"{row['scalar_plans_per_s']:6.1f} plans/s   (max rel diff to batch {rel:.1e}, "
              f"memory {'equal' if same_memory else 'DIFFERENT'}){spread}", flush=True)
if baseline:
    baseline.close()
scratch.cleanup()

worst = max(r["batch_vs_scalar_max_rel_diff"] for r in rows)
print(f"all: max rel diff to batch {worst:.1e}")
summary_row = {
    "benchmark": "sim_throughput", "graph": args.graph, "ops": len(graph),
    "plans": args.plans, "microbatches": args.microbatches,
    "batch_plans_per_s": min(r["batch_plans_per_s"] for r in rows),
    "repeats": args.repeats,
    "baseline_commit": baseline.commit if baseline else None,
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
        for i, family in enumerate(args.families):
            fam = [r for r in rows if r["family"] == family]
            ax.plot([r["devices"] for r in fam], [r["batch_plans_per_s"] for r in fam], "o-",
                    color=f"C{i}", label=family)
            if baseline:
                ax.plot([r["devices"] for r in fam], [r["baseline_plans_per_s"] for r in fam],
                        "o--", color=f"C{i}", alpha=0.5,
                        label=f"{family}, {summary_row['baseline_commit'][:7]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1000, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("devices")
        ax.set_ylabel("plans per CPU-second (batched)")
        ax.set_title(f"simulate_batch, {len(graph)}-op {args.graph}, {args.plans} plans a batch")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "sim-throughput.png", dpi=120)
    def slowest(key: str, d: int) -> float:
        return min(r[key] for r in rows if r["devices"] == d)

    write_run(folder, tag="sim-throughput",
              scenarios=[f"sim:{len(graph)}ops-{d}dev" for d in args.devices],
              kind="experiment", script="scripts/bench/bench_sim.py",
              summary=f"Simulator speed, {len(graph)}-op graph, {args.plans} plans a batch, "
                      "slowest placement family: " + ", ".join(
                          f"{slowest('batch_plans_per_s', d):,.0f} plans per CPU-second at "
                          f"{d} devices" + (f" ({slowest('baseline_plans_per_s', d):,.0f} at "
                                            f"{summary_row['baseline_commit'][:7]})"
                                            if baseline else "")
                          for d in args.devices) + ".")
    print(f"wrote {path}")
