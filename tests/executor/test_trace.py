"""run --trace: a Chrome trace per rank of the timed steps, and its summary."""

from __future__ import annotations

import json

import pytest

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.executor import run_plan
from autoplace.executor.runner import RunOptions, capture_graph
from autoplace.plan import Plan
from autoplace.tools import trace_summary


def test_each_rank_writes_a_trace_of_the_timed_steps(tmp_path):
    wl = workloads.get("gpt-tiny")
    g = capture_graph(wl)
    plan = Plan.single(g).with_parallel(data=2)
    rep = run_plan(plan, wl, cluster=preset("cpu-x2"), options=RunOptions(
        steps=5, warmup=2, reference=False, trace_dir=str(tmp_path / "tr")))
    assert rep.error is None and rep.extra["trace"].endswith("trace-rank0.json")
    files = sorted((tmp_path / "tr").glob("trace-rank*.json"))
    assert [f.name for f in files] == ["trace-rank0.json", "trace-rank1.json"]
    assert not list((tmp_path / "tr").glob("*.tmp*"))  # written whole, through a temporary
    events = json.loads(files[0].read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("autoplace step"))
    assert steps == ["autoplace step 2", "autoplace step 3", "autoplace step 4"]
    s = trace_summary.summarize(files[1])
    assert s["steps"] == 3 and s["step_ms"] > 0 and s["devices"] == {}  # CPU: no kernels
    names = [n for n, _, _ in s["top_host_ops_ms"]]
    assert any("allreduce" in n or "AddmmBackward" in n or "aten::" in n for n in names)


def test_trace_summary_rejects_a_file_that_is_not_a_run_trace(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(SystemExit, match="not a trace of `autoplace run"):
        trace_summary.summarize(bad)
    assert trace_summary.main([str(tmp_path / "missing.json")]) == 2
