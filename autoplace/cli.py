"""The ``autoplace`` command: the only face of the library.

Each subcommand has one ``@dataclass(kw_only=True)`` config whose field docs
(``metadata["help"]``) become its ``--help``. Errors the user can act on
(:class:`~autoplace.errors.AutoplaceError`) print one line and exit with status 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace.errors import AutoplaceError
from autoplace.plan import strict_json

__all__ = ["main"]


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its ``--help`` line."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def req(help: str, **kw: Any) -> Any:
    """A required config field (a positional argument unless ``flag=True``)."""
    return field(metadata={"help": help, "required": True, **kw})


# --------------------------------------------------------------------- configs
@dataclass(kw_only=True)
class ModelArgs:
    model: str = opt("gpt-tiny", "zoo workload name or package.module:factory")
    batch_size: int | None = opt(None, "global batch size (default: the workload's)")
    option: list[str] = opt([], "workload option KEY=VALUE (repeatable)", action="append")


@dataclass(kw_only=True)
class ClusterArgs:
    cluster: str = opt("detect", "cluster preset name, 'detect', or a cluster JSON path")
    memory_cap: str | None = opt(None, "cap every device's memory, e.g. 16GB")


@dataclass(kw_only=True)
class ModelsConfig:
    json: bool = opt(False, "print JSON")


@dataclass(kw_only=True)
class CaptureConfig(ModelArgs):
    json: bool = opt(False, "print JSON (num_ops, num_edges, fingerprint, param_bytes, flops)")
    out: str | None = opt(None, "write the OpGraph as JSON to this path", flag="-o")
    top: int = opt(20, "rows of the op table")


@dataclass(kw_only=True)
class ClusterConfig(ClusterArgs):
    list: bool = opt(False, "list the presets")
    preset: str | None = opt(None, "preset to write")
    detect: bool = opt(False, "describe this machine's devices")
    out: str | None = opt(None, "write the cluster JSON here", flag="-o")
    cluster: str = opt("detect", "(unused; use --preset or --detect)")


@dataclass(kw_only=True)
class SimulateConfig(ClusterArgs):
    plan: str = req("plan JSON file", positional=True)
    cluster: str | None = opt(None, "cluster (default: the one the plan was made for)")
    json: bool = opt(False, "print JSON (step_time_s, peak_memory_bytes, oom, lower_bound_s)")


@dataclass(kw_only=True)
class ShowConfig(ClusterArgs):
    plan: str = req("plan JSON file", positional=True)
    cluster: str | None = opt(None, "cluster (default: the one the plan was made for)")
    gantt: str | None = opt(None, "write a Gantt chart of the simulated step (PNG)")
    picture: str | None = opt(None, "write a placement picture (PNG)")


@dataclass(kw_only=True)
class PlanConfig(ModelArgs, ClusterArgs):
    planner: str = opt("hybrid-dp", "planner name (see --list), or 'auto'")
    policy: str | None = opt(None, "a trained policy checkpoint: place the model zero-shot")
    out: str = opt("plan.json", "where to write the plan", flag="-o")
    list: bool = opt(False, "list the planners")
    seed: int = opt(0, "random seed")
    budget: str = opt("5m", "time budget of the auto planner (e.g. 90s, 5m)")
    profile_dir: str | None = opt(
        None, "profile cache folder (autoplace profile --cache-dir): measured op times; "
        "--planner auto also reads and saves the simulator's calibration there")
    graphs: bool = opt(False, "replay each run of ops on one device as a CUDA graph on "
                              "GPUs (plans run in one process; auto tries this itself)")
    shard_units: str | None = opt(None, "FSDP2 units of a sharded plan: blocks, or modules "
                                        "(also a unit per embedding / head: less memory held)")


@dataclass(kw_only=True)
class CompareConfig(ModelArgs, ClusterArgs):
    planners: str | None = opt(None, "comma-separated planner names (default: all)")
    execute: bool = opt(False, "also execute every plan for real and add the measured column")
    steps: int = opt(10, "steps per executed plan")
    json: str | None = opt(None, "write the rows as JSON to this path")
    plot: str | None = opt(None, "write a bar chart (PNG)")
    profile_dir: str | None = opt(
        None, "profile cache folder: measured op times and the calibration saved by "
        "plan --planner auto (adds the calibrated column)")


@dataclass(kw_only=True)
class RunConfig(ClusterArgs):
    plan: str = req("plan JSON file", positional=True)
    cluster: str = opt("detect", "cluster preset, 'detect' or JSON path (devices used)")
    steps: int = opt(10, "training steps, the warm-up ones included")
    warmup: int = opt(2, "warm-up steps not counted in the step time")
    report: str | None = opt(None, "write the RunReport JSON here")
    write_measured: bool = opt(False, "fill the plan file's 'measured' block")
    no_reference: bool = opt(False, "skip the unpartitioned reference loss")
    checkpoint_dir: str | None = opt(None, "save checkpoints here")
    resume: bool = opt(False, "resume from --checkpoint-dir")
    seed: int = opt(0, "data seed")
    curve: str | None = opt(None, "write a training-curve plot (PNG)")
    trace: str | None = opt(None, "record the timed steps with torch.profiler: one Chrome "
                                  "trace per rank in this folder")


@dataclass(kw_only=True)
class TrainConfig(ModelArgs, ClusterArgs):
    policy: str = opt("seq2seq", "seq2seq, hierarchical or gnn")
    backend: str = opt("sim", "reward backend: sim or real")
    budget: str = opt("2000ep", "training budget: episodes (2000ep), updates (100up) or time (5m)")
    out: str = opt("runs/train", "output directory (checkpoint, TensorBoard, best_plan.json)")
    max_groups: str = opt("auto", "groups the graph is coarsened to: a number, or auto "
                                  "(from the graph's branch structure)")
    seed: int = opt(0, "random seed")
    resume: bool = opt(False, "resume from the checkpoint in --out")


@dataclass(kw_only=True)
class ProfileConfig(ModelArgs, ClusterArgs):
    out: str = opt("profile.json", "write the profiled OpGraph (and link speeds) here", flag="-o")
    repeats: int = opt(5, "timed repeats per op")
    cache_dir: str | None = opt(None, "also keep the op times in this profile cache folder "
                                "(for plan/compare --profile-dir)")
    links: bool = opt(True, "also measure copies between every device pair and collectives "
                            "(all-reduce, all-gather, reduce-scatter) when there are several "
                            "devices")
    cluster_out: str = opt("cluster.json", "write the cluster with the measured link and "
                                           "collective speeds here (for --cluster)")


@dataclass(kw_only=True)
class DemoConfig(ModelArgs, ClusterArgs):
    model: str = opt("gpt-small", "zoo workload name or package.module:factory")
    out: str = opt("runs/demo", "output directory")
    budget: str = opt("60s", "policy training budget")
    steps: int = opt(6, "training steps executed for real per plan")
    policy: str = opt("gnn", "policy to train: seq2seq, hierarchical or gnn")


# ------------------------------------------------------------------ helpers
def _model(cfg: ModelArgs, device: Any = None):
    from autoplace import workloads

    return workloads.get(cfg.model, device=device, **_options(cfg))


def _options(cfg: ModelArgs) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for kv in cfg.option:
        if "=" not in kv:
            raise AutoplaceError(f"--option takes KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        try:
            options[k] = json.loads(v)
        except ValueError:
            options[k] = v
    if cfg.batch_size is not None:
        options["batch_size"] = cfg.batch_size
    return options


def _graph_of(workload, profile_dir: str | None = None, cluster: Any = None):
    from autoplace.capture import capture_workload

    graph = capture_workload(workload)
    if profile_dir is not None:
        from autoplace.costs.profile import apply_cached

        if not Path(profile_dir).is_dir():
            raise AutoplaceError(f"--profile-dir {profile_dir}: no such folder; write one with "
                                 "autoplace profile --cache-dir")
        kinds = [d.kind for d in cluster.devices] if cluster is not None else []
        found = apply_cached(graph, profile_dir, kinds)
        print(f"op times: {'profiled (' + ', '.join(found) + ')' if found else 'estimated'} "
              f"from {profile_dir}", file=sys.stderr)
    return graph


def _cluster(spec: str, cap: str | None):
    from autoplace.cluster import resolve

    return resolve(spec, cap)


def _plan_cluster(plan, spec: str | None, cap: str | None):
    """The cluster for a plan: given, or rebuilt from the plan's cluster summary."""
    from autoplace.cluster import PRESETS, resolve

    if spec is not None:
        return resolve(spec, cap)
    name = str(plan.cluster.get("name", "")).split("@")[0]
    if name in PRESETS:
        c = resolve(name)
        mem = plan.cluster.get("memory_bytes")
        if mem and min(mem) < min(d.memory_bytes for d in c.devices):
            c = c.with_memory_cap(int(min(mem)))
        return resolve(c, cap)
    return resolve("detect", cap)


