"""The simulator against every stored measurement, before and after a change: a run folder.

    python scripts/bench/replay_report.py --before bench/results/<earlier replay> --out DIR

Replays (``replay_suite.py``) every stored suite whose run folder keeps its per-op profiles
(``profiles/``), and simulates every option of every one-GPU levers run (``levers.json``,
``bench_levers.py --replay`` on a copy: recompute and compiled plans, estimated op costs,
or the run's own ``profile/`` where it kept one).
Writes to ``--out`` (or a new ``<date>-cpux1-sim-replay`` folder):

* ``replay.md``: per scenario the median |simulated - measured| / measured step time and
  Kendall tau before (``--before``: an earlier run of this script or of ``replay_suite.py
  --json``, one ``<suite folder>.json`` per suite) and now; peak memory per plan family
  against the allocated and the reserved peak (max over devices); every plan whose
  simulated peak is more than 10% off; the suites that cannot be replayed and why;
* ``replay.json`` (every plan), ``<suite folder>.json`` per suite (the next run's
  ``--before``), ``levers-<run>.json``, ``steps.png`` (simulated against measured step time
  per scenario, before and now) and ``memory.png`` (peak memory per family);
* ``env.json`` (with ``--before``'s commit as ``before_commit``) and ``run.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import replay_suite as rs
from results import RESULTS, write_run
from run_folder import output_folder

#: report family of a plan (``replay_suite``'s family, ``autoplace.search.families``)
FAMILIES = ("single", "placement", "placement+mb", "CUDA graphs", "DDP", "ZeRO-2", "FSDP2",
            "pipeline", "recompute", "compiled", "offload")
#: levers recipe -> report family
RECIPE_FAMILY = {"eager": "single", "eager-blocks": "single", "compile-blocks": "compiled",
                 "checkpoint-blocks": "recompute", "selective-blocks": "recompute",
                 "checkpoint-blocks+compile": "recompute", "selective-blocks+compile": "recompute"}


def recipe_family(recipe: str) -> str:
    """The report's family of a levers recipe (offloaded recipes are ``offload``; a
    hand-written recipe on the blocks it wraps, ``"<recipe> (...)"``, is its recipe's)."""
    recipe = recipe.split(" (")[0]
    return "offload" if "offload" in recipe else RECIPE_FAMILY.get(recipe, recipe)


WITHIN = 0.10  # the memory target: simulated peak within 10% of the measured one


def is_ddp(family: str) -> bool:
    """A plan whose replicas are DDP-wrapped (ZeRO-1's too): one device per replica, not
    sharded (``replay_suite``'s family string)."""
    return family.startswith("dp-none") and "+placement" not in family \
        and "pipeline" not in family


def is_pipeline(family: str) -> bool:
    """A plan with pipeline stages (``replay_suite``'s family string)."""
    return "pipeline" in family


def is_graphed(family: str) -> bool:
    """A plan replayed as CUDA graphs (``replay_suite``'s family string)."""
    return family.endswith("+graphs")


def sharded_pieces(family: str) -> bool:
    """An FSDP2 or ZeRO-2 plan with recomputed or compiled pieces."""
    return family.startswith(("dp-fsdp", "dp-zero2")) and (
        "+recompute" in family or "+compile" in family)


#: executor changes after which a suite run before them measured some plans otherwise than
#: the executor runs them now, and the simulator models: ``(commit, what it ran before,
#: which plans (replay_suite's family string), its step times too)``. Such plans are left
#: out of the comparison (their memory, and with the last field their step time).
EXECUTOR_CHANGES = (
    ("3c667e6", "FSDP2 gathered a recomputed or compiled plan's whole model as one unit",
     sharded_pieces, True),
    ("37f5195", "DDP rebuilt its gradient buckets at the second step, its peak holding the "
     "gradients twice", is_ddp, False),
    ("80d14e7", "a pipeline's last stage kept every microbatch's output to the step's end and "
     "concatenated them", is_pipeline, False),
    ("f103a5d", "a graphed piece's capture kept make_graphed_callables' warm-up gradients "
     "alive, the run's peak a parameter gradient above its steps'", is_graphed, False),
)


