"""Host issue time of one-process plans (``Device.host_dispatch_s``) in the simulator."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from autoplace.cluster import GPU_HOST_DISPATCH_S, Cluster, Device, preset
from autoplace.graph import OpGraph, OpNode, random_dag
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import lower_bound, simulate, simulate_batch

GiB = 2**30


def with_host(cluster: Cluster, host: float) -> Cluster:
    """``cluster`` with every device's ``host_dispatch_s`` set to ``host``."""
    return replace(cluster, devices=tuple(replace(d, host_dispatch_s=host)
                                          for d in cluster.devices))


def zoo_graph(name: str) -> OpGraph:
    pytest.importorskip("autoplace.capture")
    from autoplace import workloads
    from autoplace.capture import capture_workload

    return capture_workload(workloads.get(name, device="meta"))


def chain(n: int, fwd: float, nbytes: int = 2**20) -> OpGraph:
    """``n`` equal ops in a chain (``fwd`` seconds forward, twice that backward, on cpu)."""
    nodes = [OpNode(name=f"op{i}", kind="Linear", module_path=f"layers.{i}",
                    output_bytes=nbytes, param_bytes=nbytes, activation_bytes=nbytes,
                    fwd_time_s={"cpu": fwd}, bwd_time_s={"cpu": 2 * fwd}) for i in range(n)]
    return OpGraph(f"chain{n}", nodes, [(f"op{i}", f"op{i + 1}", nbytes) for i in range(n - 1)])


