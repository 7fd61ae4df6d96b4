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
from autoplace.executor.profile_block import (
    GRAPHED_BLOCKS,
    _cut,
    _values_of,
    block_ops,
    describe,
    profile_block,
)
from autoplace.graph import OpGraph, random_dag
from autoplace.plan import Plan
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate, simulate_batch
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
    two = block_ops(graph, 2)  # the first two blocks, for the CUDA-graph comparison
    assert two[:len(names)] == names and len(two) == 2 * len(names)
    assert {graph[n].module_path.split(".")[1] for n in two[len(names):]
            if graph[n].module_path} == {"1"}
    sub, ext = _cut(graph.module, set(names))
    assert [n.op for n in sub.nodes].count("placeholder") == len(ext) == 1
    from autoplace.capture import program_inputs

    flat = tuple(program_inputs(graph.module, wl.example_inputs(graph.batch_size, "cpu")))
    (x,) = _values_of(graph.module, flat, ext)
    assert x.shape[0] == graph.batch_size and x.dim() == 3  # the residual stream


def test_measurement_reaches_cache_graph_file_and_simulator(profiled, monkeypatch, tmp_path):
    wl, graph, cache = profiled
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")  # compiles without a C++ toolchain
    got = profile_block(graph, wl.example_inputs(graph.batch_size, "cpu"), "cpu",
                        repeats=2, cache_dir=cache)
    rec, rc = got["compiled"], got["recompute"]
    assert rec is not None and rec["block_ops"] == rc["block_ops"] == len(block_ops(graph))
    assert rec["eager_s"] > 0 and rec["compiled_s"] > 0 and 0 < rec["heavy_share"] < 1
    assert 0.05 <= rec["fused_time"] <= 2.0 and rec["backend"] == "aot_eager"
    assert rc["full_s"] > 0 and rc["selective_s"] > 0 and rc["eager_s"] > 0
    # gpt-tiny's two blocks also run in turn, a piece each: the per-op extra is what the
    # second block adds checkpointed beyond what it adds eager (one call's fixed cost,
    # which the lone block carries, cancels)
    assert rc["blocks"] == 2 and rc["eager_blocks_s"] > 0 and rc["full_blocks_s"] > 0
    added = len(block_ops(graph, 2)) - rc["block_ops"]
    for mode, base in (("full", "eager"), ("selective", "eager"),
                       ("compiled_full", "compiled")):
        base_s = rec if base == "compiled" else rc
        extra = (rc[f"{mode}_blocks_s"] - rc[f"{mode}_s"]) - \
            (base_s[f"{base}_blocks_s"] - base_s[f"{base}_s"])
        assert rc[f"{mode}_host_s"] == pytest.approx(max(0.0, extra) / added)
    assert rec["blocks"] == 2 and rec["compiled_blocks_s"] > 0
    if rec["eager_blocks_s"] > rec["eager_s"]:  # the compiled factor: per added block too
        assert rec["ratio"] == pytest.approx(max(0.0, rec["compiled_blocks_s"] - rec[
            "compiled_s"]) / (rec["eager_blocks_s"] - rec["eager_s"]))
    assert "the first 2 blocks in turn" in describe(got)

    fresh = capture_workload(workloads.get("gpt-tiny", device="meta"))  # another process
    assert apply_cached(fresh, cache, ["cpu"]) == ["cpu"]
    assert fresh.profile_info["cpu"]["compiled"]["fused_time"] == rec["fused_time"]
    assert fresh.profile_info["cpu"]["recompute"]["full_host_s"] == rc["full_host_s"]
    path = tmp_path / "g.json"
    fresh.save(path)
    back = OpGraph.load(path).profile_info["cpu"]
    assert back["compiled"]["fused_time"] == rec["fused_time"]
    assert back["recompute"]["selective_host_s"] == rc["selective_host_s"]

    # the simulator prices the compiled plan with the measured factor: a compiled plan is
    # dearer at a factor of 2 than at the default and cheaper at 0.05
    plan = lever_plans(fresh, resolve("cpu-x1"))["checkpoint-blocks"].with_parallel(
        compile=True)
    times = {}
    for f in (0.05, COMPILED_FUSED_TIME, 2.0):
        fresh.profile_info["cpu"]["compiled"] = {"fused_time": f}
        times[f] = simulate(fresh, plan, resolve("cpu-x1")).step_time_s
    assert times[0.05] < times[COMPILED_FUSED_TIME] < times[2.0]


