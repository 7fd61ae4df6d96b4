"""The batched simulator equals the one-plan path on every placement family at 8 and 512
devices, its backward issue equals ``local.backward_issue`` task for task, and its slots
are each op's consumers' devices."""

from __future__ import annotations

import random

import numpy as np
import pytest

from autoplace import planners
from autoplace.cluster import preset
from autoplace.graph import OpGraph, OpNode, random_dag
from autoplace.lowering import issue_order_items
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.batch_issue import batch_backward_issue
from autoplace.sim.batch_sends import plan_sends
from autoplace.sim.local import backward_issue
from autoplace.sim.model import graph_arrays


def wide_sink(n: int) -> OpGraph:
    """A chain whose last op reads every earlier op (a fan-in past the dense table)."""
    nodes = [OpNode(name=f"op{i}", kind="Linear", module_path=f"l.{i}", output_bytes=2**16,
                    param_bytes=2**16, activation_bytes=2**16, fwd_time_s={"cuda": 1e-5},
                    bwd_time_s={"cuda": 2e-5}) for i in range(n)]
    edges = [(f"op{i}", f"op{i + 1}", 2**16) for i in range(n - 1)]
    edges += [(f"op{i}", f"op{n - 1}", 2**16) for i in range(n - 2)]
    return OpGraph(f"sink{n}", nodes, edges)


