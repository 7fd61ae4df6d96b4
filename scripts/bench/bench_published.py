"""Predicted vs published: torchtitan's Llama 3.1 runs (8 to 512 H100s) through ``sim.mesh``.

    python scripts/bench/bench_published.py --out bench/results/2026-11-29-cpux1-published-torchtitan
    python scripts/bench/bench_published.py --rows t1-fsdp,t1-compile,t3-fsdp --out /tmp/x

Reads ``bench/published/torchtitan-llama3.json`` (every row of torchtitan's
``docs/performance.md`` with its source), skips the rows marked ``excluded`` (context
parallelism, the interleaved schedule), captures each model on the meta device at the
row's sequence length, and predicts tokens/s per GPU and peak memory per GPU of the row's
configuration on the ``h100-96x8-n<nodes>`` preset (Grand Teton's 96 GB H100s, NVLink in
a host, 400 Gb/s per GPU between hosts) with :func:`autoplace.sim.mesh.estimate_config`.

The fit is kept honest: the constants of :class:`~autoplace.sim.mesh.MeshFit` are fitted
on the file's ``fit_rows`` only, one constant per row kind (``compute_scale`` on plain
FSDP, ``compile_elementwise`` / ``compile_activation`` on the torch.compile row,
``float8_speedup`` on the Float8 row, ``memory_overhead_bytes`` on plain FSDP's memory),
and errors are reported separately for the fitted rows and for the held-out rest, with,
per table, Kendall's tau between the predicted and the published order. Writes
``published.json``, ``published.md`` and ``published.png`` (predicted vs published) in
the output folder, with ``env.json`` and ``run.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from results import write_run
from run_folder import output_folder
from scipy.optimize import brentq, lsq_linear
from scipy.stats import kendalltau

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.sim.mesh import BlockTable, MeshConfig, MeshFit, block_table, estimate_config

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "bench" / "published" / "torchtitan-llama3.json"
GiB = 2**30


def load_rows(path: Path, ids: list[str] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The file and its rows to evaluate (not excluded; only ``ids`` when given)."""
    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if r["excluded"] is None]
    if ids:
        known = {r["id"] for r in doc["rows"]}
        unknown = sorted(set(ids) - known)
        if unknown:
            raise SystemExit(f"unknown row id(s) {unknown}; valid: {', '.join(sorted(known))}")
        rows = [r for r in rows if r["id"] in ids]
    return doc, rows


def cluster_of(row: dict[str, Any]):
    """The preset matching the row's hosts: ``h100-96x8-n<gpus / 8>``."""
    return preset(f"h100-96x8-n{max(1, row['gpus'] // 8)}")


