"""Replay a stored benchmark suite on today's simulator: fidelity work without GPUs.

    R=bench/results/2026-11-28-h200x2-suite-uncapped
    python scripts/bench/replay_suite.py $R/suite.json --profiles $R/profiles

A suite's ``suite.json`` (``bench_plans.py``) holds every plan's measured step time and
the links measured on its machine; its run folder's ``profiles/`` holds the per-op profiles
it simulated with (the profile cache's layout, ``<fingerprint>-<kind>.json``; a folder of
``<fingerprint>-<kind>-<tag>.profile.json`` files with ``--tag``). This script captures each scenario's
workload on the meta device, applies the stored profile, rebuilds the cluster (the
card's preset, the measured links, the scenario's memory cap), rebuilds every plan a
deterministic planner made (the hand-written options, expert, hash, critical-path,
m-etf, m-sct, hybrid-dp and the named hybrids; a stochastic planner's plan only where
the results say it was the same plan as one of those), simulates it, and prints per
scenario: the simulated time stored in the JSON, the one simulated now, the measured
one, the largest simulated and measured peak memory of a device, and the median
simulator error and Kendall tau of both against the measurements.

With the simulator unchanged the two columns agree (the check that the plans were
rebuilt right); after a change to the simulator they show what the change does to
every stored measurement. ``--json FILE`` writes the same as JSON: per plan also its
family (``autoplace.search.families``, ``+recompute`` where it recomputes) and the measured
reserved peak, read by ``replay_report.py``.

Several suites at once, each ``RESULTS.json:TAG`` (its profiles' tag), print one line per
scenario and the totals over all of them, stored and now (a change to the simulator
judged against every stored run):

    python scripts/bench/replay_suite.py --profiles PROFILES A/suite.json:TAG_A B/suite.json:TAG_B

or, with ``--own-profiles``, each suite with the ``profiles/`` folder of its own run folder:

    python scripts/bench/replay_suite.py --own-profiles A/suite.json B/suite.json

``--carried-calibration`` (several suites, in the order they ran) adds held-out fidelity as
a user gets it: auto saves its calibration (:mod:`autoplace.search.calibration`) in the profile
cache and the next run of the same model on the same cluster starts from it. For each
scenario it takes the calibration of the same graph, device kind and count and memory cap
saved by the most recent *earlier* suite on the command line that has one
(``--profiles``' ``<fingerprint>-<kind>x<n>[-cap<G>GiB]-<tag>.calibration.json``; never the
suite's own, which was fitted to these very measurements), corrects every plan's simulated
time by it (``Calibration.step_time``) and prints the median error and Kendall tau of those
beside the others (``-`` where no earlier suite has a calibration), and totals over the
scenarios that had one, uncalibrated and carried, on the same scenarios. A suite's
calibration files carry its tag, or its tag less a trailing ``x<devices>`` (the 4-GPU suites
s21x4 and s21bx4 tagged their profiles ``-s21x4`` but their calibrations ``-h200x4-s21``).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_plans as bp

DETERMINISTIC = ("expert", "hash", "critical-path", "m-etf", "m-sct", "hybrid-dp")


def read_suite(path: str) -> dict[str, Any] | None:
    """A suite's JSON from bench_plans.py, or None after printing why it cannot be read."""
    try:
        result = json.loads(Path(path).read_text())
        if "scenarios" not in result or "num_devices" not in result:
            raise ValueError("no 'scenarios' / 'num_devices': not a bench_plans.py result")
    except (OSError, ValueError) as e:
        print(f"error: cannot read {path}: {e}", file=sys.stderr)
        return None
    return result


def base_cluster(result: dict[str, Any]):
    """The preset of the result's card with the links measured in that run (stored under
    the cluster's own field names, read back as a cluster file is)."""
    from autoplace.cluster import Cluster, preset

    n = int(result["num_devices"])
    card = str(result.get("card", "cpu")).lower()
    kind = next((k for k in ("h200", "h100", "a100") if k in card), "cpu")
    cl = preset(f"{kind}x{n}" if kind != "cpu" else f"cpu-x{n}")
    links = result.get("links")
    return Cluster.from_json({**cl.to_json(), **links}) if links else cl


def _profile_dir(profiles: str | None, tag: str | None) -> str | None:
    """A folder in the profile cache's layout (``<fingerprint>-<kind>.json``): ``profiles``
    itself, or with ``tag`` a temporary copy of its ``*-<tag>.profile.json`` files."""
    if profiles is None or tag is None:
        return profiles
    tmp = tempfile.mkdtemp(prefix="autoplace-replay-")
    for f in Path(profiles).glob(f"*-{tag}.profile.json"):
        shutil.copy(f, Path(tmp) / f.name.replace(f"-{tag}.profile.json", ".json"))
    return tmp


