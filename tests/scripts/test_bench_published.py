"""bench/published/torchtitan-llama3.json and scripts/bench/bench_published.py (run as a
subprocess on a few rows, as a user runs it)."""

from __future__ import annotations

import json
import os

from tests.helpers import BENCH, ROOT, pythonpath_with_root
from tests.helpers.cli_process import run_script

PUBLISHED = ROOT / "bench" / "published" / "torchtitan-llama3.json"


def test_published_rows_load_with_sources():
    doc = json.loads(PUBLISHED.read_text())
    rows = doc["rows"]
    assert len(rows) == 18 and {r["table"] for r in rows} == {str(i) for i in range(1, 7)}
    for r in rows:
        src = r["source"]
        assert src["repo"] == "pytorch/torchtitan" and src["path"] == "docs/performance.md"
        assert len(src["commit"]) == 40 and src["table"].startswith("Table ")
        assert r["tokens_per_s_per_gpu"] > 0 and r["memory_gib"] > 0
        assert (r["excluded"] is None) or ("not" in r["excluded"])
        assert not (r["in_plan_space"] and r["modelled_beyond_plan_space"])
    ids = {r["id"] for r in rows if r["excluded"] is None}
    assert set(doc["fit_rows"]) < ids
    assert all(r["parallel"]["cp"] == 1 for r in rows if r["excluded"] is None)


def test_bench_published_runs_on_a_subset(tmp_path):
    out = tmp_path / "run"
    proc = run_script(BENCH / "bench_published.py", "--rows",
                      "t1-fsdp,t1-compile,t3-fsdp", "--out", str(out), "--no-plot",
                      cwd=ROOT, timeout=600,
                      env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "published.json").read_text())
    parts = {r["id"]: r["part"] for r in res["rows"]}
    assert parts == {"t1-fsdp": "fit", "t1-compile": "fit", "t3-fsdp": "held_out"}
    assert res["fitted_on"]["compute_scale"] == ["t1-fsdp"]
    fitted = next(r for r in res["rows"] if r["id"] == "t1-fsdp")
    assert abs(fitted["throughput_error"]) < 1e-3  # the constant fitted on it
    assert res["summary"]["held_out_throughput_median_abs_error"] is not None
    assert (out / "env.json").exists() and (out / "run.json").exists()
    assert "held_out" in (out / "published.md").read_text()


def test_bench_published_refuses_unknown_rows(tmp_path):
    proc = run_script(BENCH / "bench_published.py", "--rows", "t9-nope", "--out",
                      str(tmp_path / "x"), "--no-plot", cwd=ROOT, timeout=120,
                      env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert proc.returncode != 0 and "valid:" in proc.stderr