def split(graph: OpGraph, k: int, **parallel) -> Plan:
    """Ops cut into ``k`` contiguous runs, run ``j`` on local device ``j``."""
    n = len(graph)
    return Plan.from_assignment(graph, {op.name: i * k // n for i, op in enumerate(graph)},
                                parallel=ParallelConfig(**parallel))


def random_local_plan(graph: OpGraph, rng: random.Random, k: int, m: int) -> Plan:
    num_groups = rng.choice([4, 8, len(graph)])
    groups = {op.name: i * num_groups // len(graph) for i, op in enumerate(graph)}
    placement = [rng.randrange(k) for _ in range(num_groups)]
    placement[0], placement[-1] = 0, k - 1  # use all k devices
    rc = {g for g in range(num_groups) if rng.random() < 0.2}
    return Plan.from_groups(graph, groups, placement,
                            parallel=ParallelConfig(microbatches=m), recompute=rc)


def mixed_plans(graph: OpGraph, rng: random.Random, n_dev: int, per: int) -> list[Plan]:
    """Random one-process placements over 2 and ``n_dev`` devices with 1, 2 and 4
    microbatches (``per`` of each), their data-parallel twins where they fit, and one
    device with 4 microbatches."""
    plans = [random_local_plan(graph, rng, k, m)
             for k in sorted({2, n_dev}) for m in (1, 2, 4) for _ in range(per)]
    plans += [p.with_parallel(data=2) for p in plans if p.devices_per_replica * 2 <= n_dev]
    plans.append(Plan.single(graph).with_parallel(microbatches=4))
    return plans


def assert_batch_equals_scalar(graph: OpGraph, plans: list[Plan], cluster: Cluster):
    """The batch simulator's step times equal the scalar one's; returns the batch result."""
    batch = simulate_batch(graph, plans, cluster)
    scalar = [simulate(graph, p, cluster) for p in plans]
    np.testing.assert_allclose(batch.step_time_s, [r.step_time_s for r in scalar], rtol=1e-12)
    return batch


# ------------------------------------------------------------------- cluster
def test_presets_and_defaults():
    assert Device(name="x", kind="cpu", memory_bytes=GiB).host_dispatch_s == 0.0
    assert all(d.host_dispatch_s == 0.0 for d in preset("cpu-x4").devices)
    for name in ("h100x2", "h200x4", "a100x8", "a100-pcie-x2"):
        assert all(d.host_dispatch_s == GPU_HOST_DISPATCH_S == 30e-6
                   for d in preset(name).devices)
        assert all(d.launch_overhead_s == 8e-6 for d in preset(name).devices)


def test_json_round_trip_and_old_files(tmp_path):
    c = with_host(preset("h200x2"), 45e-6)
    path = tmp_path / "c.json"
    c.save(path)
    assert json.loads(path.read_text())["devices"][0]["host_dispatch_s"] == 45e-6
    assert Cluster.load(path) == c
    # a file written before the field existed loads with the field's default, 0.0
    # (its simulated times are the ones it had)
    old = preset("h200x2").to_json()
    for d in old["devices"]:
        del d["host_dispatch_s"]
    loaded = Cluster.from_json(old)
    assert all(d.host_dispatch_s == 0.0 for d in loaded.devices)
    assert loaded == with_host(preset("h200x2"), 0.0)


# ------------------------------------------------------------ no host time
@pytest.mark.parametrize("name", ["gpt-tiny", "branchy-mlp", "rnnlm"])
def test_zero_host_time_changes_nothing(name):
    graph = zoo_graph(name)
    cpu = preset("cpu-x4")
    zeroed = with_host(cpu, 0.0)
    gpu0 = with_host(preset("h200x4"), 0.0)
    plans = [split(graph, k, microbatches=m) for k in (1, 2, 4) for m in (1, 2, 4)]
    for cluster, ref in ((cpu, zeroed), (gpu0, gpu0)):
        want = [simulate(graph, p, ref).step_time_s for p in plans]
        assert [simulate(graph, p, cluster).step_time_s for p in plans] == want
        assert simulate_batch(graph, plans, cluster).step_time_s.tolist() == want


def test_one_device_with_long_ops_waits_only_for_the_first_issue():
    # ops of 1 ms (0.25 ms per microbatch) >> 30 us: the host runs ahead of the device
    # after the first op is issued, so the step is one dispatch longer
    graph = chain(20, 1e-3)
    base = preset("cpu-x2")
    host = with_host(base, 30e-6)
    for m in (1, 4):
        plan = Plan.single(graph).with_parallel(microbatches=m)
        t0 = simulate(graph, plan, base).step_time_s
        t1 = simulate(graph, plan, host).step_time_s
        assert t1 == pytest.approx(t0 + 30e-6, rel=1e-12, abs=1e-12)
        assert simulate_batch(graph, [plan], host).step_time_s[0] == pytest.approx(t1, rel=1e-12)


# ------------------------------------------------------------ host-bound plans
def test_many_microbatches_on_gpus_are_host_bound():
    graph = zoo_graph("gpt-small")
    n = len(graph)
    cluster = preset("h200x4")
    h = cluster.devices[0].host_dispatch_s
    no_host = with_host(cluster, 0.0)
    slow = {}
    for m in (1, 8):
        plan = split(graph, 4, microbatches=m)
        res = simulate(graph, plan, cluster, timeline=True)
        t0 = simulate(graph, plan, no_host).step_time_s
        # one thread issues all m x n forward items before the backward starts
        assert res.step_time_s >= m * n * h
        assert res.step_time_s >= res.lower_bound_s
        slow[m] = res.step_time_s - t0
        fwd = sorted((e for e in res.timeline if e.kind == "fwd"), key=lambda e: e.start_s)
        assert fwd[-1].start_s >= m * n * h * (1 - 1e-12)
    assert slow[8] >= 8 * n * h  # the GPUs are idle most of the forward
    assert slow[1] < slow[8] / 4


def test_backward_host_threads_run_per_device():
    # 2 devices, ops far shorter than a dispatch: the forward issue is serial over both
    # devices (2n dispatches), each backward thread issues only its own n/2 ops per mb,
    # device 0's once device 1's thread has issued the consumer of its last op: device 1
    # issues the later microbatch's half first (highest sequence number), device 0 then
    # follows microbatch by microbatch (m * 10 dispatches after device 1's first 10)
    graph = chain(20, 1e-9, nbytes=0)
    h = 1e-3
    cluster = with_host(Cluster.uniform("t", replace(preset("cpu-x1").devices[0],
                                                     launch_overhead_s=0.0),
                                        2, alpha_s=0.0, bandwidth=1e15), h)
    for m in (1, 2):
        plan = split(graph, 2, microbatches=m)
        res = simulate(graph, plan, cluster, timeline=True)
        assert res.step_time_s == pytest.approx((m * 20 + 10 + m * 10) * h, rel=1e-3)
        assert simulate_batch(graph, [plan], cluster).step_time_s[0] == pytest.approx(
            res.step_time_s, rel=1e-12)


# ------------------------------------------------------------ scalar == batch
@pytest.mark.parametrize("cluster_name", ["h200x2", "h200x4", "cpu-host"])
def test_batch_equals_scalar_with_host_time(cluster_name):
    rng = random.Random(11)
    if cluster_name == "cpu-host":
        cluster = with_host(preset("cpu-x4"), 200e-6)
        graphs = [random_dag(80, seed=1), random_dag(40, seed=2)]
    else:
        cluster = preset(cluster_name)
        graphs = [random_dag(80, seed=1), zoo_graph("gpt-tiny")]
    for graph in graphs:
        plans = mixed_plans(graph, rng, cluster.num_devices, 4)
        batch = assert_batch_equals_scalar(graph, plans, cluster)
        no_host = simulate_batch(graph, plans, with_host(cluster, 0.0)).step_time_s
        # host time only delays a replica on one device; over several it can also change
        # the order autograd's threads issue the backward in, for better or worse
        one = np.array([p.devices_per_replica == 1 for p in plans])
        assert one.any()
        assert (batch.step_time_s[one] >= no_host[one]).all()
        assert (batch.step_time_s > no_host).any()
        lb = lower_bound(graph, cluster)
        assert (batch.step_time_s >= lb * (1 - 1e-12)).all()


def test_pipeline_stages_pay_their_own_host_time():
    """Each stage's process issues its ops itself: with a host time far above the ops'
    device times, a stage takes (stage ops x host time) per microbatch, forward and
    backward, and the stages work in parallel (not one host for all)."""
    graph = chain(16, 1e-5)
    cluster = preset("h200x4")
    plan = split(graph, 2, pipeline=2, microbatches=4)
    base = simulate(graph, plan, with_host(cluster, 0.0)).step_time_s
    assert simulate(graph, plan, cluster).step_time_s >= base
    h = 1e-3
    slow = simulate(graph, plan, with_host(cluster, h)).step_time_s
    ops = len(graph.order) / 2  # per stage (inputs and parameters included)
    assert slow >= 2 * 4 * ops * h * 0.9  # 4 microbatches, forward and backward
    assert slow < 2 * 4 * 2 * ops * h  # the two stages' hosts overlap


# ------------------------------------------------ per-parameter host time of DP plans
def with_param_host(cluster: Cluster, ddp: float, shard: float) -> Cluster:
    return replace(cluster, devices=tuple(replace(d, ddp_param_host_s=ddp,
                                                  shard_param_host_s=shard)
                                          for d in cluster.devices))


def param_chain(n: int, fwd: float) -> OpGraph:
    """``chain`` whose ops are calls of modules ``blocks.<i>`` owning two parameter tensors
    each (each a block: an FSDP2 unit of its own)."""
    g = chain(n, fwd)
    for i, op in enumerate(g):
        op.module_path = op.target = f"blocks.{i}"
        op.param_names = (f"{op.module_path}.weight", f"{op.module_path}.bias")
    return OpGraph(g.name, list(g), g.edges)


def test_gpu_presets_carry_per_parameter_host_times():
    for name in ("h100x2", "h200x4"):
        assert all(d.ddp_param_host_s > 0 and d.shard_param_host_s > 0
                   for d in preset(name).devices)
    assert all(d.ddp_param_host_s == d.shard_param_host_s == 0.0
               for d in preset("cpu-x2").devices)


def test_ddp_hook_time_bounds_short_ops_and_hides_behind_long_ones():
    cluster = with_host(preset("cpu-x2"), 10e-6)
    hook = 1e-3
    for fwd, bound in ((1e-7, True), (1e-1, False)):
        graph = param_chain(10, fwd)
        plan = Plan.single(graph).with_parallel(data=2)
        t0 = simulate(graph, plan, cluster).step_time_s
        t1 = simulate(graph, plan, with_param_host(cluster, hook, 0.0)).step_time_s
        if bound:  # the autograd thread issues 10 backward ops of 2 hooks each
            assert t1 - t0 == pytest.approx(20 * hook, rel=0.05)
        else:  # 1 ms a parameter is nothing beside 200 ms backward ops
            assert t1 - t0 < 2 * hook
        assert simulate_batch(graph, [plan], with_param_host(cluster, hook, 0.0)
                              ).step_time_s[0] == pytest.approx(t1, rel=1e-12)
        # not DDP: no hooks (one replica, or sharded)
        for other in (Plan.single(graph), plan.with_parallel(shard="zero2")):
            assert simulate(graph, other, with_param_host(cluster, hook, 0.0)).step_time_s \
                == simulate(graph, other, cluster).step_time_s


def test_sharded_plans_per_parameter_work_runs_on_the_host_threads():
    """FSDP2's work per parameter tensor and collective (fsdp: gather in forward, gather
    and reduce-scatter in backward; zero2: no backward gather) is issued by the forward
    host thread and the autograd threads: it bounds a step of short ops and hides behind
    long ones. Pipeline stages add it to the step (``sharded_host_s``)."""
    from autoplace.sim import sharded_host_s

    c = 0.5e-3
    base = preset("cpu-x2")
    cluster = with_param_host(base, 0.0, c)
    for fwd, bound in ((1e-7, True), (1e-1, False)):
        graph = param_chain(12, fwd)  # 12 ops of 2 parameter tensors
        for shard, phases in (("fsdp", 3), ("zero2", 2), ("none", 0)):
            plan = Plan.single(graph).with_parallel(data=2, shard=shard)
            assert sharded_host_s(graph, plan, cluster) == 0.0  # one process: in the clocks
            t0 = simulate(graph, plan, base).step_time_s
            t1 = simulate(graph, plan, cluster).step_time_s
            if bound:  # the host's work, with what the devices do in its shadow
                assert phases * 24 * c <= t1 <= phases * 24 * c + t0, shard
                assert (t1 == t0) == (phases == 0)
            else:  # only the first gather's and the last reduce-scatter's work show
                assert t1 - t0 <= 4 * c + 1e-9, shard
            assert simulate_batch(graph, [plan], cluster).step_time_s[0] == pytest.approx(
                t1, rel=1e-12)
    graph = param_chain(12, 1e-4)
    c4 = with_param_host(preset("cpu-x4"), 0.0, c)
    for shard, phases in (("fsdp", 3), ("zero2", 2)):
        plan = split(graph, 2, pipeline=2, microbatches=2).with_parallel(data=2, shard=shard)
        assert sharded_host_s(graph, plan, c4) == pytest.approx(phases * 12 * c)
        res = simulate(graph, plan, c4, timeline=True)
        assert res.step_time_s == pytest.approx(
            simulate(graph, plan, preset("cpu-x4")).step_time_s + phases * 12 * c, rel=1e-12)
        assert any(e.resource == "host" for e in res.timeline)


# ------------------------------------------------------- profiled per-op host times
def with_op_host(graph: OpGraph, kind: str, fwd: float, bwd: float) -> OpGraph:
    """``graph`` with every op's profiled host times on ``kind`` set (``OpNode.fwd_host_s``)."""
    for op in graph:
        op.fwd_host_s[kind] = fwd
        op.bwd_host_s[kind] = bwd
    return graph


def test_op_host_times_replace_the_device_constant():
    """Profiled per-op host times take the place of ``host_dispatch_s``: with them equal
    to the constant the step is the same; a graph whose kind has none keeps the constant."""
    cluster = with_host(preset("cpu-x2"), 50e-6)
    plans = lambda g: [split(g, 2), split(g, 2, microbatches=4), Plan.single(g),  # noqa: E731
                       split(g, 2, pipeline=2, microbatches=4)]
    ref = [simulate(chain(24, 2e-5), p, cluster).step_time_s for p in plans(chain(24, 2e-5))]
    g = with_op_host(chain(24, 2e-5), "cpu", 50e-6, 50e-6)
    now = [simulate(g, p, with_host(cluster, 0.0)).step_time_s for p in plans(g)]
    np.testing.assert_allclose(now, ref, rtol=1e-12)
    other = with_op_host(chain(24, 2e-5), "h200", 1.0, 1.0)  # another kind's: unused
    np.testing.assert_allclose([simulate(other, p, cluster).step_time_s for p in plans(other)],
                               ref, rtol=1e-12)


def test_host_bound_placement_is_no_faster_than_one_device():
    """Ops whose host time matches their device time (small ops issued from Python) gain
    nothing from microbatches flowing through two devices in one process: the forward's
    one host thread issues every op of every microbatch; with the constant 30 us the
    flow seemed to overlap the two devices."""
    g = chain(40, 100e-6)
    cluster = preset("h200x2")
    kind = cluster.devices[0].kind
    for op in g:
        op.fwd_time_s[kind], op.bwd_time_s[kind] = 100e-6, 200e-6
    flow, one = split(g, 2, microbatches=2), Plan.single(g)
    fast = simulate(g, flow, cluster).step_time_s
    assert fast < 0.9 * simulate(g, one, cluster).step_time_s
    with_op_host(g, kind, 100e-6, 100e-6)
    assert simulate(g, one, cluster).step_time_s == pytest.approx(
        40 * 100e-6 + 40 * 200e-6, rel=0.05)
    slow = simulate(g, flow, cluster).step_time_s
    assert slow > 1.2 * fast
    assert slow >= 2 * 40 * 100e-6  # every op of both microbatches issued by one thread


@pytest.mark.parametrize("cluster_name", ["h200x2", "h200x4"])
def test_batch_equals_scalar_with_op_host_times(cluster_name):
    rng = random.Random(5)
    cluster = preset(cluster_name)
    kind = cluster.devices[0].kind
    graph = zoo_graph("gpt-tiny")
    r = np.random.default_rng(0)
    for op in graph:
        op.fwd_host_s[kind], op.bwd_host_s[kind] = r.uniform(5e-6, 80e-6, size=2)
    assert_batch_equals_scalar(graph, mixed_plans(graph, rng, cluster.num_devices, 3), cluster)


def test_pipeline_stage_pays_the_sum_of_its_ops_host_times():
    g = chain(16, 1e-6)
    cluster = with_host(preset("h200x2"), 0.0)
    kind = cluster.devices[0].kind
    for op in g:
        op.fwd_time_s[kind], op.bwd_time_s[kind] = 1e-6, 2e-6
    plan = split(g, 2, pipeline=2, microbatches=4)
    base = simulate(g, plan, cluster).step_time_s
    for i, op in enumerate(g):  # the second stage's ops are slow to issue
        op.fwd_host_s[kind], op.bwd_host_s[kind] = (1e-3, 2e-3) if i >= 8 else (0.0, 0.0)
    slow = simulate(g, plan, cluster).step_time_s
    assert slow >= 4 * 8 * (1e-3 + 2e-3) * 0.95 > 10 * base


def test_host_time_above_its_fixed_part_shrinks_with_the_microbatch():
    """A host time with a profiled fixed part scales like a device time: with fixed part
    0 each of 4 microbatches pays a quarter of it; with no fixed part known, all of it."""
    g = chain(16, 1e-6)
    cluster = with_host(preset("h200x2"), 0.0)
    kind = cluster.devices[0].kind
    for op in g:
        op.fwd_time_s[kind], op.bwd_time_s[kind] = 1e-6, 2e-6
    with_op_host(g, kind, 1e-3, 2e-3)
    plan = split(g, 2, pipeline=2, microbatches=4)
    flow = split(g, 2, microbatches=4)
    whole = [simulate(g, p, cluster).step_time_s for p in (plan, flow)]
    for op in g:
        op.fwd_host_fixed_s[kind] = op.bwd_host_fixed_s[kind] = 0.0
    part = [simulate(g, p, cluster).step_time_s for p in (plan, flow)]
    np.testing.assert_allclose(part, [w / 4 for w in whole], rtol=0.05)
    np.testing.assert_allclose(simulate_batch(g, [flow], cluster).step_time_s, part[1:],
                               rtol=1e-12)


def test_graphed_plans_pay_host_time_per_piece_not_per_op():
    """``parallel.graphs``: one replay per run of ops on one device, whatever its ops;
    the scalar and the batch simulators agree."""
    from autoplace.sim.model import GRAPH_PARAM_HOST_S, GRAPH_PIECE_HOST_S, graphed_host

    graph = zoo_graph("gpt-small")
    cluster = preset("h200x2")
    plans = [split(graph, k, microbatches=m) for k in (1, 2) for m in (1, 4)]
    graphed = [p.with_parallel(graphs=True) for p in plans]
    eager_t = assert_batch_equals_scalar(graph, plans, cluster).step_time_s
    graphs_t = assert_batch_equals_scalar(graph, graphed, cluster).step_time_s
    # gpt-small's ops are short: eager it is host-bound, graphed far less so, and more
    # microbatches cost eager far more host time than graphed
    assert (graphs_t < eager_t).all()
    assert eager_t[1] / eager_t[0] > graphs_t[1] / graphs_t[0]
    # memory: every microbatch but the first holds its own copy of its pieces' gradients
    eager_b = simulate_batch(graph, plans, cluster).peak_memory_bytes
    graphs_b = simulate_batch(graph, graphed, cluster).peak_memory_bytes
    for plan, e, g in zip(plans, eager_b, graphs_b):
        m = plan.parallel.microbatches
        on = [sum(op.param_bytes for op in graph if plan.device_of(op.name) == j)
              for j in range(cluster.num_devices)]
        np.testing.assert_allclose(g - e, [(m - 1) * b for b in on], rtol=1e-9, atol=1)
        single = simulate(graph, plan.with_parallel(graphs=True), cluster)
        np.testing.assert_allclose(single.peak_memory_bytes, g, rtol=1e-9)
    # the per-op host time: a piece's cost on its first op, by its parameter tensors
    dev = np.array([0, 0, 0, 1, 1, 0])
    params = np.array([2, 0, 1, 3, 0, 4])
    want = [GRAPH_PIECE_HOST_S + 3 * GRAPH_PARAM_HOST_S, 0, 0,
            GRAPH_PIECE_HOST_S + 3 * GRAPH_PARAM_HOST_S, 0, GRAPH_PIECE_HOST_S + 4 * GRAPH_PARAM_HOST_S]
    np.testing.assert_allclose(graphed_host(dev, params), want)
    # a per-op rate (each op's device kind's): a profiled graph of several blocks holds
    # the parameters' replay work, so its kind adds only the piece's fixed cost
    rate = np.where(dev == 1, 0.0, GRAPH_PARAM_HOST_S)
    np.testing.assert_allclose(graphed_host(dev, params, rate),
                               [want[0], 0, 0, GRAPH_PIECE_HOST_S, 0, want[5]])


def test_graphed_share_over_several_blocks_drops_the_per_parameter_constant():
    """With a graph profile of one block the graphed plan pays 9 us per parameter tensor
    on top of the shared device time; timed over several blocks it does not."""
    from autoplace.sim.model import GRAPH_PARAM_HOST_S

    graph = zoo_graph("gpt-small")
    cluster = preset("h200x2")
    plan = split(graph, 1).with_parallel(graphs=True)
    kind = cluster.devices[0].kind
    tensors = sum(len(op.param_names) for op in graph)
    steps, before = {}, getattr(graph, "profile_info", None)
    try:
        for blocks in (1, 8):
            graph.profile_info = {kind: {"graphs": {"device_share": 0.5, "blocks": blocks}}}
            steps[blocks] = simulate(graph, plan, cluster).step_time_s
    finally:
        graph.profile_info = before
    assert 0 < steps[1] - steps[8] <= 2 * tensors * GRAPH_PARAM_HOST_S * (1 + 1e-9)


def test_backward_threads_take_the_latest_ready_node_first():
    """Autograd's ready queues: device 0's latest op X waits for device 1's thread (its
    consumer Q there is slow to issue), so device 0 issues the earlier, ready Y first,
    where the reversed forward order would have held Y behind X."""
    from types import SimpleNamespace

    from autoplace.sim.local import backward_issue

    # forward order P(1) Y(0) X(0) Q(1: X, P) Z(0: Y) S(1: Q, Z), the loss
    preds = [[], [], [], [2, 0], [1], [3, 4]]
    succs = [[3], [4], [3], [5], [5], []]
    ga = SimpleNamespace(n=6, preds=preds, succs=succs)
    dev = [1, 0, 0, 1, 0, 1]
    hb = [1.0, 1.0, 1.0, 5.0, 1.0, 5.0]
    items, issued, copied = backward_issue(ga, dev, list(range(6)), hb, [0.0, 0.0], 0.0, 2)
    assert copied is None
    assert items == [5, 4, 3, 1, 2, 0]  # S; Z before Q (a tie: latest first); Y before X
    assert [issued[i] for i in range(6)] == [11.0, 7.0, 11.0, 10.0, 6.0, 5.0]
    # no host costs: the reversed forward order
    assert backward_issue(ga, dev, list(range(6)), [0.0] * 6, [0.0, 0.0], 0.0, 2)[0] == \
        [5, 4, 3, 2, 1, 0]
    # copies back to the producer's device are tasks of the consumer's thread, just
    # before the consumer in priority: device 1 copies Z's gradient back first (S's,
    # 5-5.5), then issues Q (5.5-10.5), then copies X's (10.5-11); X follows at 11-12
    items, issued, copied = backward_issue(ga, dev, list(range(6)), hb, [0.5, 0.5], 0.0, 2)
    assert copied[4 * 2 + 1] == 5.5 and issued[4] == 6.5
    assert issued[3] == 10.5 and copied[2 * 2 + 1] == 11.0 and issued[2] == 12.0
    assert copied[2 * 2 + 0] == 0.0  # nothing of X's is copied from device 0


def test_checkpointing_costs_host_time_on_a_gpu_without_a_profiled_block(monkeypatch):
    """Where no block was profiled, each checkpointed region (a recomputed group) of a GPU
    kind adds RECOMPUTE_HOST_S (none by default), and a selective one SELECTIVE_HOST_S, to
    a host-bound step; a CPU's steps are left as they are; the batched simulator agrees."""
    from autoplace.sim import block_profile
    from autoplace.sim.block_profile import SELECTIVE_HOST_S

    graph = zoo_graph("gpt-small")
    gpu = preset("h200x2")
    groups = {op.name: i // 4 for i, op in enumerate(graph)}  # regions of 4 ops
    k = len(set(groups.values()))
    plain = Plan.from_groups(graph, groups, [0] * k)
    full = Plan.from_groups(graph, groups, [0] * k, recompute=set(range(k)))
    sel = Plan.from_groups(graph, groups, [0] * k, selective=set(range(k)))
    base = simulate(graph, plain, gpu).step_time_s
    rc = simulate(graph, full, gpu).step_time_s
    # gpt-small on one H200 is host-bound: the added host time shows nearly whole
    assert simulate(graph, sel, gpu).step_time_s - base > 0.8 * k * SELECTIVE_HOST_S
    cpu = preset("cpu-x2")
    before = [simulate(graph, p, cpu).step_time_s for p in (full, sel)]
    monkeypatch.setattr(block_profile, "RECOMPUTE_HOST_S", 2e-3)
    monkeypatch.setattr(block_profile, "SELECTIVE_HOST_S", 1.0)
    assert [simulate(graph, p, cpu).step_time_s for p in (full, sel)] == before
    assert simulate(graph, full, gpu).step_time_s - rc > 0.8 * k * 2e-3
    assert simulate(graph, sel, gpu).step_time_s > k
    assert_batch_equals_scalar(graph, [plain, full], gpu)  # the batched path prices it too


def test_an_eager_recompute_issues_its_forward_again_on_a_gpu_without_a_profiled_block():
    """The ops a full recompute runs again are issued again by the host in the backward:
    on a host-bound step (gpt-small on one H200, estimated costs) every checkpointed region
    adds its rerun ops' forward host time; a compiled plan recomputes inside its pieces and
    adds none of it; a CPU's op time is its host time, already counted with the
    rerun; the batched simulator agrees."""
    from autoplace.sim import block_profile
    from autoplace.sim.model import cost_tables, graph_arrays, rerun_ops

    graph = zoo_graph("gpt-small")
    gpu = preset("h200x1")
    groups = {op.name: i // 4 for i, op in enumerate(graph)}
    k = len(set(groups.values()))
    plain = Plan.from_groups(graph, groups, [0] * k)
    full = Plan.from_groups(graph, groups, [0] * k, recompute=set(range(k)))
    ga = graph_arrays(graph)
    rerun = rerun_ops(ga, [groups[n] for n in ga.names], frozenset(range(k)), frozenset())
    issued = rerun.sum() * gpu.devices[0].host_dispatch_s
    assert issued > 0
    base = simulate(graph, plain, gpu).step_time_s
    rc = simulate(graph, full, gpu).step_time_s
    assert rc - base > 0.8 * issued
    # without the re-issue (what the simulator priced before) the difference is smaller
    real = block_profile.reissued_forward
    try:
        block_profile.reissued_forward = lambda *a, **kw: np.zeros((1, ga.n), bool)
        assert simulate(graph, full, gpu).step_time_s < rc - 0.8 * issued
    finally:
        block_profile.reissued_forward = real
    assert rerun.sum() < sum(op.kind not in ("input", "param", "output") for op in graph.ops)
    compiled = simulate(graph, full.with_parallel(compile=True), gpu).step_time_s
    assert compiled - simulate(graph, plain.with_parallel(compile=True), gpu).step_time_s \
        < 0.5 * issued
    cpu = preset("cpu-x1")
    assert block_profile.reissued_forward(graph, cost_tables(graph, cpu), ga,
                                          np.array([groups[n] for n in ga.names]),
                                          frozenset(range(k))).sum() == 0
    assert_batch_equals_scalar(graph, [plain, full, full.with_parallel(compile=True)], gpu)
