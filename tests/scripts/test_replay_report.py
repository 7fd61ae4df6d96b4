"""scripts/bench/replay_report.py: the levers rows' simulated peaks before a change come from
the earlier run's ``replay.json``."""

from __future__ import annotations

import json
import sys

from tests.helpers import BENCH

sys.path.insert(0, str(BENCH))
import replay_report  # noqa: E402  (the bench scripts import each other by module name)


def _row(option: str, sim_gib: float, recipe: str = "eager") -> dict:
    return {"run": "r", "case": "c", "option": option, "recipe": recipe, "family": "single",
            "measured_peak_gib": 2.0, "measured_reserved_gib": None, "sim_peak_gib": sim_gib}


def test_levers_peaks_before_are_matched_by_run_case_and_option(tmp_path):
    (tmp_path / "replay.json").write_text(json.dumps(
        {"levers": [_row("hand:eager", 1.5), _row("gone", 9.0)]}))
    prev = replay_report.levers_before(tmp_path)
    assert prev == {("r", "c", "hand:eager"): 1.5 * 2**30, ("r", "c", "gone"): 9.0 * 2**30}
    assert replay_report.levers_before(tmp_path / "missing") == {}
    pts = replay_report.memory_points([], [_row("hand:eager", 1.9), _row("new", 1.0, "compile-blocks")],
                                       prev)
    assert [p["before"] for p in pts] == [1.5 * 2**30, None]
    text = replay_report.markdown([], pts, [], [], None)
    # now 1.9 of 2.0 within 10%, 1.0 not; before 1.5 not
    assert "Within 10% of allocated: 1 of 2 plans (before: 0 of the 1 simulated then)." in text
