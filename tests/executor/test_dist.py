"""Multi-process plans under torchrun on CPU/gloo: pipeline, DDP, FSDP2, dp x pp, failures.

Representative workloads only (each run starts processes; the zoo matrix shares one pool
job): gpt-tiny for every mode, rnnlm (LSTM tuples crossing the cut) for 1F1B, gnmt-2 (two
inputs, a skip across the cut) for dp x pp.
"""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.executor import execute, run_plan
from autoplace.executor.runner import capture_graph
from autoplace.plan import ParallelConfig, Plan
from tests.helpers.plans import check_run, run_like_execute, single, split

TOL = 1e-4  # reductions reordered across processes
CPU2, CPU4 = preset("cpu-x2"), preset("cpu-x4")


@pytest.fixture(scope="module")
def tiny():
    wl = workloads.get("gpt-tiny")
    return wl, capture_graph(wl)


def check(r, steps=3):
    check_run(r, steps, TOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_two_stages(tiny, schedule, cpu_pool):
    wl, graph = tiny
    check(run_like_execute(cpu_pool, wl, split(graph, pipeline=2, microbatches=4,
                                               schedule=schedule), CPU2))


def test_pipeline_lstm_tuples_cross_the_cut(cpu_pool):
    wl = workloads.get("rnnlm", seq_len=8, hidden=32)
    check(run_like_execute(cpu_pool, wl, split(capture_graph(wl), pipeline=2, microbatches=4,
                                               schedule="1f1b"), CPU2))


@pytest.mark.parametrize("shard", ["none", "fsdp", "zero2", "fsdp/modules"])
def test_data_parallel(tiny, shard, cpu_pool):
    wl, graph = tiny
    shard, _, units = shard.partition("/")
    r = run_like_execute(cpu_pool, wl, single(graph, data=2, shard=shard,
                                              shard_units=units or "blocks"), CPU2)
    check(r)
    assert r.devices == ["cpu", "cpu"]


def test_ddp_with_checkpointed_groups(tiny, cpu_pool):
    """DDP over a program whose groups run under torch.utils.checkpoint (``dp_recompute``'s
    plans) trains like the reference."""
    wl, graph = tiny
    groups = {op: i * 4 // len(graph.order) for i, op in enumerate(graph.order)}
    plan = Plan.from_groups(graph, groups, [0] * 4, parallel=ParallelConfig(data=2),
                            recompute={1, 2})
    check(run_like_execute(cpu_pool, wl, plan, CPU2))


def test_ddp_zero1_trains_like_the_reference_and_resumes(tiny, tmp_path, monkeypatch,
                                                         cpu_pool):
    """DDP with AdamW's state sharded over the replicas (``shard_optimizer``: each rank
    updates half the parameters, then broadcasts them) trains like the unpartitioned
    reference; killed after a checkpoint, it resumes where it stopped, each rank
    restoring its own share of the state, and continues the same losses."""
    wl, graph = tiny
    plan = single(graph, data=2, shard_optimizer=True)
    full = run_like_execute(cpu_pool, wl, plan, CPU2, steps=4, warmup=1)
    check(full, steps=4)
    monkeypatch.setenv("AUTOPLACE_FAIL_AT_STEP", "2")
    monkeypatch.setenv("AUTOPLACE_FAIL_RANK", "1")
    with pytest.raises(AutoplaceError, match="SIGKILL"):
        execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False,
                checkpoint_dir=tmp_path)
    monkeypatch.delenv("AUTOPLACE_FAIL_AT_STEP")
    rest = execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False,
                   checkpoint_dir=tmp_path, resume=True)
    assert rest.extra["start_step"] == 2
    assert rest.loss == pytest.approx(full.loss[2:], rel=1e-6)


def test_data_parallel_over_placed_replicas(tiny, cpu_pool):
    wl, graph = tiny
    check(run_like_execute(cpu_pool, wl, split(graph, data=2, microbatches=2), CPU4))


def test_data_x_pipeline_mesh(cpu_pool):
    wl = workloads.get("gnmt-2", src_len=6, tgt_len=6, hidden=32)
    check(run_like_execute(cpu_pool, wl, split(capture_graph(wl), data=2, pipeline=2,
                                               microbatches=2), CPU4))


def test_killed_rank_is_a_clear_error_and_overwrites_nothing(tiny, tmp_path, monkeypatch):
    wl, graph = tiny
    out = tmp_path / "report.json"
    out.write_text("previous")
    monkeypatch.setenv("AUTOPLACE_FAIL_AT_STEP", "1")
    monkeypatch.setenv("AUTOPLACE_FAIL_RANK", "1")
    with pytest.raises(AutoplaceError, match=r"rank 1 \(SIGKILL\) of 2 died"):
        run_plan(single(graph, data=2), wl, cluster=CPU2, out=out, steps=3, reference=False)
    assert out.read_text() == "previous"


def test_pipeline_checkpoint_kill_and_resume(tiny, tmp_path, monkeypatch, cpu_pool):
    from autoplace.executor.runner import RunOptions

    wl, graph = tiny
    plan = split(graph, pipeline=2, microbatches=2)
    # the uninterrupted run's losses (in the module's job); killed and resumed: torchrun's
    full = cpu_pool.run(plan, wl, RunOptions(steps=4, warmup=0, reference=False), cluster=CPU2)
    assert full.ok, full.error
    monkeypatch.setenv("AUTOPLACE_FAIL_AT_STEP", "2")
    monkeypatch.setenv("AUTOPLACE_FAIL_RANK", "1")
    with pytest.raises(AutoplaceError, match="SIGKILL"):
        execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False,
                checkpoint_dir=tmp_path)
    assert (tmp_path / "latest").read_text() == "step-2"
    monkeypatch.delenv("AUTOPLACE_FAIL_AT_STEP")
    rest = execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False,
                   checkpoint_dir=tmp_path, resume=True)
    assert rest.extra["start_step"] == 2
    assert rest.loss == pytest.approx(full.loss[2:], rel=1e-6)


# every other zoo workload, small, through each multi-process mode
ZOO_SMALL = {
    "rnnlm": dict(seq_len=8, hidden=32),
    "gnmt-2": dict(src_len=6, tgt_len=6, hidden=32),
    "branchy-mlp": dict(),
    "resnet50": dict(batch_size=8),
    "inception-v3": dict(batch_size=8),
}


@pytest.mark.parametrize("mode", ["gpipe", "1f1b", "ddp", "fsdp"])
@pytest.mark.parametrize("name", list(ZOO_SMALL))
def test_zoo_workload_multiprocess(name, mode, cpu_pool):
    from autoplace.executor.runner import RunOptions

    wl = workloads.get(name, **ZOO_SMALL[name])
    graph = capture_graph(wl)
    if mode in ("gpipe", "1f1b"):
        plan = split(graph, pipeline=2, microbatches=4, schedule=mode)
    else:
        plan = single(graph, data=2, shard="none" if mode == "ddp" else "fsdp")
    r = cpu_pool.run(plan, wl, RunOptions(steps=3, warmup=1, reference=True), cluster=CPU2)
    check(r)
    assert r.reference_loss and len(r.step_times_s) == 2
