"""The mesh planner: valid plans of block groups on multi-node clusters, within a minute."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.lowering import block_groups
from autoplace.planners.mesh import (
    ac_counts,
    balanced_stages,
    mesh_candidates,
    plan_of,
    selective_first,
)
from autoplace.search.auto import auto_plan
from autoplace.sim.mesh import block_table, estimate, estimate_config


@pytest.fixture(scope="module")
def tiny():
    return capture_workload(workloads.get("llama3-tiny", device="meta", batch_size=32,
                                          n_layers=8, autocast_dtype="bfloat16"))


def test_balanced_stages_are_contiguous_and_even():
    assert balanced_stages(np.r_[0.0, np.ones(8), 0.0], 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    heavy_ends = balanced_stages(np.r_[3.0, np.ones(8), 3.0], 2)
    assert heavy_ends == (0, 0, 0, 0, 1, 1, 1, 1)
    with pytest.raises(AutoplaceError, match="each stage needs a block"):
        balanced_stages(np.ones(4), 3)


def test_mesh_plan_on_two_nodes_is_valid(tiny):
    cluster = preset("h100x8-n2")
    t0 = time.perf_counter()
    plan = planners.get("mesh")(tiny, cluster)
    assert time.perf_counter() - t0 < 60
    plan.validate(tiny, cluster)
    assert plan.num_devices <= cluster.num_devices
    assert plan.groups == block_groups(tiny)
    assert plan.predicted["simulator"] == "mesh" and not plan.predicted["oom"]
    assert plan.planner["searched"] > 100
    par = plan.parallel
    assert par.data * par.tensor * par.pipeline == plan.num_devices
    assert 32 % (par.data * par.microbatches) == 0


def test_nothing_fits_names_the_smallest_peak(tiny):
    cluster = preset("h100x8-n2").with_memory_cap(2**12)
    with pytest.raises(AutoplaceError, match="smallest peak"):
        planners.get("mesh")(tiny, cluster)


def test_auto_on_several_nodes_uses_the_mesh_planner(tiny):
    plan = auto_plan({"spec": "llama3-tiny", "options": {}}, preset("h100x8-n2"), graph=tiny,
                     progress=False)
    assert plan.planner["name"] == "auto" and plan.planner["chosen"] == "mesh"
    assert plan.planner["simulation_only"] is True  # no GPUs here


@pytest.mark.slow
def test_llama3_8b_on_eight_nodes_within_a_minute():
    graph = capture_workload(workloads.get("llama3-8b", device="meta", batch_size=64))
    cluster = preset("h100x8-n8")
    t0 = time.perf_counter()
    plan = planners.get("mesh")(graph, cluster)
    assert time.perf_counter() - t0 < 60
    plan.validate(graph, cluster)
    assert plan.num_devices == 64
    assert plan.predicted["peak_memory_bytes"][0] <= cluster.devices[0].usable_memory_bytes


def _without_ac(cfg):
    return replace(cfg, sequence_parallel=False, ac_of_block=())


def test_sequence_parallel_is_searched_emitted_and_priced_as_it_runs(tiny):
    cluster = preset("h100x8-n2")
    info = {}
    cands = mesh_candidates(tiny, cluster, info=info)
    assert 2 not in info["refused"]  # llama's stream runs on sequence shards at tp=2
    assert not any(c.sequence_parallel for c, _ in cands if c.pipeline > 1 or c.tensor == 1)
    flat = [(c, r) for c, r in cands if c.tensor == 2 and c.pipeline == 1 and not r.oom]
    on = {_without_ac(c): r for c, r in flat if c.sequence_parallel}
    off = {_without_ac(c): r for c, r in flat if not c.sequence_parallel}
    assert on and on.keys() == off.keys()  # both priced for every flat tensor plan
    assert all(on[k].peak_memory_bytes < off[k].peak_memory_bytes for k in on)
    cfg, res = flat[0]
    assert cfg.sequence_parallel  # the fastest flat tensor plan shards the stream
    plan = plan_of(tiny, cfg, cluster, res)
    assert plan.parallel.sequence_parallel
    assert estimate(tiny, plan, cluster).step_time_s == pytest.approx(res.step_time_s)
    cfg_off, res_off = next((c, r) for c, r in flat if _without_ac(c) == _without_ac(cfg)
                            and not c.sequence_parallel)
    plan_off = plan_of(tiny, cfg_off, cluster, res_off)
    assert not plan_off.parallel.sequence_parallel
    assert estimate(tiny, plan_off, cluster).step_time_s == pytest.approx(res_off.step_time_s)


def test_a_refused_stream_is_searched_without_sequence_parallel():
    graph = capture_workload(workloads.get("llama3-tiny", device="meta", batch_size=32,
                                           n_layers=2, seq_len=31))  # 31 tokens: no split
    info = {}
    cands = mesh_candidates(graph, preset("h100x8-n2"), info=info)
    assert "31 tokens" in info["refused"][2]
    assert any(c.tensor == 2 for c, _ in cands)
    assert not any(c.sequence_parallel for c, _ in cands)


def test_checkpoint_counts_are_the_first_that_fit():
    assert [ac_counts(k, 3, True) for k in range(7)] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (2, 1), (3, 0)]
    assert ac_counts(2, 3, False) == (2, 0)
    graph = capture_workload(workloads.get("llama3-tiny", device="meta", batch_size=32,
                                           n_layers=8, seq_len=256,
                                           autocast_dtype="bfloat16"))
    cluster = preset("h100x8-n2")
    table = block_table(graph, cluster)
    sel_first = selective_first(table)
    free = next(r for c, r in mesh_candidates(graph, cluster)
                if c.pipeline == 1 and c.tensor == 1 and c.data == 16 and c.shard == "fsdp"
                and c.microbatches == 1)
    assert set(next(c for c, _ in mesh_candidates(graph, cluster)
                    if c.pipeline == 1).ac_of_block) == {"none"}
    capped = cluster.with_memory_cap(int(free.peak_memory_bytes * 0.8))
    usable = capped.devices[0].usable_memory_bytes
    flat = [(c, r) for c, r in mesh_candidates(graph, capped)
            if c.pipeline == 1 and c.tensor == 1 and c.data == 16 and c.shard == "fsdp"
            and c.microbatches == 1]
    cfg, res = flat[0]
    assert not res.oom and res.peak_memory_bytes <= usable
    modes = cfg.ac_of_block
    full, sel = modes.count("full"), modes.count("selective")
    assert 0 < full + sel < 16  # some blocks checkpointed, in the order full, selective, none
    assert modes == ("full",) * full + ("selective",) * sel + ("none",) * (8 - full - sel)
    step = next(k for k in range(17) if ac_counts(k, 8, sel_first) == (full, sel))
    assert step > 0
    one_less = ac_counts(step - 1, 8, sel_first)  # one step back in the order: too big
    fewer = ("full",) * one_less[0] + ("selective",) * one_less[1]
    fewer += ("none",) * (8 - len(fewer))
    assert estimate_config(table, replace(cfg, ac_of_block=fewer), capped).oom
