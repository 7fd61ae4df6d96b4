"""The simulated step of offloaded plans (sim/offload.py): host-link copies per FSDP2 unit,
overlapped like FSDP2's prefetch, the optimizer on the CPU, GPU memory without the
parameters' state; and the cluster's host-link fields."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import Cluster, preset
from autoplace.errors import AutoplaceError
from autoplace.lowering import block_group_ids, block_groups
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.model import UPDATE_TRAFFIC_PER_PARAM_BYTE, fsdp_units, graph_arrays


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get("gpt-small", device="meta"))


def no_host(cluster: Cluster, **fields) -> Cluster:
    """``cluster`` without host issue costs (the copies and the update are what is timed)."""
    return replace(cluster, devices=tuple(
        replace(d, host_dispatch_s=0.0, ddp_param_host_s=0.0, shard_param_host_s=0.0,
                copy_host_s=0.0, **fields) for d in cluster.devices))


def blocks_plan(graph, recompute: bool = False, **parallel) -> Plan:
    groups = block_groups(graph)
    return Plan.from_groups(graph, groups, [0] * (max(groups.values()) + 1),
                            recompute=block_group_ids(graph, groups) if recompute else set(),
                            parallel=ParallelConfig(**parallel))


def test_memory_leaves_the_state_on_the_host(graph):
    cluster = no_host(preset("h200x2"))
    params = float(graph_arrays(graph).param_bytes.sum())
    single = simulate(graph, blocks_plan(graph), cluster)
    one = simulate(graph, blocks_plan(graph, shard="fsdp", offload=True), cluster)
    two = simulate(graph, blocks_plan(graph, data=2, shard="fsdp", offload=True), cluster)
    b1, b2 = one.memory_breakdown[0], two.memory_breakdown[0]
    state = lambda b: b["params"] + b["grads"] + b["optimizer"]  # noqa: E731
    assert b1["optimizer"] == 0 and b1["grads"] < params
    # on the GPU: the root's and two blocks' parameters and gradients, not 4x every one
    assert state(b1) < 0.6 * 4 * params
    # fp32 shard, its gradient and AdamW's two moments, split over the ranks
    assert b1["host"] == pytest.approx(4 * params, rel=1e-6)
    assert b2["host"] == pytest.approx(2 * params, rel=1e-6)
    # AdamW's state and most parameters leave; the gathered units and their gradients stay
    assert single.peak_memory_bytes[0] - one.peak_memory_bytes[0] > params
    assert one.peak_memory_bytes[1] == 0  # a one-device plan leaves the second GPU alone
    assert two.peak_memory_bytes[0] == two.peak_memory_bytes[1] < one.peak_memory_bytes[0]



def test_unsharded_gradients_are_counted_once(graph):
    """Each unit's unsharded gradients (and their fp32 copy) are the timeline's, at its
    reduce-scatter, on one rank as on several (FSDP2 reduce-scatters in a group of one
    too), not state held through the step: at the peak, the backward's start, none exists
    yet (one H200, gpt-1b). The gathered units are at the gather dtype."""
    cluster = no_host(preset("h200x2"))
    ga = graph_arrays(graph)
    fu = fsdp_units(ga, [0] * ga.n, 1, "blocks", blocks_plan(graph, data=2, shard="fsdp"))
    root = sum(b for b, r in zip(fu.unit_bytes, fu.root) if r)
    largest = max(b for b, r in zip(fu.unit_bytes, fu.root) if not r)
    for data in (1, 2):
        res = simulate(graph, blocks_plan(graph, data=data, shard="fsdp", offload=True),
                       cluster)
        b = res.memory_breakdown[0]
        assert b["grads"] == 0
        assert b["params"] == pytest.approx(ga.gather_scale * (root + 2 * largest))
        # the largest reduce-scatter (a unit's gradients at the gather dtype and their
        # fp32 copy) is within the timeline's peak
        assert b["activations"] + b["transient"] >= largest * (1 + ga.gather_scale)


def test_recurrent_weights_keep_their_packed_copy_when_offloaded():
    """A rank on GPUs holds cuDNN's packed copy of every LSTM's gathered weights (as FSDP2
    without offload does); a CPU packs nothing apart."""
    g = capture_workload(workloads.get("gnmt-2", device="meta", hidden=64, vocab_size=500,
                                       src_len=8, tgt_len=8, batch_size=8))
    ga = graph_arrays(g)
    packed = float(ga.packed_bytes.sum())
    assert packed > 0
    cluster = no_host(preset("h200x2"))
    plan = lambda **p: Plan.from_groups(g, {op.name: 0 for op in g}, [0],  # noqa: E731
                                        parallel=ParallelConfig(shard="fsdp", **p))
    off = simulate(g, plan(data=2, offload=True), cluster).memory_breakdown[0]["params"]
    on_cpu = simulate(g, plan(data=2, offload=True), preset("cpu-x2"))
    assert off - on_cpu.memory_breakdown[0]["params"] == pytest.approx(packed)


def test_copies_per_unit_and_the_update_on_the_cpu(graph):
    cluster = no_host(preset("h200x1"), host_bandwidth=10e9, host_memory_bandwidth=5e9)
    plan = blocks_plan(graph, shard="fsdp", offload=True)
    res = simulate(graph, plan, cluster, timeline=True)
    ga = graph_arrays(graph)
    units = fsdp_units(ga, [0] * ga.n, 1)
    h2d = [e for e in res.timeline if e.resource == "h2d"]
    d2h = [e for e in res.timeline if e.resource == "d2h"]
    # every unit copied in before its forward and again before its backward, out once
    assert sorted(e.name for e in h2d) == sorted(2 * [f"unit{u}" for u in
                                                     range(len(units.unit_bytes))])
    assert sorted(e.name for e in d2h) == sorted(f"unit{u}" for u in range(len(units.unit_bytes)))
    for e in h2d + d2h:
        u = int(e.name.removeprefix("unit"))
        assert e.end_s - e.start_s == pytest.approx(units.unit_bytes[u] / 10e9)
    # one copy at a time each way, and each unit's backward copy after its forward one
    for events in (h2d, d2h):
        spans = sorted((e.start_s, e.end_s) for e in events)
        assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))
    (update,) = [e for e in res.timeline if e.kind == "update"]
    assert update.resource == "host0"
    assert update.end_s - update.start_s == pytest.approx(
        UPDATE_TRAFFIC_PER_PARAM_BYTE * ga.param_bytes.sum() / 5e9)
    assert update.start_s >= max(e.end_s for e in d2h + [x for x in res.timeline
                                                         if x.kind == "bwd"]) - 1e-12
    assert res.step_time_s == pytest.approx(update.end_s)


def test_copies_overlap_compute_and_a_slower_link_costs_more(graph):
    plan = blocks_plan(graph, shard="fsdp", offload=True)
    steps = {}
    for bw in (1e15, 20e9, 5e9, 1e9):
        cluster = no_host(preset("h200x1"), host_bandwidth=bw)
        steps[bw] = simulate(graph, plan, cluster).step_time_s
    assert steps[1e15] < steps[20e9] < steps[5e9] < steps[1e9]
    ga = graph_arrays(graph)
    copies = 3 * ga.param_bytes.sum() / 5e9  # in twice, out once
    # the copies run beside the compute (FSDP2's prefetch): less than their sum is added
    assert steps[5e9] - steps[1e15] < 0.9 * copies


def test_cpu_devices_copy_nothing(graph):
    cluster = no_host(preset("cpu-x2"))
    res = simulate(graph, blocks_plan(graph, shard="fsdp", offload=True), cluster,
                   timeline=True)
    assert not [e for e in res.timeline if e.resource in ("h2d", "d2h")]
    assert [e for e in res.timeline if e.kind == "update"]


def test_batch_equals_one_by_one(graph):
    cluster = preset("a100x2")
    plans = [blocks_plan(graph), blocks_plan(graph, shard="fsdp", offload=True),
             blocks_plan(graph, True, data=2, shard="fsdp", offload=True),
             blocks_plan(graph, data=2, shard="fsdp")]
    batch = simulate_batch(graph, plans, cluster)
    for i, p in enumerate(plans):
        res = simulate(graph, p, cluster)
        assert batch.step_time_s[i] == pytest.approx(res.step_time_s, rel=1e-9)
        assert list(batch.peak_memory_bytes[i]) == res.peak_memory_bytes


def test_recompute_cuts_the_offloaded_activations(graph):
    # the compute bounds the step (else the copies or the CPU update hide recomputation)
    cluster = no_host(preset("h100x1"), host_bandwidth=1e15, host_memory_bandwidth=1e15)
    plain = simulate(graph, blocks_plan(graph, shard="fsdp", offload=True), cluster)
    ckpt = simulate(graph, blocks_plan(graph, True, shard="fsdp", offload=True), cluster)
    assert ckpt.memory_breakdown[0]["activations"] < plain.memory_breakdown[0]["activations"]
    assert ckpt.step_time_s > plain.step_time_s


# ------------------------------------------------------------------ cluster fields
def test_presets_and_files_carry_the_host_link():
    assert preset("h200x2").devices[0].host_bandwidth == 50e9
    assert preset("h100x1").devices[0].host_bandwidth == 50e9
    assert preset("a100x2").devices[0].host_bandwidth == 25e9
    c = replace(preset("h200x2"), devices=tuple(
        replace(d, host_bandwidth=33e9, host_memory_bandwidth=44e9) for d in preset("h200x2").devices))
    back = Cluster.from_json(json.loads(json.dumps(c.to_json())))
    assert back.devices[1].host_bandwidth == 33e9 and back.devices[1].host_memory_bandwidth == 44e9


def test_a_file_without_host_fields_reads_with_defaults():
    data = preset("h200x2").to_json()
    for d in data["devices"]:
        del d["host_bandwidth"], d["host_memory_bandwidth"]
    c = Cluster.from_json(data)
    assert c.devices[0].host_bandwidth == 25e9 and c.devices[0].host_memory_bandwidth == 20e9


def test_bad_host_bandwidth_is_named():
    data = preset("h200x2").to_json()
    data["devices"][0]["host_bandwidth"] = 0
    with pytest.raises(AutoplaceError, match="host_bandwidth must be a positive"):
        Cluster.from_json(data)
