"""Commands that describe: the model zoo, a model's graph, clusters, a plan's simulation."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from autoplace.cli.args import ClusterArgs, ModelArgs, TrustArgs, opt, req
from autoplace.cli.common import (
    build_model,
    check_fits,
    gb,
    graph_of,
    load_plan,
    ms,
    plan_cluster,
    plan_workload,
    print_table,
)
from autoplace.plan import strict_json

__all__ = ["COMMANDS"]


@dataclass(kw_only=True)
class ModelsConfig:
    json: bool = opt(False, "print JSON")


@dataclass(kw_only=True)
class CaptureConfig(ModelArgs):
    json: bool = opt(False, "print JSON (num_ops, num_edges, fingerprint, param_bytes, flops)")
    out: str | None = opt(None, "write the OpGraph as JSON to this path", flag="-o", out="file")
    top: int = opt(20, "rows of the op table", min=0)


@dataclass(kw_only=True)
class ClusterConfig(ClusterArgs):
    name: str | None = opt(None, "preset name or cluster JSON path to describe (default: this "
                                 "machine's)", positional=True, nargs="?")
    list: bool = opt(False, "list the presets")
    preset: str | None = opt(None, "preset to write (same as NAME)")
    detect: bool = opt(False, "describe this machine's devices")
    json: bool = opt(False, "print the cluster JSON (multi-node: one node and a count)")
    out: str | None = opt(None, "write the cluster JSON here", flag="-o", out="file")
    cluster: str = opt("detect", "(unused; use --preset or --detect)", unused=True)


@dataclass(kw_only=True)
class SimulateConfig(TrustArgs, ClusterArgs):
    plan: str = req("plan JSON file", positional=True)
    cluster: str | None = opt(None, "cluster (default: the one the plan was made for)")
    json: bool = opt(False, "print JSON (step_time_s, peak_memory_bytes, oom, lower_bound_s)")


@dataclass(kw_only=True)
class ShowConfig(TrustArgs, ClusterArgs):
    plan: str = req("plan JSON file", positional=True)
    cluster: str | None = opt(None, "cluster (default: the one the plan was made for)")
    gantt: str | None = opt(None, "write a Gantt chart of the simulated step (PNG, SVG, PDF)",
                            out="picture")
    picture: str | None = opt(None, "write a placement picture (PNG, SVG, PDF)", out="picture")


def cmd_models(cfg: ModelsConfig) -> int:
    from autoplace import workloads

    workloads.names()
    rows = [[name, desc] for name, (_, _, desc) in workloads.ZOO.items()]
    if cfg.json:
        print(json.dumps([{"name": n, "description": d} for n, d in rows]))
    else:
        print_table(rows, ["model", "description"])
    return 0


def cmd_capture(cfg: CaptureConfig) -> int:
    wl = build_model(cfg, device="meta")
    t0 = time.perf_counter()
    g = graph_of(wl)
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
    print_table(
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
            rows.append([name, c.num_nodes, c.gpus_per_node, d.kind, gb(d.memory_bytes),
                         f"{d.peak_flops / 1e12:.0f}", f"{c.bandwidth[0][1] / 1e9:.0f}"
                         if c.gpus_per_node > 1 else "-",
                         f"{c.network_bandwidth / 1e9:.0f}" if c.num_nodes > 1 else "-"])
        print_table(rows, ["preset", "nodes", "devices/node", "kind", "memory GiB", "TFLOP/s",
                           "link GB/s", "network GB/s"])
        return 0
    spec = cfg.name or cfg.preset
    c = Cluster.detect() if cfg.detect or not spec else resolve(spec)
    c = resolve(c, cfg.memory_cap)
    if cfg.out:
        c.save(cfg.out)
        print(f"wrote {cfg.out}: {c!r}")
    elif cfg.json:
        print(json.dumps(c.to_json(), indent=1))
    else:
        print("\n".join(cluster_lines(c)))
    return 0


def cluster_lines(c) -> list[str]:
    """A cluster for a reader: nodes x devices, the devices, the links, the memory."""
    kinds = ", ".join(c.device_kinds)
    out = [f"{c.name}: {c.num_nodes} node{'s' if c.num_nodes > 1 else ''} x "
           f"{c.gpus_per_node} {kinds} = {c.num_devices} device{'s' if c.num_devices > 1 else ''}"]
    d = c.devices[0]
    cap = "" if d.memory_cap_bytes is None else f" (capped at {gb(d.usable_memory_bytes)} GiB)"
    out.append(f"  device    {d.kind}: {gb(d.memory_bytes)} GiB{cap}, "
               f"{d.peak_flops / 1e12:.3g} TFLOP/s, {d.memory_bandwidth / 1e9:.0f} GB/s memory")
    if c.gpus_per_node > 1:
        bus = ("" if c.collective_bandwidth is None
               else f", collectives {c.collective_bandwidth / 1e9:.0f} GB/s bus bandwidth")
        out.append(f"  in a node {c.bandwidth[0][1] / 1e9:.0f} GB/s a copy, "
                   f"{c.alpha_s[0][1] * 1e6:.0f} us latency{bus}, "
                   f"{c.collective_alpha_s * 1e6:.0f} us a step")
    if c.num_nodes > 1:
        out.append(f"  network   {c.network_bandwidth / 1e9:.0f} GB/s per device "
                   f"({c.network_bandwidth * 8 / 1e9:.0f} Gb/s), "
                   f"{c.network_alpha_s * 1e6:.0f} us latency")
    total = sum(x.usable_memory_bytes for x in c.devices)
    out.append(f"  memory    {gb(total)} GiB in all, {gb(total / c.num_nodes)} GiB a node")
    return out


def _plan_and_graph(cfg):
    """The plan file (its model allowed), its model's graph and the cluster, checked."""
    plan = load_plan(cfg.plan, cfg)
    cluster = plan_cluster(plan, cfg.cluster, cfg.memory_cap)
    wl = plan_workload(plan, device="meta")
    graph = graph_of(wl)
    check_fits(plan, graph, cluster, wl.batch_size)
    return plan, graph, cluster


