"""Pipeline stage memory: autocast's cast copies and the last stage's kept outputs
(``sim.model.pipeline_held_bytes``), checked on a chain whose outputs and weights are known."""

from __future__ import annotations

import pytest

from autoplace.cluster import Cluster, Device
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import Plan
from autoplace.sim import simulate
from autoplace.sim.model import graph_arrays

MiB = 2**20


def _cluster() -> Cluster:
    dev = Device(name="cpu", kind="cpu", memory_bytes=64 * 2**30, peak_flops=50e9,
                 memory_bandwidth=10e9, launch_overhead_s=0.0)
    return Cluster.uniform("cpu-x2", dev, 2, alpha_s=1e-5, bandwidth=5e9)


def _chain(autocast: str | None) -> OpGraph:
    """Eight Linear ops (4 MiB of weights, 1 MiB out each), a 32 MiB model output (op7's)
    read by the graph's output node."""
    nodes = [OpNode(name=f"op{i}", kind="Linear", module_path=f"layers.{i}",
                    output_bytes=32 * MiB if i == 7 else MiB, param_bytes=4 * MiB,
                    activation_bytes=MiB, fwd_time_s={"cpu": 1e-3}, bwd_time_s={"cpu": 2e-3})
             for i in range(8)]
    nodes.append(OpNode(name="output", kind="output", module_path="",
                        fwd_time_s={"cpu": 0.0}, bwd_time_s={"cpu": 0.0}))
    edges = [(f"op{i}", f"op{i + 1}", MiB) for i in range(7)] + [("op7", "output", 32 * MiB)]
    g = OpGraph("chain", nodes, edges)
    g.autocast_dtype = autocast
    return g


def _breakdown(graph: OpGraph, m: int, pipeline: int) -> list[dict[str, int]]:
    plan = Plan.from_assignment(graph, {op.name: int(i >= 4) for i, op in enumerate(graph)})
    if pipeline > 1:
        plan = plan.with_parallel(pipeline=pipeline, microbatches=m, schedule="gpipe")
    return simulate(graph, plan, _cluster()).memory_breakdown


@pytest.mark.parametrize("m", [2, 8])
def test_last_stage_keeps_every_microbatch_output(m):
    """GPipe holds every microbatch's activations (4 MiB a stage: 4 ops of 1 MiB); the last
    stage also keeps (m - 1) / m of the 32 MiB model output, the current microbatch's
    share being its transient."""
    g = _chain(None)
    first, last = _breakdown(g, m, 2)
    assert first["activations"] == 4 * MiB
    assert last["activations"] == pytest.approx(4 * MiB + 32 * MiB * (m - 1) / m, abs=1)
    assert last["transient"] == pytest.approx(32 * MiB / m, abs=1)
    one_pass = _breakdown(g, 1, 1)  # no pipeline: nothing kept beyond the step's parts
    assert one_pass[1]["activations"] == 4 * MiB


def test_autocast_adds_a_low_precision_copy_of_each_stage_weight():
    """Under bf16 autocast each stage keeps half its matmul weights' bytes more; a one-pass
    plan does not (its whole-gradient term stands for the copies)."""
    plain, cast = _chain(None), _chain("bfloat16")
    assert graph_arrays(cast).gather_scale == 0.5
    for a, b in zip(_breakdown(plain, 4, 2), _breakdown(cast, 4, 2)):
        assert b["params"] - a["params"] == 0.5 * 4 * 4 * MiB  # 4 Linear ops a stage
        assert b["total"] - a["total"] == 0.5 * 4 * 4 * MiB
    assert _breakdown(plain, 1, 1) == _breakdown(cast, 1, 1)
