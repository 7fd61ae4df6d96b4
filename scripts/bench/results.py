"""Benchmark run folders: ``bench/results/<date>-<card>x<n>-<tag>/``.

Every benchmark run lives in a folder of its own holding its tables (``.md`` / ``.json``),
plots, log, an ``env.json`` (where and on what it ran) and a ``run.json`` (what it is).
``scripts/bench/results_index.py`` reads them back into ``bench/results/index.json``.

A benchmark script writes a run like this::

    from results import new_run_dir, write_env, write_run

    out = new_run_dir("2026-11-28", "NVIDIA H200", 2, "suite-capped")
    ...  # tables, plots, log into ``out``
    write_env(out, commit="bdebc21")  # the rest detected: torch, driver, card, gpus, host
    write_run(out, tag="suite-capped", scenarios=["gpt1b-16GB"], summary="...")

Standard library only, so that it imports without torch.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "ENV_KEYS", "card_slug", "run_dir_name", "new_run_dir", "detect_env",
           "write_env", "write_run", "suite_headline", "read_run"]

#: The folder that holds every run folder.
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
#: Keys every env.json has (None where unknown).
ENV_KEYS = ("commit", "torch", "driver", "card", "gpus", "host", "date")
_TAG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def card_slug(card: str | None) -> str:
    """The short lower-case name of a device model used in folder names.

    Args:
        card: a device name as torch or nvidia-smi report it ("NVIDIA H200"), or None / "cpu".

    Returns:
        "h200" for "NVIDIA H200", "cpu" for a CPU or an unknown device.
    """
    if not card or card.lower() == "cpu":
        return "cpu"
    words = [w for w in re.split(r"[^A-Za-z0-9]+", card) if w and w.lower() not in
             ("nvidia", "geforce", "tesla", "amd", "instinct", "sxm", "pcie", "nvl")]
    return (words[0] if words else "gpu").lower()


def run_dir_name(date: str, card: str | None, gpus: int, tag: str) -> str:
    """The folder name of a run: ``<date>-<card>x<n>-<tag>``.

    Args:
        date: the day the run started, ``YYYY-MM-DD``.
        card: the device model ("NVIDIA H200"; None or "cpu" for CPU runs).
        gpus: devices used (1 for a CPU run).
        tag: what ran, lower-case words joined by dashes ("suite-capped", "host-costs").

    Raises:
        ValueError: for a malformed date or tag, or fewer than one device.
    """
    if not _DATE.fullmatch(date):
        raise ValueError(f"date must be YYYY-MM-DD, got {date!r}")
    if not _TAG.fullmatch(tag):
        raise ValueError(f"tag must be lower-case words joined by '-', got {tag!r}")
    if gpus < 1:
        raise ValueError(f"a run uses at least one device, got gpus={gpus}")
    return f"{date}-{card_slug(card)}x{gpus}-{tag}"


def new_run_dir(date: str, card: str | None, gpus: int, tag: str, *,
                root: Path | str = RESULTS) -> Path:
    """Create and return a new, empty run folder under ``root``.

    A run of the same name that already exists is never overwritten: the new folder
    then gets a ``-2``, ``-3``, ... suffix.

    Args:
        date: ``YYYY-MM-DD``.
        card: device model, as for :func:`run_dir_name`.
        gpus: devices used.
        tag: what ran.
        root: the results folder (``bench/results`` by default).

    Returns:
        The created folder.
    """
    name = run_dir_name(date, card, gpus, tag)
    path, n = Path(root) / name, 1
    while path.exists():
        n += 1
        path = Path(root) / f"{name}-{n}"
    path.mkdir(parents=True)
    return path


def _run(cmd: list[str]) -> str | None:
    """A command's stripped output, None where it is missing or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def detect_env() -> dict[str, Any]:
    """What this machine can tell about itself, None for what it cannot.

    Returns:
        ``commit`` (git's short HEAD, with ``+dirty`` for uncommitted changes), ``torch``
        (the installed distribution's version), ``driver``, ``card`` and ``gpus`` (from
        ``nvidia-smi``; card "cpu" and gpus 1 without it), ``host`` (platform and CPU),
        ``date`` (today, UTC).
    """
    commit = _run(["git", "rev-parse", "--short", "HEAD"])
    if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += "+dirty"
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    rows = [r.split(", ") for r in smi.splitlines()] if smi else []
    return {"commit": commit, "torch": torch,
            "driver": rows[0][1] if rows else None,
            "card": rows[0][0] if rows else "cpu",
            "gpus": len(rows) or 1,
            "host": f"{platform.system()} {platform.machine()} {platform.processor()}".strip(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")}


def _write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")
    return path


def write_env(run_dir: Path | str, *, detect: bool = True, **fields: Any) -> Path:
    """Write ``env.json``: where and with what a run ran.

    Args:
        run_dir: the run's folder.
        detect: fill what ``fields`` leaves out from :func:`detect_env`.
        **fields: values for :data:`ENV_KEYS` (an explicit None stays None) and any extra
            keys (``time``, ``notes``, ...).

    Returns:
        The path written.
    """
    env: dict[str, Any] = dict.fromkeys(ENV_KEYS)
    if detect:
        env.update(detect_env())
    env.update(fields)
    return _write_json(Path(run_dir) / "env.json", env)


def write_run(run_dir: Path | str, *, tag: str, scenarios: list[str], summary: str,
              headline: list[dict[str, Any]] | None = None, **extra: Any) -> Path:
    """Write ``run.json``: what a run is, for the index.

    Args:
        run_dir: the run's folder.
        tag: what ran (the folder name's last part).
        scenarios: the scenario names it measured; the newest run of each scenario on a
            card and device count is the current one.
        summary: one line.
        headline: headline metrics (a suite's are derived from its ``suite.json`` when
            left out).
        **extra: other keys (``kind``, ``script``, ...).

    Returns:
        The path written.
    """
    if not summary or "\n" in summary:
        raise ValueError("summary must be one non-empty line")
    run = {"tag": tag, "scenarios": list(scenarios), "summary": summary, **extra}
    if headline is not None:
        run["headline"] = headline
    return _write_json(Path(run_dir) / "run.json", run)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def suite_headline(suite: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scenario of a ``scripts/bench/bench_plans.py`` result: the best hand-written option,
    auto's plan, and how they compare.

    Args:
        suite: the suite's JSON.

    Returns:
        One dict per scenario: ``scenario``, ``best_hand_written``, ``best_hand_written_ms``,
        ``auto_plan``, ``auto_ms``, ``auto_vs_best``, ``auto_vs_lower_bound``,
        ``sim_error_median`` (None where the suite lacks it).
    """
    rows = []
    for sc in suite.get("scenarios", []):
        auto = next((p for p in sc.get("plans", []) if p.get("planner") == "auto"), {})
        ratio, bound = sc.get("auto_vs_best_manual"), sc.get("auto_vs_lower_bound")
        err = sc.get("sim_error_median")
        rows.append({"scenario": sc.get("name"), "best_hand_written": sc.get("best_manual"),
                     "best_hand_written_ms": _ms(sc.get("best_manual_s")),
                     "auto_plan": auto.get("parallel"),
                     "auto_ms": _ms(auto.get("measured_step_time_s")),
                     "auto_vs_best": None if ratio is None else round(ratio, 2),
                     "auto_vs_lower_bound": None if bound is None else round(bound, 2),
                     "sim_error_median": None if err is None else round(err, 3)})
    return rows


def read_run(run_dir: Path | str) -> dict[str, Any]:
    """A run folder as one index entry: env.json and run.json merged.

    A suite's headline comes from its ``suite.json`` when run.json has none.

    Args:
        run_dir: the run's folder.

    Returns:
        ``dir`` (the folder's name), the env keys, then the run keys.

    Raises:
        FileNotFoundError: where env.json or run.json is missing.
    """
    d = Path(run_dir)
    env = json.loads((d / "env.json").read_text())
    run = json.loads((d / "run.json").read_text())
    if "headline" not in run and (d / "suite.json").exists():
        run["headline"] = suite_headline(json.loads((d / "suite.json").read_text()))
    return {"dir": d.name, **{k: env.get(k) for k in ENV_KEYS},
            **{k: v for k, v in env.items() if k not in ENV_KEYS}, **run}
