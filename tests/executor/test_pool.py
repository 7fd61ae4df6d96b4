"""PlanPool: multi-process plans run one after another in a torchrun job kept alive."""

from __future__ import annotations

import math

import pytest

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.executor import run_plan
from autoplace.executor.pool import PlanPool, rank_devices
from autoplace.executor.runner import RunOptions, capture_graph
from autoplace.plan import ParallelConfig, Plan

CPU2 = preset("cpu-x2")


def _plan(graph, devices: int = 1, **parallel) -> Plan:
    n = len(graph.order)
    groups = {op: min(devices - 1, i * devices // n) for i, op in enumerate(graph.order)}
    return Plan.from_groups(graph, groups, list(range(devices)),
                            parallel=ParallelConfig(**parallel))


@pytest.fixture(scope="module")
def tiny():
    wl = workloads.get("gpt-tiny")
    return wl, capture_graph(wl)


@pytest.fixture(scope="module")
def ddp_by_torchrun(tiny):
    """The DDP plan's 3 steps (1 warm-up, no reference) in a torchrun of its own, as the
    pooled runs are compared with it."""
    wl, g = tiny
    return run_plan(_plan(g, data=2), wl, cluster=CPU2,
                    options=RunOptions(steps=3, warmup=1, reference=False))


def test_rank_devices(tiny):
    _, g = tiny
    h4 = preset("h100x4")
    assert rank_devices(_plan(g, data=2), h4) == ("cuda:0", "cuda:1")
    assert rank_devices(_plan(g, 4, pipeline=4, microbatches=4), h4) == tuple(
        f"cuda:{i}" for i in range(4))
    # two replicas of two devices each: each process starts at its replica's first device
    assert rank_devices(_plan(g, 2, data=2), h4) == ("cuda:0", "cuda:2")


def test_pool_runs_plans_in_one_job_and_matches_run_plan(tiny, ddp_by_torchrun):
    wl, g = tiny
    ddp = _plan(g, data=2)
    pipe = _plan(g, 2, pipeline=2, microbatches=2)
    opts = RunOptions(steps=3, warmup=1, reference=False)
    with PlanPool(CPU2, timeout_s=240) as pool:
        a = pool.run(ddp, wl, opts)
        b = pool.run(pipe, wl, opts)
        c = pool.run(ddp, wl, opts)
        one = pool.run(_plan(g), wl, opts)  # one process: a one-process job of its own
        again = pool.run(_plan(g), wl, opts)
        assert pool.starts == 2 and again.extra["pool_run"] == 2
    for r in (a, b, c, one):
        assert r.error is None and len(r.loss) == 3 and len(r.step_times_s) == 2
    assert a.extra["pool_run"] == 1 and b.extra["pool_run"] == 2 and c.extra["pool_run"] == 3
    # every run trains a fresh copy of the same initial model on the same batches
    assert a.loss == c.loss
    fresh = ddp_by_torchrun  # the same plan and options in a torchrun of its own
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a.loss, fresh.loss))
    assert all(math.isclose(x, y, rel_tol=1e-4) for x, y in zip(a.loss, b.loss))


def test_a_failed_run_is_reported_and_the_next_starts_a_new_job(tiny, tmp_path):
    wl, g = tiny
    ddp = _plan(g, data=2)
    bad = tmp_path / "not-weights.pt"
    bad.write_text("not a weights file")
    from autoplace.errors import AutoplaceError

    with PlanPool(CPU2, timeout_s=240) as pool:
        with pytest.raises(AutoplaceError, match="cannot read weights file"):
            pool.run(ddp, wl, RunOptions(steps=2, warmup=1, reference=False,
                                         weights_file=str(bad)))
        ok = pool.run(ddp, wl, RunOptions(steps=2, warmup=1, reference=False))
        assert ok.error is None and len(ok.loss) == 2
        assert pool.starts == 2 and ok.extra["pool_run"] == 1


def test_a_rank_killed_mid_run_ends_the_job_not_the_pool(tiny, monkeypatch):
    """Rank 1 dies at step 1 while rank 0 waits in an all-reduce: torchrun stops the job,
    the driver gets an error naming the rank, and the next run starts a fresh job."""
    from autoplace.errors import AutoplaceError

    wl, g = tiny
    ddp = _plan(g, data=2)
    opts = RunOptions(steps=3, warmup=1, reference=False)
    with PlanPool(CPU2, timeout_s=120) as pool:
        monkeypatch.setenv("AUTOPLACE_FAIL_AT_STEP", "1")
        monkeypatch.setenv("AUTOPLACE_FAIL_RANK", "1")
        with pytest.raises(AutoplaceError, match=r"rank 1 \(SIGKILL\)"):
            pool.run(ddp, wl, opts)
        assert pool.starts == 2  # the replacement job started at once, in the background
        monkeypatch.delenv("AUTOPLACE_FAIL_AT_STEP")
        pool.warm(ddp, wl)  # a fresh job (without the fault) that builds the model first
        ok = pool.run(ddp, wl, opts)
        assert ok.error is None and len(ok.loss) == 3
        assert pool.starts == 3 and ok.extra["pool_run"] == 1