def rebuild_plans(name: str, cluster, profiles: str | None, kind: str,
                  hf_module: str | None = None):
    """Scenario ``name``'s workload captured on the meta device with the stored profile
    applied, and every plan the suite's deterministic planners made for it on ``cluster``
    (the scenario's memory cap already applied): ``(graph, profiled, {planner: plan})``.
    ``hf_module``: the module of the ``hf-*`` scenarios' models (``bench_plans.py``'s
    ``--hf-module``)."""
    from autoplace import planners, workloads
    from autoplace.capture import capture_workload
    from autoplace.costs.profile import apply_cached

    sc = bp.scenario(name, hf_module)
    meta = workloads.get(sc["model"], device="meta", **sc["options"])
    graph = capture_workload(meta)
    profiled = bool(profiles) and bool(apply_cached(graph, profiles, [kind]))
    plans = dict(bp.hand_written(graph, cluster))  # split by analytic costs, as the suite
    for k in DETERMINISTIC:
        plans[k] = planners.get(k)(graph, cluster)
    plans.update(bp.hybrid_plans(graph, cluster))
    return graph, profiled, plans


def scenario_cluster(result: dict[str, Any], rec: dict[str, Any]):
    """The cluster a stored scenario ran on: :func:`base_cluster` with its memory cap."""
    base = base_cluster(result)
    cap = rec.get("memory_cap_bytes")
    return base.with_memory_cap(int(cap)) if cap else base


def calibration_tags(tag: str | None, num_devices: int) -> list[str]:
    """The tags a suite's calibration files may carry: its own, and without a trailing
    ``x<devices>`` (the calibration's name holds the device count already: suite s21x4's
    files are ``...-h200x4-s21.calibration.json``)."""
    if not tag:
        return []
    suffix = f"x{num_devices}"
    return [tag, tag[:-len(suffix)]] if tag.endswith(suffix) and tag != suffix else [tag]


def carried_calibration(folder: str | Path | None, graph, cluster, earlier: list[list[str]],
                        own: list[str]):
    """``(Calibration, tag)``: the calibration of ``graph`` on ``cluster`` in ``folder``
    (a folder of ``<calibration_path's name less .calibration.json>-<tag>
    .calibration.json``) saved by the last suite of ``earlier`` (each suite's
    :func:`calibration_tags`, in command-line order) that has a usable one, never one of
    ``own`` tags; None without one (or without a folder). Read by ``Calibration.load`` from a
    temporary copy under the untagged name (a file it rejects, with its warning, counts as
    none)."""
    from autoplace.search.calibration import Calibration, calibration_path, same_cap_regime

    if folder is None:
        return None
    untagged = calibration_path(folder, graph, cluster)
    stem = untagged.name.removesuffix(".calibration.json")
    for tags in reversed(earlier):
        for t in tags:
            f = untagged.with_name(f"{stem}-{t}.calibration.json")
            if t not in own and not f.exists():
                f = same_cap_regime(untagged, t) or f  # a cap measured anew each run
            if t in own or not f.exists():
                continue
            tmp = tempfile.mkdtemp(prefix="autoplace-replay-cal-")
            try:
                shutil.copy(f, calibration_path(tmp, graph, cluster))
                cal = Calibration.load(tmp, graph, cluster)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            if cal.samples:
                return cal, t
    return None


CarriedLookup = Callable[[Any, Any], Any]
"""``(graph, cluster) -> (Calibration, tag) | None``: a scenario's carried calibration."""


