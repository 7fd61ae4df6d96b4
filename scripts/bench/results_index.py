"""Rebuild the index of benchmark runs and the tables generated from it.

    python scripts/bench/results_index.py            # rewrite the three files below
    python scripts/bench/results_index.py --check    # exit 1 where one is out of date

Reads every run folder of ``bench/results/`` (its ``env.json`` and ``run.json``, see
``scripts/bench/results.py``) and writes:

* ``bench/results/index.json``: one entry per run, newest first; ``current`` marks a run
  that is the newest of at least one of its scenarios on its card and device count;
* ``bench/README.md``: every run in a table, current ones marked, and the headline of
  every current suite;
* the headline results table of ``README.md``, between ``<!-- results:begin -->`` and
  ``<!-- results:end -->``.

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from results import RESULTS, card_slug, read_run  # beside this script

__all__ = ["load_runs", "mark_current", "index_json", "bench_readme", "readme_table",
           "replace_between", "main"]

ROOT = RESULTS.parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
_FIRST = ("dir", "date", "card", "gpus", "tag", "scenarios", "commit", "torch", "driver",
          "host", "summary", "headline", "current", "current_scenarios")


def _order(run: dict[str, Any]) -> tuple[str, str, str]:
    """Chronological sort key: date, then start time (or when its results were added)."""
    return (run["date"] or "", run.get("time") or (run.get("added_at") or "")[11:16],
            run["dir"])


def mark_current(runs: list[dict[str, Any]]) -> None:
    """Set ``current_scenarios`` (those no later run on the same card and device count
    measured again) and ``current`` (any) on every run, in place."""
    newest: dict[tuple[str, Any, str], str] = {}
    for run in sorted(runs, key=_order):
        for sc in run.get("scenarios") or []:
            newest[(card_slug(run["card"]), run["gpus"], sc)] = run["dir"]
    for run in runs:
        key = (card_slug(run["card"]), run["gpus"])
        run["current_scenarios"] = [sc for sc in run.get("scenarios") or []
                                    if newest[(*key, sc)] == run["dir"]]
        run["current"] = bool(run["current_scenarios"])


def load_runs(root: Path | str = RESULTS) -> list[dict[str, Any]]:
    """Every run folder under ``root`` as an index entry, newest first, current marked.

    Args:
        root: the results folder.

    Returns:
        The entries; keys in a fixed order (``dir``, ``date``, ``card`` ... then the rest).
    """
    runs = [read_run(d) for d in sorted(Path(root).iterdir())
            if d.is_dir() and (d / "env.json").exists()]
    mark_current(runs)
    runs.sort(key=_order, reverse=True)
    return [{**{k: r.get(k) for k in _FIRST}, **{k: v for k, v in r.items() if k not in _FIRST}}
            for r in runs]


def index_json(runs: list[dict[str, Any]]) -> str:
    """The text of ``index.json``."""
    return json.dumps(runs, indent=1, allow_nan=False) + "\n"


def _card(run: dict[str, Any]) -> str:
    slug = card_slug(run["card"])
    return "CPU" if slug == "cpu" else f"{run['gpus']}x {slug.upper()}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


#: Scenarios of the benchmark suite in the order tables show them; others follow by name.
SCENARIO_ORDER = ("gpt1b-16GB", "gpt1b", "gnmt4-capped", "branchy-mlp", "inception")


def _row_order(item: tuple[dict[str, Any], dict[str, Any]]) -> tuple[Any, ...]:
    run, h = item
    sc = h["scenario"] or ""
    known = sc in SCENARIO_ORDER
    return (card_slug(run["card"]), run["gpus"], not known,
            SCENARIO_ORDER.index(sc) if known else 0, sc)


def _headline_rows(runs: list[dict[str, Any]], link: str) -> list[str]:
    """Table rows of the current scenarios of every current run with a headline, by
    card, device count and scenario."""
    items = [(run, h) for run in runs for h in run.get("headline") or []
             if h["scenario"] in run["current_scenarios"]]
    rows = []
    for run, h in sorted(items, key=_row_order):
        ratio = "-" if h["auto_vs_best"] is None else f"**{h['auto_vs_best']:.2f}**"
        rows.append(f"| {h['scenario']} | {_card(run)} | {h['best_hand_written'] or '-'} "
                    f"{_ms(h['best_hand_written_ms'])} | {h['auto_plan'] or '-'}, "
                    f"{_ms(h['auto_ms'])} | {ratio} | [{run['date']}]({link}{run['dir']}/) |")
    return rows


_HEAD = ("| scenario | devices | best hand-written | autoplace `--planner auto` | auto / best "
         "| run |\n|---|---|---|---|---|---|")


def readme_table(runs: list[dict[str, Any]]) -> str:
    """The headline table for README.md (without the markers)."""
    return "\n".join([
        "Measured step times; each row is the newest run of its scenario (card, commit and "
        "torch in the run's `env.json`).", "", _HEAD,
        *_headline_rows(runs, "bench/results/"), "",
        "Scenarios, simulator error and hand-written references: "
        "[docs/results.md](docs/results.md); every run: [bench/README.md](bench/README.md)."])


def bench_readme(runs: list[dict[str, Any]]) -> str:
    """The text of ``bench/README.md``."""
    lines = [
        "# Benchmark results", "",
        "<!-- generated by scripts/bench/results_index.py from each run's env.json and "
        "run.json; do not edit -->", "",
        "One folder per run, `results/<date>-<card>x<devices>-<tag>/`: its tables (`.md`, "
        "`.json`), plots, log, `env.json` (commit, torch, driver, card, gpus, host, date) and "
        "`run.json` (tag, scenarios, summary). A suite's `profiles/` holds the per-op "
        "profiles and auto's calibrations it used, in the profile cache's layout "
        "(`autoplace plan --profile-dir`, `scripts/bench/replay_suite.py --profiles`). "
        "`results/index.json` lists every run; a run is *current* when no later run on the "
        "same card and device count measured one of its scenarios again. Figures from "
        "different cards or runs are not comparable.", "",
        "A benchmark script makes a run folder with `new_run_dir` and `write_env` / "
        "`write_run` of `scripts/bench/results.py`; then "
        "`python scripts/bench/results_index.py` rebuilds the index, this page and the "
        "README's table.", "",
        "## Current headline", "", _HEAD, *_headline_rows(runs, "results/"), "",
        "## Every run", "",
        "| run | devices | commit | torch | what | current |", "|---|---|---|---|---|---|"]
    for run in runs:
        mark = "yes" if run["current"] else ""
        lines.append(f"| [{run['dir']}](results/{run['dir']}/) | {_card(run)} | "
                     f"{run['commit'] or '-'} | {run['torch'] or '-'} | {run['summary']} | "
                     f"{mark} |")
    return "\n".join(lines) + "\n"


def replace_between(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with what lies between the markers ``begin`` and ``end`` replaced by
    ``block``.

    Raises:
        ValueError: where the markers are missing or out of order.
    """
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"README.md needs the markers {begin} and {end}, in that order")
    return text[:i + len(begin)] + "\n" + block.strip("\n") + "\n" + text[j:]


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) index.json, bench/README.md and README.md."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 where a generated file is out of date")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root")
    args = ap.parse_args(argv)
    results = args.root / "bench" / "results"
    runs = load_runs(results)
    readme = args.root / "README.md"
    outputs = {results / "index.json": index_json(runs),
               args.root / "bench" / "README.md": bench_readme(runs),
               readme: replace_between(readme.read_text(), readme_table(runs))}
    stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(args.root)} "
                  "(run python scripts/bench/results_index.py)")
        return 1 if stale else 0
    for p in stale:
        p.write_text(outputs[p])
        print(f"wrote {p.relative_to(args.root)}")
    print(f"{len(runs)} runs, {sum(r['current'] for r in runs)} current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
