from __future__ import annotations

import pytest

from autoplace import planners
from autoplace.cluster import Cluster, preset
from autoplace.errors import AutoplaceError
from autoplace.graph import random_dag
from autoplace.search.compare import compare, format_table
from autoplace.sim import simulate

FIELDS = {"planner", "parallel", "sim_step_time_s", "peak_memory_bytes", "oom", "search_time_s",
          "ratio_to_best", "ratio_to_lower_bound", "lower_bound_s", "plan", "error"}
PLANNERS = ["single", "round-robin", "expert", "m-etf", "ddp", "pipeline", "hybrid-dp"]


def _cluster(n: int = 2) -> Cluster:
    return Cluster.uniform(f"cpu-x{n}", preset("cpu-x1").devices[0], n, alpha_s=50e-6,
                           bandwidth=5e9)


def _capped_case():
    g = random_dag(120, seed=3)
    g.batch_size = 8
    c = _cluster(2)
    peak = max(simulate(g, planners.get("single")(g, c), c).peak_memory_bytes)
    return g, c.with_memory_cap(int(peak * 0.7))


def test_rows_have_fields_and_are_sorted_with_oom_last():
    g, c = _capped_case()
    rows = compare(g, c, PLANNERS)
    assert sorted(r["planner"] for r in rows) == sorted(PLANNERS)
    for r in rows:
        assert FIELDS <= set(r)
        assert r["error"] is None
        assert r["plan"].planner["name"] == r["planner"]
        assert r["plan"].predicted["step_time_s"] == pytest.approx(r["sim_step_time_s"])
        assert len(r["peak_memory_bytes"]) == c.num_devices
        assert r["ratio_to_lower_bound"] >= 1.0 - 1e-9
    oom = [r["oom"] for r in rows]
    assert oom == sorted(oom)  # False (fits) first
    assert any(oom) and not all(oom)  # the cap makes single OOM, not every plan
    assert next(r for r in rows if r["planner"] == "single")["oom"]
    fits = [r["sim_step_time_s"] for r in rows if not r["oom"]]
    assert fits == sorted(fits)
    assert rows[0]["ratio_to_best"] == pytest.approx(1.0)
    table = format_table(rows)
    for name in PLANNERS:
        assert f"| {name} |" in table
    assert "OOM" in table


def test_execute_adds_measured_times():
    g, c = random_dag(60, seed=1), _cluster(2)
    seen = []

    def fake_execute(plan):
        seen.append(plan.planner["name"])
        return {"step_time_s": 0.5 if plan.planner["name"] == "single" else 0.25, "oom": False}

    rows = compare(g, c, ["single", "expert"], execute=fake_execute)
    assert sorted(seen) == ["expert", "single"]
    by = {r["planner"]: r for r in rows}
    assert by["single"]["measured_step_time_s"] == 0.5
    assert by["expert"]["measured_ratio_to_best"] == pytest.approx(1.0)
    assert by["single"]["plan"].measured == {"step_time_s": 0.5}
    assert "measured ms" in format_table(rows)


def test_anneal_is_seeded_with_the_best_plans_so_far():
    g, c = random_dag(60, seed=2), _cluster(2)
    rows = compare(g, c, ["anneal", "ddp", "expert"],
                   options={"anneal": {"time_budget_s": 0.5, "seeds": ()}})
    by = {r["planner"]: r for r in rows}
    assert by["anneal"]["plan"].planner["seed_planner"] in ("ddp", "expert")
    assert by["anneal"]["sim_step_time_s"] <= min(
        by["ddp"]["sim_step_time_s"], by["expert"]["sim_step_time_s"]) * (1 + 1e-9)


def test_unknown_planner_fails_before_any_work():
    with pytest.raises(AutoplaceError, match="valid:"):
        compare(random_dag(20), _cluster(2), ["single", "nope"])


def test_failing_planner_becomes_an_error_row():
    g, c = random_dag(40), _cluster(2)
    rows = compare(g, c, ["single", "pipeline"], options={"pipeline": {"stages": 9}})
    assert rows[-1]["planner"] == "pipeline" and "stages" in rows[-1]["error"]
    assert "failed" in format_table(rows)
