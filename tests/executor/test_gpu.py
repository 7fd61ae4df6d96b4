"""The executor on 2 GPUs (NCCL): placement, pipeline, DDP, FSDP2, memory caps, failures.

Run through the device tool: ``pytest -m gpu tests/executor/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from autoplace import workloads
from autoplace.cluster import Cluster
from autoplace.errors import AutoplaceError
from autoplace.executor import execute, run_plan
from autoplace.executor.runner import capture_graph
from autoplace.plan import ParallelConfig, Plan
from tests.helpers import pythonpath_with_root
from tests.helpers.plans import single, split

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs"),
]

TOL = 1e-3  # GPU kernels reorder reductions (cuDNN, atomics in embedding backward)
SMALL = {
    "gpt-tiny": {},
    "rnnlm": {},
    "gnmt-2": {},
    "branchy-mlp": {},
    "resnet50": {"image_size": 32, "width": 0.125, "blocks": (1, 1, 1, 1), "batch_size": 4},
    "inception-v3": {"width": 0.125, "batch_size": 4},
}


@pytest.fixture(scope="module")
def gpus():
    return Cluster.detect().subset([0, 1])


def check(r, steps=3, tol=TOL):
    assert r.ok, r.error
    assert len(r.loss) == steps
    assert r.max_loss_rel_diff < tol, (r.loss, r.reference_loss)


@pytest.fixture
def exact_convs():
    """cuDNN's TF32 and algorithm choice differ between GPUs; BatchNorm CNNs amplify it."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = old


@pytest.mark.parametrize("name", list(SMALL))
def test_local_placement_on_two_gpus(gpus, name, exact_convs):
    wl = workloads.get(name, **SMALL[name])
    graph = capture_graph(wl)
    for mb, rc in ((1, ()), (2, ()), (2, (0, 1))):
        r = execute(wl, split(graph, microbatches=mb, recompute=rc), cluster=gpus, steps=3,
                    warmup=1)
        check(r)
        assert r.devices == ["cuda:0", "cuda:1"]
        assert all(b > 0 for b in r.peak_memory_bytes)


def test_interleaved_placement_moves_tensors_between_gpus(gpus):
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    plan = Plan.from_groups(graph, {op: i % 2 for i, op in enumerate(graph.order)}, [0, 1])
    check(execute(wl, plan, cluster=gpus, steps=3, warmup=1))


def test_streamed_copies_between_gpus_match(gpus, monkeypatch):
    """Edges that skip PyTorch's two-way stream barrier (AUTOPLACE_COPY_STREAMS=1) give
    the losses and gradients of plain ``.to`` copies, and train like the reference."""
    from autoplace.executor.local import build_local
    from autoplace.lowering import issue_order

    wl = workloads.get("gpt-tiny")
    plan = Plan.from_groups(capture_graph(wl), {op: i % 2 for i, op in
                                                enumerate(capture_graph(wl).order)}, [0, 1],
                            parallel=ParallelConfig(microbatches=2))
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    x, y = wl.make_batch(wl.batch_size, "cuda:0")
    out = []
    for streams in (False, True):
        g = capture_graph(workloads.get("gpt-tiny"))
        prog = build_local(g.module, plan, devices, wl.loss_fn, order=issue_order(g, plan), copy_streams=streams)
        loss = prog(x, y)
        loss.backward()
        torch.cuda.synchronize()
        out.append((loss.detach().cpu(), [p.grad.cpu() for p in prog.parameters()]))
    torch.testing.assert_close(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b)
    monkeypatch.setenv("AUTOPLACE_COPY_STREAMS", "1")
    check(execute(wl, plan, cluster=gpus, steps=3, warmup=1))


@pytest.mark.parametrize("name", ["gpt-tiny", "inception-v3", "gnmt-2"])
def test_graphed_placement_trains_like_the_reference(gpus, name, exact_convs):
    """``parallel.graphs``: every run of ops on one device replays as a CUDA graph from
    the second step on (warm-up 2: the timed steps replay), with the reference's losses;
    the pieces really replay (none fell back to eager)."""
    from autoplace.executor.local import _Graphed, build_local
    from autoplace.lowering import issue_order

    wl = workloads.get(name, **SMALL[name])
    graph = capture_graph(wl)
    for mb in (1, 2):
        check(execute(wl, split(graph, microbatches=mb, graphs=True), cluster=gpus, steps=5,
                      warmup=2), steps=5)
    plan = split(graph, microbatches=2, graphs=True)
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    g = capture_graph(workloads.get(name, **SMALL[name]))
    prog = build_local(g.module, plan, devices, wl.loss_fn, order=issue_order(g, plan),
                       graphs=True)
    for _ in range(3):
        x, y = wl.make_batch(wl.batch_size, "cuda:0")
        prog(x, y).backward()
    pieces = [m for m in prog.program.children() if isinstance(m, _Graphed)]
    assert len(pieces) == 4
    assert [p.failed for p in pieces] == [None] * 4
    assert all(p._replay is not None for p in pieces)


