"""A model's ``no_grad`` and autocast-off regions through torch.export, the executor and the
profiler: transformers 5.17's Llama computes its rotary angles in a ``@torch.no_grad``
method under ``torch.autocast(enabled=False)``, entered only where autocast is on. Exported
without autocast that region vanished and, run under the executor's autocast, the angles'
matmul ran in bf16 (torch 2.11 refused the graph at its dtype assertion); exported under
the workload's autocast it is a ``wrap_with_autocast`` call inside a
``wrap_with_set_grad_enabled`` body, whose device constants name where the op runs."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autoplace import workloads
from autoplace.capture import body_on_device, capture_workload, fetch_attr
from autoplace.cluster import preset
from autoplace.executor.runner import capture_graph
from autoplace.plan import ParallelConfig, Plan
from tests.helpers import pythonpath_with_root
from tests.helpers.plans import run_like_execute, split
from tests.helpers.region_models import rotary_net

WRAP = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]




@pytest.fixture(autouse=True)
def _workers_find_the_module(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_root())


@pytest.mark.skipif(WRAP is None, reason="this torch has no wrap_with_autocast")
def test_autocast_off_region_is_kept_and_computes_in_fp32():
    wl = rotary_net(autocast_dtype="bfloat16")
    gm = capture_graph(wl).module
    wraps = [n for m in _graph_modules(gm) for n in m.graph.nodes if n.target is WRAP]
    assert wraps and wraps[0].args[2] is False  # autocast off inside the no_grad body
    (x,), _ = wl.make_batch(2, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = wl.model(x)
        got = gm(x)
    assert torch.equal(got, want)  # angles of positions 700-955 in fp32, as the model
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the lost region computed
        h = wl.model.inp(x)
        pos = torch.arange(256).expand(2, -1) + 700
        freq = wl.model.rotary.inv_freq[None, :, None].expand(2, -1, 1)
        lost = wl.model.out(h * (freq @ pos[:, None, :].float()).transpose(1, 2).cos())
    assert not torch.allclose(lost.float(), want.float(), atol=1e-2)


def test_bodies_name_the_device_their_op_runs_on():
    gm = capture_workload(rotary_net(autocast_dtype="bfloat16")).module
    meta = torch.device("meta")
    moved = body_on_device(gm, meta)
    for m in _graph_modules(moved):
        for n in m.graph.nodes:
            devices = [a for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs))
                       if isinstance(a, torch.device)]
            assert all(d == meta for d in devices), n.format_node()
            if n.target is WRAP:
                assert n.args[0] == "meta"
    originals = [n for m in _graph_modules(gm) for n in m.graph.nodes
                 if isinstance(n.args[0] if n.args else None, torch.device)
                 or n.target is WRAP]
    assert originals and all((n.args[0] == "cpu" if n.target is WRAP else
                              n.args[0].type == "cpu") for n in originals)  # left alone


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["local mb=2", "gpipe"])
def test_trains_like_the_unpartitioned_model(plan, cpu_pool):
    wl = workloads.get("tests.helpers.region_models:rotary_net", autocast_dtype="bfloat16")
    graph = capture_graph(wl)
    if plan == "local mb=2":
        p = split(graph, microbatches=2)
    else:  # the rotary region and the first layer on stage 0, the rest on stage 1
        cut = graph.order.index("mul")
        p = Plan.from_groups(graph, {op: int(i >= cut) for i, op in enumerate(graph.order)},
                             [0, 1], parallel=ParallelConfig(pipeline=2, microbatches=2))
    r = run_like_execute(cpu_pool, wl, p, preset("cpu-x2"), steps=3, warmup=1, graph=graph)
    assert r.ok, r.error
    assert r.max_loss_rel_diff < 1e-4, (r.loss, r.reference_loss)  # as test_hf_models


@pytest.mark.slow
def test_a_stage_without_parameters_trains_and_resumes(tmp_path, cpu_pool):
    """Program order puts the parameter-free position ops on stage 0 and every layer on
    stage 1: stage 0 has nothing to update (it failed at AdamW's empty parameter list),
    and its checkpoint holds no optimizer state."""
    wl = workloads.get("tests.helpers.region_models:rotary_net")
    graph = capture_graph(wl)
    cut = graph.order.index("linear")
    plan = Plan.from_groups(graph, {op: int(i >= cut) for i, op in enumerate(graph.order)},
                            [0, 1], parallel=ParallelConfig(pipeline=2, microbatches=2))
    gm = graph.module
    on_first = {n for n, g in plan.groups.items() if plan.placement[g] == 0}
    params = {n.name for n in gm.graph.nodes
              if n.op == "get_attr" and isinstance(fetch_attr(gm, n.target), torch.nn.Parameter)}
    assert not any(a.name in params for n in gm.graph.nodes
                   if n.name in on_first and n.op == "call_function" for a in n.all_input_nodes)
    cpu2 = preset("cpu-x2")
    whole = run_like_execute(cpu_pool, wl, plan, cpu2, steps=4, warmup=1, graph=graph)
    assert whole.ok, whole.error
    assert whole.max_loss_rel_diff < 1e-4, (whole.loss, whole.reference_loss)
    first = run_like_execute(cpu_pool, wl, plan, cpu2, steps=2, warmup=0, graph=graph,
                             checkpoint_dir=tmp_path, reference=False)
    assert first.ok, first.error
    rest = run_like_execute(cpu_pool, wl, plan, cpu2, steps=4, warmup=0, graph=graph,
                            checkpoint_dir=tmp_path, resume=True, reference=False)
    assert rest.ok, rest.error
    assert rest.loss == pytest.approx(whole.loss[2:], rel=1e-6)
