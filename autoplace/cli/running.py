"""Commands that run on the devices: execute a plan, profile ops and links, the demo, and
the summary of a run's traces."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from autoplace.cli.args import ClusterArgs, ModelArgs, TrustArgs, opt, parse_options, req
from autoplace.cli.common import (
    build_model,
    check_fits,
    cluster_of,
    gb,
    graph_of,
    load_plan,
    ms,
    plan_workload,
)
from autoplace.errors import AutoplaceError
from autoplace.files import write_json_atomic
from autoplace.plan import strict_json

__all__ = ["COMMANDS"]


@dataclass(kw_only=True)
class RunConfig(TrustArgs, ClusterArgs):
    plan: str = req("plan JSON file", positional=True)
    cluster: str = opt("detect", "cluster preset, 'detect' or JSON path (devices used)")
    steps: int = opt(10, "training steps, the warm-up ones included", min=1)
    warmup: int = opt(2, "warm-up steps not counted in the step time", min=0)
    report: str | None = opt(None, "write the RunReport JSON here", out="file")
    write_measured: bool = opt(False, "fill the plan file's 'measured' block")
    no_reference: bool = opt(False, "skip the unpartitioned reference loss")
    checkpoint_dir: str | None = opt(None, "save checkpoints here (a folder that holds one "
                                           "is resumed with --resume, never overwritten)",
                                     out="dir")
    resume: bool = opt(False, "resume from the checkpoint in --checkpoint-dir")
    seed: int = opt(0, "data seed")
    curve: str | None = opt(None, "write a training-curve plot (PNG, SVG, PDF)", out="picture")
    trace: str | None = opt(None, "record the timed steps with torch.profiler: one Chrome "
                                  "trace per rank in this folder", out="dir")
    memory: str | None = opt(None, "record the CUDA allocator over the last warm-up step: per "
                                   "rank a snapshot (for pytorch.org/memory_viz) and a JSON "
                                   "summary of reserved memory by stream and of what was "
                                   "alive at the peak, in this folder", out="dir")
    nnodes: int | None = opt(None, "nodes of a run over several (default: as many as the "
                                   "plan's devices fill on the cluster)", min=1)
    node_rank: int | None = opt(None, "run this node's share of a run over several nodes "
                                      "(0 .. nnodes-1); without it such a plan's per-node "
                                      "commands are printed", min=0)
    rdzv_endpoint: str | None = opt(None, "HOST:PORT of the rendezvous of a run over several "
                                          "nodes (node 0's address)")
    rdzv_id: str | None = opt(None, "name of the run at the rendezvous, the same on every "
                                    "node (default: from the plan)")

    def check(self) -> None:
        if self.steps <= self.warmup:
            raise AutoplaceError(
                f"--steps {self.steps} leaves no step to time after --warmup {self.warmup} "
                "(the steps include the warm-up ones); use --steps greater than --warmup")
        if self.resume and not self.checkpoint_dir:
            raise AutoplaceError("--resume needs --checkpoint-dir (the folder to resume from)")
        if self.node_rank is not None and not self.rdzv_endpoint:
            raise AutoplaceError("--node-rank needs --rdzv-endpoint HOST:PORT (node 0's "
                                 "address, the same on every node)")


@dataclass(kw_only=True)
class ProfileConfig(ModelArgs, ClusterArgs):
    out: str = opt("profile.json", "write the profiled OpGraph (and link speeds) here (an "
                                   "existing file at the default path is kept unless --force)",
                   flag="-o", out="file", guard=True)
    repeats: int = opt(5, "timed repeats per op", min=1)
    cache_dir: str | None = opt(None, "also keep the op times in this profile cache folder "
                                "(for plan/compare --profile-dir)", out="dir")
    links: bool = opt(True, "also measure copies between every device pair and collectives "
                            "(all-reduce, all-gather, reduce-scatter) when there are several "
                            "devices")
    cluster_out: str = opt("cluster.json", "write the cluster with the measured link and "
                                           "collective speeds here (for --cluster; an existing "
                                           "file at the default path is kept unless --force)",
                           out="file", guard=True, when="links")
    block: bool = opt(True, "on a GPU, also time the model's first block compiled "
                            "(torch.compile) and recomputed (checkpointed) against eager: "
                            "the simulator's price of those levers on this machine")
    force: bool = opt(False, "replace existing files at the default output paths")


@dataclass(kw_only=True)
class DemoConfig(ModelArgs, ClusterArgs):
    model: str = opt("gpt-small", "zoo workload name or package.module:factory")
    out: str = opt("runs/demo", "output directory", out="dir")
    budget: str = opt("60s", "policy training budget: episodes (500ep), updates (100up) or "
                             "time (60s, 5m)")
    steps: int = opt(6, "training steps executed for real per plan, 2 warm-up steps included",
                     min=3)
    policy: str = opt("gnn", "policy to train: seq2seq, hierarchical or gnn")
    profile: bool = opt(True, "measure the ops on the first device before ranking plans, so "
                              "the simulator uses this machine's op times (--no-profile: "
                              "estimated costs)")

    def check(self) -> None:
        from autoplace.policies.reinforce import parse_budget

        try:
            parse_budget(self.budget)
        except AutoplaceError as e:
            raise AutoplaceError(f"--budget: {e}") from None


@dataclass(kw_only=True)
class TraceSummaryConfig:
    traces: list[str] = req("Chrome traces (autoplace run --trace DIR writes one per rank)",
                            positional=True, nargs="+")
    top: int = opt(12, "kernels and host operations listed", min=1)
    json: str | None = opt(None, "also write the summaries as JSON here", out="file")


def cmd_run(cfg: RunConfig) -> int:
    from autoplace.executor import launch, nodes
    from autoplace.executor.checkpoint import require_resumable
    from autoplace.executor.tensor_parallel import process_count

    plan = load_plan(cfg.plan, cfg)
    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    nnodes, per_node = nodes.node_layout(plan, cluster, cfg.nnodes)
    wl = plan_workload(plan, device="meta")
    check_fits(plan, graph_of(wl), cluster, wl.batch_size)
    rdzv_id = cfg.rdzv_id or nodes.rdzv_id_of(plan)
    node = None
    if nnodes > 1 and cfg.node_rank is None:  # printed anywhere: no device needed here
        print("\n".join(nodes.node_commands(_run_args(cfg), nnodes, per_node,
                                             cfg.rdzv_endpoint, rdzv_id)))
        return 0
    cluster.require_present(max(plan.num_devices, process_count(plan)),
                            what=f"plan {cfg.plan} ({plan.split()})")
    if cfg.node_rank is not None:
        node = nodes.NodeLaunch(nnodes=nnodes, node_rank=cfg.node_rank,
                                nproc_per_node=per_node, rdzv_endpoint=str(cfg.rdzv_endpoint),
                                rdzv_id=rdzv_id)
    if cfg.checkpoint_dir:
        start = require_resumable(cfg.checkpoint_dir, cfg.resume, cfg.steps)
        if cfg.resume:
            print(f"resuming from step {start} of {cfg.checkpoint_dir} ({cfg.steps - start} "
                  "steps to go)" if start else
                  f"no checkpoint in {cfg.checkpoint_dir} yet: starting at step 0", flush=True)
    spec = {"spec": plan.model["spec"], "options": plan.model.get("options", {}),
            "seed": int(plan.model.get("seed", 0))}
    report = launch.run_plan(
        plan, spec, cluster=cluster, steps=cfg.steps, warmup=cfg.warmup,
        reference=not cfg.no_reference, checkpoint_dir=cfg.checkpoint_dir, resume=cfg.resume,
        seed=cfg.seed, progress=True, trace_dir=cfg.trace, memory_dir=cfg.memory, trusted=True,
        node=node,
    )
    if report is None:
        print(f"node {cfg.node_rank}: this node's processes finished; global rank 0 ran on "
              "another node and wrote the report there")
        return 0
    if cfg.report:
        write_json_atomic(cfg.report, strict_json(report.to_json()), allow_nan=False)
    if report.error:
        print(f"autoplace: error: {report.error}", file=sys.stderr)
        return 3
    print(f"{plan.describe()}: step {ms(report.step_time_s)} ms (median of "
          f"{len(report.step_times_s)}), {report.samples_per_s:.1f} samples/s, peak GiB "
          f"{' / '.join(gb(b) for b in report.peak_memory_bytes)}")
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
    if report.extra.get("memory_record"):
        print("allocator record of one step (rank 0): "
              f"{', '.join(report.extra['memory_record'])}")
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


def _run_args(cfg: RunConfig) -> list[str]:
    """``autoplace run`` as typed, without the node options (each node adds its own)."""
    args = ["autoplace", "run", cfg.plan, "--cluster", cfg.cluster]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("plan", "cluster", "nnodes", "node_rank", "rdzv_endpoint",
                      "rdzv_id") or value == f.default:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    return args


def cmd_profile(cfg: ProfileConfig) -> int:
    from autoplace.costs.profile import profile

    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    cluster.require_present(cluster.num_devices if cfg.links else 1, what="profile")
    wl = build_model(cfg)
    device = cluster.devices[0].name
    graph = profile(wl, [device], repeats=cfg.repeats, cache_dir=cfg.cache_dir)
    if cfg.block and device.startswith("cuda"):
        from autoplace.executor.profile_block import describe, profile_block

        rec = profile_block(graph, wl.example_inputs(graph.batch_size, "cpu"), device,
                            autocast_dtype=wl.autocast_dtype, repeats=cfg.repeats,
                            cache_dir=cfg.cache_dir)
        print(f"first block: {describe(rec)}")
    graph.save(cfg.out)
    print(f"profiled {len(graph)} ops on {device} -> {cfg.out}")
    if cfg.links and cluster.num_devices > 1:
        from autoplace.executor.collectives import measured_cluster

        measured, summary = measured_cluster(cluster)
        measured.save(cfg.cluster_out)
        print(f"links: {summary} -> {cfg.cluster_out} (use with --cluster {cfg.cluster_out})")
    return 0


def cmd_demo(cfg: DemoConfig) -> int:
    from autoplace.demo import run_demo

    cluster = cluster_of(cfg.cluster, cfg.memory_cap)
    cluster.require_present(what="the demo (it executes plans)")
    run_demo(cfg.model, cfg.cluster, memory_cap=cfg.memory_cap, options=parse_options(cfg),
             out_dir=cfg.out, policy=cfg.policy, budget=cfg.budget, steps=cfg.steps,
             profile_ops=cfg.profile)
    return 0


def cmd_trace_summary(cfg: TraceSummaryConfig) -> int:
    from autoplace.tools import trace_summary

    argv = [*cfg.traces, "--top", str(cfg.top)] + (["--json", cfg.json] if cfg.json else [])
    return trace_summary.main(argv)


COMMANDS = {
    "run": (RunConfig, cmd_run, "execute a plan as real training and report"),
    "profile": (ProfileConfig, cmd_profile, "measure per-op times on this machine's devices"),
    "demo": (DemoConfig, cmd_demo, "the whole chain on a default workload (README's main job)"),
    "trace-summary": (TraceSummaryConfig, cmd_trace_summary,
                      "where a step's time went, from the traces of run --trace"),
}