def _workload_of_plan(plan, device: Any = None):
    from autoplace import workloads

    spec = plan.model.get("spec")
    if not spec:
        raise AutoplaceError("the plan records no model spec; it cannot be rebuilt")
    return workloads.get(spec, device=device, seed=int(plan.model.get("seed", 0)),
                         **plan.model.get("options", {}))


def _print_table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    def numeric(c: str) -> bool:
        return c.replace(".", "", 1).replace("-", "", 1).replace("e", "", 1).isdigit()

    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if numeric(c) else c.ljust(w)
                        for c, w in zip(r, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _gb(b: float) -> str:
    return f"{b / 2**30:.2f}"


# ----------------------------------------------------------------- commands
def cmd_models(cfg: ModelsConfig) -> int:
    from autoplace import workloads

    workloads.names()
    rows = [[name, desc] for name, (_, _, desc) in workloads.ZOO.items()]
    if cfg.json:
        print(json.dumps([{"name": n, "description": d} for n, d in rows]))
    else:
        _print_table(rows, ["model", "description"])
    return 0


def cmd_capture(cfg: CaptureConfig) -> int:
    wl = _model(cfg, device="meta")
    t0 = time.perf_counter()
    g = _graph_of(wl)
    dt = time.perf_counter() - t0
    summary = {
        "model": wl.name, "num_ops": len(g), "num_edges": g.nx.number_of_edges(),
        "fingerprint": g.fingerprint, "param_bytes": g.param_bytes, "flops": g.flops,
        "activation_bytes": g.activation_bytes, "capture_time_s": round(dt, 3),
    }
    if cfg.out:
        g.save(cfg.out)
    if cfg.json:
        print(json.dumps(summary))
        return 0
    print(f"{wl.name}: {len(g)} ops, {summary['num_edges']} edges, "
          f"{g.param_bytes / 2**20:.1f} MiB params, {g.flops / 1e9:.2f} GFLOP forward, "
          f"fingerprint {g.fingerprint} ({dt:.2f} s)")
    ops = sorted(g, key=lambda o: -o.flops)[: cfg.top]
    _print_table(
        [[o.name, o.kind, o.module_path, "x".join(map(str, o.output_shapes[0])) if o.output_shapes
          else "", f"{o.flops / 1e6:.1f}", f"{o.param_bytes / 2**20:.2f}"] for o in ops],
        ["op", "kind", "module", "output", "MFLOP", "param MiB"],
    )
    return 0


def cmd_cluster(cfg: ClusterConfig) -> int:
    from autoplace.cluster import PRESETS, Cluster, preset, resolve

    if cfg.list:
        rows = []
        for name in PRESETS:
            c = preset(name)
            d = c.devices[0]
            rows.append([name, c.num_devices, d.kind, _gb(d.memory_bytes),
                         f"{d.peak_flops / 1e12:.0f}", f"{c.bandwidth[0][-1] / 1e9:.0f}"
                         if c.num_devices > 1 else "-"])
        _print_table(rows, ["preset", "devices", "kind", "memory GiB", "TFLOP/s", "link GB/s"])
        return 0
    c = Cluster.detect() if cfg.detect or not cfg.preset else resolve(cfg.preset)
    c = resolve(c, cfg.memory_cap)
    if cfg.out:
        c.save(cfg.out)
        print(f"wrote {cfg.out}: {c!r}")
    else:
        print(json.dumps(c.to_json(), indent=1))
    return 0


def _load_plan_and_graph(path: str):
    from autoplace.plan import Plan

    plan = Plan.load(path)
    wl = _workload_of_plan(plan, device="meta")
    graph = _graph_of(wl)
    return plan, wl, graph


def cmd_simulate(cfg: SimulateConfig) -> int:
    plan, _, graph = _load_plan_and_graph(cfg.plan)
    from autoplace.sim import simulate

    cluster = _plan_cluster(plan, cfg.cluster, cfg.memory_cap)
    res = simulate(graph, plan, cluster)
    out = {"step_time_s": res.step_time_s, "peak_memory_bytes": res.peak_memory_bytes,
           "oom": res.oom, "oom_devices": res.oom_devices, "lower_bound_s": res.lower_bound_s,
           "busy_time_s": res.busy_time_s, "cluster": cluster.name}
    if cfg.json:
        print(json.dumps(strict_json(out), allow_nan=False))
    else:
        print(f"{plan.describe()} on {cluster.name}: step {_ms(res.step_time_s)} ms "
              f"(lower bound {_ms(res.lower_bound_s)} ms), peak GiB "
              f"{' / '.join(_gb(b) for b in res.peak_memory_bytes)}"
              + (f", OUT OF MEMORY on devices {res.oom_devices}" if res.oom else ""))
    return 0


def cmd_show(cfg: ShowConfig) -> int:
    from autoplace import viz
    from autoplace.sim import simulate

    plan, _, graph = _load_plan_and_graph(cfg.plan)
    cluster = _plan_cluster(plan, cfg.cluster, cfg.memory_cap)
    print(plan.describe())
    counts: dict[int, int] = {}
    for op in plan.groups:
        counts[plan.device_of(op)] = counts.get(plan.device_of(op), 0) + 1
    for d in sorted(counts):
        print(f"  device {d}: {counts[d]} ops")
    if cfg.gantt:
        res = simulate(graph, plan, cluster, timeline=True)
        viz.gantt(res.timeline, cfg.gantt, title=f"{plan.describe()} on {cluster.name}: "
                  f"{_ms(res.step_time_s)} ms")
        print(f"wrote {cfg.gantt}")
    if cfg.picture:
        viz.placement_picture(graph, plan, cfg.picture)
        print(f"wrote {cfg.picture}")
    return 0


def cmd_plan(cfg: PlanConfig) -> int:
    from autoplace import planners

    if cfg.list:
        for name in [*planners.names(), "auto"]:
            print(name)
        return 0
    wl = _model(cfg, device="meta")
    cluster = _cluster(cfg.cluster, cfg.memory_cap)
    graph = _graph_of(wl, cfg.profile_dir, cluster)
    t0 = time.perf_counter()
    if cfg.graphs and cfg.planner == "auto" and not cfg.policy:
        raise AutoplaceError("--graphs with --planner auto: auto already measures every "
                             "one-process plan graphed too, and keeps it where it is faster")
    if cfg.policy:
        from autoplace.policies import place

        plan = place(cfg.policy, graph, cluster)
    elif cfg.planner == "auto":
        from autoplace.search.auto import auto_plan

        plan = auto_plan(wl.spec, cluster, budget=cfg.budget, graph=graph, progress=True,
                         cache_dir=cfg.profile_dir)
    else:
        planner = planners.get(cfg.planner)
        seeded = "seed" in inspect.signature(inspect.unwrap(planner)).parameters
        plan = planner(graph, cluster, **({"seed": cfg.seed} if seeded else {}))
    if cfg.graphs:
        try:
            plan = plan.with_parallel(graphs=True)
        except AutoplaceError as e:
            raise AutoplaceError(f"--graphs: {plan.planner.get('name', 'this')} planner's "
                                 f"plan ({plan.split()}) {e}") from None
    if cfg.shard_units:
        try:
            plan = plan.with_parallel(shard_units=cfg.shard_units)
        except AutoplaceError as e:
            raise AutoplaceError(f"--shard-units: {plan.planner.get('name', 'this')} planner's "
                                 f"plan ({plan.split()}): {e}") from None
    from autoplace.sim import simulate

    res = simulate(graph, plan, cluster)
    plan = plan.with_predicted({"step_time_s": res.step_time_s,
                                "peak_memory_bytes": res.peak_memory_bytes, "oom": res.oom,
                                "lower_bound_s": res.lower_bound_s})
    plan.save(cfg.out)
    print(f"{plan.describe()} -> {cfg.out} (simulated {_ms(res.step_time_s)} ms"
          + (", OOM" if res.oom else "") + f", search {time.perf_counter() - t0:.2f} s)")
    return 0


def cmd_compare(cfg: CompareConfig) -> int:
    from autoplace.search.compare import compare, format_table

    wl = _model(cfg, device="meta")
    cluster = _cluster(cfg.cluster, cfg.memory_cap)
    graph = _graph_of(wl, cfg.profile_dir, cluster)
    calibration = None
    if cfg.profile_dir:
        from autoplace.search.calibration import Calibration

        calibration = Calibration.load(cfg.profile_dir, graph, cluster)
        if not calibration.samples:
            calibration = None
    execute = None
    if cfg.execute:
        from autoplace.executor import launch

        def execute(plan):
            return launch.run_plan(plan, wl.spec, cluster=cluster, steps=cfg.steps,
                                   reference=False)

    planners = cfg.planners.split(",") if cfg.planners else None
    rows = compare(graph, cluster, planners, execute=execute, progress=True,
                   calibration=calibration)
    print(f"{wl.name} on {cluster.name} ({cluster.num_devices} devices)")
    print(format_table(rows))
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(
            strict_json([{k: v for k, v in r.items() if k != "plan"} for r in rows]),
            indent=1, allow_nan=False))
    if cfg.plot:
        from autoplace import viz

        viz.bar_chart(rows, cfg.plot, title=f"{wl.name} on {cluster.name}")
    return 0