def test_placed_lstms_keep_one_flat_weight_buffer(gpus):
    """LSTMs placed on the second GPU are re-flattened (``reflatten_rnns``): cuDNN does not
    warn that their weights "need to be compacted at every call", and each LSTM's weights
    share one storage on its device."""
    import warnings

    from autoplace.executor.local import build_local
    from autoplace.lowering import issue_order

    wl = workloads.get("gnmt-2")
    g = capture_graph(wl)
    n = len(g.order)
    # everything from the middle on runs on cuda:1, so its LSTMs move there
    plan = Plan.from_groups(g, {op: int(i >= n // 2) for i, op in enumerate(g.order)}, [0, 1])
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    prog = build_local(g.module, plan, devices, wl.loss_fn, order=issue_order(g, plan))
    lstms = [m for m in g.module.modules() if isinstance(m, torch.nn.LSTM)]
    assert {w.device for m in lstms for w in m._flat_weights} == {torch.device("cuda:0"),
                                                                  torch.device("cuda:1")}
    for m in lstms:
        assert len({w.untyped_storage().data_ptr() for w in m._flat_weights}) == 1
    x, y = wl.make_batch(wl.batch_size, "cuda:0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog(x, y).backward()
        torch.cuda.synchronize()
    assert not [w for w in caught if "contiguous chunk" in str(w.message)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", ["gpt-tiny", "rnnlm"])
def test_pipeline_on_two_gpus(gpus, name, schedule):
    wl = workloads.get(name)
    check(execute(wl, split(capture_graph(wl), pipeline=2, microbatches=4, schedule=schedule),
                  cluster=gpus, steps=3, warmup=1))


@pytest.mark.parametrize("shard", ["none", "zero2", "fsdp"])
def test_data_parallel_on_two_gpus(gpus, shard):
    wl = workloads.get("gpt-small")
    check(execute(wl, single(capture_graph(wl), data=2, shard=shard), cluster=gpus, steps=3,
                  warmup=1))


@pytest.mark.parametrize("shard", ["fsdp", "zero2"])
@pytest.mark.parametrize("name", ["rnnlm", "gnmt-2"])
def test_sharded_lstms_train_like_the_reference(gpus, name, shard):
    """cuDNN LSTMs under FSDP2: their forward re-flattens the gathered weights it first sees
    (``RNNBase._update_flat_weights``); training must still see every step's gathered
    parameters, so the loss follows the unsharded reference's over several steps."""
    wl = workloads.get(name)
    check(execute(wl, single(capture_graph(wl), data=2, shard=shard), cluster=gpus, steps=4,
                  warmup=1), steps=4)


def test_bf16_autocast_pipeline(gpus):
    wl = workloads.get("gpt-small", autocast_dtype="bfloat16")
    check(execute(wl, split(capture_graph(wl), pipeline=2, microbatches=4), cluster=gpus,
                  steps=3, warmup=1), tol=2e-2)


def test_memory_cap_oom_names_the_device(gpus):
    wl = workloads.get("gpt-small", batch_size=64)
    graph = capture_graph(wl)
    capped = gpus.with_memory_cap(64 * 2**20)
    r = execute(wl, split(graph), cluster=capped, steps=2, warmup=0)
    assert r.oom and r.oom_device in ("cuda:0", "cuda:1") and "out of memory" in r.error
    assert len(r.reference_loss) == 2  # the reference ran before the cap
    # the process is usable afterwards, caps lifted
    check(execute(workloads.get("gpt-tiny"), split(capture_graph(workloads.get("gpt-tiny"))),
                  cluster=gpus, steps=3, warmup=1))


def test_killed_rank_on_gpus(gpus, tmp_path, monkeypatch):
    wl = workloads.get("gpt-tiny")
    monkeypatch.setenv("AUTOPLACE_FAIL_AT_STEP", "1")
    monkeypatch.setenv("AUTOPLACE_FAIL_RANK", "0")
    with pytest.raises(AutoplaceError, match=r"rank 0 \(SIGKILL\)"):
        run_plan(single(capture_graph(wl), data=2), wl, cluster=gpus, steps=3,
                 reference=False, out=tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_pool_job_frees_an_out_of_memory_run_before_the_next(gpus):
    """On 2x H200 a one-process pool job whose run ran out of memory under a cap kept that
    run's memory allocated (a reference cycle through the error's traceback), so every
    later plan in the job ran out too. The job now collects after every run."""
    from autoplace.executor.pool import PlanPool
    from autoplace.executor.runner import RunOptions

    # the first run surely runs out (as in test_memory_cap_oom_names_the_device); the
    # second, two halves, needs less than one GPU's uncapped peak of the whole
    wl = workloads.get("gpt-small", batch_size=64)
    graph = capture_graph(wl)
    need = execute(wl, single(graph), cluster=gpus, steps=2, warmup=1,
                   reference=False).peak_memory_bytes[0]
    tiny, capped = gpus.with_memory_cap(64 * 2**20), gpus.with_memory_cap(need)
    opts = RunOptions(steps=3, warmup=1, reference=False)
    with PlanPool(gpus, timeout_s=120) as pool:
        # what a run leaves allocated in the job without any failure (cuBLAS workspaces)
        base = pool.run(split(graph), wl, opts, cluster=capped)
        assert base.error is None, base.error
        oom = pool.run(single(graph), wl, opts, cluster=tiny)
        assert oom.oom
        ok = pool.run(split(graph), wl, opts, cluster=capped)
        assert ok.error is None, ok.error
        assert ok.extra["pool_run"] == 3
        assert ok.extra["leftover_allocated_bytes"] <= base.extra["leftover_allocated_bytes"]
        # under a cap the allocator grows segments in place (build.cap_allocator), and
        # goes back to fixed segments for an uncapped run in the same process
        assert ok.extra["expandable_segments"] is True
        free = pool.run(split(graph), wl, opts, cluster=gpus)
        assert free.error is None and free.extra["expandable_segments"] is False
        assert not any("job_retired" in r.extra for r in (base, oom, ok, free))
        # the allocator's counters of the timed steps, for both devices of the plan
        for rep in (ok, free):
            alloc = rep.extra["allocator"]
            assert sorted(alloc) == ["0", "1"]
            for d in alloc.values():
                assert d["alloc_retries"] >= 0 and d["device_allocs"] >= 0
                assert d["reserved_peak_bytes"] > 0
        assert free.allocator_retries == 0  # a whole H100 / H200 for gpt-small


def test_pool_job_that_keeps_memory_ends_and_is_replaced(gpus, monkeypatch):
    """A one-process pool job that still holds more than ``RETIRE_HELD_BYTES`` on a GPU
    after a run (here a model that keeps a tensor) says so and ends; the pool starts a
    fresh job at once, and the next run of the layout runs there, as its first run."""

    from autoplace.executor.pool import PlanPool
    from autoplace.executor.runner import RunOptions
    from autoplace.executor.worker import RETIRE_HELD_BYTES

    monkeypatch.setenv("PYTHONPATH", pythonpath_with_root())  # the jobs import tests.helpers
    wl = workloads.get("tests.helpers.zoo_user_workload:leaky_regression",
                       leak_bytes=RETIRE_HELD_BYTES + (256 << 20))
    graph = capture_graph(wl)
    opts = RunOptions(steps=2, warmup=1, reference=False)
    with PlanPool(gpus, timeout_s=120) as pool:
        first = pool.run(single(graph), wl, opts, cluster=gpus)
        assert first.error is None, first.error
        assert "GiB still reserved" in first.extra["job_retired"]
        assert first.extra["leftover_reserved_bytes"] > RETIRE_HELD_BYTES
        assert pool.replaced == 1
        second = pool.run(single(graph), wl, opts, cluster=gpus)
        assert second.error is None, second.error
        assert second.extra["pool_run"] == 1  # a fresh job
        healthy = workloads.get("tests.helpers.zoo_user_workload:leaky_regression")
        third = pool.run(single(graph), healthy, opts, cluster=gpus)
        assert third.error is None and third.extra["pool_run"] == 1
        fourth = pool.run(single(graph), healthy, opts, cluster=gpus)
        assert "job_retired" not in fourth.extra and fourth.extra["pool_run"] == 2
