"""Per-block levers: activation checkpointing (whole or selective) and torch.compile per
piece, executed by the local program and modelled by the simulator."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import PlanError
from autoplace.executor.local import build_local
from autoplace.executor.pieces import COMPILE_BACKEND_ENV, CompiledPiece, Piece, direct_children
from autoplace.executor.runner import capture_graph
from autoplace.lowering import block_group_ids, block_groups, block_regions, issue_order
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate


@pytest.fixture(scope="module")
def tiny():
    wl = workloads.get("gpt-tiny")
    return wl, capture_graph(wl)


def _blocks_plan(graph, recompute=(), selective=(), **parallel) -> Plan:
    groups = block_groups(graph)
    n = max(groups.values()) + 1
    return Plan.from_groups(graph, groups, [0] * n, recompute=set(recompute),
                            selective=set(selective), parallel=ParallelConfig(**parallel))


def _block_ids(graph, groups) -> list[int]:
    return sorted(block_group_ids(graph, groups))


def test_block_groups_are_the_blocks(tiny):
    _, graph = tiny
    groups = block_groups(graph)
    regions = dict(zip(graph.order, block_regions(graph)))
    blocks = _block_ids(graph, groups)
    assert len(blocks) == 2  # gpt-tiny's two transformer blocks
    for g in blocks:  # one block per group, and every op of a block in its group
        assert len({regions[op] for op, x in groups.items()
                    if x == g and graph.ops[graph.index[op]].kind not in ("input", "param")}) == 1
    assert {regions[op] for op in graph.order if regions[op]} == {"blocks.0", "blocks.1"}


def _loss_and_grads(wl, graph, plan):
    torch.manual_seed(0)
    g = capture_graph(workloads.get("gpt-tiny"))  # the same initial weights every time
    prog = build_local(g.module, plan, [torch.device("cpu")], wl.loss_fn,
                       order=issue_order(g, plan))
    x, y = wl.make_batch(wl.batch_size, "cpu")
    loss = prog(x, y)
    loss.backward()
    return prog, loss.detach(), {n: p.grad.clone() for n, p in g.module.named_parameters()}


@pytest.mark.parametrize("levers", ["full", "selective", "compile", "selective+compile"])
def test_pieces_train_like_the_eager_program(tiny, monkeypatch, levers):
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")  # compiles without a C++ toolchain
    wl, graph = tiny
    blocks = _block_ids(graph, block_groups(graph))
    kw = {"recompute": blocks} if "full" in levers else \
        {"selective": blocks} if "selective" in levers else {}
    plan = _blocks_plan(graph, compile="compile" in levers, **kw)
    _, ref_loss, ref_grads = _loss_and_grads(wl, graph, _blocks_plan(graph))
    prog, loss, grads = _loss_and_grads(wl, graph, plan)
    pieces = [m for m in prog.program.modules() if isinstance(m, (Piece, CompiledPiece))]
    assert pieces
    if "compile" in levers:
        assert all(isinstance(m, CompiledPiece) for m in prog.program.children()
                   if isinstance(m, (Piece, CompiledPiece)))
        compiled = [m for m in pieces if isinstance(m, CompiledPiece)]
        assert compiled and all(m.failed is None and m.compile_s is not None for m in compiled)
    modes = {m.recompute for m in pieces if isinstance(m, Piece)}
    want = {"full"} if "full" in levers else {"selective"} if "selective" in levers else set()
    if "compile" in levers:  # every group runs in compiled pieces
        want.add(None)
    assert modes == want
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("levers", ["eager", "full"])
def test_the_program_finds_its_modules_without_module_getattr(tiny, monkeypatch, levers):
    """fx's code calls a module by its path (``getattr(self.blocks, "0").ln1(x)``), each
    step through ``nn.Module.__getattr__``; the built program finds its modules directly: a
    forward looks none of them up through ``__getattr__``, the model's layers and the state
    dict are as they were, the loss and gradients are the unbuilt program's, and a child
    replaced later is the one called."""
    wl, graph = tiny
    blocks = _block_ids(graph, block_groups(graph))
    plan = _blocks_plan(graph, **({"recompute": blocks} if levers == "full" else {}))
    torch.manual_seed(0)  # as _loss_and_grads: the same weights and batch
    g = capture_graph(workloads.get("gpt-tiny"))
    prog = build_local(g.module, plan, [torch.device("cpu")], wl.loss_fn,
                       order=issue_order(g, plan))
    x, y = wl.make_batch(wl.batch_size, "cpu")
    if levers == "eager":
        assert 'getattr(self.blocks, "0")' in prog.program.code
    ours = [m for m in prog.program.modules() if m is prog.program or type(m) is torch.nn.Module
            or isinstance(m, Piece) or isinstance(m, torch.fx.GraphModule)]
    assert len(ours) > 2
    keys = list(prog.state_dict())
    layers = [m for m in prog.program.modules() if all(m is not o for o in ours)]
    assert layers and all(not any(isinstance(v, torch.nn.Module) for v in vars(m).values())
                          for m in layers)  # the model's layers keep their children as were
    looked_up = []
    real = torch.nn.Module.__getattr__

    def counting(self, name):
        looked_up.append((self, name))
        return real(self, name)

    monkeypatch.setattr(torch.nn.Module, "__getattr__", counting)
    loss = prog(x, y)
    monkeypatch.undo()
    loss.backward()
    # (tensors stay where nn.Module keeps them: ``to()`` replaces a buffer in ``_buffers``)
    assert not [name for m, name in looked_up
                if name in m._modules and any(m is o for o in ours)]
    assert list(prog.state_dict()) == keys
    grads = {n: p.grad.clone() for n, p in g.module.named_parameters()}
    _, ref_loss, ref_grads = _loss_and_grads(wl, graph, _blocks_plan(graph))
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6)
    # a module replaced through nn.Module.__setattr__ is the one the program then calls
    head = prog.program.head
    calls = []
    prog.program.head = _Calls(head, calls)
    prog(x, y)
    assert calls
    assert direct_children(torch.nn.Module()) == 0


class _Calls(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, calls: list) -> None:
        super().__init__()
        self.inner, self.calls = inner, calls

    def forward(self, *args):
        self.calls.append(1)
        return self.inner(*args)


_COUNTING: dict = {}  # the counting backend's current function


def test_every_piece_is_compiled_past_the_recompile_limit(monkeypatch):
    """torch.compile keeps at most 8 compiled graphs per code object; a model of more
    pieces than that (12 blocks + the rest) still runs every one compiled, the repeated
    blocks through one compiled graph, and a piece is shared by the microbatches that run
    the same ops."""
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "autoplace_count_test")
    compiled: list[int] = []

    def counting(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    registry = torch._dynamo.backends.registry
    if "autoplace_count_test" not in registry.list_backends(exclude_tags=()):
        registry.register_backend(lambda gm, ex: _COUNTING["fn"](gm, ex), "autoplace_count_test")
    monkeypatch.setitem(_COUNTING, "fn", counting)
    wl = workloads.get("gpt-tiny", n_layers=12)
    graph = capture_graph(wl)
    plan = _blocks_plan(graph, compile=True, microbatches=2)
    prog = build_local(graph.module, plan, [torch.device("cpu")], wl.loss_fn,
                       order=issue_order(graph, plan))
    pieces = [m for m in prog.program.children() if isinstance(m, CompiledPiece)]
    assert len(pieces) == plan.num_groups  # one per group, not one per group x microbatch
    x, y = wl.make_batch(wl.batch_size, "cpu")
    prog(x, y).backward()
    assert all(m.failed is None and m.compile_s is not None for m in pieces)
    # every piece ran compiled; the 12 blocks share one compiled graph (forward and
    # backward: 2 backend calls), as blocks compiled one by one by hand do
    kinds = {m.kind for m in pieces}
    assert len(pieces) > 8 and len(kinds) < len(pieces) - 10
    assert len(compiled) <= 2 * len(kinds)
    torch._dynamo.reset()


def test_a_piece_whose_compile_fails_runs_eager_and_says_so():
    inner = torch.nn.Linear(4, 4)
    cp = CompiledPiece(Piece(inner, None), "group 3 (microbatch 0)")

    def broken(*args):
        raise RuntimeError("backend exploded")

    object.__setattr__(cp, "_compiled", broken)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = cp(x)
    assert any("group 3 (microbatch 0)" in str(m.message) and "runs eager" in str(m.message)
               for m in w)
    assert cp.failed.startswith("RuntimeError: backend exploded")
    torch.testing.assert_close(out, inner(x))
    torch.testing.assert_close(cp(x), inner(x))  # and stays eager


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_graph_piece_stops_early_without_fx_error_formatting(monkeypatch, mode):
    """torch.utils.checkpoint stops a recompute by raising inside the region once its last
    saved tensor is made (the block's last matmul keeps only its input: it never runs
    again). Called through its ``__call__``, a GraphModule formats the traceback of every
    exception it sees (0.1 ms and more a region, per step); the piece calls its generated
    forward, so the stop costs nothing, and the gradients are eager's."""
    import traceback

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    inner = torch.fx.symbolic_trace(Mlp())
    x = torch.randn(4, 8, requires_grad=True)
    inner(x).sum().backward()
    want = [t.grad.clone() for t in (x, *inner.parameters())]
    for t in (x, *inner.parameters()):
        t.grad = None
    extracted = []
    real = traceback.StackSummary.extract
    monkeypatch.setattr(traceback.StackSummary, "extract",
                        classmethod(lambda cls, *a, **k: extracted.append(1) or real(*a, **k)))
    Piece(inner, mode)(x).sum().backward()
    assert not extracted
    for got, ref in zip([t.grad for t in (x, *inner.parameters())], want):
        torch.testing.assert_close(got, ref)