def cmd_run(cfg: RunConfig) -> int:
    from autoplace.executor import launch
    from autoplace.plan import Plan

    if cfg.steps <= cfg.warmup:
        raise AutoplaceError(
            f"--steps {cfg.steps} leaves no step to time after --warmup {cfg.warmup} (the "
            "steps include the warm-up ones); use --steps greater than --warmup")
    plan = Plan.load(cfg.plan)
    cluster = _cluster(cfg.cluster, cfg.memory_cap)
    spec = {"spec": plan.model.get("spec"), "options": plan.model.get("options", {}),
            "seed": int(plan.model.get("seed", 0))}
    if not spec["spec"]:
        raise AutoplaceError(f"{cfg.plan}: the plan records no model spec; it cannot be run")
    report = launch.run_plan(
        plan, spec, cluster=cluster, steps=cfg.steps, warmup=cfg.warmup,
        reference=not cfg.no_reference, checkpoint_dir=cfg.checkpoint_dir, resume=cfg.resume,
        seed=cfg.seed, progress=True, trace_dir=cfg.trace,
    )
    if cfg.report:
        Path(cfg.report).write_text(json.dumps(strict_json(report.to_json()), indent=1,
                                               allow_nan=False))
    if report.error:
        print(f"error: {report.error}", file=sys.stderr)
        return 3
    print(f"{plan.describe()}: step {_ms(report.step_time_s)} ms (median of "
          f"{len(report.step_times_s)}), {report.samples_per_s:.1f} samples/s, peak GiB "
          f"{' / '.join(_gb(b) for b in report.peak_memory_bytes)}")
    if report.reference_loss:
        print(f"loss {report.loss[-1]:.6f} vs reference {report.reference_loss[-1]:.6f} "
              f"(max rel diff {report.max_loss_rel_diff:.2e})")
        if report.extra.get("random_ops"):
            print(f"note: the model has {report.extra['random_ops']} dropout ops; the plan "
                  "draws their random masks on other shares of the batch than the reference "
                  "does, so the losses agree only statistically (set dropout to 0 to compare "
                  "them exactly)")
    if report.extra.get("trace"):
        print(f"trace of the timed steps (rank 0): {report.extra['trace']}")
    if cfg.write_measured:
        plan.with_measured({"step_time_s": report.step_time_s,
                            "peak_memory_bytes": report.peak_memory_bytes,
                            "device_names": report.device_names,
                            "torch_version": report.torch_version}).save(cfg.plan)
    if cfg.curve:
        from autoplace import viz

        viz.training_curve({"plan": report.loss, "reference": report.reference_loss or []},
                           cfg.curve, ylabel="loss")
    return 0


