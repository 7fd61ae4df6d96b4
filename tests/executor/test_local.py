"""Local placement (one process): placed + microbatched + recomputed runs match the reference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import PlanError
from autoplace.executor import RunReport, execute
from autoplace.executor.local import build_local
from autoplace.executor.runner import capture_graph
from autoplace.lowering import issue_order
from autoplace.plan import ParallelConfig, Plan

# small sizes so the whole file runs in about a minute on 2 CPU cores
SMALL = {
    "gpt-tiny": {},
    "rnnlm": {"seq_len": 8, "hidden": 32},
    "gnmt-2": {"src_len": 6, "tgt_len": 6, "hidden": 32},
    "branchy-mlp": {},
    "resnet50": {"image_size": 32, "width": 0.125, "blocks": (1, 1, 1, 1), "batch_size": 4},
    "inception-v3": {"width": 0.125, "batch_size": 4},
}
CPU2 = preset("cpu-x2")


def two_halves(graph, **parallel) -> Plan:
    """Ops in topological order, first half on device 0, second on device 1."""
    half = len(graph.order) // 2
    groups = {op: int(i >= half) for i, op in enumerate(graph.order)}
    return Plan.from_groups(graph, groups, [0, 1], parallel=ParallelConfig(**parallel))


def interleaved(graph) -> Plan:
    """Every other op on the other device: the least contiguous DAG placement."""
    groups = {op: i % 2 for i, op in enumerate(graph.order)}
    return Plan.from_groups(graph, groups, [0, 1])


@pytest.mark.parametrize("name", list(SMALL))
def test_two_group_placement_matches_reference(name):
    wl = workloads.get(name, **SMALL[name])
    graph = capture_graph(wl)
    configs = ((1, set()), (2, set()), (2, {0, 1}))
    if name in ("inception-v3", "resnet50"):  # slow on CPU: the config that covers both
        configs = configs[2:]
    for mb, recompute in configs:
        plan = two_halves(graph, microbatches=mb)
        plan = Plan.from_groups(graph, plan.groups, plan.placement, parallel=plan.parallel,
                                recompute=recompute)
        r = execute(wl, plan, cluster=CPU2, steps=2, warmup=1)
        assert r.ok, r.error
        assert len(r.loss) == 2 and len(r.reference_loss) == 2
        assert r.max_loss_rel_diff < 1e-5, (mb, recompute, r.loss, r.reference_loss)


def test_interleaved_placement_and_report_json(tmp_path):
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    r = execute(wl, interleaved(graph), cluster=CPU2, steps=3, warmup=1)
    assert r.max_loss_rel_diff < 1e-5
    assert r.loss[-1] < r.loss[0]  # it trains
    assert len(r.step_times_s) == 2 and r.step_time_s > 0 and r.samples_per_s > 0
    assert r.devices == ["cpu", "cpu"] and len(r.peak_memory_bytes) == 2
    assert r.torch_version == torch.__version__ and not r.oom
    path = tmp_path / "r.json"
    r.save(path)
    back = RunReport.from_json(json.loads(path.read_text()))
    assert back.loss == r.loss and math.isclose(back.step_time_s, r.step_time_s)


def test_reference_can_be_skipped():
    wl = workloads.get("branchy-mlp")
    r = execute(wl, Plan.single(capture_graph(wl)), cluster=CPU2, steps=2, warmup=0,
                reference=False)
    assert r.reference_loss == [] and r.max_loss_rel_diff is None and len(r.loss) == 2


def test_program_moves_tensors_once_per_device_and_checkpoints_groups():
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    plan = interleaved(graph)
    plan = Plan.from_groups(graph, plan.groups, plan.placement, recompute={1})
    prog = build_local(graph.module, plan, [torch.device("cpu")] * 2, wl.loss_fn, order=issue_order(graph, plan))
    code = prog.program.code
    assert "move_to" in code and "_recompute0" in code
    # each (value, destination) pair moves at most once
    moves = [n for n in prog.program.graph.nodes if n.target.__class__ is not str
             and getattr(n.target, "__name__", "") == "move_to"]
    keys = [(n.args[0].name, str(n.args[1])) for n in moves]
    assert len(keys) == len(set(keys))


def test_plan_for_another_model_is_rejected():
    tiny = workloads.get("gpt-tiny")
    plan = Plan.single(capture_graph(workloads.get("branchy-mlp")))
    with pytest.raises(PlanError, match="another graph"):
        execute(tiny, plan, cluster=CPU2, steps=1)


def test_plan_needing_more_devices_is_rejected():
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    groups = {op: 0 for op in graph.order}
    plan = Plan.from_groups(graph, groups, [3])
    with pytest.raises(PlanError, match="needs 4 devices"):
        execute(wl, plan, cluster=CPU2, steps=1)


def test_pipeline_that_is_no_chain_is_rejected():
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    groups = {op: i % 2 for i, op in enumerate(graph.order)}
    plan = Plan.from_groups(graph, groups, [0, 1],
                            parallel=ParallelConfig(pipeline=2, microbatches=2))
    with pytest.raises(PlanError, match="chain"):
        execute(wl, plan, cluster=CPU2, steps=1)


def test_batch_that_does_not_split_is_rejected():
    wl = workloads.get("gpt-tiny", batch_size=3)
    plan = two_halves(capture_graph(wl), microbatches=2)
    with pytest.raises(PlanError, match="does not split"):
        execute(wl, plan, cluster=CPU2, steps=1)


def test_checkpoint_resume_gives_the_same_losses(tmp_path):
    wl = workloads.get("gpt-tiny")
    plan = two_halves(capture_graph(wl), microbatches=2)
    full = execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False)
    first = execute(wl, plan, cluster=CPU2, steps=2, warmup=0, reference=False,
                    checkpoint_dir=tmp_path)
    assert (tmp_path / "checkpoint.pt").exists()
    rest = execute(wl, plan, cluster=CPU2, steps=4, warmup=0, checkpoint_dir=tmp_path,
                   resume=True)
    assert first.loss == full.loss[:2]
    assert rest.extra["start_step"] == 2 and len(rest.loss) == 2
    assert rest.loss == pytest.approx(full.loss[2:], rel=1e-6)
    assert rest.reference_loss == pytest.approx(full.loss[2:], rel=1e-5)


def test_out_of_memory_wrapped_by_pipelining_is_recognised():
    """pipelining re-raises a stage's OOM as RuntimeError("Failed to run stage backward")."""
    from autoplace.executor.runner import _out_of_memory_cause

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 786.00 MiB.")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("Failed to run stage backward") from inner
    except RuntimeError as e:
        cause = _out_of_memory_cause(e)
    assert isinstance(cause, torch.OutOfMemoryError)
    assert _out_of_memory_cause(RuntimeError("shape mismatch")) is None