def test_the_simulator_prices_selective_between_none_and_full(tiny, monkeypatch):
    from autoplace.sim import block_profile

    _, graph = tiny
    base = preset("h100x1")  # device time only: gpt-tiny's step is otherwise host-bound
    cluster = replace(base, devices=tuple(replace(d, host_dispatch_s=0.0) for d in base.devices))
    monkeypatch.setattr(block_profile, "SELECTIVE_HOST_S", 0.0)  # nor checkpointing's host time
    monkeypatch.setattr(block_profile, "RECOMPUTE_HOST_S", 0.0)
    blocks = _block_ids(graph, block_groups(graph))
    runs = {name: simulate(graph, _blocks_plan(graph, **kw), cluster)
            for name, kw in (("none", {}), ("selective", {"selective": blocks}),
                             ("full", {"recompute": blocks}))}
    t = {k: r.step_time_s for k, r in runs.items()}
    act = {k: r.memory_breakdown[0]["activations"] for k, r in runs.items()}
    assert t["none"] < t["selective"] < t["full"]
    assert act["full"] < act["selective"] < act["none"]


def test_plan_fields_round_trip_and_validate(tiny):
    _, graph = tiny
    blocks = _block_ids(graph, block_groups(graph))
    plan = _blocks_plan(graph, selective=blocks[:1], recompute=blocks[1:], compile=True)
    again = Plan.from_json(plan.to_json())
    assert again.selective == plan.selective and again.parallel.compile
    assert "compile" in again.parallel.describe()
    plan.validate(graph)
    old = _blocks_plan(graph).to_json()
    assert "selective" not in old and "compile" not in old["parallel"]  # older readers
    with pytest.raises(PlanError, match="both recompute and selective"):
        _blocks_plan(graph, selective=blocks, recompute=blocks).validate(graph)
    with pytest.raises(PlanError, match="exclude each other"):
        ParallelConfig(compile=True, graphs=True)
    with pytest.raises(PlanError, match="selective"):
        Plan.from_json({**old, "selective": ["x"]})


