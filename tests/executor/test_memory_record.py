"""run --memory: the CUDA allocator's history over the first timed step, summarised."""

from __future__ import annotations

import json

import pytest
import torch

from autoplace import workloads
from autoplace.cluster import Cluster, preset
from autoplace.executor import run_plan
from autoplace.executor.memory_record import recorded_step, site, source, summarize
from autoplace.executor.runner import RunOptions, capture_graph
from autoplace.plan import Plan

FSDP = [{"filename": "/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
         "name": "foreach_all_gather", "line": 1},
        {"filename": "/x/autoplace/executor/runner.py", "name": "run_here", "line": 2}]
CKPT = [{"filename": "/x/torch/utils/checkpoint.py", "name": "unpack_hook", "line": 3},
        {"filename": "/x/torch/autograd/graph.py", "name": "_engine_run_backward", "line": 4}]
BWD = [{"filename": "/x/torch/autograd/graph.py", "name": "_engine_run_backward", "line": 5},
       {"filename": "/x/autoplace/executor/build.py", "name": "step", "line": 6}]
FWD = [{"filename": "/x/model.py", "name": "forward", "line": 7},
       {"filename": "/x/autoplace/executor/build.py", "name": "step", "line": 8}]


def test_a_block_is_named_by_the_innermost_frame_that_says_where_it_came_from():
    assert source(FSDP) == "fsdp:foreach_all_gather"
    assert source(CKPT) == "recompute"  # inside the backward, but recomputation's
    assert source(BWD) == "backward"
    assert source(FWD) == "forward"
    assert source([{"filename": "/x/other.py", "name": "f"}]) == "other"
    assert source([]) == "unknown"


def snapshot() -> dict:
    """A step on device 0: 100 bytes allocated before it (a 40-byte block of it freed in
    the step), the compute stream (0) and a collective stream (7)."""
    ev = [
        {"action": "segment_map", "addr": 0, "size": 200, "stream": 7},
        {"action": "alloc", "addr": 1000, "size": 150, "stream": 7, "frames": FSDP},
        {"action": "segment_map", "addr": 0, "size": 300, "stream": 0},
        {"action": "alloc", "addr": 2000, "size": 250, "stream": 0, "frames": FWD},
        {"action": "free_requested", "addr": 1000, "size": 150, "stream": 7},
        {"action": "free_completed", "addr": 1000, "size": 150, "stream": 7},
        {"action": "free_completed", "addr": 50, "size": 40, "stream": 0},  # from before
        {"action": "oom", "addr": 0, "size": 500, "stream": 0},
        {"action": "segment_unmap", "addr": 0, "size": 200, "stream": 7},
        {"action": "alloc", "addr": 3000, "size": 90, "stream": 0, "frames": BWD},
        {"action": "free_completed", "addr": 2000, "size": 250, "stream": 0},
    ]
    # at the end: the 60 bytes left of before, the backward's 90; 300 + 400 reserved
    segs = [{"device": 0, "stream": 0, "total_size": 700, "allocated_size": 150},
            {"device": 1, "stream": 0, "total_size": 999, "allocated_size": 999}]
    return {"segments": segs, "device_traces": [ev, []]}


def test_the_summary_finds_the_peak_and_the_reserved_memory_per_stream():
    s = summarize(snapshot(), 0)
    assert s["allocated_before_bytes"] == 100
    assert s["allocated_peak_bytes"] == 100 + 150 + 250
    assert s["allocated_at_peak_by_source"] == {"forward": 250, "fsdp:foreach_all_gather": 150,
                                                "before": 100}
    assert s["allocated_in_step_at_peak_by_stream"] == {"7": 150, "0": 250}
    # reserved before the step: 700 at the end - 300 - 200 + 200 mapped in it = 400
    assert s["reserved_peak_bytes"] == 400 + 200 + 300
    assert s["reserved_at_peak_by_stream"] == {"0": 700, "7": 200}
    assert s["reserved_stream_peaks"] == {"0": 700, "7": 200}
    assert s["ooms"] == 1 and s["events"] == 11
    other = summarize(snapshot(), 1)  # no events: everything was there before
    assert other["allocated_peak_bytes"] == other["allocated_before_bytes"] == 999
    # the sites alive at the peak, most bytes first (the backward's block came after it)
    assert s["largest_at_peak"] == [
        {"site": "model.py:7 forward",
         "bytes": 250, "blocks": 1, "largest_block": 250},
        {"site": "_fsdp_collectives.py:1 foreach_all_gather < runner.py:2 run_here",
         "bytes": 150, "blocks": 1, "largest_block": 150}]


