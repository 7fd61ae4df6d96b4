"""The optimizer's host time after the backward (``sim/optimizer_host.py``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from autoplace.cluster import preset
from autoplace.costs.passes import optimizer_host
from autoplace.graph import OpGraph, OpNode
from autoplace.parallel_config import ParallelConfig
from autoplace.plan import Plan
from autoplace.sim import optimizer_host as oh
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.model import cost_tables


def gpu_chain(n: int, fwd: float, param_bytes: int = 4) -> OpGraph:
    """``n`` ops in a chain timed on h200, each holding one parameter tensor."""
    nodes = [OpNode(name=f"op{i}", kind="Linear", module_path=f"layers.{i}",
                    output_bytes=1024, param_bytes=param_bytes, activation_bytes=1024,
                    param_names=(f"layers.{i}.weight",), fwd_time_s={"h200": fwd},
                    bwd_time_s={"h200": 2 * fwd})
             for i in range(n)]
    return OpGraph(f"chain{n}", nodes, [(f"op{i}", f"op{i + 1}", 1024) for i in range(n - 1)])


def test_table_takes_the_profiled_figures_else_gpu_defaults():
    g = gpu_chain(4, 1e-3)
    g.profile_info = {"h200": {"optimizer": {"tensors": [10, 80],
                                             "step_host_s": [1.0e-4, 4.5e-4],
                                             "zero_grad_host_s": [2e-5, 1.6e-4]}}}
    table = oh.optimizer_host_table(g, ["h200", "h100", "cpu"])
    np.testing.assert_allclose(table[0], [0.5e-4, 5e-6, 2e-6])  # the two counts' line
    np.testing.assert_allclose(table[1], [oh.OPT_STEP_HOST_S, oh.OPT_STEP_TENSOR_HOST_S,
                                          oh.ZERO_GRAD_TENSOR_HOST_S])
    assert not table[2].any()  # a CPU's measured op times are its step
    assert oh.optimizer_host_s(table, 0, 0) == (0.0, 0.0)
    assert oh.optimizer_host_s(table, 0, 100) == pytest.approx((5.5e-4, 2e-4))


def test_host_bound_step_waits_for_the_optimizer_device_bound_does_not(monkeypatch):
    cluster = preset("h200x1")
    n = 200
    host_bound, device_bound = gpu_chain(n, 1e-6), gpu_chain(n, 2e-3)
    with_opt = {g.name + str(i): simulate(g, Plan.single(g), cluster).step_time_s
                for i, g in enumerate((host_bound, device_bound))}
    step_h, zero_h = oh.optimizer_host_s(cost_tables(host_bound, cluster).opt_host, 0, n)
    assert step_h > 0 and zero_h > 0
    for name in ("OPT_STEP_HOST_S", "OPT_STEP_TENSOR_HOST_S", "ZERO_GRAD_TENSOR_HOST_S"):
        monkeypatch.setattr(oh, name, 0.0)
    without = {g.name + str(i): simulate(g, Plan.single(g), cluster).step_time_s
               for i, g in enumerate((host_bound, device_bound))}
    key_h, key_d = host_bound.name + "0", device_bound.name + "1"
    assert with_opt[key_h] - without[key_h] == pytest.approx(step_h + zero_h, rel=0.02)
    assert with_opt[key_d] == pytest.approx(without[key_d], rel=1e-9)  # hidden by the device


def test_batch_equals_scalar_with_the_optimizer_host():
    """Random one-process placements, with microbatches and data parallelism, of a
    host-bound chain: the batched simulator's steps equal the scalar one's."""
    g = gpu_chain(24, 3e-6)
    rng = random.Random(3)
    plans = []
    for k, m, d in ((1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 4, 1), (1, 2, 2), (2, 1, 2)):
        groups = {op.name: i * 6 // len(g) for i, op in enumerate(g)}
        placement = [0, *(rng.randrange(k) for _ in range(4)), k - 1]
        plans.append(Plan.from_groups(g, groups, placement,
                                      parallel=ParallelConfig(microbatches=m, data=d)))
    cluster = preset("h200x4")
    batch = simulate_batch(g, plans, cluster)
    np.testing.assert_allclose(batch.step_time_s,
                               [simulate(g, p, cluster).step_time_s for p in plans], rtol=1e-12)


def test_profile_measures_step_and_zero_grad_at_two_counts():
    rec = optimizer_host(40, torch.device("cpu"), 2)
    assert rec["tensors"] == [5, 40]
    assert all(t > 0 for t in rec["step_host_s"] + rec["zero_grad_host_s"])
    fixed, per, zero = oh.fitted(rec)
    assert fixed >= 0 and per >= 0 and zero > 0
