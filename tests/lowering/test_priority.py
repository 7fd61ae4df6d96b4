"""A plan's per-group issue priority: the lowering's order, the simulator's step time, and
the order the executor's one-process program really runs its ops in."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import PlanError
from autoplace.executor import execute
from autoplace.executor.local import build_local
from autoplace.executor.runner import capture_graph
from autoplace.graph import OpGraph, OpNode
from autoplace.lowering import issue_order, issue_order_items, lower
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch

CPU2 = preset("cpu-x2")


def two_branches() -> OpGraph:
    """x -> short (device 0) -> join; x -> long head (device 0) -> long tail (device 1, 5 s)
    -> join. Program order puts the short branch first."""
    def op(name: str, kind: str, t: float = 0.0) -> OpNode:
        return OpNode(name=name, kind=kind, fwd_time_s={"cpu": t}, bwd_time_s={"cpu": t})

    ops = [op("x", "input"), op("short", "linear", 1.0), op("head", "linear", 1.0),
           op("tail", "linear", 5.0), op("join", "add", 0.1), op("out", "output")]
    edges = [("x", "short", 64), ("x", "head", 64), ("head", "tail", 64),
             ("short", "join", 64), ("tail", "join", 64), ("join", "out", 64)]
    return OpGraph("two-branches", ops, edges)


def branch_plan(graph: OpGraph, priority: tuple[int, ...] = (), **parallel) -> Plan:
    """Group 0 = the short branch, 1 = the long branch's head (both device 0), 2 = the rest
    (device 1)."""
    groups = {"x": 0, "short": 0, "head": 1, "tail": 2, "join": 2, "out": 2}
    plan = Plan.from_groups(graph, groups, [0, 0, 1], parallel=ParallelConfig(**parallel))
    return replace(plan, priority=priority)


def test_no_priority_is_the_wavefront_order_and_equal_priorities_change_nothing():
    wl = workloads.get("branchy-mlp")
    graph = capture_graph(wl)
    groups = {op: min(3, i * 4 // len(graph)) for i, op in enumerate(graph.order)}
    plan = Plan.from_groups(graph, groups, [0, 1, 0, 1], parallel=ParallelConfig(microbatches=3))
    plain = issue_order(graph, plan)
    assert issue_order(graph, replace(plan, priority=(2, 2, 2, 2))) == plain
    # the list scheduler itself, forced on with equal priorities, gives the sorted order
    n = len(graph)
    preds = [[] for _ in range(n)]
    for u, v, _ in graph.edges:
        preds[graph.index[v]].append(graph.index[u])
    dev = [plan.device_of(op) for op in graph.order]
    assert issue_order_items(preds, dev, 3, [0] * n) == issue_order_items(preds, dev, 3)
    with pytest.raises(PlanError, match="3 entries for"):
        issue_order_items(preds, dev, 3, [0, 0, 0])


def test_priority_reorders_ready_ops_of_one_device_and_is_a_pure_function():
    graph = two_branches()
    plain = [op for _, op in lower(graph, branch_plan(graph)).order]
    assert plain == ["x", "short", "head", "tail", "join", "out"]
    plan = branch_plan(graph, priority=(1, 0, 0))  # the long branch's head first
    first = lower(graph, plan).order
    assert [op for _, op in first] == ["x", "head", "short", "tail", "join", "out"]
    assert lower(graph, plan).order == first  # same plan, same order
    assert lower(graph, branch_plan(graph, priority=(0, 1, 1))).order == lower(
        graph, branch_plan(graph)).order


def test_issuing_the_long_branch_first_is_simulated_faster():
    graph = two_branches()
    plain = simulate(graph, branch_plan(graph), CPU2).step_time_s
    long_first = simulate(graph, branch_plan(graph, priority=(1, 0, 0)), CPU2).step_time_s
    # forward: the long tail starts after one op instead of two; backward mirrors it
    assert long_first < plain - 0.9, (long_first, plain)
    # the batch path (vectorised over plans) agrees with the scalar one on both
    batch = simulate_batch(graph, [branch_plan(graph), branch_plan(graph, priority=(1, 0, 0))],
                           CPU2).step_time_s
    assert batch.tolist() == pytest.approx([plain, long_first])


def test_priority_over_microbatches_every_item_once_and_producers_first():
    graph = two_branches()
    plan = branch_plan(graph, priority=(2, 0, 1), microbatches=3)
    order = lower(graph, plan).order
    assert sorted(order) == sorted((mb, op) for mb in range(3) for op in graph.order)
    pos = {item: i for i, item in enumerate(order)}
    for u, v, _ in graph.edges:
        for mb in range(3):
            assert pos[(mb, u)] < pos[(mb, v)]
    # device 0 issues each microbatch's long-branch head before its short branch, which
    # the wavefront order does the other way round
    plain = {item: i for i, item in enumerate(lower(graph, replace(plan, priority=())).order)}
    for mb in range(3):
        assert pos[(mb, "head")] < pos[(mb, "short")]
        assert plain[(mb, "short")] < plain[(mb, "head")]


def _branch_groups(graph: OpGraph) -> dict[str, int]:
    """branchy-mlp: branch b's ops are group b + 1; the rest group 0."""
    return {op: int(op.split("_")[1]) + 1 if op.startswith("branches_") else 0
            for op in graph.order}


def test_the_executor_runs_ops_in_the_prioritised_order():
    wl = workloads.get("branchy-mlp")
    graph = capture_graph(wl)
    plan = Plan.from_groups(graph, _branch_groups(graph), [0, 0, 0, 1, 1],
                            parallel=ParallelConfig(microbatches=2))
    plan = replace(plan, priority=(0, 3, 2, 1, 0))  # on device 0: branch 1 before branch 0
    order = list(lower(graph, plan).order)
    assert order != issue_order(graph, replace(plan, priority=()))
    program = build_local(graph.module, plan, [torch.device("cpu")] * 2, wl.loss_fn,
                          order=order)
    ran: list[str] = []
    hooks = [mod.register_forward_pre_hook(lambda *_, name=op.name: ran.append(name))
             for op in graph.ops if op.kind == "Linear"
             for mod in [graph.module.get_submodule(op.target)]]
    try:
        inputs, target = wl.make_batch(4, "cpu")
        program(inputs, target).backward()
    finally:
        for h in hooks:
            h.remove()
    linear = [op for _, op in order if graph.ops[graph.index[op]].kind == "Linear"]
    assert ran == linear
    dev0 = [op for op in ran if op.startswith(("branches_0", "branches_1"))]
    assert dev0[0].startswith("branches_1")


def test_a_prioritised_plan_trains_as_the_reference():
    wl = workloads.get("branchy-mlp")
    graph = capture_graph(wl)
    plan = Plan.from_groups(graph, _branch_groups(graph), [0, 0, 0, 1, 1],
                            parallel=ParallelConfig(microbatches=2))
    r = execute(wl, replace(plan, priority=(0, 3, 2, 1, 0)), cluster=CPU2, steps=2, warmup=1)
    assert r.ok, r.error
    assert r.max_loss_rel_diff < 1e-5
