"""The simulator's price of compiled pieces: fused ops cheaper, heavy kernels unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.lowering import block_group_ids, block_groups
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import compiled as compiled_mod
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.compiled import (
    COMPILED_CALL_HOST_S,
    COMPILED_FUSED_TIME,
    compiled_arrays,
    compiled_tables,
    fused_chains,
    fused_times,
)
from autoplace.sim.memory import cast_weight_bytes
from autoplace.sim.model import cost_tables, ensure_costs, graph_arrays
from autoplace.workloads import Workload


@pytest.fixture(scope="module")
def gpt():
    return capture_workload(workloads.get("gpt-small", device="meta"))


def _blocks(graph, compiled: bool) -> Plan:
    groups = block_groups(graph)
    return Plan.from_groups(graph, groups, [0] * (max(groups.values()) + 1),
                            parallel=ParallelConfig(compile=compiled))


def test_fused_ops_are_scaled_and_heavy_ones_kept(gpt):
    cluster = preset("h200x1")
    ensure_costs(gpt, cluster)
    ga = graph_arrays(gpt)
    eager = cost_tables(gpt, cluster)
    comp = compiled_tables(eager, ga)
    assert ga.saved.any() and (~ga.saved).any()
    np.testing.assert_allclose(comp.fwd[:, ga.saved], eager.fwd[:, ga.saved])
    np.testing.assert_allclose(comp.bwd[:, ~ga.saved], COMPILED_FUSED_TIME * eager.bwd[:, ~ga.saved])
    assert not np.isnan(comp.host_fwd).any()  # a missing host time is the device's, scaled


def test_a_compiled_plan_simulates_faster_and_batch_agrees(gpt, monkeypatch):
    monkeypatch.setattr(compiled_mod, "COMPILED_CALL_HOST_S", 0.0)  # gpt-small's blocks
    cluster = preset("h200x1")
    eager, comp = _blocks(gpt, False), _blocks(gpt, True)
    t_eager = simulate(gpt, eager, cluster).step_time_s
    t_comp = simulate(gpt, comp, cluster).step_time_s
    assert t_comp < t_eager
    batch = simulate_batch(gpt, [eager, comp], cluster)
    np.testing.assert_allclose(batch.step_time_s, [t_eager, t_comp], rtol=1e-9)


class _TanhGeluMLP(torch.nn.Module):
    """Linear -> GELU written out (pow, mul, tanh: five kept tensors eagerly) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(h)


def test_a_compiled_chain_of_fused_ops_keeps_only_its_input():
    wl = Workload(name="gelu-mlp", model=_TanhGeluMLP(), batch_size=512,
                  make_batch=lambda bs, dev: ((torch.randn(bs, 64, device=dev),),
                                              torch.randn(bs, 64, device=dev)),
                  loss_fn=torch.nn.functional.mse_loss)
    graph = capture_workload(wl)
    ga = graph_arrays(graph)
    plan = Plan.single(graph, parallel=ParallelConfig(compile=True))
    comp = compiled_arrays(graph, ga, plan)
    fused = ~ga.saved & (ga.act_bytes > 0)
    assert fused.sum() >= 3  # the chain's ops keep their tensors eagerly
    assert comp.act_bytes[fused].sum() < 0.5 * ga.act_bytes[fused].sum()
    np.testing.assert_array_equal(comp.act_bytes[ga.saved], ga.act_bytes[ga.saved])
    cluster = preset("h200x1")
    peak = {c: max(simulate(graph, Plan.single(graph, parallel=ParallelConfig(compile=c)),
                            cluster).peak_memory_bytes) for c in (False, True)}
    assert peak[True] < peak[False]


def test_a_chain_is_priced_by_the_bytes_entering_and_leaving_it():
    """The tanh-GELU chain (seven fused ops between two matmuls) is one chain: it reads
    the first matmul's output and writes the second's input, once each; its compiled
    forward costs those bytes over the bandwidth, at least a launch, at most eager, and a
    profiled factor replaces the chain pricing on its device kind."""
    wl = Workload(name="gelu-mlp", model=_TanhGeluMLP(), batch_size=4096,
                  make_batch=lambda bs, dev: ((torch.randn(bs, 64, device=dev),),
                                              torch.randn(bs, 64, device=dev)),
                  loss_fn=torch.nn.functional.mse_loss)
    graph = capture_workload(wl)
    cluster = preset("h200x1")
    ensure_costs(graph, cluster)
    ga = graph_arrays(graph)
    plan = Plan.single(graph, parallel=ParallelConfig(compile=True))
    root, entering, leaving = fused_chains(graph, ga, plan)
    chain_ops = np.nonzero(root >= 0)[0]
    roots = set(root[chain_ops].tolist())
    gelu = max(roots, key=lambda r: (root == r).sum())
    members = np.nonzero(root == gelu)[0]
    assert len(members) >= 5
    up = graph.index["up"]
    assert entering[gelu] == pytest.approx(ga.out_bytes[up])  # the matmul's output, once
    assert leaving[gelu] > 0
    eager = cost_tables(graph, cluster)
    comp = compiled_tables(eager, ga, graph=graph, plan=plan)
    dev = cluster.devices[0]
    want = max(dev.launch_overhead_s, (entering[gelu] + leaving[gelu]) / dev.memory_bandwidth)
    got = comp.fwd[0, members].sum()
    assert got == pytest.approx(min(want, eager.fwd[0, members].sum()))
    assert got < eager.fwd[0, members].sum()
    np.testing.assert_allclose(comp.fwd[:, ga.saved], eager.fwd[:, ga.saved])
    graph.profile_info = {"h200": {"compiled": {"fused_time": 0.9}}}
    prof = compiled_tables(eager, ga, fused_times(graph, eager.kinds), graph=graph, plan=plan)
    np.testing.assert_allclose(prof.fwd[0, members], 0.9 * eager.fwd[0, members])


