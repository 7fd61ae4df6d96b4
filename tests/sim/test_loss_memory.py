"""The loss's memory where the logits dominate: its backward holds what it kept (the
float32 log-softmax), the gradient of that and the gradient of its float32 input, three
float32 tensors of the logits' size; its forward the logits as the model made them, their
float32 copy and what it keeps. Measured here on a real step of the executor on the CPU
(every tensor storage alive, op by op) against the simulator's peak."""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.cluster import Cluster, Device, resolve
from autoplace.executor.runner import capture_graph
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import Plan
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.memory import loss_backward_bytes, loss_keep_bytes
from autoplace.tools.step_memory import measure_step

MiB = 2**20


def _cluster() -> Cluster:
    dev = Device(name="cpu", kind="cpu", memory_bytes=64 * 2**30, peak_flops=50e9,
                 memory_bandwidth=10e9, launch_overhead_s=0.0)
    return Cluster.uniform("cpu-x1", dev, 1, alpha_s=1e-5, bandwidth=5e9)


def _head(numel: int, dtype: str, workspace: int) -> OpGraph:
    """A Linear head whose ``numel`` logits (``dtype``) go to the loss, which the capture
    measured at ``workspace`` bytes."""
    size = numel * (2 if dtype == "bfloat16" else 4)
    nodes = [OpNode(name="head", kind="Linear", module_path="head", target="head",
                    param_names=("head.weight",), param_bytes=MiB, activation_bytes=MiB,
                    output_shapes=((numel,),), output_dtypes=(dtype,), output_bytes=size,
                    fwd_time_s={"cpu": 1e-3}, bwd_time_s={"cpu": 2e-3}),
             OpNode(name="output", kind="output", workspace_bytes=workspace,
                    fwd_time_s={"cpu": 0.0}, bwd_time_s={"cpu": 0.0})]
    return OpGraph("head", nodes, [("head", "output", size)])


def test_loss_backward_holds_three_float32_logits():
    """bf16 logits (16 MiB; float32 32 MiB) whose loss the capture measured at the logits
    and two float32 copies: the step peaks in the loss's backward at the kept log-softmax
    and two float32 gradients (3 x 32 MiB) beside the head's input and the static part,
    not at the captured workspace (16 + 2 x 32); the batched path agrees."""
    f32 = 32 * MiB
    g = _head(f32 // 4, "bfloat16", f32 // 2 + 2 * f32)
    out = g["output"]
    assert loss_keep_bytes(g, out) == f32 and loss_backward_bytes(g, out) == 2 * f32
    assert loss_keep_bytes(g, g["head"]) == loss_backward_bytes(g, g["head"]) == 0.0
    plan = Plan.single(g)
    b = simulate(g, plan, _cluster()).memory_breakdown[0]
    assert b["activations"] == MiB + f32 and b["transient"] == 2 * f32 and b["grads"] == 0
    # parameters (fp32 and autocast's copy: none without autocast), AdamW, activations
    assert b["total"] == MiB + 2 * MiB + MiB + 3 * f32
    assert simulate_batch(g, [plan], _cluster()).peak_memory_bytes[0][0] == b["total"]


def test_float32_logits_and_a_larger_captured_workspace():
    """float32 logits: the same three copies. A loss the capture measured above that (a
    workspace of its own, less the model's output it counts held) keeps its measure."""
    f32 = 8 * MiB
    g = _head(f32 // 4, "float32", 3 * f32)
    assert loss_backward_bytes(g, g["output"]) == 2 * f32
    big = _head(f32 // 4, "float32", 6 * f32)
    assert loss_backward_bytes(big, big["output"]) == 6 * f32 - f32 - f32
    none = _head(f32 // 4, "float32", 0)  # a loss that could not run on meta: unmodelled
    assert loss_keep_bytes(none, none["output"]) == loss_backward_bytes(none, none["output"]) == 0


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
@pytest.mark.parametrize("recipe", ["single", "checkpoint-blocks"])
def test_simulated_peak_matches_a_measured_step_whose_logits_dominate(autocast, recipe):
    """A GPT whose logits (4 x 64 x 4096) dwarf its blocks (d=32): the real step peaks in
    the loss's backward (``_log_softmax_backward_data``) with three float32 logit-sized
    tensors alive, and the simulator's peak is that step's, within 1%."""
    wl = workloads.get("gpt-tiny", vocab_size=4096, seq_len=64, d_model=32, n_layers=2,
                       n_heads=2, batch_size=4, autocast_dtype=autocast)
    graph = capture_graph(wl)
    cluster = resolve("cpu-x1")
    plan = {"single": Plan.single(graph, cluster=cluster), **lever_plans(graph, cluster)}[recipe]
    step = measure_step(wl, graph, plan, cluster, autocast)
    measured, at, alive = step["measured_bytes"], step["peak_op"], step["alive_at_peak"]
    f32 = 4 * 64 * 4096 * 4
    assert "_log_softmax_backward_data" in at
    assert sum(n == f32 and what.startswith("torch.float32") for n, what in alive) == 3
    simulated = simulate(graph, plan, cluster).peak_memory_bytes[0]
    assert simulated == pytest.approx(measured, rel=0.01)