def _check(r, steps=3):
    assert r.ok, r.error
    assert r.max_loss_rel_diff < 1e-4, (r.loss, r.reference_loss)
    assert len(r.loss) == steps


@pytest.mark.parametrize("levers", ["recompute", "selective+compile"])
def test_a_pipeline_stage_runs_recomputed_or_compiled(tiny, monkeypatch, levers):
    """A pipeline stage's groups recomputed (whole or selectively) or compiled: the stage
    runs as one piece under torch.distributed.pipelining, with the reference's losses."""
    from autoplace.executor import execute
    from tests.helpers.plans import split

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    wl, graph = tiny
    base = split(graph, pipeline=2, microbatches=2, compile="compile" in levers)
    kw = {"selective": {1}} if "selective" in levers else {"recompute": {1}}
    plan = Plan.from_groups(graph, base.groups, base.placement, parallel=base.parallel, **kw)
    _check(execute(wl, plan, cluster=preset("cpu-x2"), steps=3, warmup=1))


def test_a_stage_recomputed_in_part_is_refused(tiny):
    from autoplace.lowering import validate

    _, graph = tiny
    groups = block_groups(graph)
    n = max(groups.values()) + 1
    placement = [0 if g < n // 2 else 1 for g in range(n)]
    plan = Plan.from_groups(graph, groups, placement, recompute={n - 1},
                            parallel=ParallelConfig(pipeline=2, microbatches=2))
    with pytest.raises(PlanError, match="stage 1 recomputes some of its groups"):
        validate(graph, plan)


@pytest.mark.parametrize("recipe", ["ddp+compile", "fsdp+checkpoint-blocks+compile"])
def test_data_parallel_recipes_train_like_the_reference(tiny, monkeypatch, recipe):
    """DDP + compile and FSDP2 + per-block checkpointing + compile (torchtitan's recipe) as
    autoplace runs them, two gloo ranks: the reference's losses."""
    from autoplace.executor import execute
    from autoplace.planners.manual import lever_plans

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    wl, graph = tiny
    gpu_like = preset("h100x2")  # the compiled recipes are offered for GPUs
    plan = lever_plans(graph, gpu_like)[recipe]
    _check(execute(wl, plan, cluster=preset("cpu-x2"), steps=3, warmup=1))


def test_a_compiled_run_reports_its_pieces_and_warm_up(monkeypatch):
    from autoplace.executor.runner import RunOptions, run_here

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    wl = workloads.get("gpt-tiny")
    graph = capture_graph(wl)
    plan = _blocks_plan(graph, compile=True)
    rep = run_here(wl, plan, preset("cpu-x1"), RunOptions(steps=4, warmup=2))
    assert rep.error is None and rep.max_loss_rel_diff <= 1e-4
    comp = rep.extra["compile"]
    assert comp["pieces"] == plan.num_groups and comp["kinds"] < comp["pieces"]
    assert comp["compile_s"] > 0 and comp["failed"] == [] and "warmup_overhead_s" in comp
    assert f"{comp['pieces']} compiled pieces" in rep.summary()


@pytest.mark.parametrize("wrap", [(None, True), ("full", False), ("selective", True)])
def test_a_wrapped_stage_keeps_its_shapes(tiny, wrap):
    """Every pipeline stage carries its input and output shapes from the fake run, and a
    stage recomputed or compiled whole still shows them to PipelineStage (which otherwise
    infers them by running the stage on uninitialised inputs)."""
    from autoplace.executor.pieces import piece
    from autoplace.executor.pipeline import _unwrapped, build_stage, example_values
    from tests.helpers.plans import split

    wl, graph = tiny
    plan = split(graph, pipeline=2, microbatches=2)
    inputs, _ = wl.make_batch(wl.batch_size // 2, "cpu")
    values = example_values(graph.module, inputs)
    cpu = torch.device("cpu")
    last = build_stage(graph.module, plan, 1, inputs, cpu, values)
    ins, outs = last.stage_io
    assert [tuple(t.shape) for t in outs] == [(wl.batch_size // 2, *tuple(
        values[next(n for n in graph.module.graph.nodes if n.op == "output").args[0].name]
        .shape)[1:])]
    wrapped = piece(last, wrap[0], wrap[1], "pipeline stage 1")
    assert _unwrapped(wrapped).stage_io is last.stage_io
