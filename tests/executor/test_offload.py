"""Offloaded plans (``parallel.offload``): FSDP2's CPUOffloadPolicy on one rank and on two
(gloo on CPU), with recompute and compile; the GPU memory it saves (``-m gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoplace import workloads
from autoplace.cluster import Cluster, preset
from autoplace.executor import execute
from autoplace.executor.data import wrap_data_parallel
from autoplace.executor.offload import (
    host_threads,
    offload_optimizer,
    on_host,
    one_rank_group,
    one_rank_mesh,
    rank_threads,
)
from autoplace.executor.pieces import COMPILE_BACKEND_ENV
from autoplace.executor.runner import capture_graph
from autoplace.lowering import block_group_ids, block_groups
from autoplace.plan import ParallelConfig, Plan

TOL = 1e-4
CPU2 = preset("cpu-x2")


@pytest.fixture(scope="module")
def tiny():
    wl = workloads.get("gpt-tiny")
    return wl, capture_graph(wl)


def blocks_plan(graph, recompute: str | None = None, **parallel) -> Plan:
    """The model's blocks as groups on one device, checkpointed whole or selectively."""
    groups = block_groups(graph)
    blocks = block_group_ids(graph, groups)
    return Plan.from_groups(graph, groups, [0] * (max(groups.values()) + 1),
                            recompute=blocks if recompute == "full" else set(),
                            selective=blocks if recompute == "selective" else set(),
                            parallel=ParallelConfig(**parallel))


def check(r, steps=3):
    assert r.ok, r.error
    assert len(r.loss) == steps and len(r.reference_loss) == steps
    assert r.max_loss_rel_diff <= TOL, (r.loss, r.reference_loss)
    assert r.extra["params_on_host"] is True


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_one_device_trains_like_the_reference(tiny, recompute):
    wl, graph = tiny
    r = execute(wl, blocks_plan(graph, recompute, shard="fsdp", offload=True), cluster=CPU2,
                steps=3, warmup=1)
    check(r)
    assert r.plan.endswith("fsdp offload")
    assert not dist.is_initialized()  # its process group of one is gone with the run


def test_two_ranks_train_like_the_reference(tiny):
    wl, graph = tiny
    r = execute(wl, blocks_plan(graph, data=2, shard="fsdp", offload=True), cluster=CPU2,
                steps=3, warmup=1)
    check(r)
    assert r.devices == ["cpu", "cpu"]


def test_compiled_and_checkpointed(tiny, monkeypatch):
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")  # compiles without a C++ toolchain
    wl, graph = tiny
    r = execute(wl, blocks_plan(graph, "full", shard="fsdp", offload=True, compile=True),
                cluster=CPU2, steps=3, warmup=1)
    check(r)
    assert r.extra["compile"]["pieces"] > 0 and not r.extra["compile"]["failed"]


def test_checkpoint_resumes_exactly(tiny, tmp_path):
    wl, graph = tiny
    plan = blocks_plan(graph, shard="fsdp", offload=True)
    full = execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False)
    execute(wl, plan, cluster=CPU2, steps=2, warmup=0, reference=False, checkpoint_dir=tmp_path)
    rest = execute(wl, plan, cluster=CPU2, steps=4, warmup=0, reference=False,
                   checkpoint_dir=tmp_path, resume=True)
    assert rest.ok, rest.error
    assert rest.loss == pytest.approx(full.loss[2:], rel=1e-6)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_shards_stay_on_the_host_between_steps():
    """wrap_data_parallel with offload: every unit's shard is a CPU DTensor after each step,
    and training equals plain AdamW on the whole module."""
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    units = {f"blocks.{i}": f"blocks.{i}" for i in range(3)}
    with one_rank_group(torch.device("cpu")):
        model = wrap_data_parallel(net, units, "fsdp", mesh=one_rank_mesh(torch.device("cpu")),
                                   offload=True)
        opt = offload_optimizer(list(model.parameters()), lr=1e-2)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
            assert on_host(model)
        got = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6)
    assert not dist.is_initialized()


def test_one_rank_group_joins_a_world_of_one():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with one_rank_group(torch.device("cpu")):
            assert dist.get_world_size() == 1
        assert dist.is_initialized()  # not ours to destroy
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_peak_gpu_memory_well_below_the_plain_plan():
    """gpt-medium (102M parameters) with checkpointed blocks on one GPU: with its
    parameters, gradients and AdamW state (16 bytes a parameter) on the host the GPU's
    peak falls by most of those bytes (on one H200: 4.08 -> 2.83 GB, 1.25 of 1.63 GB;
    activations, which stay, are most of the rest)."""
    wl = workloads.get("gpt-medium")
    graph = capture_graph(wl)
    gpu = Cluster.detect().subset([0])
    plain = execute(wl, blocks_plan(graph, "full"), cluster=gpu, steps=3, warmup=1)
    off = execute(wl, blocks_plan(graph, "full", shard="fsdp", offload=True), cluster=gpu,
                  steps=3, warmup=1)
    for r in (plain, off):
        assert r.ok, r.error
        assert r.max_loss_rel_diff < 1e-3, (r.loss, r.reference_loss)
    assert off.extra["params_on_host"] is True
    state = 16 * sum(p.numel() for p in wl.model.parameters())
    assert plain.peak_memory_bytes[0] - off.peak_memory_bytes[0] > 0.6 * state, (
        off.peak_memory_bytes, plain.peak_memory_bytes, state)


def test_a_gpu_rank_steps_on_its_share_of_the_cores(monkeypatch):
    """The ranks of a node split its cores; on a GPU the run uses them and restores the
    threads after; on a CPU device the threads are left as they are."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert rank_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with host_threads(torch.device("cuda", 0)) as n:
            assert n == 8 and torch.get_num_threads() == 8
        assert torch.get_num_threads() == 1
        with host_threads(torch.device("cpu")) as n:
            assert n == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