def replay(result: dict[str, Any], profiles: str | None,
           carried: CarriedLookup | None = None,
           hf_module: str | None = None) -> list[dict[str, Any]]:
    """Every rebuilt plan of every scenario with its stored, current and measured times;
    with ``carried`` also each plan's time corrected by the scenario's carried calibration
    (``sim_carried_s``, None without one) and the calibration's tag (``carried_from``)."""
    from autoplace.search.families import family
    from autoplace.sim import simulate

    kind = base_cluster(result).devices[0].kind
    out = []
    for rec in result["scenarios"]:
        if rec["name"] not in bp.SCENARIOS:
            print(f"{rec['name']}: not a scenario of bench_plans.py, skipped")
            continue
        if bp.SCENARIOS[rec["name"]]["model"].startswith(bp.HF) and not hf_module:
            print(f"{rec['name']}: a Hugging Face model, skipped (pass --hf-module)")
            continue
        cl = scenario_cluster(result, rec)
        graph, profiled, plans = rebuild_plans(rec["name"], cl, profiles, kind, hf_module)
        found = carried(graph, cl) if carried is not None else None
        rows = []
        for r in rec["plans"]:
            src = r["planner"] if r["planner"] in plans else next(
                (x for x in r.get("same_plan_as", []) if x in plans), None)
            if src is None:
                continue
            plan = plans[src]
            sim = simulate(graph, plan, cl)
            rows.append({"planner": r["planner"], "split": plan.split(),
                         "sim_stored_s": r["sim_step_time_s"],
                         "sim_now_s": sim.step_time_s,
                         "measured_s": r["measured_step_time_s"]
                         if not r.get("oom_measured") else None,
                         "sim_peak_now_bytes": max(sim.peak_memory_bytes),
                         "measured_peak_bytes": max(r["peak_memory_bytes"])
                         if r.get("peak_memory_bytes") else None,
                         "measured_reserved_bytes": r.get("reserved_peak_bytes"),
                         "family": family(plan) + ("+recompute" if plan.recompute
                                                   or plan.selective else ""),
                         "same_split": plan.split() == r["parallel"]})
            if carried is not None:
                rows[-1]["sim_carried_s"] = (found[0].step_time(plan, sim.step_time_s)
                                             if found else None)
        sc_out = {"name": rec["name"], "profiled": profiled, "plans": rows}
        if carried is not None:
            sc_out.update(carried_from=found[1] if found else None,
                          carried_time_factors=found[0].time_factors if found else None)
        out.append({**sc_out, **fidelity(rows, carried is not None)})
    return out


