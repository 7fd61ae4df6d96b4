"""The simulator's price of compiled pieces: fused ops cheaper, heavy kernels unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.lowering import block_groups
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.compiled import COMPILED_FUSED_TIME, compiled_tables
from autoplace.sim.model import cost_tables, ensure_costs, graph_arrays


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
