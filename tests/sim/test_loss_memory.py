"""The loss's memory where the logits dominate: its backward holds what it kept (the
float32 log-softmax), the gradient of that and the gradient of its float32 input, three
float32 tensors of the logits' size; its forward the logits as the model made them, their
float32 copy and what it keeps. Measured here on a real step of the executor on the CPU
(every tensor storage alive, op by op) against the simulator's peak."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplace import workloads
from autoplace.cluster import Cluster, Device, resolve
from autoplace.executor import build
from autoplace.executor.runner import capture_graph, global_batch, workload_optimizer
from autoplace.graph import OpGraph, OpNode
from autoplace.plan import Plan
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate, simulate_batch
from autoplace.sim.memory import loss_backward_bytes, loss_keep_bytes

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


class _LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages made under the mode and still alive, op by op (a
    storage dies when its last tensor does, whoever holds it: autograd's saved tensors
    too), their peak and what was alive there. ``known``: storages not counted (made
    before the step)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        for t in known:
            s = t.untyped_storage()
            self.live[s._cdata] = (StorageWeakRef(s), 0, "before")
        self.total = self.peak = 0
        self.at_peak: tuple[str, list[tuple[int, str]]] = ("", [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for k in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(k)[1]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live:
                s = t.untyped_storage()
                self.live[s._cdata] = (StorageWeakRef(s), s.nbytes(), f"{t.dtype} {func}")
                self.total += s.nbytes()
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = (str(func), [(n, what) for _, n, what in self.live.values() if n])
        return out


def _measured_step(wl, graph, plan, cluster, autocast: str | None):
    """Peak bytes of the executor's second step (AdamW state made by the first) on the
    CPU: parameters, optimizer state and batch, and the most the step holds at once;
    with what was alive there. Autocast as the executor's loop has it on GPUs (one region
    over forward and backward, its cast cache on), here on the CPU."""
    built = build.build_rank(wl, graph, plan, cluster, 0, wl.batch_size)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = workload_optimizer(params, wl, built.devices[0])
    region = (lambda: torch.autocast("cpu", dtype=getattr(torch, autocast))) if autocast \
        else contextlib.nullcontext
    for step in range(2):
        inputs, targets = global_batch(wl, step, 0)
        before = [*params, *inputs, targets,
                  *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
        mode = _LiveStorages(before)
        with mode:
            with region():
                built.step(inputs, targets)
            opt.step()
            opt.zero_grad(set_to_none=True)
    static = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                  for t in before}.values())
    return static + mode.peak, mode.at_peak


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
    measured, (at, alive) = _measured_step(wl, graph, plan, cluster, autocast)
    f32 = 4 * 64 * 4096 * 4
    assert "_log_softmax_backward_data" in at
    assert sum(n == f32 and what.startswith("torch.float32") for n, what in alive) == 3
    simulated = simulate(graph, plan, cluster).peak_memory_bytes[0]
    assert simulated == pytest.approx(measured, rel=0.01)
