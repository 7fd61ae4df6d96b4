"""The command line: real subprocesses, as a user runs it (forked from one that has imported
it: tests/helpers/cli_process.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import pythonpath_with_root
from tests.helpers.cli_process import run_cli


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=pythonpath_with_root())
    return run_cli(*args, env=env, cwd=cwd, timeout=300)


def assert_clean_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    for n in needles:
        assert n in err[0], err[0]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    p = run("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "expert",
            "-o", str(path))
    assert p.returncode == 0, p.stderr
    return path


def test_capture_json():
    p = run("capture", "--model", "gpt-tiny", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["num_ops"] > 10 and d["num_edges"] >= d["num_ops"] - 1
    assert d["param_bytes"] == 134_912 * 4
    assert d["flops"] > 0 and len(d["fingerprint"]) == 16


def test_plan_simulate_show(plan_file, tmp_path):
    plan = json.loads(plan_file.read_text())
    assert plan["format"] == "autoplace.plan/1" and plan["model"]["spec"] == "gpt-tiny"
    assert sorted(set(plan["placement"])) == [0, 1]
    p = run("simulate", str(plan_file), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["step_time_s"] >= d["lower_bound_s"] > 0
    assert len(d["peak_memory_bytes"]) == 2 and d["oom"] is False
    gantt = tmp_path / "g.png"
    p = run("show", str(plan_file), "--gantt", str(gantt))
    assert p.returncode == 0, p.stderr
    assert gantt.stat().st_size > 5000


def test_plan_with_cuda_graphs(tmp_path):
    """--graphs marks a one-process plan graphed; a multi-process plan gets a clear error."""
    path = tmp_path / "g.json"
    p = run("plan", "--model", "gpt-tiny", "--cluster", "h100x2", "--planner", "expert",
            "--graphs", "-o", str(path))
    assert p.returncode == 0, p.stderr
    assert json.loads(path.read_text())["parallel"]["graphs"] is True
    assert "graphs" in p.stdout
    bad = tmp_path / "ddp.json"
    p = run("plan", "--model", "gpt-tiny", "--cluster", "h100x2", "--planner", "ddp",
            "--graphs", "-o", str(bad))
    assert_clean_error(p, "--graphs", "ddp", "one process")
    assert not bad.exists()


def test_plan_with_fsdp_units_by_module(tmp_path):
    """--shard-units modules marks a sharded plan; DDP gets a clear error."""
    path = tmp_path / "f.json"
    p = run("plan", "--model", "gpt-tiny", "--cluster", "h100x2", "--planner", "fsdp",
            "--shard-units", "modules", "-o", str(path))
    assert p.returncode == 0, p.stderr
    assert json.loads(path.read_text())["parallel"]["shard_units"] == "modules"
    assert "dp=2/fsdp/modules" in p.stdout
    bad = tmp_path / "ddp.json"
    p = run("plan", "--model", "gpt-tiny", "--cluster", "h100x2", "--planner", "ddp",
            "--shard-units", "modules", "-o", str(bad))
    assert_clean_error(p, "--shard-units", "ddp", "only to a sharded plan")
    assert not bad.exists()  # a bad value: tests/executor/test_fsdp_units.py::test_plan_field


def test_corrupt_plan(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "autoplace.plan/1", "groups": ')
    assert_clean_error(run("simulate", str(bad)), "not valid JSON")
    assert_clean_error(run("run", str(bad)), "not valid JSON")


def test_run_with_no_step_left_to_time(single_plan_file):
    plan = single_plan_file  # gpt-tiny's single plan (tests/conftest.py)
    assert_clean_error(run("run", str(plan), "--steps", "2"), "--steps 2 leaves no step",
                       "--warmup 2")


def test_plan_for_another_graph(plan_file, tmp_path):
    other = json.loads(plan_file.read_text())
    other["model"]["options"] = {"n_layers": 3}
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    assert_clean_error(run("simulate", str(path)), "another graph")


def test_device_out_of_range(plan_file, tmp_path):
    d = json.loads(plan_file.read_text())
    d["placement"] = [5 for _ in d["placement"]]
    path = tmp_path / "far.json"
    path.write_text(json.dumps(d))
    before = path.read_text()
    assert_clean_error(run("simulate", str(path), "--cluster", "cpu-x2"), "out of range")
    assert path.read_text() == before


def test_unknown_workload():
    assert_clean_error(run("capture", "--model", "gpt-huge"), "unknown workload", "gpt-tiny")


def test_untraceable_model():
    assert_clean_error(run("capture", "--model", "tests.helpers.zoo_user_workload:untraceable"),
                       "x.sum() > 0")


def test_unknown_planner():
    assert_clean_error(run("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2",
                           "--planner", "magic"), "valid", "hybrid-dp")


def test_models_lists_zoo():
    p = run("models", "--json")
    names = {m["name"] for m in json.loads(p.stdout)}
    assert {"gpt-tiny", "gpt-1b", "rnnlm", "gnmt-4", "inception-v3", "resnet50",
            "branchy-mlp"} <= names


def test_compare_execute(tmp_path):
    out, plot = tmp_path / "rows.json", tmp_path / "bars.png"
    p = run("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planners",
            "single,expert,ddp", "--execute", "--steps", "3", "--json", str(out),
            "--plot", str(plot))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())
    assert [r["planner"] for r in rows if r["planner"] == "ddp"] == ["ddp"]
    for r in rows:
        assert r["sim_step_time_s"] > 0 and r["oom"] is False
        assert r["measured_step_time_s"] > 0, r
        assert len(r["peak_memory_bytes"]) == 2
    assert plot.stat().st_size > 5000


def test_profile_cache_and_calibrated_compare(tmp_path):
    """profile --cache-dir, then compare --profile-dir uses the op times and calibration."""
    from autoplace import planners, workloads
    from autoplace.capture import capture_workload
    from autoplace.cluster import preset
    from autoplace.costs.profile import apply_cached
    from autoplace.search.calibration import Calibration, calibration_path
    from autoplace.sim import simulate

    cache = tmp_path / "profile"
    p = run("profile", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--repeats", "1",
            "--cache-dir", str(cache), "-o", str(tmp_path / "g.json"),
            "--cluster-out", str(tmp_path / "measured.json"))
    assert p.returncode == 0, p.stderr
    # links and collectives measured too: a cluster file --cluster takes
    from autoplace.cluster import Cluster

    measured = Cluster.load(tmp_path / "measured.json")
    assert measured.collective_bandwidth > 0 and "collectives" in p.stdout
    assert measured.bandwidth[0][1] != preset("cpu-x2").bandwidth[0][1]
    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    cluster = preset("cpu-x2")
    assert apply_cached(graph, cache, ["cpu"]) == ["cpu"]
    # a saved measurement: single-device plans really take 3x the simulated time
    plan = planners.get("single")(graph, cluster)
    cal = Calibration.empty(graph, cluster)
    sim = simulate(graph, plan, cluster)
    cal.record(plan, "single", sim.step_time_s, max(sim.peak_memory_bytes),
               3.0 * sim.step_time_s)
    cal.save(calibration_path(cache, graph, cluster))
    p = run("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planners",
            "single,ddp", "--profile-dir", str(cache), "--json", str(tmp_path / "rows.json"))
    assert p.returncode == 0, p.stderr
    assert "profiled (cpu)" in p.stderr and "calibrated ms" in p.stdout
    rows = {r["planner"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    single = rows["single"]
    assert single["calibrated_step_time_s"] == pytest.approx(3.0 * single["sim_step_time_s"])
    # ddp has no sample of its own: another family's error does not carry over
    assert rows["ddp"]["calibrated_step_time_s"] == pytest.approx(rows["ddp"]["sim_step_time_s"])
    assert_clean_error(run("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2",
                           "--profile-dir", str(tmp_path / "missing")), "no such folder")


def test_train_refuses_a_bad_group_count(tmp_path):
    p = run("train", "--model", "gpt-tiny", "--cluster", "h100x2", "--budget", "1",
            "--max-groups", "many", "--out", str(tmp_path / "t"))
    assert_clean_error(p, "--max-groups", "auto")
    assert not (tmp_path / "t").exists()