def _max_groups(text: str) -> int | str:
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise AutoplaceError(f"--max-groups must be a positive number or auto, got {text!r}")
    return n


def cmd_train(cfg: TrainConfig) -> int:
    from autoplace.policies import train

    wl = _model(cfg, device="meta")
    cluster = _cluster(cfg.cluster, cfg.memory_cap)
    res = train(wl, cluster, policy=cfg.policy, backend=cfg.backend, budget=cfg.budget,
                out_dir=cfg.out, seed=cfg.seed, max_groups=_max_groups(cfg.max_groups),
                resume=cfg.resume,
                progress=True)
    print(f"best plan: {res.best_plan.describe()}, {_ms(res.best_step_time_s)} ms -> "
          f"{Path(cfg.out) / 'best_plan.json'}")
    return 0


def cmd_profile(cfg: ProfileConfig) -> int:
    from autoplace.costs.profile import profile

    wl = _model(cfg)
    cluster = _cluster(cfg.cluster, cfg.memory_cap)
    graph = profile(wl, [d.name for d in cluster.devices][:1], repeats=cfg.repeats,
                    cache_dir=cfg.cache_dir)
    graph.save(cfg.out)
    print(f"profiled {len(graph)} ops on {cluster.devices[0].name} -> {cfg.out}")
    if cfg.links and cluster.num_devices > 1:
        from autoplace.executor.collectives import measured_cluster

        measured, summary = measured_cluster(cluster)
        measured.save(cfg.cluster_out)
        print(f"links: {summary} -> {cfg.cluster_out} (use with --cluster {cfg.cluster_out})")
    return 0


