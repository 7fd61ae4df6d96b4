"""What several commands do: build the model (a plan's only when allowed), the cluster,
the graph; print tables; refuse a run that cannot fit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from autoplace.cli.args import parse_options
from autoplace.errors import AutoplaceError

__all__ = ["build_model", "cluster_of", "gb", "graph_of", "load_plan", "ms", "nothing_fits",
           "plan_cluster", "plan_workload", "print_table"]


def build_model(cfg: Any, device: Any = None):
    """The workload ``--model`` names (the user named it: it may import a module)."""
    from autoplace import workloads

    return workloads.get(cfg.model, device=device, **parse_options(cfg))


def cluster_of(spec: str, cap: str | None):
    """The cluster ``--cluster`` and ``--memory-cap`` name."""
    from autoplace.cluster import resolve

    return resolve(spec, cap)


def graph_of(workload, profile_dir: str | None = None, cluster: Any = None):
    """The workload's captured graph, with op times from ``profile_dir`` when given."""
    from autoplace.capture import capture_workload

    if profile_dir is not None and not Path(profile_dir).is_dir():
        raise AutoplaceError(f"--profile-dir {profile_dir}: no such folder; write one with "
                             "autoplace profile --cache-dir")
    graph = capture_workload(workload)
    if profile_dir is not None:
        from autoplace.costs.profile import apply_cached

        kinds = [d.kind for d in cluster.devices] if cluster is not None else []
        found = apply_cached(graph, profile_dir, kinds)
        print(f"op times: {'profiled (' + ', '.join(found) + ')' if found else 'estimated'} "
              f"from {profile_dir}", file=sys.stderr)
    return graph


def load_plan(path: str, cfg: Any):
    """The plan file at ``path`` and whether its model may be built: a zoo name always;
    ``module:factory`` only when ``--model`` names the same or ``--trust-model`` is given
    (a plan file is data: reading one runs no code of its own)."""
    from autoplace import workloads
    from autoplace.plan import Plan

    plan = Plan.load(path)
    workloads.check_trusted(plan.model.get("spec"), source=f"plan {path}",
                            user_model=getattr(cfg, "model", None),
                            trust=bool(getattr(cfg, "trust_model", False)))
    return plan


def plan_workload(plan, device: Any = None):
    """The workload of a plan that :func:`load_plan` allowed."""
    from autoplace import workloads

    return workloads.get(plan.model["spec"], device=device, trusted=True,
                         seed=int(plan.model.get("seed", 0)), **plan.model.get("options", {}))


def plan_cluster(plan, spec: str | None, cap: str | None):
    """The cluster for a plan: given, or rebuilt from the plan's cluster summary."""
    from autoplace.cluster import PRESETS, resolve

    if spec is not None:
        return resolve(spec, cap)
    name = str(plan.cluster.get("name", "")).split("@")[0]
    if name in PRESETS:
        c = resolve(name)
        mem = plan.cluster.get("memory_bytes")
        if isinstance(mem, list) and mem and all(isinstance(m, int) and m > 0 for m in mem) \
                and min(mem) < min(d.memory_bytes for d in c.devices):
            c = c.with_memory_cap(int(min(mem)))
        return resolve(c, cap)
    return resolve("detect", cap)


def check_fits(plan, graph, cluster, batch_size: int) -> None:
    """Refuse a plan that does not fit the graph, the cluster or the batch."""
    from autoplace.lowering import validate

    validate(graph, plan, cluster)
    plan.parallel.micro_batch_size(batch_size)


def nothing_fits(rows: list[dict[str, Any]], cluster) -> str | None:
    """The message when no row's plan fits the devices' memory (None when one does)."""
    from autoplace.cluster import format_bytes

    ok = [r for r in rows if r.get("plan") is not None and not r.get("oom")]
    oom = [r for r in rows if r.get("oom") and r.get("peak_memory_bytes")]
    if ok or not oom:
        return None
    least = min(oom, key=lambda r: max(r["peak_memory_bytes"]))
    usable = min(d.usable_memory_bytes for d in cluster.devices)
    need = max(least["peak_memory_bytes"])
    return (f"nothing fits in {format_bytes(usable)} per device ({cluster.name}): the smallest "
            f"peak any plan needed is {format_bytes(need)} ({least['planner']}: "
            f"{least.get('parallel') or '?'}); raise --memory-cap to at least "
            f"{format_bytes(need)}, or use more devices")


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    """Rows as aligned text columns (numbers right-aligned)."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def numeric(c: str) -> bool:
        return c.replace(".", "", 1).replace("-", "", 1).replace("e", "", 1).isdigit()

    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if numeric(c) else c.ljust(w)
                        for c, w in zip(r, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def ms(s: float | None) -> str:
    """Seconds as milliseconds with two decimals (``-`` for none)."""
    return "-" if s is None else f"{s * 1e3:.2f}"


def gb(b: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{b / 2**30:.2f}"
