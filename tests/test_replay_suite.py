"""scripts/replay_suite.py: a stored suite's plans rebuilt and simulated again offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def _stored_suite():
    """A suite result as bench_plans.py writes it (CPU, the 'tiny' scenario), with
    'measured' times 10% above the simulated ones except one plan measured faster."""
    import bench_plans as bp

    from autoplace import baselines, workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import preset
    from autoplace.sim import simulate

    cl = preset("cpu-x2")
    sc = bp.SCENARIOS["tiny"]
    g = capture_workload(workloads.get(sc["model"], device="meta", **sc["options"]))
    plans = dict(bp.hand_written(g, cl))
    for k in ("expert", "m-etf"):
        plans[k] = baselines.get(k)(g, cl)
    rows = []
    for k, p in plans.items():
        s = simulate(g, p, cl).step_time_s
        rows.append({"planner": k, "parallel": p.split(), "sim_step_time_s": s,
                     "measured_step_time_s": s * (0.5 if k == "ddp" else 1.1),
                     "oom_measured": False, "same_plan_as": []})
    rows.append({"planner": "rl-gnn", "parallel": "x", "sim_step_time_s": 1.0,
                 "measured_step_time_s": 1.0, "same_plan_as": []})  # not rebuildable
    expert = next(r for r in rows if r["planner"] == "expert")
    rows.append({**expert, "planner": "auto", "same_plan_as": ["expert"]})
    return {"card": "cpu", "num_devices": 2,
            "scenarios": [{"name": "tiny", "memory_cap_bytes": None, "plans": rows}]}


def test_replay_rebuilds_every_deterministic_plan_and_scores_it(tmp_path, capsys):
    import replay_suite

    result = _stored_suite()
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(result))
    out_json = tmp_path / "replay.json"
    assert replay_suite.main([str(path), "--json", str(out_json)]) == 0
    (sc,) = json.loads(out_json.read_text())
    got = {r["planner"]: r for r in sc["plans"]}
    assert "rl-gnn" not in got and "auto" in got  # auto via the plan it was the same as
    stored = {r["planner"]: r for r in result["scenarios"][0]["plans"]}
    for k, r in got.items():
        assert r["same_split"] and r["sim_now_s"] == pytest.approx(stored[k]["sim_step_time_s"])
    # every distinct measured plan once (auto is expert's plan); the one plan measured at
    # half its simulated time makes the error and the ranking imperfect
    assert sc["measured_plans"] == len({(r["split"], r["measured_s"]) for r in got.values()})
    assert sc["measured_plans"] < len(got)
    assert sc["error_now"] == pytest.approx(0.1 / 1.1) and sc["error_stored"] == sc["error_now"]
    assert sc["tau_now"] == sc["tau_stored"] and -1 <= sc["tau_now"] < 1
    assert "tiny (analytic costs)" in capsys.readouterr().out


def test_several_suites_give_a_line_per_scenario_and_totals(tmp_path, capsys):
    import replay_suite

    result = _stored_suite()
    paths = []
    for i in range(2):
        path = tmp_path / f"suite{i}.json"
        path.write_text(json.dumps(result))
        paths.append(f"{path}:none{i}")  # a tag with no profiles: analytic costs, as stored
    out_json = tmp_path / "all.json"
    assert replay_suite.main([*paths, "--profiles", str(tmp_path), "--json",
                              str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert [r["suite"] for r in rows] == ["suite0", "suite1"]
    assert rows[0]["error_now"] == pytest.approx(0.1 / 1.1)
    out = capsys.readouterr().out
    assert out.count(" tiny ") == 2
    # each suite's distinct measured plans (auto is expert's plan: counted once)
    assert f"now: median error 0.091 over {2 * rows[0]['measured_plans']} measured plans" in out
    tau = rows[0]["tau_now"]
    assert f"mean Kendall tau {tau:.3f} over 2 scenarios, {2 * (tau >= 0.8)} of them" in out


def test_replay_refuses_a_file_that_is_no_suite(tmp_path, capsys):
    import replay_suite

    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"plan": 1}))
    assert replay_suite.main([str(bad)]) == 2
    assert "not a bench_plans.py result" in capsys.readouterr().err