def test_checkpointing_host_time_reaches_the_simulator():
    """On a GPU (where the issuing thread is simulated) a recomputed plan's step grows
    with the profiled checkpointing host time, the batched simulator agrees with the
    scalar one, and an eager plan is unchanged."""
    g = capture_workload(workloads.get("gpt-tiny", device="meta"))
    cluster = resolve("h200x1")
    plans = lever_plans(g, cluster)
    full, sel = plans["checkpoint-blocks"], plans["selective-blocks"]
    eager = Plan.single(g)
    base = {k: simulate(g, p, cluster).step_time_s for k, p in
            (("full", full), ("sel", sel), ("eager", eager))}
    g.profile_info = {"h200": {"recompute": {"full_host_s": 1e-3, "selective_host_s": 2e-3}}}
    now = {k: simulate(g, p, cluster).step_time_s for k, p in
           (("full", full), ("sel", sel), ("eager", eager))}
    n_ops = len(block_ops(g))
    assert now["eager"] == base["eager"]
    assert now["full"] >= base["full"] + 0.5 * 1e-3 * n_ops
    assert now["sel"] >= base["sel"] + 0.5 * 2e-3 * n_ops
    batch = simulate_batch(g, [eager, full, sel], cluster).step_time_s
    assert batch.tolist() == pytest.approx([now["eager"], now["full"], now["sel"]], rel=1e-9)


def test_graphed_device_share_reaches_the_simulator(tmp_path):
    """A CUDA-graphs plan's device times scale with the profiled share; the graph file
    keeps it; eager plans are unchanged; batched and scalar simulators agree."""
    g = capture_workload(workloads.get("gpt-small", device="meta"))
    cluster = resolve("h200x1")
    graphed, eager = Plan.single(g).with_parallel(graphs=True), Plan.single(g)
    base = [simulate(g, p, cluster).step_time_s for p in (graphed, eager)]
    g.profile_info = {"h200": {"graphs": {"device_share": 0.25}}}
    now = [simulate(g, p, cluster).step_time_s for p in (graphed, eager)]
    assert now[1] == base[1] and now[0] < base[0]
    assert simulate_batch(g, [graphed, eager], cluster).step_time_s.tolist() == \
        pytest.approx(now, rel=1e-9)
    g.save(tmp_path / "g.json")
    assert OpGraph.load(tmp_path / "g.json").profile_info == g.profile_info


def test_no_blocks_no_measurement():
    graph = random_dag(20, seed=0)  # no module paths: no blocks
    assert block_ops(graph) == []
    assert profile_block(graph, (), "cpu") is None


def test_graph_file_with_a_bad_factor_is_refused(tmp_path):
    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    data = graph.to_json()
    for bad in ({"cpu": {"fused_time": -1}}, {"cpu": {"fused_time": 0}},
                {"cpu": {"device_share": "1"}},
                {"cpu": {"full_host_s": float("nan")}}, {"cpu": {"selective_host_s": True}},
                {"cpu": {"other": 1.0}}, {"cpu": 1.0}, ["cpu"]):
        data["block_profile"] = bad
        (tmp_path / "g.json").write_text(json.dumps(data))
        with pytest.raises(AutoplaceError, match="block_profile"):
            OpGraph.load(tmp_path / "g.json")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_block_on_a_gpu(tmp_path):
    """On a GPU every form runs: inductor compiles the block, the CUDA graph captures it,
    and the record reaches the cache."""
    wl = workloads.get("gpt-tiny", device="cuda", autocast_dtype="bfloat16")
    graph = profile(wl, ["cuda:0"], repeats=2, cache_dir=tmp_path)
    got = profile_block(graph, wl.example_inputs(graph.batch_size, "cpu"), "cuda:0",
                        autocast_dtype="bfloat16", repeats=3, cache_dir=tmp_path)
    assert got["compiled"] is not None and got["compiled"]["backend"] == "inductor"
    assert got["graphs"] is not None, got.get("graphs_failed")
    assert 0 < got["graphs"]["device_share"] <= 1
    # gpt-tiny's blocks: the first one graphed alone and the first two as one graph (how
    # their times compare is the profile's to measure, not a test's: on 2x H200 two blocks
    # once replayed in 2.02x the lone block's time)
    g = got["graphs"]
    assert g["blocks"] == min(GRAPHED_BLOCKS, 2) and g["added_ops_s"] > 0
    assert 0 < g["graphed_s"] < g["graphed_blocks_s"]
    assert got["recompute"]["full_s"] > 0
    fresh = capture_workload(workloads.get("gpt-tiny", device="meta",
                                           autocast_dtype="bfloat16"))
    kind = next(iter(graph.profile_info))
    assert apply_cached(fresh, tmp_path, [kind]) == [kind]
    assert set(fresh.profile_info[kind]) >= {"compiled", "recompute", "graphs"}