def cmd_demo(cfg: DemoConfig) -> int:
    from autoplace.demo import run_demo

    run_demo(cfg.model, cfg.cluster, memory_cap=cfg.memory_cap, options=_options(cfg),
             out_dir=cfg.out, policy=cfg.policy, budget=cfg.budget, steps=cfg.steps)
    return 0


COMMANDS: dict[str, tuple[type, Callable[[Any], int], str]] = {
    "models": (ModelsConfig, cmd_models, "list the model zoo"),
    "capture": (CaptureConfig, cmd_capture, "capture a model's op graph and summarise it"),
    "cluster": (ClusterConfig, cmd_cluster, "list presets, detect devices, write cluster JSON"),
    "plan": (PlanConfig, cmd_plan, "make a plan with a planner or a trained policy"),
    "compare": (CompareConfig, cmd_compare, "run every planner and print one table"),
    "simulate": (SimulateConfig, cmd_simulate, "simulate one training step of a plan"),
    "show": (ShowConfig, cmd_show, "describe a plan; Gantt chart and placement picture"),
    "run": (RunConfig, cmd_run, "execute a plan as real training and report"),
    "train": (TrainConfig, cmd_train, "train a placement policy with REINFORCE"),
    "profile": (ProfileConfig, cmd_profile, "measure per-op times on this machine's devices"),
    "demo": (DemoConfig, cmd_demo, "the whole chain on a default workload (README's main job)"),
}


