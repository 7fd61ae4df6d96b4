"""Tensor parallelism under torchrun on CPU/gloo: tp alone, with FSDP2 (2-D), with a
pipeline (3-D mesh dims pp x tp), HSDP, with recomputed groups, with sequence parallelism
(alone and under FSDP2), on grouped-query attention, and resumed from a checkpoint; the
loss equals the unpartitioned model's."""

from __future__ import annotations

import json

import pytest

from autoplace import workloads
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.executor import execute
from autoplace.executor.runner import capture_graph
from autoplace.lowering import block_groups
from autoplace.plan import ParallelConfig, Plan
from tests.helpers.plans import check_run, run_like_execute, single

TOL = 1e-4  # reductions reordered across processes
CPU2, CPU4 = preset("cpu-x2"), preset("cpu-x4")
#: every Linear of gpt-tiny's two blocks: q/k/v fused and out projection, MLP up and down
SPLIT = [f"blocks.{b}.{m}" for b in (0, 1)
         for m in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")]
#: gpt-tiny's norms inside the blocks, run on sequence shards under sequence parallelism
NORMS = [f"blocks.{b}.{n}" for b in (0, 1) for n in ("ln1", "ln2")]


@pytest.fixture(scope="module")
def tiny():
    wl = workloads.get("gpt-tiny")
    return wl, capture_graph(wl)


def check(r, steps=3):
    check_run(r, steps, TOL)


def test_tensor_parallel_two_ranks(tiny, cpu_pool):
    wl, graph = tiny
    r = run_like_execute(cpu_pool, wl, single(graph, tensor=2), CPU2)
    check(r)
    assert r.extra["tensor_split"] == SPLIT
    assert r.devices == ["cpu", "cpu"]


def test_fsdp_x_tensor_2d(tiny, cpu_pool):
    wl, graph = tiny
    r = run_like_execute(cpu_pool, wl, single(graph, data=2, shard="fsdp", tensor=2), CPU4)
    check(r)
    assert len(r.devices) == 4


def test_pipeline_x_tensor(tiny, cpu_pool):
    wl, graph = tiny
    # stage 0: embeddings and block 0, stage 1: block 1 and the head (cut between blocks)
    cut = graph.order.index("blocks_1_ln1")
    groups = {op: int(i >= cut) for i, op in enumerate(graph.order)}
    plan = Plan.from_groups(graph, groups, [0, 1],
                            parallel=ParallelConfig(pipeline=2, microbatches=2, tensor=2))
    r = run_like_execute(cpu_pool, wl, plan, CPU4)
    check(r)
    assert r.extra["tensor_split"] == SPLIT[:4]  # rank 0's: stage 0 splits block 0


def test_hsdp_two_by_two(tiny, cpu_pool):
    wl, graph = tiny
    check(run_like_execute(cpu_pool, wl, single(graph, data=4, shard="fsdp", replicate=2), CPU4))


def test_tensor_parallel_with_ddp_and_recompute(tiny, cpu_pool):
    """DDP's replicas reduce the tensor-parallel (DTensor) gradients over ``dp``; blocks
    recomputed under torch.utils.checkpoint run their collectives again in backward."""
    wl, graph = tiny
    groups = block_groups(graph)
    blocks = {groups[op] for op in graph.order if op.startswith("blocks_")}
    plan = Plan.from_groups(graph, groups, [0] * (max(groups.values()) + 1),
                            parallel=ParallelConfig(data=2, tensor=2), recompute=blocks)
    check(run_like_execute(cpu_pool, wl, plan, CPU4))



def test_sequence_parallel_two_ranks(tiny, cpu_pool):
    wl, graph = tiny
    r = run_like_execute(cpu_pool, wl, single(graph, tensor=2, sequence_parallel=True), CPU2)
    check(r)
    assert r.extra["tensor_split"] == sorted(SPLIT + NORMS)


def test_fsdp_x_tensor_with_sequence_parallel(tiny, cpu_pool):
    wl, graph = tiny
    check(run_like_execute(cpu_pool, wl, single(graph, data=2, shard="fsdp", tensor=2,
                                             sequence_parallel=True), CPU4))


def test_grouped_query_attention_splits_kv_heads(cpu_pool):
    """llama3-tiny: 4 query heads, 2 key/value heads repeated by expand + flatten, rotary
    embeddings; each rank keeps 2 query and 1 key/value head (and its norms' sequence
    shard)."""
    wl = workloads.get("llama3-tiny")
    graph = capture_graph(wl)
    r = run_like_execute(cpu_pool, wl, single(graph, tensor=2, sequence_parallel=True), CPU2)
    check(r)
    split = r.extra["tensor_split"]
    assert {"layers.0.attention.wk", "layers.0.attention.wv", "layers.1.feed_forward.w3",
            "layers.1.ffn_norm"} <= set(split)
    assert len(split) == 2 * (7 + 2)  # per block: 7 Linears, 2 norms


def test_tensor_parallel_checkpoint_resumes_exactly(tiny, tmp_path, cpu_pool):
    """A tp=2 run saved after 2 steps (DTensor shards through torch.distributed.checkpoint,
    the regrouped qkv's layout recorded) continues at step 3 as the unpartitioned model."""
    wl, graph = tiny
    plan = single(graph, tensor=2)
    first = run_like_execute(cpu_pool, wl, plan, CPU2, steps=2, warmup=0,
                             checkpoint_dir=tmp_path)
    check(first, steps=2)
    layout = json.loads((tmp_path / "step-2" / "tensor_layout.json").read_text())
    assert layout == {f"program.blocks.{b}.attn.qkv": [2, 3, 2, 32] for b in (0, 1)}
    rest = run_like_execute(cpu_pool, wl, plan, CPU2, steps=4, warmup=0,
                            checkpoint_dir=tmp_path, resume=True)
    assert rest.ok, rest.error
    assert rest.extra["start_step"] == 2
    check(rest, steps=2)  # the reference's steps 3 and 4, trained from step 0
    with pytest.raises(AutoplaceError, match="saved with tensor-parallel columns regrouped"):
        execute(wl, single(graph, data=2), cluster=CPU2, steps=6, warmup=0,
                checkpoint_dir=tmp_path, resume=True, reference=False)


def test_split_and_whole_parameters_step_fused_in_groups_of_their_own():
    """Tensor parallel leaves norms whole: their plain parameters sit beside DTensor ones.
    A fused AdamW step (the executor's on CUDA; CPU has the same kernel) refuses the mix
    in one group, and takes the optimizer's groups of one kind each."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from autoplace.executor.runner import param_groups

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        split = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        whole = nn.Parameter(torch.randn(4))
        for p in (split, whole):
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            torch.optim.AdamW([split, whole], fused=True).step()
        before = whole.detach().clone()
        torch.optim.AdamW(param_groups([split, whole]), fused=True).step()
        assert not torch.equal(whole.detach(), before)
        assert param_groups([whole]) == [whole]
    finally:
        dist.destroy_process_group()
