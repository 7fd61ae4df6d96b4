"""A compiled block profiled on the machine: the measurement reaches the cache, the graph
file and the simulator's price of compiled plans."""

from __future__ import annotations

import json

import pytest
import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.costs.profile import apply_cached, profile
from autoplace.errors import AutoplaceError
from autoplace.executor.pieces import COMPILE_BACKEND_ENV
from autoplace.executor.profile_compiled import _cut, _values_of, block_ops, profile_compiled
from autoplace.graph import OpGraph, random_dag
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate
from autoplace.sim.compiled import COMPILED_FUSED_TIME


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    torch.manual_seed(0)
    cache = tmp_path_factory.mktemp("profile")
    wl = workloads.get("gpt-tiny")
    graph = profile(wl, ["cpu"], repeats=1, cache_dir=cache)
    return wl, graph, cache


def test_block_is_the_first_block_and_runs_as_in_the_model(profiled):
    wl, graph, _ = profiled
    names = block_ops(graph)
    assert names and all(graph[n].module_path.startswith("blocks.0") or
                         not graph[n].module_path for n in names)
    assert any(graph[n].module_path.startswith("blocks.0.attn") for n in names)
    sub, ext = _cut(graph.module, set(names))
    assert [n.op for n in sub.nodes].count("placeholder") == len(ext) == 1
    from autoplace.capture import program_inputs

    flat = tuple(program_inputs(graph.module, wl.example_inputs(graph.batch_size, "cpu")))
    (x,) = _values_of(graph.module, flat, ext)
    assert x.shape[0] == graph.batch_size and x.dim() == 3  # the residual stream


def test_measurement_reaches_cache_graph_file_and_simulator(profiled, monkeypatch, tmp_path):
    wl, graph, cache = profiled
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")  # compiles without a C++ toolchain
    rec = profile_compiled(graph, wl.example_inputs(graph.batch_size, "cpu"), "cpu",
                           repeats=2, cache_dir=cache)
    assert rec is not None and rec["block_ops"] == len(block_ops(graph))
    assert rec["eager_s"] > 0 and rec["compiled_s"] > 0 and 0 < rec["heavy_share"] < 1
    assert 0.05 <= rec["fused_time"] <= 2.0 and rec["backend"] == "aot_eager"

    fresh = capture_workload(workloads.get("gpt-tiny", device="meta"))  # another process
    assert apply_cached(fresh, cache, ["cpu"]) == ["cpu"]
    assert fresh.profile_info["cpu"]["compiled"]["fused_time"] == rec["fused_time"]
    path = tmp_path / "g.json"
    fresh.save(path)
    assert OpGraph.load(path).profile_info["cpu"]["compiled"]["fused_time"] == rec["fused_time"]

    # the simulator prices the compiled plan with the measured factor: a compiled plan is
    # dearer at a factor of 2 than at the default and cheaper at 0.05
    plan = lever_plans(fresh, resolve("cpu-x1"))["checkpoint-blocks"].with_parallel(
        compile=True)
    times = {}
    for f in (0.05, COMPILED_FUSED_TIME, 2.0):
        fresh.profile_info["cpu"]["compiled"] = {"fused_time": f}
        times[f] = simulate(fresh, plan, resolve("cpu-x1")).step_time_s
    assert times[0.05] < times[COMPILED_FUSED_TIME] < times[2.0]


def test_no_blocks_no_measurement():
    graph = random_dag(20, seed=0)  # no module paths: no blocks
    assert block_ops(graph) == []
    assert profile_compiled(graph, (), "cpu") is None


def test_graph_file_with_a_bad_factor_is_refused(tmp_path):
    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    data = graph.to_json()
    for bad in ({"cpu": -1}, {"cpu": float("nan")}, {"cpu": True}, ["cpu"]):
        data["compiled_fused_time"] = bad
        (tmp_path / "g.json").write_text(json.dumps(data))
        with pytest.raises(AutoplaceError, match="compiled_fused_time"):
            OpGraph.load(tmp_path / "g.json")
