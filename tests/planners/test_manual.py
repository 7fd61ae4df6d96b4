"""The hand-written options: split by analytic costs whatever a profile says."""

from __future__ import annotations

import pytest

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.costs import estimate_costs
from autoplace.lowering import block_regions
from autoplace.planners.manual import analytic_copy, halves_name, hand_written, lever_plans
from autoplace.search.auto import signature


@pytest.fixture(scope="module")
def graphs():
    wl = workloads.get("gpt-tiny", device="meta")
    plain = capture_workload(wl)
    profiled = capture_workload(wl)
    cluster = preset("h100x2")
    estimate_costs(plain, cluster)
    # a "profile" that makes the first half of the ops ten times slower than estimated
    estimate_costs(profiled, cluster)
    kind = cluster.devices[0].kind
    for i, op in enumerate(profiled):
        if i < len(profiled) // 2:
            op.fwd_time_s[kind] *= 10
            op.bwd_time_s[kind] *= 10
            op.fwd_host_s[kind] = 1e-3
    return plain, profiled, cluster


def test_the_options_and_their_names(graphs):
    plain, _, cluster = graphs
    opts = hand_written(plain, cluster, levers=False)
    assert list(opts) == ["single", "two-halves", "ddp", "fsdp", "pipeline-gpipe",
                          "pipeline-1f1b"]
    blocks = ["checkpoint-blocks", "selective-blocks", "ddp+checkpoint-blocks",
              "compile-blocks", "checkpoint-blocks+compile", "selective-blocks+compile"]
    assert list(hand_written(plain, cluster)) == [
        *opts, *blocks, "fsdp+offload", "fsdp+offload+checkpoint-blocks", "ddp+compile",
        "fsdp+compile-blocks", "fsdp+checkpoint-blocks+compile"]
    assert list(lever_plans(plain, preset("cpu-x2"))) == blocks[:3]  # no compile on CPUs
    ddp_ckpt = hand_written(plain, cluster)["ddp+checkpoint-blocks"]
    assert ddp_ckpt.parallel.data == 2 and ddp_ckpt.recompute
    fc = hand_written(plain, cluster)["fsdp+compile-blocks"]
    assert fc.parallel.compile and fc.parallel.shard == "fsdp" and not fc.recompute
    ckpt = hand_written(plain, cluster)["fsdp+checkpoint-blocks+compile"]
    assert fc.groups == ckpt.groups  # compiled in the same pieces: the blocks
    assert ckpt.parallel.compile and ckpt.parallel.shard == "fsdp" and ckpt.recompute
    regions = dict(zip(plain.order, block_regions(plain)))
    computed = [op for op in plain.order if plain.ops[plain.index[op]].kind
                not in ("input", "param", "output")]
    assert {regions[op] for op in computed if ckpt.groups[op] in ckpt.recompute} == \
        {"blocks.0", "blocks.1"}  # the blocks are checkpointed, nothing else
    assert all(regions[op] for op in computed if ckpt.groups[op] in ckpt.recompute)
    assert opts["two-halves"].devices_per_replica == 2
    assert opts["two-halves"].parallel.microbatches == 1
    assert opts["ddp"].parallel.data == 2 and opts["fsdp"].parallel.shard == "fsdp"
    assert opts["pipeline-1f1b"].parallel.pipeline == 2
    assert opts["pipeline-1f1b"].parallel.microbatches == 8
    assert halves_name(2) == "two-halves" and halves_name(4) == "4-parts"
    assert list(hand_written(plain, preset("h100x1"), levers=False)) == ["single", "ddp",
                                                                           "fsdp"]


def test_splits_ignore_the_profile(graphs):
    plain, profiled, cluster = graphs
    by_analytic = hand_written(plain, cluster)
    by_profile = hand_written(profiled, cluster)
    for k in by_analytic:
        assert signature(by_analytic[k]) == signature(by_profile[k]), k
    # the profile-balanced expert split does move: the test's profile matters
    assert signature(planners.get("expert")(profiled, cluster)) != \
        signature(by_analytic["two-halves"])


def test_analytic_copy_leaves_the_graph_alone(graphs):
    _, profiled, cluster = graphs
    kind = cluster.devices[0].kind
    before = profiled.fwd_times(kind).copy()
    copy = analytic_copy(profiled, cluster)
    assert (profiled.fwd_times(kind) == before).all()
    assert copy.batch_size == profiled.batch_size
    assert not any(op.fwd_host_s for op in copy)
    assert copy.fwd_times(kind).sum() < before.sum()
