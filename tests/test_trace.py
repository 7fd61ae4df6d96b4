"""run --trace: a Chrome trace per rank of the timed steps, and its summary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.executor import run_plan
from autoplace.executor.runner import RunOptions, capture_graph
from autoplace.plan import Plan

ROOT = Path(__file__).resolve().parents[1]


def _summary_module():
    spec = importlib.util.spec_from_file_location("trace_summary",
                                                  ROOT / "scripts" / "trace_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_rank_writes_a_trace_of_the_timed_steps(tmp_path):
    wl = workloads.get("gpt-tiny")
    g = capture_graph(wl)
    plan = Plan.single(g).with_parallel(data=2)
    rep = run_plan(plan, wl, cluster=preset("cpu-x2"), options=RunOptions(
        steps=5, warmup=2, reference=False, trace_dir=str(tmp_path / "tr")))
    assert rep.error is None and rep.extra["trace"].endswith("trace-rank0.json")
    files = sorted((tmp_path / "tr").glob("trace-rank*.json"))
    assert [f.name for f in files] == ["trace-rank0.json", "trace-rank1.json"]
    events = json.loads(files[0].read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("autoplace step"))
    assert steps == ["autoplace step 2", "autoplace step 3", "autoplace step 4"]
    s = _summary_module().summarize(files[1])
    assert s["steps"] == 3 and s["step_ms"] > 0 and s["devices"] == {}  # CPU: no kernels
    names = [n for n, _, _ in s["top_host_ops_ms"]]
    assert any("allreduce" in n or "AddmmBackward" in n or "aten::" in n for n in names)


def test_trace_summary_rejects_a_file_that_is_not_a_run_trace(tmp_path):
    mod = _summary_module()
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(SystemExit, match="not a trace of `autoplace run"):
        mod.summarize(bad)
    assert mod.main([str(tmp_path / "missing.json")]) == 2