def test_a_site_is_the_library_call_and_the_first_frame_outside_torch():
    assert site(FSDP) == "_fsdp_collectives.py:1 foreach_all_gather < runner.py:2 run_here"
    assert site(FWD) == "model.py:7 forward"  # the model's own line allocated it
    assert site(CKPT) == "checkpoint.py:3 unpack_hook"  # torch's frames only
    assert site([]) == "autograd engine"


def test_the_step_recorded_is_the_last_warm_up_one_where_there_is_one():
    assert recorded_step(0, 2) == 1 and recorded_step(0, 5) == 4  # no timed step slowed
    assert recorded_step(0, 1) == 1 and recorded_step(0, 0) == 0  # the first timed one
    assert recorded_step(6, 2) == 6  # resumed past the warm-up: the first step run


def test_a_run_on_cpus_records_nothing_and_says_so(tmp_path):
    wl = workloads.get("gpt-tiny")
    plan = Plan.single(capture_graph(wl))
    rep = run_plan(plan, wl, cluster=preset("cpu-x2"), options=RunOptions(
        steps=3, warmup=1, reference=False, memory_dir=str(tmp_path / "mem")))
    assert rep.error is None and "memory_record" not in rep.extra
    assert not (tmp_path / "mem").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_each_rank_of_an_fsdp_run_writes_its_allocator_record(tmp_path):
    wl = workloads.get("gpt-tiny")
    plan = Plan.single(capture_graph(wl)).with_parallel(data=2, shard="fsdp")
    rep = run_plan(plan, wl, cluster=Cluster.detect().subset([0, 1]), options=RunOptions(
        steps=4, warmup=2, reference=False, memory_dir=str(tmp_path)))
    assert rep.error is None, rep.error
    for r in (0, 1):
        assert (tmp_path / f"memory-rank{r}.pickle").stat().st_size > 0
        dev = json.loads((tmp_path / f"memory-rank{r}.json").read_text())["devices"][0]
        assert dev["events"] > 0 and dev["allocated_peak_bytes"] > dev["allocated_before_bytes"]
        assert any(k.startswith("fsdp:") for k in dev["allocated_at_peak_by_source"])
        assert len(dev["reserved_stream_peaks"]) >= 2  # FSDP2's collectives' own streams
        assert dev["allocated_peak_bytes"] <= rep.peak_memory_bytes[r] * 1.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_recomputed_plan_records_its_step(tmp_path):
    """Recording the allocator's history does not break a checkpointed region's
    recomputation (max pooling's and cuDNN LSTM's backward raised a SystemError when every
    free's stack was recorded too)."""
    from autoplace.lowering import block_group_ids, block_groups

    for name, opts in (("inception-v3", dict(image_size=75, width=0.25, batch_size=4)),
                       ("gnmt-2", dict(hidden=64, vocab_size=500, src_len=8, tgt_len=8,
                                       batch_size=8))):
        wl = workloads.get(name, **opts)
        g = capture_graph(wl)
        groups = block_groups(g)
        plan = Plan.from_groups(g, groups, [0] * (max(groups.values()) + 1),
                                recompute=block_group_ids(g, groups))
        out = tmp_path / name
        rep = run_plan(plan, wl, cluster=Cluster.detect().subset([0]), options=RunOptions(
            steps=3, warmup=2, reference=False, memory_dir=str(out)))
        assert rep.error is None, rep.error
        dev = json.loads((out / "memory-rank0.json").read_text())["devices"][0]
        assert dev["events"] > 0 and dev["largest_at_peak"]
        assert dev["allocated_peak_bytes"] > dev["allocated_before_bytes"]