def config_of(row: dict[str, Any], table: BlockTable) -> MeshConfig:
    """The row's configuration: FSDP over ``fsdp`` ranks, tp, pp stages split evenly by
    blocks (torchtitan's default split), the row's checkpointing on every block."""
    par, nb = row["parallel"], table.num_blocks
    pp = par["pp"]
    return MeshConfig(data=par["fsdp"], tensor=par["tp"], pipeline=pp,
                      microbatches=par["microbatches"], schedule=par["schedule"] or "1f1b",
                      shard="fsdp", stage_of_block=tuple(i * pp // nb for i in range(nb)),
                      ac_of_block=(row["activation_checkpointing"],) * nb,
                      compile=row["compile"], batch_size=row["global_batch"],
                      sequence_parallel=par["tp"] > 1)


class Predictor:
    """Captures each (model, sequence length) once and predicts rows under a fit."""

    def __init__(self) -> None:
        self.tables: dict[tuple[str, int, str], BlockTable] = {}
        self.capture_s: dict[str, float] = {}

    def table(self, row: dict[str, Any]) -> BlockTable:
        cluster = cluster_of(row)
        key = (row["model"], row["seq_len"], cluster.devices[0].kind)
        if key not in self.tables:
            t0 = time.perf_counter()
            wl = workloads.get(row["model"], device="meta", seq_len=row["seq_len"])
            graph = capture_workload(wl)
            self.capture_s[f"{row['model']}@{row['seq_len']}"] = time.perf_counter() - t0
            self.tables[key] = block_table(graph, cluster)
        return self.tables[key]

    def predict(self, row: dict[str, Any], fit: MeshFit) -> tuple[float, float]:
        """(tokens/s per GPU, peak GiB per GPU)."""
        table = self.table(row)
        res = estimate_config(table, config_of(row, table), cluster_of(row), fit=fit,
                              float8=row["float8"], async_tp=row["async_tp"])
        return res.tokens_per_s_per_gpu, res.peak_memory_bytes / GiB


def _solve(fn, lo: float, hi: float) -> float:
    """The root of ``fn`` in ``[lo, hi]``, or the end nearer to it when the sign holds."""
    a, b = fn(lo), fn(hi)
    if a * b > 0:
        return lo if abs(a) < abs(b) else hi
    return float(brentq(fn, lo, hi, xtol=1e-6))


def fit_constants(pred: Predictor, rows: list[dict[str, Any]]) -> tuple[MeshFit, dict]:
    """Each constant from the fit rows of its kind (the median of their solutions)."""
    fit = MeshFit()
    used: dict[str, list[str]] = {}

    def solve(name: str, pick, metric: int, lo: float, hi: float, additive: bool = False):
        nonlocal fit
        chosen = [r for r in rows if pick(r)]
        if not chosen:
            return
        sols = []
        for r in chosen:
            target = r["tokens_per_s_per_gpu"] if metric == 0 else r["memory_gib"]
            if additive:
                base = pred.predict(r, MeshFit(**{**fit.__dict__, name: 0.0}))[metric]
                sols.append((target - base) * GiB)
            else:
                sols.append(_solve(lambda x, r=r, t=target: pred.predict(
                    r, MeshFit(**{**fit.__dict__, name: x}))[metric] / t - 1.0, lo, hi))
        fit = MeshFit(**{**fit.__dict__, name: statistics.median(sols)})
        used[name] = [r["id"] for r in chosen]

    def plain(r):
        return not r["compile"] and not r["float8"]

    def compiled(r):
        return r["compile"] and not r["float8"]

    solve("compute_scale", plain, 0, 0.2, 20.0)
    solve("compile_elementwise", compiled, 0, 0.0, 3.0)
    solve("float8_speedup", lambda r: r["float8"] and not r["async_tp"], 0, 0.3, 6.0)
    return fit_memory(pred, rows, fit, used)


#: memory constants, fitted together (memory is affine in each), with their physical ranges:
#: a share of the counted activations, a non-negative overhead up to 16 GiB, compile keeping
#: at most what eager keeps
MEMORY_CONSTANTS = {"activation_scale": (0.0, 2.0), "memory_overhead_bytes": (0.0, 16 * GiB),
                    "compile_activation": (0.0, 1.0)}


def fit_memory(pred: Predictor, rows: list[dict[str, Any]], fit: MeshFit,
               used: dict[str, list[str]]) -> tuple[MeshFit, dict[str, list[str]]]:
    """The memory constants by bounded least squares over the fit rows' peaks (a constant
    no row tells apart, such as compile's without a compiled row, keeps its neutral value)."""
    names = [n for n in MEMORY_CONSTANTS if n != "compile_activation"
             or any(r["compile"] for r in rows)]
    if not rows:
        return fit, used
    zero = {n: 0.0 for n in names}

    def mem(r, values):
        return pred.predict(r, replace(fit, **values))[1] * GiB

    base = [mem(r, zero) for r in rows]
    cols = [[mem(r, {**zero, n: 1.0}) - b for r, b in zip(rows, base)] for n in names]
    a = np.array(cols).T
    rhs = np.array([r["memory_gib"] * GiB - b for r, b in zip(rows, base)])
    keep = [i for i in range(len(names)) if np.abs(a[:, i]).max() > 0][:len(rows)]
    bounds = np.array([MEMORY_CONSTANTS[names[i]] for i in keep]).T
    scale = np.array([GiB if names[i].endswith("bytes") else 1.0 for i in keep])
    sol = lsq_linear(a[:, keep] * scale, rhs, bounds=(bounds[0] / scale, bounds[1] / scale)
                     ).x * scale
    values = {names[i]: float(v) for i, v in zip(keep, sol)}
    for n in values:
        used[n] = [r["id"] for r in rows]
    return replace(fit, **values), used


def tau(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau of two orders (None below two rows or when one side is all ties)."""
    if len(xs) < 2:
        return None
    value = kendalltau(xs, ys).statistic
    return None if value != value else float(value)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median absolute relative errors (fit and held-out), and per-table Kendall tau."""
    out: dict[str, Any] = {}
    for part in ("fit", "held_out"):
        sel = [r for r in rows if r["part"] == part]
        for key in ("throughput", "memory"):
            errs = [abs(r[f"{key}_error"]) for r in sel]
            out[f"{part}_{key}_median_abs_error"] = statistics.median(errs) if errs else None
        out[f"{part}_rows"] = [r["id"] for r in sel]
        plan = [r for r in sel if r["in_plan_space"]]
        errs = [abs(r["throughput_error"]) for r in plan]
        out[f"{part}_in_plan_space_throughput_median_abs_error"] = (
            statistics.median(errs) if errs else None)
    tables = {}
    for t in sorted({r["table"] for r in rows}):
        sel = [r for r in rows if r["table"] == t]
        tables[t] = {"rows": [r["id"] for r in sel],
                     "throughput_tau": tau([r["pred_tokens_per_s_per_gpu"] for r in sel],
                                           [r["tokens_per_s_per_gpu"] for r in sel]),
                     "memory_tau": tau([r["pred_memory_gib"] for r in sel],
                                       [r["memory_gib"] for r in sel])}
    out["tables"] = tables
    return out


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], fit: MeshFit,
             used: dict[str, list[str]]) -> str:
    lines = ["# torchtitan's published Llama 3.1 runs vs autoplace's mesh model", "",
             "| row | table | GPUs | techniques | part | published TPS/GPU | predicted | "
             "error | published GiB | predicted | error |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['id']} | {r['table']} | {r['gpus']} | {', '.join(r['techniques'])} | "
            f"{r['part']} | {r['tokens_per_s_per_gpu']:,} | "
            f"{r['pred_tokens_per_s_per_gpu']:,.0f} | {r['throughput_error']:+.1%} | "
            f"{r['memory_gib']} | {r['pred_memory_gib']:.1f} | {r['memory_error']:+.1%} |")
    lines += ["", "Fitted constants (rows they were fitted on):", ""]
    for name, value in fit.__dict__.items():
        shown = f"{value / GiB:.2f} GiB" if name.endswith("bytes") else f"{value:.3f}"
        lines.append(f"- `{name}` = {shown} ({', '.join(used.get(name, [])) or 'not fitted'})")
    lines += ["", "| part | median abs error, throughput | median abs error, memory |",
              "|---|---:|---:|"]
    for part in ("fit", "held_out"):
        t, m = (summary[f"{part}_{k}_median_abs_error"] for k in ("throughput", "memory"))
        lines.append(f"| {part} | {'-' if t is None else f'{t:.1%}'} | "
                     f"{'-' if m is None else f'{m:.1%}'} |")
    lines += ["", "| table | rows | Kendall tau, throughput | Kendall tau, memory |",
              "|---|---|---:|---:|"]
    for t, v in summary["tables"].items():
        lines.append(f"| {t} | {', '.join(v['rows'])} | {_signed(v['throughput_tau'])} | "
                     f"{_signed(v['memory_tau'])} |")
    return "\n".join(lines) + "\n"


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, pub, pre, label, log in (
            (axes[0], "tokens_per_s_per_gpu", "pred_tokens_per_s_per_gpu", "tokens/s per GPU",
             True),
            (axes[1], "memory_gib", "pred_memory_gib", "peak memory per GPU (GiB)", False)):
        for part, marker in (("fit", "s"), ("held_out", "o")):
            sel = [r for r in rows if r["part"] == part]
            ax.scatter([r[pub] for r in sel], [r[pre] for r in sel], marker=marker, label=part)
            for r in sel:
                ax.annotate(r["id"], (r[pub], r[pre]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        values = [r[k] for r in rows for k in (pub, pre)]
        lo, hi = min(values) * 0.8, max(values) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"published {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend()
    fig.suptitle("torchtitan Llama 3.1 on H100s: autoplace sim.mesh vs published")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--published", default=str(PUBLISHED), help="published rows (JSON)")
    ap.add_argument("--rows", default=None, help="comma-separated row ids (default: all)")
    ap.add_argument("--out", default=None, help="output folder (default: a new run folder)")
    ap.add_argument("--no-plot", action="store_true", help="skip the picture")
    args = ap.parse_args(argv)
    doc, rows = load_rows(Path(args.published), args.rows.split(",") if args.rows else None)
    folder = output_folder(args.out, "published-torchtitan", card="cpu", gpus=1,
                           notes="predictions on CPU; the published runs' machines are in "
                                 "bench/published/torchtitan-llama3.json")
    pred = Predictor()
    fit_rows = [r for r in rows if r["id"] in doc["fit_rows"]]
    t0 = time.perf_counter()
    fit, used = fit_constants(pred, fit_rows)
    out_rows = []
    for r in rows:
        tps, mem = pred.predict(r, fit)
        out_rows.append({**{k: r[k] for k in ("id", "table", "row", "model", "gpus",
                                              "techniques", "in_plan_space",
                                              "tokens_per_s_per_gpu", "memory_gib")},
                         "part": "fit" if r in fit_rows else "held_out",
                         "pred_tokens_per_s_per_gpu": tps, "pred_memory_gib": mem,
                         "throughput_error": tps / r["tokens_per_s_per_gpu"] - 1.0,
                         "memory_error": mem / r["memory_gib"] - 1.0})
    summary = summarise(out_rows)
    result = {"published": str(Path(args.published).resolve().relative_to(ROOT))
              if Path(args.published).resolve().is_relative_to(ROOT) else args.published,
              "fit": {k: float(v) for k, v in fit.__dict__.items()}, "fitted_on": used,
              "capture_s": pred.capture_s, "seconds": time.perf_counter() - t0,
              "summary": summary, "rows": out_rows}
    (folder / "published.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(out_rows, summary, fit, used)
    (folder / "published.md").write_text(text)
    if not args.no_plot:
        plot(out_rows, folder / "published.png")
    held_t = summary["held_out_throughput_median_abs_error"]
    held_m = summary["held_out_memory_median_abs_error"]
    write_run(folder, tag="published-torchtitan", scenarios=["published:torchtitan-llama3"],
              summary=f"sim.mesh vs torchtitan's published Llama 3.1 runs ({len(out_rows)} rows, "
                      f"{len(fit_rows)} fitted): held-out median error "
                      + (f"{held_t:.1%} throughput, {held_m:.1%} memory" if held_t is not None
                         else "n/a (no held-out row)"),
              kind="experiment", script="scripts/bench/bench_published.py")
    print(text)
    print(f"wrote {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
