"""Commands that make plans: one planner's (or a policy's, or auto's) plan, and every
planner side by side."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

from autoplace.cli.args import ClusterArgs, ModelArgs, opt
from autoplace.cli.common import build_model, cluster_of, graph_of, ms, nothing_fits
from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic
from autoplace.plan import strict_json

__all__ = ["COMMANDS"]


@dataclass(kw_only=True)
class PlanConfig(ModelArgs, ClusterArgs):
    planner: str = opt("hybrid-dp", "planner name (see --list), 'auto', or 'pretrained' (the "
                                    "GNN shipped with autoplace, zero-shot on 2, 4 or 8 devices)")
    policy: str | None = opt(None, "a trained policy checkpoint: place the model zero-shot",
                             exists=True)
    out: str = opt("plan.json", "where to write the plan (an existing file at the default "
                                "path is kept unless --force)", flag="-o", out="file",
                   guard=True)
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
    force: bool = opt(False, "replace an existing file at the default output path")

    def check(self) -> None:
        if self.graphs and self.planner == "auto" and not self.policy:
            raise AutoplaceError("--graphs with --planner auto: auto already measures every "
                                 "one-process plan graphed too, and keeps it where it is faster")
        if self.planner == "auto":
            from autoplace.search.auto import parse_duration

            try:
                parse_duration(self.budget)
            except AutoplaceError as e:
                raise AutoplaceError(f"--budget: {e}") from None


@dataclass(kw_only=True)
class CompareConfig(ModelArgs, ClusterArgs):
    planners: str | None = opt(None, "comma-separated planner names (default: all)")
    execute: bool = opt(False, "also execute every plan for real and add the measured column")
    steps: int = opt(10, "steps per executed plan, 2 warm-up steps included", min=3)
    json: str | None = opt(None, "write the rows as JSON to this path", out="file")
    plot: str | None = opt(None, "write a bar chart of the simulated step times (PNG, SVG, PDF)",
                           out="picture")
    profile_dir: str | None = opt(
        None, "profile cache folder: measured op times and the calibration saved by "
        "plan --planner auto (adds the calibrated column)")


def cmd_plan(cfg: PlanConfig) -> int:
    from autoplace import planners

    if cfg.list:
        for name in [*planners.names(), "auto", "pretrained"]:
            print(name)
        return 0
    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    if cfg.planner == "auto" and not cfg.policy:
        if getattr(cluster, "num_nodes", 1) == 1:  # several: planned by simulation only
            cluster.require_present(what="--planner auto (it measures plans on the devices)")
    elif not cfg.policy and cfg.planner != "pretrained":
        planners.get(cfg.planner)  # an unknown name fails before the capture
    if cfg.policy:  # a file that is not a policy checkpoint fails before the capture too
        from autoplace.policies.checkpoint import load_policy

        load_policy(cfg.policy)
    wl = build_model(cfg, device="meta")
    graph = graph_of(wl, cfg.profile_dir, cluster)
    t0 = time.perf_counter()
    if cfg.policy:
        from autoplace.policies import place

        plan = place(cfg.policy, graph, cluster)
    elif cfg.planner == "pretrained":
        from autoplace.policies.pretrained import place_pretrained

        plan = place_pretrained(graph, cluster, seed=cfg.seed)
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
    if (plan.predicted or {}).get("simulator") == "mesh":  # predicted by its own model
        plan.save(cfg.out)
        print(f"{plan.describe()} -> {cfg.out} (predicted "
              f"{ms(plan.predicted['step_time_s'])} ms, "
              f"{plan.predicted['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, search "
              f"{time.perf_counter() - t0:.2f} s)")
        return 0
    from autoplace.sim import simulate

    res = simulate(graph, plan, cluster)
    if res.oom:
        row = {"planner": plan.planner.get("name", cfg.planner), "plan": plan, "oom": True,
               "parallel": plan.split(), "peak_memory_bytes": list(res.peak_memory_bytes)}
        raise AutoplaceError(f"{nothing_fits([row], cluster)}; no plan written "
                             "(autoplace compare shows every planner's memory)")
    plan = plan.with_predicted({"step_time_s": res.step_time_s,
                                "peak_memory_bytes": res.peak_memory_bytes, "oom": res.oom,
                                "lower_bound_s": res.lower_bound_s})
    plan.save(cfg.out)
    print(f"{plan.describe()} -> {cfg.out} (simulated {ms(res.step_time_s)} ms"
          + f", search {time.perf_counter() - t0:.2f} s)")
    return 0


def cmd_compare(cfg: CompareConfig) -> int:
    from autoplace.search.compare import compare, format_table

    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    if cfg.execute:
        cluster.require_present(what="compare --execute")
    wl = build_model(cfg, device="meta")
    graph = graph_of(wl, cfg.profile_dir, cluster)
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
        write_json_atomic(cfg.json, strict_json([{k: v for k, v in r.items() if k != "plan"}
                                                 for r in rows]), allow_nan=False)
    if cfg.plot:
        from autoplace import viz

        viz.bar_chart(rows, cfg.plot, value="sim_step_time_s", scale=1e3,
                      ylabel="simulated step (ms)", title=f"{wl.name} on {cluster.name}")
    problem = nothing_fits(rows, cluster)
    if problem is not None:  # after the table and the files: they show every planner's peak
        raise AutoplaceError(problem)
    return 0


COMMANDS = {
    "plan": (PlanConfig, cmd_plan, "make a plan with a planner or a trained policy"),
    "compare": (CompareConfig, cmd_compare, "run every planner and print one table"),
}
