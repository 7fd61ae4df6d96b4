"""The demo's table never shows a simulated order the measurement beside it contradicts
without saying so, and why."""

from __future__ import annotations

from autoplace.cluster import preset
from autoplace.demo import order_notes
from autoplace.graph import random_dag
from autoplace.plan import ParallelConfig, Plan
from autoplace.search.compare import format_table

GRAPH = random_dag(6, seed=0)


def _row(planner: str, sim_ms: float, measured_ms: float | None, data: int = 1) -> dict:
    plan = Plan.single(GRAPH, parallel=ParallelConfig(data=data), planner=planner)
    return {"planner": planner, "plan": plan, "parallel": plan.split(),
            "sim_step_time_s": sim_ms / 1e3, "peak_memory_bytes": [1, 1], "oom": False,
            "search_time_s": 0.0, "error": None, "ratio_to_best": 1.0,
            "ratio_to_lower_bound": 1.0,
            "measured_step_time_s": None if measured_ms is None else measured_ms / 1e3}


def test_disagreements_are_marked_in_the_table_with_the_reason():
    rows = [_row("hybrid-dp", 138.6, 700.0, 2), _row("ddp", 152.2, 478.0, 2),
            _row("single", 270.0, 2500.0), _row("expert", 262.0, None)]
    notes = order_notes(rows, preset("cpu-x2"))
    assert "disagree" in notes[0] and "hybrid-dp was simulated 0.91x ddp's step and " \
        "measured 1.46x" in notes[0]
    assert "same cores" in notes[1]
    table = format_table(rows)
    assert "sim vs measured" in table.splitlines()[0]
    assert "measured 1.46x ddp's step" in next(x for x in table.splitlines()
                                                if x.startswith("| hybrid-dp"))
    assert rows[1].get("order_note") is None and rows[3].get("order_note") is None


def test_agreement_is_said_too():
    rows = [_row("ddp", 150.0, 480.0, 2), _row("hybrid-dp", 151.0, 490.0, 2),
            _row("single", 270.0, 2500.0)]
    assert order_notes(rows, preset("cpu-x2")) == [
        "simulated and measured orders agree for the 3 plans executed (within 5%)"]
    assert "sim vs measured" not in format_table(rows)
