"""Every bad input is refused before work starts, with a message that says what is valid;
a run that goes wrong never reports success."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from autoplace.cluster import Cluster, parse_bytes, preset
from autoplace.errors import AutoplaceError, PlanError
from autoplace.executor.report import RunReport, max_rel_diff
from autoplace.plan import ParallelConfig
from tests.reliability._run import clean_error, cli

NAN_MODEL = "tests.reliability.user_models:always_nan"


def _cluster_file(tmp_path: Path, where: str, key: str, value) -> Path:
    data = preset("cpu-x2").to_json()
    if where == "device":
        data["devices"][1][key] = value
    elif where == "link":
        data[key][0][1] = value
    else:
        data[key] = value
    path = tmp_path / f"{where}-{key}.json"
    path.write_text(json.dumps(data))
    return path


BAD_CLUSTERS = [
    ("device", "memory_bytes", -8), ("device", "memory_bytes", "8GB"),
    ("device", "memory_bytes", 0), ("device", "peak_flops", 0),
    ("device", "peak_flops", float("nan")), ("device", "peak_flops", float("inf")),
    ("device", "memory_bandwidth", -1.0), ("device", "launch_overhead_s", -1e-6),
    ("link", "bandwidth", 0), ("link", "bandwidth", -5e9), ("link", "bandwidth", "fast"),
    ("link", "alpha_s", float("nan")), ("top", "collective_bandwidth", 0),
    ("top", "gamma_s_per_byte", float("inf")),
]


@pytest.mark.parametrize("where,key,value", BAD_CLUSTERS)
def test_bad_cluster_values_are_refused(tmp_path, where, key, value):
    path = _cluster_file(tmp_path, where, key, value)
    with pytest.raises(AutoplaceError, match=key):
        Cluster.load(path)


def test_a_bad_cluster_file_fails_the_command_before_it_plans(tmp_path):
    path = _cluster_file(tmp_path, "device", "peak_flops", 0)
    clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", str(path), "-o",
                    str(tmp_path / "p.json")), "peak_flops", "positive")
    assert not (tmp_path / "p.json").exists()


def test_memory_sizes_need_units():
    with pytest.raises(AutoplaceError, match="no unit"):
        parse_bytes("16")
    with pytest.raises(AutoplaceError, match="positive"):
        parse_bytes("0GB")
    assert parse_bytes("16GB") == 16 * 2**30 and parse_bytes("512B") == 512
    clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--memory-cap", "16"),
                "--memory-cap", "no unit", "16GB")


def test_nothing_fitting_is_an_error_naming_the_smallest_peak(tmp_path):
    out = tmp_path / "plan.json"
    p = cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--memory-cap", "1KB",
            "--planner", "expert", "-o", str(out))
    clean_error(p, "nothing fits in 1KB", "smallest peak", "--memory-cap")
    assert not out.exists()
    rows = tmp_path / "rows.json"
    p = cli("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--memory-cap", "1KB",
            "--planners", "single,expert,ddp", "--json", str(rows))
    line = clean_error(p, "nothing fits in 1KB", "smallest peak")
    assert "| single |" in p.stdout and rows.exists(), "the table and rows come first"
    need = min(max(r["peak_memory_bytes"]) for r in json.loads(rows.read_text()))
    from autoplace.cluster import format_bytes

    assert format_bytes(need) in line


def test_batch_sizes_and_steps_are_checked():
    clean_error(cli("plan", "--model", "gpt-tiny", "--batch-size", "0"), "--batch-size",
                "at least 1")
    clean_error(cli("capture", "--model", "gpt-tiny", "--batch-size", "-4"), "--batch-size")
    clean_error(cli("compare", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--execute",
                    "--steps", "0"), "--steps", "at least 3")
    clean_error(cli("run", "plan.json", "--steps", "5", "--warmup", "-1"), "--warmup")


def test_microbatches_must_split_the_batch(tmp_path):
    path = tmp_path / "plan.json"
    assert cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "single",
               "--batch-size", "4", "-o", str(path)).returncode == 0
    data = json.loads(path.read_text())
    data["parallel"]["microbatches"] = 7
    path.write_text(json.dumps(data))
    clean_error(cli("simulate", str(path)), "batch of 4", "7 microbatch")
    clean_error(cli("run", str(path), "--cluster", "cpu-x2"), "batch of 4", "7 microbatch")
    with pytest.raises(PlanError, match="divisible by 6"):
        ParallelConfig(data=2, microbatches=3).micro_batch_size(8)
    assert ParallelConfig(data=2, microbatches=2).micro_batch_size(8) == 2


def test_a_run_the_machine_cannot_host_is_refused_before_torchrun(tmp_path):
    path = tmp_path / "ddp4.json"
    assert cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x4", "--planner", "ddp",
               "-o", str(path)).returncode == 0
    p = cli("run", str(path), "--cluster", "cpu-x2")
    clean_error(p, "needs 4 devices", "cpu-x2", "has 2")
    assert "rank" not in p.stdout + p.stderr, "no process was started"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_clusters_need_cuda(tmp_path):
    path = tmp_path / "ddp.json"
    assert cli("plan", "--model", "gpt-tiny", "--cluster", "h100x2", "--planner", "ddp",
               "-o", str(path)).returncode == 0
    clean_error(cli("run", str(path), "--cluster", "h100x2"), "no CUDA device", "cpu-x2")
    clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", "h100x2", "--planner", "auto",
                    "-o", str(tmp_path / "auto.json")), "--planner auto", "no CUDA device")
    clean_error(cli("compare", "--model", "gpt-tiny", "--cluster", "h100x2", "--execute"),
                "no CUDA device")


@pytest.mark.parametrize("planner", ["single", "ddp"])
def test_a_non_finite_loss_stops_the_run_naming_the_step(tmp_path, planner):
    plan = tmp_path / "plan.json"
    assert cli("plan", "--model", NAN_MODEL, "--cluster", "cpu-x2", "--planner", planner,
               "-o", str(plan)).returncode == 0
    report = tmp_path / "report.json"
    p = cli("run", str(plan), "--cluster", "cpu-x2", "--model", NAN_MODEL, "--steps", "5",
            "--report", str(report))
    clean_error(p, "the loss is nan at step 0", code=3)
    if planner == "single":
        data = json.loads(report.read_text())
        assert "nan at step 0" in data["error"] and data["extra"]["non_finite_step"] == 0


def test_a_report_with_a_nan_loss_is_never_a_success():
    rep = RunReport(loss=[1.0, float("nan")], reference_loss=[1.0, 1.0],
                    step_times_s=[0.1]).finish()
    assert not rep.ok and "at step 1" in rep.error
    assert math.isinf(rep.max_loss_rel_diff)
    assert max_rel_diff([float("nan")], [1.0]) == math.inf
    back = RunReport.from_json(json.loads(rep.dumps()))
    assert math.isnan(back.loss[1]) and back.error == rep.error