def _add_args(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        help_ = meta.pop("help", "")
        if meta.pop("positional", False):
            parser.add_argument(f.name, help=help_)
            continue
        names = [f"--{f.name.replace('_', '-')}"]
        if "flag" in meta:
            names.insert(0, meta.pop("flag"))
        meta.pop("required", None)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if meta.get("action") == "append":
            parser.add_argument(*names, default=[], action="append", help=help_, dest=f.name)
        elif isinstance(default, bool):  # on by default: --no-<name> turns it off
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(*names, action=action, default=default, help=help_,
                                dest=f.name)
        else:
            typ = int if isinstance(default, int) or "int" in str(f.type) else str
            parser.add_argument(*names, type=typ, default=default, dest=f.name,
                                help=f"{help_} (default: {default})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoplace",
        description="Find and run the fastest way to train a PyTorch model on a set of devices.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (cls, _, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        _add_args(sp, cls)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    cls, fn, _ = COMMANDS[args.command]
    cfg = cls(**{k: v for k, v in vars(args).items() if k != "command"})
    try:
        return fn(cfg)
    except AutoplaceError as e:
        print(f"autoplace: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoplace: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked
        if os.environ.get("AUTOPLACE_DEBUG"):
            raise
        print(f"autoplace: internal error: {type(e).__name__}: {e} "
              "(set AUTOPLACE_DEBUG=1 to see the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