def test_compiled_pieces_keep_their_own_weight_copies_per_microbatch():
    """Eagerly autocast casts each weight once a step (its cache serves every microbatch;
    the ops that read a copy save it until their backward);
    a compiled piece casts inside its graph and keeps the bf16 copies for its backward, so
    each microbatch in flight holds them (gpt-1b on 2x H200: 0.73 / 1.55 GiB more compiled
    than eager on a stage holding 0.77 GiB of bf16 weights, 2 / 4 microbatches)."""
    graph = capture_workload(workloads.get("gpt-small", device="meta"))
    graph.autocast_dtype = "bfloat16"  # as on a GPU
    cluster = preset("h200x1")
    ga = graph_arrays(graph)
    cast = cast_weight_bytes(ga)
    assert cast.sum() > 0 and np.all(cast <= 0.5 * ga.param_bytes)

    def breakdown(m: int, compiled: bool) -> dict:
        plan = Plan.single(graph, parallel=ParallelConfig(microbatches=m, compile=compiled))
        return simulate(graph, plan, cluster).memory_breakdown[0]

    comp = compiled_arrays(graph, ga, Plan.single(graph, parallel=ParallelConfig(compile=True)))
    np.testing.assert_array_equal(comp.call_keep, cast)
    for m in (1, 4):
        eager, compiled = breakdown(m, False), breakdown(m, True)
        # neither holds the copies beside the parameters: a one-process step's ops save them
        assert eager["params"] == compiled["params"]
    # eagerly the microbatches share one copy; compiled, each microbatch's forward keeps its
    # own: at the end of the forwards (the peak) four microbatches hold the same
    # activations as one and, compiled, three copies more
    grow = breakdown(4, True)["activations"] - breakdown(1, True)["activations"]
    assert grow == pytest.approx(3 * cast.sum(), rel=1e-6)


def test_a_compiled_selective_region_keeps_no_weight_copies():
    """Under the selective policy a compiled region saves the policy's outputs (the
    matmuls') and casts its weights again in backward: every block selective and compiled
    holds its blocks' bf16 weights less than the same plan compiled without checkpointing
    does through its copies (gpt-1b on one H200: 21.8 GiB selective and compiled, 23.8
    selective eagerly, whose one autocast region holds the copies to the step's end)."""
    graph = capture_workload(workloads.get("gpt-small", device="meta"))
    graph.autocast_dtype = "bfloat16"
    cluster = preset("h200x1")
    groups = block_groups(graph)
    blocks = block_group_ids(graph, groups)
    place = [0] * (max(groups.values()) + 1)
    ga = graph_arrays(graph)
    cast = cast_weight_bytes(ga)
    in_blocks = np.isin(np.array([groups[n] for n in ga.names]), list(blocks))
    block_cast = float(cast[in_blocks].sum())
    assert block_cast > 0

    def act(selective: bool, compiled: bool) -> float:
        plan = Plan.from_groups(graph, groups, place, parallel=ParallelConfig(compile=compiled),
                                selective=blocks if selective else frozenset())
        return simulate(graph, plan, cluster).memory_breakdown[0]["activations"]

    # compiled: the selective blocks drop their copies and their recomputed activations
    saved_by_policy = act(False, False) - act(True, False)
    assert act(False, True) - act(True, True) >= block_cast + 0.5 * saved_by_policy


def test_without_autocast_a_compiled_piece_keeps_no_weight_copies(gpt):
    ga = graph_arrays(gpt)
    comp = compiled_arrays(gpt, ga, Plan.single(gpt, parallel=ParallelConfig(compile=True)))
    assert comp.call_keep is None


def test_each_compiled_piece_pays_its_call(gpt, monkeypatch):
    """A piece's call (guards, the compiled wrapper) is host time of its own: gpt-small
    with every op a compiled piece of its own is host-bound on an H200, so each piece
    adds its call to the step."""
    cluster = preset("h200x1")
    groups = {name: i for i, name in enumerate(gpt.order)}
    plan = Plan.from_groups(gpt, groups, [0] * len(groups),
                            parallel=ParallelConfig(compile=True))
    with_calls = simulate(gpt, plan, cluster).step_time_s
    monkeypatch.setattr(compiled_mod, "COMPILED_CALL_HOST_S", 0.0)
    without = simulate(gpt, plan, cluster).step_time_s
    assert with_calls - without == pytest.approx(len(groups) * COMPILED_CALL_HOST_S, rel=0.01)