def ran_before(folder: Path, commit: str) -> bool:
    """Whether the suite in ``folder`` ran before ``commit`` (its ``env.json`` commit does
    not descend from it; an unknown commit counts as before)."""
    env = folder / "env.json"
    ran = json.loads(env.read_text()).get("commit", "") if env.exists() else ""
    ran = ran.split("+")[0]
    if not ran:
        return True
    try:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", commit, ran],
                              capture_output=True, cwd=Path(__file__).resolve().parent)
    except OSError:  # no git: the history cannot tell
        return True
    return done.returncode != 0


def changes_since(folder: Path) -> list[tuple]:
    """The :data:`EXECUTOR_CHANGES` made after the suite in ``folder`` ran."""
    return [c for c in EXECUTOR_CHANGES if ran_before(folder, c[0])]


def mark_stale(changes: list[tuple], rows: list[dict[str, Any]]) -> None:
    """Set ``stale_memory`` and ``stale_time`` on the rows (a suite's) that one of
    ``changes`` (:func:`changes_since` the suite) concerns."""
    for r in rows:
        hit = [c for c in changes if c[2](r["family"])]
        r["stale_memory"] = bool(hit)
        r["stale_time"] = any(c[3] for c in hit)


def fresh(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``replay_suite.distinct_measured`` of the rows whose step time is not stale."""
    return rs.distinct_measured([r for r in rows if not r.get("stale_time")])


def report_family(family: str) -> str:
    """The report's family of ``replay_suite``'s ``family`` string."""
    if "+recompute" in family:
        return "recompute"
    if "+compile" in family:
        return "compiled"
    if "pipeline" in family:
        return "pipeline"
    if family.startswith("dp-fsdp"):
        return "FSDP2"
    if family.startswith("dp-zero2"):
        return "ZeRO-2"
    if family.startswith("dp-"):
        return "DDP"
    if family.endswith("+graphs"):
        return "CUDA graphs"
    return family


def suites(root: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """Stored suites (``suite.json``) that can be replayed, and ``(folder, why not)``."""
    ok, skipped = [], []
    for f in sorted(root.glob("*/suite.json")):
        if (f.parent / "profiles").is_dir():
            ok.append(f)
            continue
        hf = any(sc["name"].startswith("hf-") for sc in json.loads(f.read_text())["scenarios"])
        skipped.append((f.parent.name, "no per-op profiles stored" + (
            " (Hugging Face models)" if hf else "") + ": its searched plans cannot be rebuilt "
            "as measured, and analytic costs are not what it simulated"))
    return ok, skipped


def replay_suites(paths: list[Path], before: Path | None) -> list[dict[str, Any]]:
    """Every replayable suite's scenarios, each plan with its time and peak before."""
    out = []
    for path in paths:
        result = json.loads(path.read_text())
        scs = rs._replay_with(result, str(path.parent / "profiles"), None)
        old = before / f"{path.parent.name}.json" if before else None
        old_scs = {sc["name"]: sc for sc in json.loads(old.read_text())} \
            if old and old.exists() else {}
        changes = changes_since(path.parent)
        for sc in scs:
            mark_stale(changes, sc["plans"])
            prev = {r["planner"]: r for r in old_scs.get(sc["name"], {}).get("plans", [])}
            for r in sc["plans"]:
                p = prev.get(r["planner"], {})
                r["sim_before_s"] = p.get("sim_now_s")
                r["sim_peak_before_bytes"] = p.get("sim_peak_now_bytes")
            sc.update(suite=path.parent.name, num_devices=int(result["num_devices"]),
                      **_errors(sc["plans"]))
        out.extend(scs)
    return out


def _errors(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step-time error and Kendall tau before and now over distinct measured plans."""
    from scipy.stats import kendalltau

    pts = fresh(rows)
    res: dict[str, Any] = {"measured_plans": len(pts)}
    for k in ("before", "now"):
        if not pts or any(p[f"sim_{k}_s"] is None for p in pts):
            res[f"error_{k}"] = res[f"tau_{k}"] = None
            continue
        xs, ys = [p[f"sim_{k}_s"] for p in pts], [p["measured_s"] for p in pts]
        res[f"error_{k}"] = statistics.median(abs(x - y) / y for x, y in zip(xs, ys))
        res[f"tau_{k}"] = float(kendalltau(xs, ys).statistic) if len(pts) >= 3 else None
    return res


@functools.cache
def _attention_calls(model: str, options: str) -> tuple[bool, tuple[dict[str, Any], ...]]:
    """Whether ``model`` (with ``options``, JSON) is captured by ``torch.export``, and the
    keyword arguments of its graph's attention calls."""
    from autoplace import workloads
    from autoplace.capture import capture_workload

    g = capture_workload(workloads.get(model, device="meta", **json.loads(options)))
    calls = tuple(dict(n.kwargs) for n in g.module.graph.nodes
                  if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target))
    return g.capture_method == "export", calls


def exported_attention(levers: dict[str, Any]) -> bool:
    """Whether a levers run's model is captured by ``torch.export`` and attends
    (``scaled_dot_product_attention``): the graphs ``capture.attention`` rewrites."""
    exported, calls = _attention_calls(levers["model"], json.dumps(levers["options"]))
    return exported and bool(calls)


def exported_grouped_query(levers: dict[str, Any]) -> bool:
    """Whether a levers run's model is exported and its capture now passes attention
    grouped keys and values (``enable_gqa``) it repeated per head before 13c6dda."""
    exported, calls = _attention_calls(levers["model"], json.dumps(levers["options"]))
    return exported and any(kw.get("enable_gqa") for kw in calls)


#: capture changes after which a levers run before them measured another graph than the
#: capture gives now, in step time and memory alike: ``(commit, what changed, which runs
#: (on their levers.json))``. Such runs are left out of the replay (their own sim-check
#: stays in their folder).
CAPTURE_CHANGES = (
    ("a1989b9", "an exported graph's causal mask, built from shapes, ruled FlashAttention "
     "out and repeated grouped keys and values per head (capture.attention)",
     exported_attention),
    ("13c6dda", "an exported graph repeated grouped keys and values per head for attention, "
     "which kept them for backward repeated (capture.attention)", exported_grouped_query),
)


def replay_levers(root: Path, left_out: list[tuple[str, str]] | None = None
                  ) -> list[dict[str, Any]]:
    """Every levers run's options simulated (``bench_levers.replay`` on a copy of its
    ``levers.json``), one row per measured option that ran; a run measured on another
    graph than today's capture (:data:`CAPTURE_CHANGES`) is added to ``left_out`` with
    why."""
    import bench_levers

    rows = []
    for f in sorted(root.glob("*/levers.json")):
        levers = json.loads(f.read_text())
        if levers["card"] == "cpu":
            continue  # an execution check on a CPU: the report is of the cards
        change = next((c for c in CAPTURE_CHANGES
                       if ran_before(f.parent, c[0]) and c[2](levers)), None)
        if change is not None:
            if left_out is not None:
                left_out.append((f.parent.name, f"measured before {change[0]}: {change[1]}"))
            continue
        tmp = Path(tempfile.mkdtemp(prefix="autoplace-levers-"))
        try:
            shutil.copy(f, tmp / "levers.json")
            if (f.parent / "plans").is_dir():  # auto's own plan, where it was kept
                shutil.copytree(f.parent / "plans", tmp / "plans")
            profile = f.parent / "profile"  # the run's op profile (and first block), if kept
            bench_levers.replay(tmp, str(profile) if profile.is_dir() else None)
            check = json.loads((tmp / "sim-check.json").read_text())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        ran = [r for r in check["rows"] if r["measured_ms"] and not r["measured_oom"]]
        # the executor changes since the run, judged on each recipe's plan family
        staled = [{"family": r["family"] if r["recipe"] == "auto" else suite_family(r["recipe"])}
                  for r in ran]
        mark_stale(changes_since(f.parent), staled)
        for r, st in zip(ran, staled):
            rows.append({**r, "run": f.parent.name, "stale_memory": st["stale_memory"],
                         "family": recipe_family(r["recipe"]) if r["recipe"] != "auto"
                         else report_family(r["family"])})
    return rows


def suite_family(recipe: str) -> str:
    """A levers recipe's plan family as ``replay_suite`` writes it (what
    :data:`EXECUTOR_CHANGES`' tests read): FSDP2 (offloaded too) or DDP replicas, with
    ``+recompute`` / ``+compile`` where the recipe recomputes or compiles."""
    base = ("dp-fsdp" if "fsdp" in recipe or "offload" in recipe
            else "dp-none" if "ddp" in recipe else "single")
    if "checkpoint" in recipe or "selective" in recipe:
        base += "+recompute"
    if "compile" in recipe:
        base += "+compile"
    return base


def levers_before(before: Path | None) -> dict[tuple[str, str, str], float]:
    """The levers options' simulated peaks (bytes) of an earlier run of this script, by
    ``(run, case, option)`` (its ``replay.json``; empty without one)."""
    f = before / "replay.json" if before else None
    if not f or not f.exists():
        return {}
    rows = json.loads(f.read_text()).get("levers", [])
    return {(r["run"], r["case"], r["option"]): r["sim_peak_gib"] * 2**30 for r in rows
            if r.get("sim_peak_gib") is not None}


def memory_points(scs: list[dict[str, Any]], levers: list[dict[str, Any]],
                  levers_prev: dict[tuple[str, str, str], float] | None = None
                  ) -> list[dict[str, Any]]:
    """One point per distinct measured plan: family, simulated peak now and before (a
    levers option's from ``levers_prev``, :func:`levers_before`), measured allocated and
    reserved peak (bytes, max over devices), and its name; ``stale`` where the executor
    has changed how it runs the plan since (:func:`mark_stale`)."""
    levers_prev = levers_prev or {}
    pts = []
    for sc in scs:
        for r in rs.distinct_measured(sc["plans"]):
            if r["measured_peak_bytes"]:
                pts.append({"family": report_family(r["family"]),
                            "name": f"{sc['suite']} {sc['name']} {r['planner']} ({r['split']})",
                            "sim": r["sim_peak_now_bytes"], "before": r["sim_peak_before_bytes"],
                            "allocated": r["measured_peak_bytes"],
                            "reserved": r["measured_reserved_bytes"],
                            "stale": bool(r.get("stale_memory"))})
    seen = set()
    for r in levers:  # hand-written options and autoplace's of one recipe: one point each
        key = (r["run"], r["case"], r["recipe"], round(r["measured_peak_gib"], 1))
        if key in seen:
            continue
        seen.add(key)
        pts.append({"family": r["family"], "name": f"{r['run']} {r['case']} {r['option']}",
                    "sim": r["sim_peak_gib"] * 2**30,
                    "before": levers_prev.get((r["run"], r["case"], r["option"])),
                    "allocated": r["measured_peak_gib"] * 2**30,
                    "reserved": (r["measured_reserved_gib"] or 0) * 2**30 or None,
                    "stale": bool(r.get("stale_memory"))})
    return pts


def pct(x: float | None, spec: str = ".1%") -> str:
    """``x`` as a percentage, ``-`` for None."""
    return "-" if x is None else format(x, spec)


def markdown(scs, pts, skipped, levers, before: str | None, stale: int = 0) -> str:
    """The run's tables (see the module docstring); ``stale``: the plans left out of the
    memory tables (:func:`memory_points`)."""
    lines = ["# The simulator replayed on every stored measurement", "",
             "Every suite that kept its per-op profiles replayed (`scripts/bench/replay_suite.py`:"
             " plans rebuilt by the deterministic planners from the suite's profiles, links and "
             "cap) and every one-GPU levers run's options simulated (`bench_levers.py --replay`,"
             " estimated op costs, or the ops and first block profiled on the card where the run"
             " kept its profile), on a CPU, against what the GPUs measured. Step time: "
             "|simulated - measured| / measured, median over a scenario's distinct measured "
             f"plans, and Kendall tau; *before*: {before or 'no earlier replay'}.", "",
             "| suite | scenario | devices | plans | median error before | now | "
             "Kendall tau before | now |", "|---|---|---|---|---|---|---|---|"]
    for sc in scs:
        lines.append(f"| [{sc['suite']}](../{sc['suite']}/) | {sc['name']} | {sc['num_devices']}"
                     f" | {sc['measured_plans']} | {pct(sc['error_before'])} | "
                     f"{pct(sc['error_now'])} | {pct(sc['tau_before'], '.2f')} | "
                     f"{pct(sc['tau_now'], '.2f')} |")
    gone = sum(len(rs.distinct_measured(sc["plans"])) - len(fresh(sc["plans"])) for sc in scs)
    if gone:
        lines.append(f"\nLeft out of the step times: {gone} plans measured before an executor "
                     "change that altered how they run (" + "; ".join(
                         f"before {c[0]}, {c[1]}" for c in EXECUTOR_CHANGES if c[3]) + ").")
    for k in ("before", "now"):
        errs = [abs(p[f"sim_{k}_s"] - p["measured_s"]) / p["measured_s"] for sc in scs
                for p in fresh(sc["plans"]) if p[f"sim_{k}_s"] is not None]
        taus = [sc[f"tau_{k}"] for sc in scs if sc[f"tau_{k}"] is not None]
        if errs and taus:
            lines.append(f"\n**{k}**: median error {statistics.median(errs):.1%} over "
                         f"{len(errs)} plans, mean Kendall tau {statistics.mean(taus):.2f} over "
                         f"{len(taus)} scenarios.")
    runs = sorted({r["run"] for r in levers})
    lines += ["", "One GPU, per-block recipes (" + ", ".join(f"[{r}](../{r}/)" for r in runs)
              + "):", "",
              "| run | case | option | recipe | measured ms | simulated ms | error |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['case']} | {r['option']} | {r['recipe']} | "
              f"{r['measured_ms']:.1f} | {r['sim_ms']:.1f} | {pct(r['time_err'], '+.1%')} |"
              for r in levers]
    lines += ["", "## Peak memory per plan family", "",
              "Simulated peak (max over devices) / measured - 1, against the allocated peak "
              "(`torch.cuda.max_memory_allocated`) and the reserved one (the caching "
              "allocator's segments; 4-GPU suites did not record it). Target: within 10% of "
              "allocated."
              + (f" Left out: the {stale} plans measured before an executor change that "
                 "concerns them (" + "; ".join(f"before {c[0]}, {c[1]}"
                                               for c in EXECUTOR_CHANGES) + ")."
                 if stale else ""), "",
              "| family | plans | median error allocated (before) | worst | within 10% | "
              "median error reserved |", "|---|---|---|---|---|---|"]
    for fam in FAMILIES:
        fp = [p for p in pts if p["family"] == fam]
        if not fp:
            continue
        e = [p["sim"] / p["allocated"] - 1 for p in fp]
        eb = [p["before"] / p["allocated"] - 1 for p in fp if p["before"]]
        er = [p["sim"] / p["reserved"] - 1 for p in fp if p["reserved"]]
        worst = max(e, key=abs)
        lines.append(f"| {fam} | {len(fp)} | {pct(statistics.median(map(abs, e)))} "
                     f"({pct(statistics.median(map(abs, eb)) if eb else None)}) | "
                     f"{worst:+.1%} | {sum(abs(x) <= WITHIN for x in e)}/{len(e)} | "
                     f"{pct(statistics.median(map(abs, er)) if er else None)} |")
    had = [p for p in pts if p["before"]]
    lines += ["", f"Within 10% of allocated: {_within(pts, 'sim')} of {len(pts)} plans"
              + (f" (before: {_within(had, 'before')} of the {len(had)} simulated then)"
                 if had else "") + "."]
    lines += ["", "Plans more than 10% off the allocated peak:", "",
              "| family | plan | simulated GiB | allocated | reserved | error |",
              "|---|---|---|---|---|---|"]
    for p in sorted(pts, key=lambda p: (FAMILIES.index(p["family"]), p["name"])):
        e = p["sim"] / p["allocated"] - 1
        if abs(e) > WITHIN:
            lines.append(f"| {p['family']} | {p['name']} | {p['sim'] / 2**30:.2f} | "
                         f"{p['allocated'] / 2**30:.2f} | "
                         f"{pct(p['reserved'] and p['reserved'] / 2**30, '.2f')} | {e:+.1%} |")
    lines += ["", "## Runs not replayed", ""]
    lines += [f"- [{d}](../{d}/): {why}" for d, why in skipped]
    return "\n".join(lines) + "\n"


def _within(pts: list[dict[str, Any]], key: str) -> int:
    """How many of ``pts`` have their ``key`` peak within 10% of the allocated one."""
    return sum(abs(p[key] / p["allocated"] - 1) <= WITHIN for p in pts)


def plots(scs, pts, folder: Path) -> None:
    """``steps.png``: simulated against measured step time per scenario, before and now;
    ``memory.png``: simulated against measured (allocated) peak per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 5
    rows = -(-len(scs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax, sc in zip(axes.flat, scs):
        pts_sc = fresh(sc["plans"])
        ys = [p["measured_s"] * 1e3 for p in pts_sc]
        for k, style in (("before", dict(marker="o", facecolors="none", edgecolors="0.5")),
                         ("now", dict(marker=".", color="C0"))):
            xs = [p[f"sim_{k}_s"] * 1e3 if p[f"sim_{k}_s"] else float("nan") for p in pts_sc]
            ax.scatter(ys, xs, label=k, s=30 if k == "before" else 40, **style)
        lo, hi = min(ys) * 0.7, max(ys) * 1.3
        ax.plot([lo, hi], [lo, hi], "k:", lw=0.8)
        ax.set(xscale="log", yscale="log", title=f"{sc['name']} x{sc['num_devices']}",
               xlabel="measured ms", ylabel="simulated ms")
    for ax in axes.flat[len(scs):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "steps.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    for i, fam in enumerate(FAMILIES):
        fp = [p for p in pts if p["family"] == fam]
        if fp:
            ax.scatter([p["allocated"] / 2**30 for p in fp], [p["sim"] / 2**30 for p in fp],
                       label=fam, color=f"C{i}", s=22)
    lo, hi = 0.3, 60
    ax.plot([lo, hi], [lo, hi], "k:", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.9")
    ax.set(xscale="log", yscale="log", xlabel="measured peak allocated, GiB",
           ylabel="simulated peak, GiB", title="Peak memory per plan (max over devices)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "memory.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=None,
                    help="an earlier replay's folder (one <suite folder>.json per suite)")
    ap.add_argument("--out", default=None, help="output folder (default: a new run folder)")
    ap.add_argument("--results", default=str(RESULTS), help="the run folders' root")
    args = ap.parse_args(argv)
    root = Path(args.results)
    before = Path(args.before) if args.before else None
    paths, skipped = suites(root)
    scs = replay_suites(paths, before)
    levers = replay_levers(root, skipped)
    every = memory_points(scs, levers, levers_before(before))
    pts = [p for p in every if not p.get("stale")]
    env = json.loads((before / "env.json").read_text()) if before and \
        (before / "env.json").exists() else {}
    folder = output_folder(args.out, "sim-replay", before_commit=env.get("commit"))
    for path in paths:
        (folder / f"{path.parent.name}.json").write_text(json.dumps(
            [sc for sc in scs if sc["suite"] == path.parent.name], indent=1))
    (folder / "replay.json").write_text(json.dumps({"scenarios": scs, "levers": levers,
                                                    "memory": every}, indent=1))
    text = markdown(scs, pts, skipped, levers, before and before.name, len(every) - len(pts))
    (folder / "replay.md").write_text(text)
    plots(scs, pts, folder)
    within = _within(pts, "sim")
    errs = [abs(p["sim_now_s"] - p["measured_s"]) / p["measured_s"] for sc in scs
            for p in fresh(sc["plans"])]
    write_run(folder, tag="sim-replay", scenarios=["sim:replay"], kind="experiment",
              script="scripts/bench/replay_report.py",
              summary=f"The simulator replayed on {len(paths)} stored suites ({len(errs)} measured"
              f" plans, median step error {statistics.median(errs):.1%}) and {len(levers)} measured "
              f"options of one-GPU levers runs; peak memory within 10% of allocated on {within} of "
              f"{len(pts)} plans.")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
