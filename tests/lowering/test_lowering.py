"""The one description of how a plan runs (autoplace.lowering), and its two readers."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import PlanError
from autoplace.executor.local import build_local
from autoplace.executor.runner import capture_graph
from autoplace.lowering import (
    ROOT_UNIT,
    gather_dtype,
    issue_order,
    lower,
    pipeline_actions,
)
from autoplace.plan import ParallelConfig, Plan
from tests.helpers.plans import single, split


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_schedules(rank: int, world: int, runs: list[tuple[str, int]], port: int,
                      out: str) -> None:
    """One stage of real torch pipelines, run one after another in one process group:
    writes, per (schedule, microbatches) of ``runs``, the order its forward and backward
    ran."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for schedule, m in runs:
            torch.manual_seed(0)
            mod = nn.Linear(4, 4)
            seen: list[str] = []
            mod.register_forward_pre_hook(
                lambda *_, seen=seen: seen.append(f"F{sum(a[0] == 'F' for a in seen)}"))
            mod.weight.register_hook(
                lambda g, seen=seen: seen.append(f"B{sum(a[0] == 'B' for a in seen)}"))
            stage = PipelineStage(mod, rank, world, torch.device("cpu"))
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            sched = cls(stage, m, loss_fn=lambda y, t: ((y - t) ** 2).mean())
            x = torch.randn(2 * m, 4)
            for _ in range(2):  # the first step also runs the stage once to infer its shapes
                seen.clear()
                if rank == 0:
                    sched.step(x)
                elif rank == world - 1:
                    sched.step(target=torch.zeros(2 * m, 4), losses=[])
                else:
                    sched.step()
            with open(f"{out}-{schedule}-{m}-{rank}.json", "w") as f:
                json.dump(seen, f)
    finally:
        dist.destroy_process_group()


SCHEDULES = [("gpipe", 2, 3), ("1f1b", 2, 4), ("1f1b", 3, 5)]


@pytest.fixture(scope="module")
def recorded_schedules(tmp_path_factory) -> str:
    """What each stage of every pipeline of SCHEDULES ran, recorded by hooks in real gloo
    processes: the pipelines of one stage count share their processes, forked from this one
    (torch and this module imported already: seconds a process on the 2-core CI machine)."""
    out = str(tmp_path_factory.mktemp("order") / "order")
    for stages in sorted({s for _, s, _ in SCHEDULES}):
        runs = [(schedule, m) for schedule, s, m in SCHEDULES if s == stages]
        mp.start_processes(_record_schedules, args=(stages, runs, _free_port(), out),
                           nprocs=stages, start_method="fork")
    return out


@pytest.mark.parametrize("schedule,stages,m", SCHEDULES)
def test_pipeline_actions_are_what_torch_runs(recorded_schedules, schedule, stages, m):
    """Each stage's action list is the order torch's ScheduleGPipe / Schedule1F1B run its
    forwards and backwards (recorded by hooks in real gloo processes)."""
    for s in range(stages):
        with open(f"{recorded_schedules}-{schedule}-{m}-{s}.json") as f:
            ran = json.load(f)
        assert ran == pipeline_actions(schedule, stages, m, s), (s, ran)


def test_pipeline_actions_refuse_an_unknown_schedule():
    with pytest.raises(PlanError, match="valid: gpipe, 1f1b"):
        pipeline_actions("interleaved", 2, 4, 0)


@pytest.fixture(scope="module")
def tiny():
    wl = workloads.get("gpt-tiny")
    return wl, capture_graph(wl)


def test_issue_order_is_a_wavefront_and_the_executor_issues_it(tiny):
    wl, graph = tiny
    plan = split(graph, microbatches=2)
    order = issue_order(graph, plan)
    assert len(order) == 2 * len(graph)
    pos = {item: i for i, item in enumerate(order)}
    dev = {op: plan.device_of(op) for op in graph.order}
    # a wavefront: device 1's part of microbatch 0 is issued before device 0's part of
    # microbatch 1, which comes before device 1's part of microbatch 1
    ends = [max(pos[(mb, op)] for op in graph.order if dev[op] == d and
                graph.ops[graph.index[op]].kind not in ("input", "param", "output"))
            for mb, d in ((0, 1), (1, 0))]
    starts = [min(pos[(mb, op)] for op in graph.order if dev[op] == d and
                  graph.ops[graph.index[op]].kind not in ("input", "param", "output"))
              for mb, d in ((1, 0), (1, 1))]
    assert ends[0] < starts[0] and ends[1] < starts[1]
    for u, v, _ in graph.edges:  # topological inside each microbatch
        for mb in range(2):
            assert pos[(mb, u)] < pos[(mb, v)]
    # the executor builds its program from the lowering's order, with no order of its own
    with pytest.raises(TypeError, match="order"):
        build_local(graph.module, plan, [torch.device("cpu")] * 2, wl.loss_fn)
    assert list(lower(graph, plan).order) == order


def test_lower_a_pipeline(tiny):
    _, graph = tiny
    plan = split(graph, pipeline=2, microbatches=4, schedule="1f1b")
    low = lower(graph, plan, preset("cpu-x2"))
    assert low.order == () and len(low.actions) == 2
    assert list(low.actions[1]) == pipeline_actions("1f1b", 2, 4, 1)
    assert set(low.stage_of.values()) == {0, 1}
    for op in graph.ops:  # every compute op's stage is its placement
        if op.kind not in ("input", "param"):
            assert low.stage_of[op.name] == plan.device_of(op.name)
    assert low.unit_keys == {} and low.gather_dtype is None


def test_lower_a_sharded_plan():
    wl = workloads.get("gpt-tiny", autocast_dtype="bfloat16")
    graph = capture_graph(wl)
    plan = single(graph, data=2, shard="fsdp")
    low = lower(graph, plan, preset("cpu-x2"))
    blocks = {k for k in low.unit_keys.values() if k != ROOT_UNIT}
    assert blocks and all(k.split(".")[-1].isdigit() for k in blocks)
    assert set(low.module_units(graph).values()) == blocks
    assert low.gather_dtype == "bfloat16" and gather_dtype(graph, "cpu") is None
    modules = lower(graph, Plan.from_groups(graph, plan.groups, plan.placement, parallel=ParallelConfig(
        data=2, shard="fsdp", shard_units="modules")))
    assert set(modules.unit_keys.values()) > set(low.unit_keys.values())  # more units


def test_lower_refuses_tied_weights_under_a_sharded_pipeline():
    wl = workloads.get("tests.helpers.hf_models:gpt2")
    graph = capture_graph(wl)
    plan = split(graph, pipeline=2, microbatches=2, data=2, shard="fsdp")
    with pytest.raises(PlanError, match="tied weights"):
        lower(graph, plan, preset("cpu-x4"))
