"""Pipeline stage memory (``sim.pipeline.stage_memory``): microbatches held per schedule,
the last stage's kept outputs, autocast's cast copies, checked on a chain whose outputs
and weights are known."""

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


def _breakdown(graph: OpGraph, m: int, pipeline: int, schedule: str = "gpipe"
               ) -> list[dict[str, int]]:
    plan = Plan.from_assignment(graph, {op.name: int(i >= 4) for i, op in enumerate(graph)})
    if pipeline > 1:
        plan = plan.with_parallel(pipeline=pipeline, microbatches=m, schedule=schedule)
    return simulate(graph, plan, _cluster()).memory_breakdown


def test_gpipe_holds_every_microbatch_1f1b_as_many_as_stages_after():
    """Stage 0 (4 ops of 1 MiB kept activations, a 1 MiB output sent on), 4 microbatches
    of a quarter each. Its peak is at the end of microbatch 0's backward, which made every
    gradient (16 MiB): GPipe still holds microbatches 1-3 (3 x (1 + 0.25) MiB), the
    quarter op0 frees as it runs and microbatch 0's sent output; 1F1B (at most p - s = 2
    microbatches in flight) peaks at 2.5 MiB. Both keep the four buffers the gradients of
    its output come back into (a quarter each: 1 MiB)."""
    g = _chain(None)
    gpipe = _breakdown(g, 4, 2, "gpipe")[0]
    one_f = _breakdown(g, 4, 2, "1f1b")[0]
    assert gpipe["grads"] == one_f["grads"] == 16 * MiB
    assert gpipe["activations"] == pytest.approx(3 * 1.25 * MiB + 0.25 * MiB + 0.25 * MiB
                                                 + 1.0 * MiB)
    assert one_f["activations"] == pytest.approx(1.25 * MiB + 0.25 * MiB + 1.0 * MiB + 1.0 * MiB)
    assert gpipe["activations"] - one_f["activations"] == pytest.approx(2 * 0.875 * MiB)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_keep_a_receive_buffer_per_microbatch(schedule):
    """``PipelineStage`` receives every microbatch into a buffer of its own, kept: stage 1
    the activations crossing the cut (1 MiB for the batch, in 4 buffers of a quarter),
    stage 0 their gradients, however many microbatches the schedule holds at once. A cut
    of 3 MiB instead (op3's output, read by op4) adds 2 MiB to each stage's peak."""
    g = _chain(None)
    data = g.to_json()
    data["edges"] = [[u, v, 3 * MiB if (u, v) == ("op3", "op4") else b]
                     for u, v, b in data["edges"]]
    wide = OpGraph.from_json(data)
    a, b = _breakdown(g, 4, 2, schedule), _breakdown(wide, 4, 2, schedule)
    assert b[1]["activations"] - a[1]["activations"] == pytest.approx(2 * MiB)
    # stage 0: the gradients' buffers, and the larger outputs it keeps until their backward
    assert b[0]["activations"] - a[0]["activations"] >= 2 * MiB


@pytest.mark.parametrize("m", [2, 4])
def test_last_stage_holds_a_microbatch_output_until_its_backward(m):
    """The executor steps the schedule with ``return_outputs=False``: torch's
    PipelineStage holds a microbatch's model output (32 / m MiB of the batch's 32) in its
    ``fwd_cache`` until that microbatch's backward, keeps no chunk to the step's end and
    concatenates none. GPipe runs every forward before the first backward, so its last
    stage holds all m outputs at once (32 MiB); 1F1B's last stage runs each backward right
    after its forward and holds one (32 / m MiB): the difference is the outputs of the
    m - 1 microbatches GPipe has in flight."""
    gpipe = _breakdown(_chain(None), m, 2, "gpipe")[1]
    one_f = _breakdown(_chain(None), m, 2, "1f1b")[1]
    assert gpipe["activations"] >= 32 * MiB
    assert gpipe["activations"] - one_f["activations"] >= (m - 1) * 32 * MiB / m
    # no concatenation at the step's end: the transient is at most an output's gradient
    # or the loss's copies of one microbatch, not the whole batch's outputs
    assert one_f["transient"] < 32 * MiB


def test_autocast_adds_a_low_precision_copy_of_each_weight():
    """Under bf16 autocast each weight a matmul reads has a half-size copy. A pipeline's
    schedule runs wholly inside the autocast region: each stage holds its copies from first
    use to the end of the step, beside its parameters. A one-process program runs its
    backward outside it: each copy lives in the saved tensors of the op that reads it,
    until that op's backward, so the device whose peak comes at the start of its backward
    holds all its copies there and the other fewer."""
    plain, cast = _chain(None), _chain("bfloat16")
    assert graph_arrays(cast).gather_scale == 0.5
    copies = 0.5 * 4 * 4 * MiB  # 4 Linear ops a device
    for a, b in zip(_breakdown(plain, 4, 2), _breakdown(cast, 4, 2)):
        assert b["params"] - a["params"] == copies
        assert b["total"] - a["total"] == copies
    grow = []
    for a, b in zip(_breakdown(plain, 1, 1), _breakdown(cast, 1, 1)):
        assert b["params"] == a["params"]
        grow.append(b["activations"] - a["activations"])
        assert b["total"] - a["total"] == grow[-1]
    assert max(grow) == copies and 0 < min(grow) < copies