def cmd_simulate(cfg: SimulateConfig) -> int:
    from autoplace.sim import simulate

    plan, graph, cluster = _plan_and_graph(cfg)
    res = simulate(graph, plan, cluster)
    out = {"step_time_s": res.step_time_s, "peak_memory_bytes": res.peak_memory_bytes,
           "oom": res.oom, "oom_devices": res.oom_devices, "lower_bound_s": res.lower_bound_s,
           "busy_time_s": res.busy_time_s, "cluster": cluster.name}
    if cfg.json:
        print(json.dumps(strict_json(out), allow_nan=False))
    else:
        print(f"{plan.describe()} on {cluster.name}: step {ms(res.step_time_s)} ms "
              f"(lower bound {ms(res.lower_bound_s)} ms), peak GiB "
              f"{' / '.join(gb(b) for b in res.peak_memory_bytes)}"
              + (f", OUT OF MEMORY on devices {res.oom_devices}" if res.oom else ""))
    return 0


def cmd_show(cfg: ShowConfig) -> int:
    from autoplace import viz
    from autoplace.sim import simulate

    plan, graph, cluster = _plan_and_graph(cfg)
    print(plan.describe())
    counts: dict[int, int] = {}
    for op in plan.groups:
        counts[plan.device_of(op)] = counts.get(plan.device_of(op), 0) + 1
    for d in sorted(counts):
        print(f"  device {d}: {counts[d]} ops")
    if cfg.gantt:
        res = simulate(graph, plan, cluster, timeline=True)
        viz.gantt(res.timeline, cfg.gantt, title=f"{plan.describe()} on {cluster.name}: "
                  f"{ms(res.step_time_s)} ms")
        print(f"wrote {cfg.gantt}")
    if cfg.picture:
        par = plan.parallel  # replicas and tensor ranks (of one device or pipeline each)
        if (par.data > 1 or par.tensor > 1) and (plan.devices_per_replica == 1
                                                 or par.pipeline > 1):
            viz.mesh_picture(plan, cluster.gpus_per_node, cfg.picture)
        else:
            viz.placement_picture(graph, plan, cfg.picture)
        print(f"wrote {cfg.picture}")
    return 0


COMMANDS = {
    "models": (ModelsConfig, cmd_models, "list the model zoo"),
    "capture": (CaptureConfig, cmd_capture, "capture a model's op graph and summarise it"),
    "cluster": (ClusterConfig, cmd_cluster, "list presets, detect devices, write cluster JSON"),
    "simulate": (SimulateConfig, cmd_simulate, "simulate one training step of a plan"),
    "show": (ShowConfig, cmd_show, "describe a plan; Gantt chart and placement picture"),
}
