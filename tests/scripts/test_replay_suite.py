"""scripts/bench/replay_suite.py: a stored suite's plans rebuilt and simulated again offline
(run as a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.planners.manual import hand_written
from tests.helpers import BENCH, ROOT, pythonpath_with_root
from tests.helpers.cli_process import run_script


def replay(*args: str) -> subprocess.CompletedProcess:
    """``replay_suite.py ARGS`` in a process of its own."""
    return run_script(BENCH / "replay_suite.py", *args, cwd=ROOT,
                      timeout=300,
                      env={**os.environ, "PYTHONPATH": pythonpath_with_root()})


def _tiny_plans():
    """The 'tiny' scenario's graph (bench_plans.py's gpt-tiny at batch 8, meta device), the
    CPU cluster and the hand-written, expert and m-ETF plans, as bench_plans.py builds them."""
    cl = preset("cpu-x2")
    g = capture_workload(workloads.get("gpt-tiny", device="meta", batch_size=8))
    plans = dict(hand_written(g, cl))
    for k in ("expert", "m-etf"):
        plans[k] = planners.get(k)(g, cl)
    return g, cl, plans


def _stored_suite():
    """A suite result as bench_plans.py writes it (CPU, the 'tiny' scenario), with
    'measured' times 10% above the simulated ones except one plan measured faster."""
    from autoplace.sim import simulate

    g, cl, plans = _tiny_plans()
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


def test_replay_rebuilds_every_deterministic_plan_and_scores_it(tmp_path):
    result = _stored_suite()
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(result))
    out_json = tmp_path / "replay.json"
    run = replay(str(path), "--json", str(out_json))
    assert run.returncode == 0, run.stderr[-2000:]
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
    assert "tiny (analytic costs)" in run.stdout


def test_several_suites_give_a_line_per_scenario_and_totals(tmp_path):
    result = _stored_suite()
    paths = []
    for i in range(2):
        path = tmp_path / f"suite{i}.json"
        path.write_text(json.dumps(result))
        paths.append(f"{path}:none{i}")  # a tag with no profiles: analytic costs, as stored
    out_json = tmp_path / "all.json"
    run = replay(*paths, "--profiles", str(tmp_path), "--json", str(out_json))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out_json.read_text())
    assert [r["suite"] for r in rows] == ["suite0", "suite1"]
    assert rows[0]["error_now"] == pytest.approx(0.1 / 1.1)
    out = run.stdout
    assert out.count(" tiny ") == 2
    # each suite's distinct measured plans (auto is expert's plan: counted once)
    assert f"now: median error 0.091 over {2 * rows[0]['measured_plans']} measured plans" in out
    tau = rows[0]["tau_now"]
    assert f"mean Kendall tau {tau:.3f} over 2 scenarios, {2 * (tau >= 0.8)} of them" in out


def test_replay_refuses_a_file_that_is_no_suite(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"plan": 1}))
    run = replay(str(bad))
    assert run.returncode == 2 and "not a bench_plans.py result" in run.stderr


@pytest.mark.slow
def test_a_hugging_face_scenario_needs_the_module_of_its_models(tmp_path):
    """An hf-* scenario's models come from --hf-module (bench_plans.py's): without it the
    scenario is skipped with the reason, with it its plans are rebuilt."""
    suite = {"card": "cpu", "num_devices": 2, "scenarios": [
        {"name": "tiny-hf", "memory_cap_bytes": None, "plans": [
            {"planner": "single", "parallel": "x", "sim_step_time_s": 1.0,
             "measured_step_time_s": 1.0, "oom_measured": False, "same_plan_as": []}]}]}
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    run = replay(str(path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tiny-hf: a Hugging Face model, skipped (pass --hf-module)" in run.stdout
    out_json = tmp_path / "hf.json"
    run = replay(str(path), "--hf-module", "tests.helpers.hf_models", "--json", str(out_json))
    assert run.returncode == 0, run.stderr[-2000:]
    (sc,) = json.loads(out_json.read_text())
    assert sc["name"] == "tiny-hf" and [r["planner"] for r in sc["plans"]] == ["single"]


def test_carried_calibration_comes_from_the_latest_earlier_suite_never_its_own(tmp_path):
    """Suites in order ax2, b, c, d, d; calibration files tagged a (ax2's, the device
    count dropped as the 4-GPU suites' were), b and d, with DDP's factor 2, 3 and 7: the
    first suite has none, b carries a's, c b's (the latest earlier one), d b's (c saved
    none, its own d never counts, nor does it when an earlier suite had the same tag);
    every plan's time is Calibration.step_time of the carried one."""
    from autoplace.search.calibration import Calibration, calibration_path
    from autoplace.sim import simulate

    g, cl, plans = _tiny_plans()
    untagged = calibration_path(tmp_path, g, cl)
    cals = {}
    for tag, factor in (("a", 2.0), ("b", 3.0), ("d", 7.0)):
        cal = Calibration.empty(g, cl)
        s = simulate(g, plans["ddp"], cl).step_time_s
        cal.record(plans["ddp"], "ddp", s, 1.0, factor * s)
        cal.save(untagged.with_name(untagged.name.replace(".calibration.json",
                                                          f"-{tag}.calibration.json")))
        cals[tag] = cal
    assert not untagged.exists()  # only tagged files: the suites' own lookups are tagged

    path = tmp_path / "suite.json"
    path.write_text(json.dumps(_stored_suite()))
    out_json = tmp_path / "carried.json"
    run = replay(*[f"{path}:{t}" for t in ("ax2", "b", "c", "d", "d")], "--profiles",
                 str(tmp_path), "--carried-calibration", "--json", str(out_json))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out_json.read_text())
    assert [r["carried_from"] for r in rows] == [None, "a", "b", "b", "b"]
    assert rows[0]["error_carried"] is None and rows[0]["tau_carried"] is None
    assert all(p["sim_carried_s"] is None for p in rows[0]["plans"])
    for r in rows[1:]:
        cal = cals[r["carried_from"]]
        for p in r["plans"]:
            src = p["planner"] if p["planner"] in plans else "expert"  # auto is expert's
            assert p["sim_carried_s"] == pytest.approx(cal.step_time(plans[src], p["sim_now_s"]))
        ddp = next(p for p in r["plans"] if p["planner"] == "ddp")
        factor = {"a": 2.0, "b": 3.0}[r["carried_from"]]
        assert ddp["sim_carried_s"] == pytest.approx(factor * ddp["sim_now_s"])
        assert any(p["sim_carried_s"] == pytest.approx(p["sim_now_s"]) for p in r["plans"])
    # ddp measured at half its simulated time: a factor above 1 makes its error worse
    assert rows[1]["error_carried"] >= rows[1]["error_now"]
    out = run.stdout
    assert "the 4 of 5 scenarios with an earlier suite's calibration:" in out
    n = 4 * rows[1]["measured_plans"]
    assert f"  uncalibrated (now): median error 0.091 over {n} measured plans" in out
    assert f"  carried calibration: median error {rows[1]['error_carried']:.3f} over {n}" in out