def distinct_measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured rows of one scenario, a plan credited to several planners once; not a
    planner whose plan, rebuilt by today's code, has another split than the one measured
    (the hybrid DP's choice moves as the search gains options: its ZeRO-1 plan is not the
    pipeline a 2026-11-30 GNMT-4 suite measured)."""
    seen, pts = set(), []
    for r in rows:
        if r.get("same_split") is False:
            continue
        if r["measured_s"] and (r["split"], r["measured_s"]) not in seen:
            seen.add((r["split"], r["measured_s"]))
            pts.append(r)
    return pts


def fidelity(rows: list[dict[str, Any]], carried: bool = False) -> dict[str, Any]:
    """Median |sim - real| / real and Kendall tau, stored and now (and with ``carried`` the
    carried-calibrated times, None where the rows have none), over distinct measured plans
    (a plan credited to several planners counts once)."""
    from scipy.stats import kendalltau

    pts = distinct_measured(rows)
    res: dict[str, Any] = {"measured_plans": len(pts)}
    for k in ("stored", "now", "carried")[:3 if carried else 2]:
        if any(p.get(f"sim_{k}_s") is None for p in pts):
            res[f"error_{k}"] = res[f"tau_{k}"] = None
            continue
        xs = [p[f"sim_{k}_s"] for p in pts]
        ys = [p["measured_s"] for p in pts]
        res[f"error_{k}"] = (statistics.median(abs(x - y) / y for x, y in zip(xs, ys))
                             if pts else None)
        res[f"tau_{k}"] = float(kendalltau(xs, ys).statistic) if len(pts) >= 3 else None
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+",
                    help="a suite's JSON from bench_plans.py; several as JSON:TAG "
                         "for a summary over all of them")
    ap.add_argument("--profiles", default=None,
                    help="folder of per-op profiles (profile cache layout, or with --tag "
                         "*-TAG.profile.json files); default: analytic costs")
    ap.add_argument("--own-profiles", action="store_true",
                    help="each suite with the profiles/ folder beside its JSON (its run "
                         "folder's); overrides --profiles")
    ap.add_argument("--tag", default=None, help="the profiles' tag (*-TAG.profile.json)")
    ap.add_argument("--hf-module", default=None, metavar="MODULE",
                    help="module of the hf-* scenarios' model factories, as bench_plans.py's")
    ap.add_argument("--json", default=None, help="also write the replay here")
    ap.add_argument("--carried-calibration", action="store_true",
                    help="also each scenario's fidelity with the calibration (in --profiles) "
                         "saved by the most recent earlier suite on the command line")
    args = ap.parse_args(argv)
    if len(args.results) > 1 or args.carried_calibration:
        return _summary(args)
    path, tag = _path_tag(args.results[0], args.tag)
    result = read_suite(path)
    if result is None:
        return 2
    out = _replay_with(result, _profiles_of(args, path), tag, hf_module=args.hf_module)

    def ms(x):
        return f"{x * 1e3:8.2f}" if x else "       -"

    def gib(x):
        return f"{x / 2**30:6.2f}" if x else "     -"

    def f2(x):
        return f"{x:.2f}" if x is not None else "-"

    for sc in out:
        print(f"{sc['name']} ({'profiled' if sc['profiled'] else 'analytic costs'})")
        print(f"  {'planner':>16} {'stored':>8} {'now':>8} {'measured':>8}   "
              f"peak GiB now / measured")
        for r in sc["plans"]:
            flag = "" if r["same_split"] else "  (rebuilt split differs)"
            print(f"  {r['planner']:>16} {ms(r['sim_stored_s'])} {ms(r['sim_now_s'])} "
                  f"{ms(r['measured_s'])}   {gib(r['sim_peak_now_bytes'])} / "
                  f"{gib(r['measured_peak_bytes'])}{flag}")
        print(f"  {sc['measured_plans']} measured plans: median error "
              f"{f2(sc['error_stored'])} stored, {f2(sc['error_now'])} now; Kendall tau "
              f"{f2(sc['tau_stored'])} stored, {f2(sc['tau_now'])} now")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _profiles_of(args: argparse.Namespace, path: str) -> str | None:
    """The profiles folder of the suite at ``path``: its run folder's with
    ``--own-profiles`` (None where it has none), else ``--profiles``."""
    if not args.own_profiles:
        return args.profiles
    own = Path(path).parent / "profiles"
    return str(own) if own.is_dir() else None


def _suite_name(path: str) -> str:
    """A suite's name in the summary: its file's stem, or its run folder's name for a
    ``suite.json``."""
    p = Path(path)
    return p.parent.name if p.stem == "suite" else p.stem


def _path_tag(item: str, default: str | None) -> tuple[str, str | None]:
    """``RESULTS.json:TAG`` -> (path, tag); a bare path keeps ``default``."""
    path, sep, tag = item.rpartition(":")
    if sep and path.endswith(".json") and tag:
        return path, tag
    return item, default


def _replay_with(result: dict[str, Any], profiles: str | None, tag: str | None,
                 carried: CarriedLookup | None = None,
                 hf_module: str | None = None) -> list[dict[str, Any]]:
    folder = _profile_dir(profiles, tag)
    try:
        return replay(result, folder, carried, hf_module)
    finally:
        if folder is not None and folder != profiles:
            shutil.rmtree(folder, ignore_errors=True)


def _summary(args: argparse.Namespace) -> int:
    """One line per scenario of several suites, and the totals over all of them."""
    rows: list[tuple[str, dict[str, Any]]] = []
    earlier: list[list[str]] = []  # the calibration tags of the suites replayed so far
    for item in args.results:
        path, tag = _path_tag(item, args.tag)
        result = read_suite(path)
        if result is None:
            return 2
        own = calibration_tags(tag, int(result["num_devices"]))
        carried = (functools.partial(carried_calibration, args.profiles, earlier=list(earlier),
                                     own=own)
                   if args.carried_calibration else None)
        for sc in _replay_with(result, _profiles_of(args, path), tag, carried, args.hf_module):
            rows.append((_suite_name(path), sc))
        earlier.append(own)

    def f(x, spec):
        return format(x, spec) if x is not None else "-"

    cc = args.carried_calibration
    print(f"{'suite':>32} {'scenario':>13} {'plans':>5}  error stored / now   tau stored / now"
          + ("   error / tau carried  from" if cc else ""))
    for name, sc in rows:
        print(f"{name:>32} {sc['name']:>13} {sc['measured_plans']:>5}  "
              f"{f(sc['error_stored'], '6.3f')} / {f(sc['error_now'], '6.3f')}   "
              f"{f(sc['tau_stored'], '5.2f')} / {f(sc['tau_now'], '5.2f')}"
              + (f"   {f(sc['error_carried'], '6.3f'):>6} / {f(sc['tau_carried'], '5.2f'):>5}"
                 f"        {sc['carried_from'] or '-'}" if cc else ""))

    def totals(label: str, k: str, scs: list[dict[str, Any]]) -> None:
        errs = [abs(p[f"sim_{k}_s"] - p["measured_s"]) / p["measured_s"]
                for sc in scs for p in distinct_measured(sc["plans"])]
        taus = [sc[f"tau_{k}"] for sc in scs if sc[f"tau_{k}"] is not None]
        print(f"{label}: median error {f(statistics.median(errs) if errs else None, '.3f')} over "
              f"{len(errs)} measured plans; mean Kendall tau {f(statistics.mean(taus) if taus else None, '.3f')} "
              f"over {len(taus)} scenarios, {sum(t >= 0.8 for t in taus)} of them >= 0.8")

    for k in ("stored", "now"):
        totals(k, k, [sc for _, sc in rows])
    if cc:
        with_cal = [sc for _, sc in rows if sc["carried_from"]]
        print(f"the {len(with_cal)} of {len(rows)} scenarios with an earlier suite's "
              "calibration:")
        totals("  uncalibrated (now)", "now", with_cal)
        totals("  carried calibration", "carried", with_cal)
    if args.json:
        Path(args.json).write_text(json.dumps([{"suite": n, **sc} for n, sc in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