def family_plans(graph: OpGraph, cluster, rng: random.Random) -> list[Plan]:
    """Each placement family's plan (critical path, round-robin, hash, random), its
    devices relabelled, with 1 and 3 microbatches, data-parallel twins at 4 devices a
    replica, a recomputed variant, issue priorities, and 2-stage pipelines."""
    k = cluster.num_devices
    base = [planners.get(name)(graph, cluster) for name in ("critical-path", "round-robin",
                                                            "hash")]
    base += [planners.get("random")(graph, cluster, seed=s) for s in range(3)]
    plans = []
    for plan in base:
        perm = list(range(k))
        rng.shuffle(perm)
        placement = [perm[x] for x in plan.placement]
        g = len(placement)
        for m in (1, 3):
            plans.append(Plan.from_groups(graph, plan.groups, placement,
                                          parallel=ParallelConfig(microbatches=m)))
        half = [x % (k // 2) for x in placement]
        plans.append(Plan.from_groups(graph, plan.groups, half,
                                      parallel=ParallelConfig(data=2, microbatches=2)))
        plans.append(Plan.from_groups(graph, plan.groups, placement,
                                      recompute={x for x in range(g) if rng.random() < 0.3}))
        plans.append(Plan.from_groups(graph, plan.groups, placement,
                                      parallel=ParallelConfig(microbatches=2),
                                      priority=[rng.randrange(3) for _ in range(g)]))
    n = len(graph)
    halves = {op.name: 2 * i // n for i, op in enumerate(graph)}
    plans.append(Plan.from_groups(graph, halves, [0, 1],
                                  parallel=ParallelConfig(pipeline=2, microbatches=4)))
    return plans


@pytest.mark.parametrize("cluster_name", ["h200x8", "cpu-x4"])
def test_batch_equals_scalar_on_every_placement_family(cluster_name):
    cluster = preset(cluster_name)
    rng = random.Random(5)
    for graph in (random_dag(120, seed=2), wide_sink(24)):
        plans = family_plans(graph, cluster, rng)
        batch = simulate_batch(graph, plans, cluster)
        scalar = [simulate(graph, p, cluster) for p in plans]
        np.testing.assert_allclose(batch.step_time_s, [r.step_time_s for r in scalar],
                                   rtol=1e-9, atol=0)
        np.testing.assert_array_equal(batch.peak_memory_bytes,
                                      [r.peak_memory_bytes for r in scalar])


@pytest.mark.parametrize(("n", "m"), [(60, 1), (60, 3), (24, 2)])
def test_batch_issue_equals_backward_issue(n, m):
    """Order, issue times and copy times, plan by plan (the wide sink: past the table)."""
    graph = random_dag(n, seed=4) if n != 24 else wide_sink(n)
    ga = graph_arrays(graph)
    rng = random.Random(n + m)
    num, kk = 12, 5
    dev = np.array([[rng.randrange(kk) for _ in range(n)] for _ in range(num)])
    dev[:, 0] = kk - 1  # every plan uses all kk devices
    hb = np.array([[rng.choice([1e-5, 2e-5, 3e-5]) for _ in range(num)] for _ in range(n)])
    copy_h = np.array([2e-4] * kk)
    host_f = np.array([rng.random() * 1e-3 for _ in range(num)])
    copy_on = np.array([p % 4 != 3 for p in range(num)])  # some plans without copy tasks
    order_t = np.stack([np.array(issue_order_items(ga.preds, dev[p].tolist(), m))
                        for p in range(num)], 1)
    sends = plan_sends(ga, np.ascontiguousarray(dev.T))
    bpos, issued, copied = batch_backward_issue(ga, dev, order_t, m, hb, copy_h, copy_on,
                                                host_f, kk, sends)
    for p in range(num):
        order = order_t[:, p].tolist()
        items, iss, cop = backward_issue(ga, dev[p].tolist(), order, hb[:, p].tolist(),
                                         (copy_h if copy_on[p] else 0 * copy_h).tolist(),
                                         float(host_f[p]), kk)
        pos = {it: s for s, it in enumerate(order)}
        assert bpos[:, p].tolist() == [pos[it] for it in items]
        assert issued[:, p].tolist() == [iss[it] for it in items]
        if cop is not None:  # copied is per slot: back on devices, zero elsewhere
            by_dev = np.zeros((len(items), kk))
            ops = np.asarray(items) % n
            for j in range(1, sends.width):
                on = sends.used[ops, j, p]
                by_dev[np.flatnonzero(on), sends.dev[ops[on], j, p]] = copied[on, j, p]
            assert by_dev.tolist() == np.asarray(cop).reshape(-1, kk)[items].tolist()


def test_backward_issue_takes_no_task_before_its_consumers_are_issued():
    """A gradient's copy back is issued after every consumer on its device, and an op
    after its consumers and copies, whichever thread was passed over before."""
    graph = random_dag(80, seed=9)
    ga = graph_arrays(graph)
    rng = random.Random(3)
    kk, m = 4, 3
    for _ in range(6):
        dev = [rng.randrange(kk) for _ in range(ga.n)]
        hb = [rng.choice([1e-5, 3e-5]) for _ in range(ga.n)]
        copy_h = [2e-4] * kk
        order = issue_order_items(ga.preds, dev, m)
        items, issued, copied = backward_issue(ga, dev, order, hb, copy_h, 0.0, kk)
        n = ga.n
        for it in range(m * n):
            i, off = it % n, it - it % n
            start = issued[it] - hb[i]
            for w in ga.succs[i]:
                if dev[w] == dev[i]:
                    assert start >= issued[off + w] - 1e-15
                else:
                    copy_start = copied[it * kk + dev[w]] - copy_h[dev[w]]
                    assert copy_start >= issued[off + w] - 1e-15
                    assert start >= copied[it * kk + dev[w]] - 1e-15


def test_batch_equals_scalar_at_512_devices_in_one_chunk(monkeypatch):
    """At 512 devices every plan of a batch shares one chunk (its arrays span each op's
    slots, not the devices) and links get compact cells; the results are the scalar's."""
    from autoplace.sim import batch

    cluster = preset("h200x8-n64")
    graph = random_dag(60, seed=3)
    rng = random.Random(7)
    plans = []
    for name in ("critical-path", "round-robin", "hash"):
        base = planners.get(name)(graph, cluster)
        perm = list(range(cluster.num_devices))
        rng.shuffle(perm)
        plans.append(Plan.from_groups(graph, base.groups, [perm[x] for x in base.placement]))
    plans += [planners.get("random")(graph, cluster, seed=s) for s in range(6)]
    g = len(plans[-1].placement)
    plans.append(Plan.from_groups(graph, plans[-1].groups,
                                  [x % 256 for x in plans[-1].placement],
                                  parallel=ParallelConfig(data=2, microbatches=2)))
    plans.append(Plan.from_groups(graph, plans[-2].groups, plans[-2].placement,
                                  parallel=ParallelConfig(microbatches=3),
                                  recompute={x for x in range(g) if x % 3 == 0}))
    chunks = []
    run_chunk = batch._run_chunk
    monkeypatch.setattr(batch, "_run_chunk", lambda *a: chunks.append(len(a[1])) or run_chunk(*a))
    result = simulate_batch(graph, plans, cluster)
    assert chunks == [9, 1, 1]  # one chunk per microbatch count
    assert max(p.devices_per_replica for p in plans) > 400
    scalar = [simulate(graph, p, cluster) for p in plans]
    np.testing.assert_allclose(result.step_time_s, [r.step_time_s for r in scalar],
                               rtol=1e-9, atol=0)
    np.testing.assert_array_equal(result.peak_memory_bytes,
                                  [r.peak_memory_bytes for r in scalar])


@pytest.mark.parametrize("cluster_name", ["h200x8", "cpu-x4"])
@pytest.mark.parametrize("group", [1, 3])
def test_compact_link_cells_equal_direct_ones(monkeypatch, cluster_name, group):
    """Links numbered by first use (as past ``DIRECT_LINK_CELLS``, ``group`` plans at a
    time) give the same steps (``cpu-x4``: no host costs and slow links, so links queue)."""
    from autoplace.sim import batch_sends

    cluster = preset(cluster_name)
    graph = random_dag(120, seed=2)
    plans = family_plans(graph, cluster, random.Random(5))
    direct = simulate_batch(graph, plans, cluster).step_time_s
    kk = cluster.num_devices
    monkeypatch.setattr(batch_sends, "DIRECT_LINK_CELLS", group * kk * kk)
    np.testing.assert_array_equal(simulate_batch(graph, plans, cluster).step_time_s, direct)


def fan_out(n: int) -> OpGraph:
    """One op read by ``n`` others, each edge of another size."""
    nodes = [OpNode(name=f"op{i}", kind="Linear", output_bytes=2**12, fwd_time_s={"cuda": 1e-5},
                    bwd_time_s={"cuda": 2e-5}) for i in range(n + 1)]
    return OpGraph(f"fan{n}", nodes, [("op0", f"op{i}", 2**(30 - i)) for i in range(1, n + 1)])


@pytest.mark.parametrize("graph", [random_dag(80, seed=3), fan_out(20)], ids=["dag", "fan"])
def test_plan_sends_slots_are_the_consumers_devices_in_order(graph):
    """Slot ``j > 0`` of an op is the ``j``-th other device its consumers run on, in
    device order, with the largest tensor sent there (``local_plan``'s sends)."""
    ga = graph_arrays(graph)
    rng = random.Random(11)
    plans = [planners.get("random")(graph, preset("h200x8"), seed=s) for s in range(5)]
    dev_t = np.array([[p.device_of(name) for p in plans] for name in ga.names])
    dev_t[::7] = rng.randrange(8)  # some ops with all consumers on their device
    sends = plan_sends(ga, dev_t)
    for p in range(len(plans)):
        dev = dev_t[:, p].tolist()
        for u in range(ga.n):
            other = {}
            for v, b in zip(ga.succs[u], ga.succ_bytes[u]):
                if dev[v] != dev[u]:
                    other[dev[v]] = max(other.get(dev[v], 0.0), b)
            used = sends.used[u, :, p]
            assert sends.dev[u, used, p].tolist() == sorted(other)
            assert sends.nbytes[u, used, p].tolist() == [other[e] for e in sorted(other)]
            assert not used[0] and sends.dev[u, 0, p] == dev[u]
        for e, (u, v) in enumerate(zip(ga.edge_src.tolist(), ga.edge_dst.tolist())):
            assert sends.dev[u, sends.edge_slot[e, p], p] == dev[v]
