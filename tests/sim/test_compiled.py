"""The simulator's price of compiled pieces: fused ops cheaper, heavy kernels unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.lowering import block_groups
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.compiled import (
    COMPILED_FUSED_TIME,
    compiled_arrays,
    compiled_tables,
    fused_chains,
    fused_times,
)
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


def test_a_compiled_plan_simulates_faster_and_batch_agrees(gpt):
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