def test_each_microbatch_loss_follows_its_forward():
    """The lowering's issue order: the second device's part of a
    microbatch before the first device's part of the next one, and each microbatch's
    loss right after its output, as a hand-written flow issues them."""
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    plan = two_halves(graph, microbatches=3)
    prog = build_local(graph.module, plan, [torch.device("cpu")] * 2, wl.loss_fn, order=issue_order(graph, plan))
    names = [n.name for n in prog.program.graph.nodes]
    losses = [i for i, n in enumerate(prog.program.graph.nodes) if n.target == "_loss"]
    embeddings = [names.index(e) for e in ("tok_emb", "tok_emb_1", "tok_emb_2")]
    assert len(losses) == 3
    assert embeddings[0] < losses[0] < embeddings[1] < losses[1] < embeddings[2] < losses[2]
    x, y = wl.make_batch(3 * wl.batch_size, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(prog(x, y), wl.loss_fn(wl.model(*x), y))


def _moves(prog) -> list[str]:
    return [getattr(n.target, "__name__", "") for n in prog.program.graph.nodes
            if n.op == "call_function" and "move_to" in getattr(n.target, "__name__", "")]


def test_streamed_copies_give_the_same_losses_and_gradients(monkeypatch):
    """copy_streams (or AUTOPLACE_COPY_STREAMS=1) swaps every edge's move for the
    stream-aware one; the program computes the same loss and gradients."""
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    plan = Plan.from_groups(graph, interleaved(graph).groups, [0, 1],
                            parallel=ParallelConfig(microbatches=2))
    x, y = wl.make_batch(2 * wl.batch_size, "cpu")
    results = []
    for streams in (False, True):
        g = capture_graph(workloads.get("gpt-tiny"))  # same initial weights each time
        prog = build_local(g.module, plan, [torch.device("cpu")] * 2, wl.loss_fn, order=issue_order(g, plan),
                           copy_streams=streams)
        assert set(_moves(prog)) == {"move_to_streamed" if streams else "move_to"}
        loss = prog(x, y)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in prog.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
    monkeypatch.setenv("AUTOPLACE_COPY_STREAMS", "1")
    prog = build_local(graph.module, plan, [torch.device("cpu")] * 2, wl.loss_fn, order=issue_order(graph, plan))
    assert set(_moves(prog)) == {"move_to_streamed"}


def test_streamed_copy_is_differentiable():
    from autoplace.executor.local import _CopyTo

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = _CopyTo.apply(x, torch.device("cpu"))
    assert y is not x
    (3 * y).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_a_second_capture_of_a_workload_is_bound_to_its_own_model():
    """The executor captures each workload spec once per process and batch size: a new
    model of the same workload gets the earlier graph bound to its own parameters, and
    the cache keeps no model alive."""
    import gc
    import weakref

    from autoplace.executor import inputs

    inputs._CAPTURES.clear()
    first = workloads.get("gpt-tiny")
    g1 = capture_graph(first)
    gone = weakref.ref(first.model)
    second = workloads.get("gpt-tiny", seed=1)
    g2 = capture_graph(second)
    assert g2.module is not g1.module and g2.fingerprint == g1.fingerprint
    assert g2.order == g1.order and len(inputs._CAPTURES) == 1
    assert {id(p) for p in g2.module.parameters()} == {id(p) for p in second.model.parameters()}
    x, y = second.make_batch(second.batch_size, "cpu")
    torch.testing.assert_close(g2.module(*x), second.model(*x))
    # another batch size is another capture; so is another architecture under the same spec
    assert capture_graph(second, 2).batch_size == 2 and len(inputs._CAPTURES) == 2
    wider = workloads.get("gpt-tiny", d_model=32)
    wider.spec = dict(second.spec)
    g3 = capture_graph(wider)
    assert g3.fingerprint != g1.fingerprint
    del first, g1
    gc.collect()
    assert gone() is None
    # a plan made on the first capture runs on the second model
    plan = Plan.from_groups(g2, two_halves(g2).groups, [0, 1])
    r = execute(second, plan, cluster=preset("cpu-x2"), steps=2, warmup=0)
    assert r.ok and r.max_loss_rel_diff < 1e-5


def test_global_batch_is_kept_per_workload_step_and_size(monkeypatch):
    """A pool job trains plan after plan on the same steps: each step's batch is drawn
    once (the same tensors come back), other steps, sizes and workloads get their own,
    and the oldest batches go when the cache passes its byte limit."""
    from autoplace.executor import inputs

    monkeypatch.setattr(inputs, "_BATCHES", {})
    wl = workloads.get("gpt-tiny", batch_size=4)
    a = inputs.global_batch(wl, 0, 0)
    assert inputs.global_batch(wl, 0, 0) is a
    b = inputs.global_batch(wl, 1, 0)
    assert b is not a and not torch.equal(a[0][0], b[0][0])
    assert inputs.global_batch(wl, 0, 0, batch_size=2)[1].shape[0] == 2
    other = workloads.get("gpt-tiny", batch_size=4, seq_len=16)
    assert inputs.global_batch(other, 0, 0)[0][0].shape[1] == 16
    torch.manual_seed(0)  # the batch is what a fresh draw after the step's seed gives
    fresh = wl.make_batch(4, "cpu")
    assert torch.equal(fresh[0][0], a[0][0]) and torch.equal(fresh[1], a[1])
    one = sum(t.numel() * t.element_size() for t in (*a[0], a[1]))
    monkeypatch.setattr(inputs, "_BATCH_CACHE_BYTES", 2 * one)
    for s in range(2, 6):
        inputs.global_batch(wl, s, 0)
    assert len(inputs._BATCHES) <= 3 and inputs.global_batch(wl, 5, 0) is not None
    assert all(json.loads(k)[2] != 0 for k in inputs._BATCHES)  # step 0 went first


def test_a_run_reports_where_its_time_went():
    wl = workloads.get("gpt-tiny")
    r = execute(wl, two_halves(capture_graph(wl)), cluster=CPU2, steps=3, warmup=2,
                reference=False)
    assert r.ok, r.error
    x = r.extra
    assert len(x["warmup_step_s"]) == 2 and len(r.step_times_s) == 1
    assert 0 < x["steps_s"] <= x["run_s"] and x["build_s"] >= 0 and x["teardown_s"] >= 0
    # the caching allocator's counters are CUDA's: a CPU run has none, and no retries
    assert "allocator" not in x and r.allocator_retries == 0


def test_allocator_retries_are_summed_over_devices_and_shown():
    """``extra["allocator"]`` (what the timed steps cost the CUDA caching allocator, per
    device) survives JSON, and its retries (the plan ran into its memory cap) are summed
    and said in the summary."""
    alloc = {"0": {"alloc_retries": 3, "device_allocs": 5, "device_frees": 2,
                   "reserved_peak_bytes": 2**30},
             "1": {"alloc_retries": 4, "device_allocs": 0, "device_frees": 0,
                   "reserved_peak_bytes": 2**30}}
    r = RunReport(plan="dp=2/fsdp", step_time_s=0.1, peak_memory_bytes=[1, 1],
                  extra={"allocator": alloc})
    back = RunReport.from_json(json.loads(r.dumps()))
    assert back.allocator_retries == 7
    assert back.reserved_peak_bytes == 2**30
    assert RunReport(plan="x", step_time_s=0.1).reserved_peak_bytes is None  # CPU
    assert "7 allocator retries" in back.summary()
    assert "allocator" not in RunReport(plan="x", step_time_s=0.1).summary()


def test_global_batch_pins_only_with_cuda_and_keeps_pinned_apart(monkeypatch):
    """``pin=True`` asks for page-locked tensors (asynchronous copies to a GPU): without
    CUDA it is the pageable batch with the same values; cached apart from it."""
    import torch

    from autoplace import workloads
    from autoplace.executor import inputs

    monkeypatch.setattr(inputs, "_BATCHES", {})
    wl = workloads.get("gpt-tiny")
    a = inputs.global_batch(wl, 0, 0)
    b = inputs.global_batch(wl, 0, 0, pin=True)
    assert torch.equal(a[1], b[1]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    if torch.cuda.is_available():
        assert b[1].is_pinned() and all(x.is_pinned() for x in b[0])
        assert b is not a and len(inputs._BATCHES) == 2
    else:
        assert not b[1].is_pinned()


def _pieces(prog):
    from autoplace.executor.local import _Graphed

    return [m for m in prog.program.children() if isinstance(m, _Graphed)]


@pytest.mark.parametrize("name", ["gpt-tiny", "gnmt-2", "inception-v3"])
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_graphed_pieces_give_the_same_losses_and_gradients(name, layout, monkeypatch):
    """graphs=True (or AUTOPLACE_CUDA_GRAPHS=1) cuts each microbatch into runs of ops on
    one device, one module per run (on CPU they run eagerly; on GPUs each is replayed as
    a CUDA graph: tests/executor/test_gpu.py); loss and gradients are unchanged."""
    wl = workloads.get(name, **SMALL[name])
    graph = capture_graph(wl)
    base = two_halves(graph) if layout == "halves" else interleaved(graph)
    plan = Plan.from_groups(graph, base.groups, [0, 1], parallel=ParallelConfig(microbatches=2))
    x, y = wl.make_batch(wl.batch_size, "cpu")
    results = []
    for graphs in (False, True):
        g = capture_graph(workloads.get(name, **SMALL[name]))  # same initial weights
        prog = build_local(g.module, plan, [torch.device("cpu")] * 2, wl.loss_fn, order=issue_order(g, plan),
                           graphs=graphs)
        pieces = _pieces(prog)
        if graphs:
            # a piece per run of ops on one device and microbatch: 2 x 2 for the halves
            # (an interleaved placement's runs are mostly single ops, which run eagerly)
            assert len(pieces) == 4 if layout == "halves" else len(pieces) % 2 == 0
        else:
            assert not pieces
        torch.manual_seed(0)
        loss = prog(x, y)
        loss.backward()
        # the captured module's parameters, in its order (the programs own them in others)
        results.append((loss.detach(), [p.grad.clone() for p in g.module.parameters()
                                        if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert len(results[0][1]) == len(results[1][1]) > 0
    for a, b in zip(results[0][1], results[1][1]):  # the order of the sums differs
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
    if layout == "halves":
        monkeypatch.setenv("AUTOPLACE_CUDA_GRAPHS", "1")
        prog = build_local(graph.module, plan, [torch.device("cpu")] * 2, wl.loss_fn, order=issue_order(graph, plan))
        assert len(_pieces(prog)) == 4


def test_a_bound_piece_is_a_function_of_tensors_and_parameters():
    """What a CUDA graph captures: the piece called with its tensors, then its parameters
    as arguments (aliases of them get the gradients), its non-tensor values fixed."""
    from autoplace.executor.local import _Bound

    inner = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    args = ((x, 2.0),)

    class Piece(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = inner

        def forward(self, pair):
            y, scale = pair
            return (self.lin(y) * scale, y.shape)

    piece = Piece()
    bound = _Bound(piece, args)
    assert bound.n_args == 1 and bound.params == list(piece.parameters())
    assert bound.matches(((x, 2.0),)) == [x]
    assert bound.matches(((x, 3.0),)) is None  # another constant: not this capture
    aliases = [p.detach().requires_grad_() for p in bound.params]
    (out,) = bound(x, *aliases)
    torch.testing.assert_close(out, piece(*args)[0])
    out.sum().backward()
    assert all(a.grad is not None for a in aliases)
    assert all(p.grad is None for p in piece.parameters())


def test_a_run_gives_cublas_workspaces_back(monkeypatch):
    """A run's teardown releases cuBLAS's per-stream workspaces, which the caching
    allocator holds until they are cleared (a benchmark's pool job kept 192-384 MiB of them
    from run to run); without CUDA (or that function) it only collects."""
    from autoplace.executor import runner

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: calls.append("cublas"), raising=False)
    runner._free()
    assert calls == ["cublas", "empty"]
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    calls.clear()
    runner._free()
    assert calls == ["empty"]