def test_warm_job_with_weights_file_trains_the_same_model_every_run(tiny, tmp_path,
                                                                   ddp_by_torchrun):
    from autoplace.executor.weights import save_weights

    wl, g = tiny
    path = str(save_weights(wl.model, tmp_path / "w.pt"))
    ddp = _plan(g, data=2)
    opts = RunOptions(steps=3, warmup=1, reference=False, weights_file=path)
    with PlanPool(CPU2, timeout_s=240) as pool:
        pool.warm(ddp, wl, path)
        a = pool.run(ddp, wl, opts)
        b = pool.run(ddp, wl, opts)
        assert pool.starts == 1
    assert a.error is None and a.loss == b.loss  # each run loads the initial weights afresh
    built = ddp_by_torchrun  # the model built in each process, not loaded
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a.loss, built.loss))


def test_ensure_starts_missing_layouts_and_ready_tells_when_a_job_is_up(tiny):
    import time

    wl, g = tiny
    ddp, one = _plan(g, data=2), _plan(g)
    with PlanPool(CPU2, timeout_s=240) as pool:
        pool.warm(one, wl)
        assert not pool.ready(ddp)  # no job for its layout
        pool.ensure([one, ddp])  # keeps the one-process job, starts the ddp one
        assert pool.starts == 2
        deadline = time.monotonic() + 120
        while not (pool.ready(ddp) and pool.ready(one)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.ready(ddp) and pool.ready(one)
        pool.ensure(ddp)  # up already: nothing new
        assert pool.starts == 2
        rep = pool.run(ddp, wl, RunOptions(steps=2, warmup=1, reference=False))
        assert rep.error is None and rep.extra["pool_run"] == 1  # it found the job up
        pool.warm(one, wl)  # stops both (the ready ones politely) and starts one afresh
        assert not pool.ready(ddp)


def test_spares_replace_a_failed_job_with_one_started_before_the_failure(tiny, tmp_path):
    """With ``spares=True`` a multi-process layout has an idle spare job from its first
    start on; a job that ends in a run is replaced by that spare, and a new spare starts.
    One-process layouts get no spare (their jobs survive their own failed runs)."""
    from autoplace.errors import AutoplaceError

    wl, g = tiny
    ddp = _plan(g, data=2)
    layout = rank_devices(ddp, CPU2)
    bad = tmp_path / "not-weights.pt"
    bad.write_text("not a weights file")
    with PlanPool(CPU2, timeout_s=240, spares=True) as pool:
        pool.ensure([ddp, _plan(g)])
        assert pool.starts == 3  # the ddp job, its spare, the one-process job
        spare = pool._spares[layout]
        with pytest.raises(AutoplaceError, match="cannot read weights file"):
            pool.run(ddp, wl, RunOptions(steps=2, warmup=1, reference=False,
                                         weights_file=str(bad)))
        assert pool.replaced == 1 and pool._jobs[layout] is spare
        assert pool.starts == 4 and pool._spares[layout] is not spare  # the next spare
        ok = pool.run(ddp, wl, RunOptions(steps=2, warmup=1, reference=False))
        assert ok.error is None and len(ok.loss) == 2 and ok.extra["pool_run"] == 1
        assert set(ok.extra["job_start_s"]) == {"imports", "groups", "preload"}
        new_spare = pool._spares[layout]
    assert not spare.alive() and not new_spare.alive()  # close stops spares too


def test_a_preload_that_fails_does_not_end_the_job(tiny, tmp_path):
    """The preload is a head start only: a job whose preload fails (here a weights file
    that now holds another model's weights) still serves runs, which load their own."""
    from autoplace.executor.weights import save_weights

    wl, g = tiny
    other = workloads.get("branchy-mlp", batch_size=8)
    stale = str(save_weights(other.model, tmp_path / "w.pt"))
    ddp = _plan(g, data=2)
    with PlanPool(CPU2, timeout_s=240) as pool:
        pool.warm(ddp, wl, stale)
        rep = pool.run(ddp, wl, RunOptions(steps=2, warmup=1, reference=False))
        assert rep.error is None and rep.extra["pool_run"] == 1 and pool.replaced == 0
