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
