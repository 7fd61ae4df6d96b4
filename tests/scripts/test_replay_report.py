"""scripts/bench/replay_report.py: the levers rows' simulated peaks before a change come from
the earlier run's ``replay.json`` (its functions run in a process of their own, beside the
script, as the bench scripts import each other by module name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import BENCH, pythonpath_with_root

CHECK = """
import json, sys
from pathlib import Path
import replay_report

def row(option, sim_gib, recipe="eager"):
    return {"run": "r", "case": "c", "option": option, "recipe": recipe, "family": "single",
            "measured_peak_gib": 2.0, "measured_reserved_gib": None, "sim_peak_gib": sim_gib}

folder = Path(sys.argv[1])
prev = replay_report.levers_before(folder)
pts = replay_report.memory_points([], [row("hand:eager", 1.9), row("new", 1.0, "compile-blocks")],
                                  prev)
print(json.dumps({"prev": [[list(k), v] for k, v in prev.items()],
                  "missing": replay_report.levers_before(folder / "missing"),
                  "before": [p["before"] for p in pts],
                  "text": replay_report.markdown([], pts, [], [], None)}))
"""


def test_levers_peaks_before_are_matched_by_run_case_and_option(tmp_path):
    rows = [{"run": "r", "case": "c", "option": o, "recipe": "eager", "family": "single",
             "measured_peak_gib": 2.0, "measured_reserved_gib": None, "sim_peak_gib": g}
            for o, g in (("hand:eager", 1.5), ("gone", 9.0))]
    (tmp_path / "replay.json").write_text(json.dumps({"levers": rows}))
    p = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], cwd=BENCH,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert dict((tuple(k), v) for k, v in out["prev"]) == {
        ("r", "c", "hand:eager"): 1.5 * 2**30, ("r", "c", "gone"): 9.0 * 2**30}
    assert out["missing"] == {}
    assert out["before"] == [1.5 * 2**30, None]
    # now 1.9 of 2.0 within 10%, 1.0 not; before 1.5 not
    assert "Within 10% of allocated: 1 of 2 plans (before: 0 of the 1 simulated then)." \
        in out["text"]


STALE = """
import json, sys
from pathlib import Path
import replay_report

root = Path(sys.argv[1])
for name, commit in (("old", "a572b63+dirty"), ("new", replay_report.DDP_KEEPS_BUCKETS),
                     ("unknown", "")):
    (root / name).mkdir()
    (root / name / "env.json").write_text(json.dumps({"commit": commit}))

def plan(family):
    return {"planner": family, "family": family, "split": family, "measured_s": 1.0,
            "sim_now_s": 1.0, "measured_peak_bytes": 2**30, "measured_reserved_bytes": None,
            "sim_peak_now_bytes": 2**30, "sim_peak_before_bytes": None, "same_split": True}

scs = [{"suite": name, "name": "x", "ddp_rebuilt_buckets": replay_report.ddp_rebuilt_buckets(
            root / name),
        "plans": [plan(f) for f in ("dp-none", "dp-none+zero1+recompute", "dp-fsdp",
                                    "dp-none+placement")]} for name in ("old", "new")]
pts = replay_report.memory_points(scs, [])
print(json.dumps({"rebuilt": [replay_report.ddp_rebuilt_buckets(root / n)
                              for n in ("old", "new", "unknown")],
                  "stale": [(p["name"], p["stale"]) for p in pts]}))
"""


def test_ddp_peaks_of_suites_run_while_ddp_rebuilt_its_buckets_are_left_out(tmp_path):
    """A suite run before the executor kept DDP's first gradient buckets measured DDP's
    peak with the gradients twice: its DDP and ZeRO-1 plans (recomputing or not) are marked
    stale, and the memory tables leave them out; FSDP2 and a placement's replicas (not
    DDP-wrapped) stay, as do every plan of a suite run since."""
    p = subprocess.run([sys.executable, "-c", STALE, str(tmp_path)], cwd=BENCH,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rebuilt"] == [True, False, True]
    stale = {name.split(" (")[0]: s for name, s in out["stale"]}
    assert stale == {"old x dp-none": True, "old x dp-none+zero1+recompute": True,
                     "old x dp-fsdp": False, "old x dp-none+placement": False,
                     "new x dp-none": False, "new x dp-none+zero1+recompute": False,
                     "new x dp-fsdp": False, "new x dp-none+placement": False}
