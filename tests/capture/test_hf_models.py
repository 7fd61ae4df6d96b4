"""Hugging Face models, unmodified, through capture, the CLI and every executor mode on CPU.

The workloads are ``module:factory`` names of ``tests/hf_models.py``, as a user's own module
would be; the executor's torchrun workers import it from ``PYTHONPATH``. Each run trains 4
steps and must match the unpartitioned model's losses (dropout off): GPT-2's and T5's tied
embeddings cross pipeline stages, BERT indexes by its attention mask in the stage after the
cut, T5 leaves an optional input ``None``, Llama's rotary tables and Mixtral's routing
(top-2 of 4 experts per token) run on every stage and microbatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from autoplace import workloads  # noqa: E402
from autoplace.capture import capture_workload, model_output, program_inputs, random_ops  # noqa: E402
from autoplace.cluster import preset  # noqa: E402
from autoplace.errors import PlanError  # noqa: E402
from autoplace.executor import execute  # noqa: E402
from autoplace.executor.runner import capture_graph  # noqa: E402
from autoplace.lowering import stage_of_ops, tied_parameters, validate  # noqa: E402
from tests.helpers import ROOT, pythonpath_with_root
from tests.helpers.plans import run_like_execute, single, split  # noqa: E402

TOL = 1e-4
CPU2, CPU4 = preset("cpu-x2"), preset("cpu-x4")


@pytest.fixture(autouse=True)
def _workers_find_the_module(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_root())
    monkeypatch.syspath_prepend(str(ROOT))


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "llama", "mixtral", "vit"])
def test_captures_on_meta_with_torch_export(name):
    wl = workloads.get(f"tests.helpers.hf_models:{name}", device="meta")
    g = capture_workload(wl)
    assert g.capture_method == "export"
    params = {id(p): p for p in wl.model.parameters()}  # tied weights once
    assert g.param_bytes == sum(p.numel() * p.element_size() for p in params.values())
    assert g.flops > 0
    out = next(op for op in g if op.kind == "output")
    assert out.workspace_bytes > 0  # the loss ran on the restored ModelOutput


def test_flattened_inputs_and_restored_output():
    """An exported graph takes its inputs' leaves (T5's ``None`` mask keeps its place) and a
    program built from its nodes hands the loss the model's own ``ModelOutput``."""
    wl = workloads.get("tests.helpers.hf_models:t5")
    g = capture_graph(wl)
    inputs, target = wl.make_batch(4, "cpu")
    flat = program_inputs(g.module, inputs)
    assert len(flat) == 3 and flat[1] is None
    assert len([n for n in g.module.graph.nodes if n.op == "placeholder"]) == 3
    out = g.module(*inputs)
    assert type(out).__name__ == "Seq2SeqLMOutput"
    restored = model_output(g.module, [out.logits, out.encoder_last_hidden_state])
    assert type(restored) is type(out)
    torch.testing.assert_close(restored.logits, out.logits)


def test_tied_embeddings_are_copied_to_both_stages_and_buffers_are_refused():
    wl = workloads.get("tests.helpers.hf_models:gpt2")
    g = capture_graph(wl)
    plan = split(g, pipeline=2, microbatches=2)
    assert tied_parameters(g.module, plan) == {"transformer.wte.weight": [0, 1]}
    stage_of_ops(g.module, plan)  # no error: parameters may be shared
    one = single(g)
    assert tied_parameters(g.module, one) == {}


def test_random_ops_counts_dropout_with_a_probability():
    assert random_ops(capture_graph(workloads.get("tests.helpers.hf_models:bert")).module) == []
    rnd = random_ops(capture_graph(workloads.get("tests.helpers.hf_models:bert", dropout=0.1)).module)
    assert len(rnd) >= 2 * 2 + 1  # two per layer, and the embeddings'


def check(r, steps=3):
    assert r.ok, r.error
    assert len(r.loss) == steps
    assert r.max_loss_rel_diff < TOL, (r.loss, r.reference_loss)


#: name -> (model, options, plan, cluster). Runs whose tied embeddings cross a pipeline cut
#: train at a learning rate at which a copy updated without the other stage's gradient
#: shows in the loss (gpt2 1f1b, 4 steps: 0.036 relative apart without the sum, 6e-7 with it).
TIED = {"lr": 0.03}
RUNS = {
    "gpt2 fsdp": ("gpt2", {}, lambda g: single(g, data=2, shard="fsdp"), CPU2),
    "gpt2 1f1b (tied across the cut)": (
        "gpt2", TIED, lambda g: split(g, pipeline=2, microbatches=4, schedule="1f1b"), CPU2),
    "gpt2 dp x pp (tied across the cut)": (
        "gpt2", TIED, lambda g: split(g, data=2, pipeline=2, microbatches=2), CPU4),
    "bert ddp": ("bert", {}, lambda g: single(g, data=2), CPU2),
    "bert gpipe (mask indexed after the cut)": (
        "bert", {}, lambda g: split(g, pipeline=2, microbatches=2), CPU2),
    "t5 local mb=2 (None input)": ("t5", {}, lambda g: split(g, microbatches=2), CPU2),
    "t5 gpipe (tied across the cut)": (
        "t5", TIED, lambda g: split(g, pipeline=2, microbatches=8), CPU2),  # microbatch of 1
    "llama 1f1b": ("llama", {}, lambda g: split(g, pipeline=2, microbatches=4, schedule="1f1b"),
                   CPU2),
    "mixtral fsdp (experts chosen by the data)": (
        "mixtral", {}, lambda g: single(g, data=2, shard="fsdp"), CPU2),
    "mixtral local mb=2": ("mixtral", {}, lambda g: split(g, microbatches=2), CPU2),
    "vit gpipe": ("vit", {}, lambda g: split(g, pipeline=2, microbatches=2), CPU2),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_trains_like_the_unpartitioned_model(run, cpu_pool):
    name, options, make_plan, cluster = RUNS[run]
    wl = workloads.get(f"tests.helpers.hf_models:{name}", **options)
    graph = capture_graph(wl)
    check(run_like_execute(cpu_pool, wl, make_plan(graph), cluster, steps=4, warmup=1,
                           graph=graph), steps=4)


def test_sharded_pipeline_with_tied_weights_is_a_clear_error():
    graph = capture_graph(workloads.get("tests.helpers.hf_models:gpt2"))
    plan = split(graph, data=2, pipeline=2, microbatches=2, shard="fsdp")
    with pytest.raises(PlanError, match=r"'transformer.wte.weight' is used by pipeline stages "
                                        r"\[0, 1\] \(tied weights\)"):
        validate(graph, plan, CPU4)  # the lowering's check, on the graph's fx module
    validate(graph, split(graph, data=2, pipeline=2, microbatches=2), CPU4)  # DDP: fine


def test_cli_finds_the_module_in_the_working_directory(tmp_path):
    """``autoplace`` is a console script: a user's ``mymodels:factory`` in the directory it
    runs in is found there; plan and run (two processes) work and note the dropout. A
    one-device plan: where the module is found is the console script's, not the plan's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    (tmp_path / "mymodels.py").write_text((ROOT / "tests" / "helpers" / "hf_models.py").read_text())
    exe = Path(sys.executable).with_name("autoplace")
    plan = tmp_path / "plan.json"

    def cli(*args):
        return subprocess.run([str(exe), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    r = cli("plan", "--model", "mymodels:gpt2", "--option", "dropout=0.1", "--cluster",
            "cpu-x1", "--planner", "single", "-o", str(plan))
    assert r.returncode == 0, r.stderr
    assert json.loads(plan.read_text())["model"]["spec"] == "mymodels:gpt2"
    r = cli("run", str(plan), "--steps", "3")  # a plan file names no code of its own
    assert r.returncode == 2 and "--trust-model" in r.stderr
    r = cli("run", str(plan), "--model", "mymodels:gpt2", "--steps", "3")
    assert r.returncode == 0, r.stderr
    assert "dropout ops" in r.stdout and "loss " in r.stdout
    r = cli("capture", "--model", "nomodule:gpt2")
    assert r.returncode != 0 and "cannot import workload module 'nomodule'" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------- GPUs
GPU_RUNS = {
    "gpt2 local placement mb=2": ("gpt2", {}, lambda g: split(g, microbatches=2)),
    "gpt2 1f1b (tied across the cut)": (
        "gpt2", {}, lambda g: split(g, pipeline=2, microbatches=4, schedule="1f1b")),
    "bert ddp": ("bert", {}, lambda g: single(g, data=2)),
    "bert gpipe": ("bert", {}, lambda g: split(g, pipeline=2, microbatches=2)),
    "t5 fsdp": ("t5", {}, lambda g: single(g, data=2, shard="fsdp")),
    "t5 gpipe (tied across the cut)": ("t5", {}, lambda g: split(g, pipeline=2, microbatches=2)),
    "llama 1f1b (rotary region on both stages)": (
        "llama", {}, lambda g: split(g, pipeline=2, microbatches=4, schedule="1f1b")),
    "mixtral fsdp": ("mixtral", {}, lambda g: single(g, data=2, shard="fsdp")),
    "vit ddp": ("vit", {}, lambda g: single(g, data=2)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("run", list(GPU_RUNS))
def test_trains_like_the_unpartitioned_model_on_two_gpus(run):
    """On GPUs under bf16 autocast (the reference autocasts too), at the default learning
    rate: GPU kernels reorder reductions, so the tolerance is test_executor_gpu's (the CPU
    runs above check the tied gradients' sum)."""
    from autoplace.cluster import Cluster

    name, options, make_plan = GPU_RUNS[run]
    wl = workloads.get(f"tests.helpers.hf_models:{name}", autocast_dtype="bfloat16", **options)
    r = execute(wl, make_plan(capture_graph(wl)), cluster=Cluster.detect().subset([0, 1]),
                steps=4, warmup=1)
    assert r.ok, r.error
    assert r.max_loss_rel_diff < 1e-3, (r.loss, r.reference_loss)


ONE_GPU_RUNS = {
    "llama eager (rotary angles in fp32 under bf16 autocast)": ("llama", {}),
    "llama graphs": ("llama", {"graphs": True}),
    "mixtral graphs (experts routed by the data)": ("mixtral", {"graphs": True}),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("run", list(ONE_GPU_RUNS))
def test_trains_like_the_unpartitioned_model_on_one_gpu(run):
    """The whole model on one GPU, bf16 autocast, eager or replayed as CUDA graphs: the
    exported no_grad / autocast-off regions run on the GPU with autocast off inside."""
    from autoplace.cluster import Cluster

    name, parallel = ONE_GPU_RUNS[run]
    wl = workloads.get(f"tests.helpers.hf_models:{name}", autocast_dtype="bfloat16")
    r = execute(wl, single(capture_graph(wl), **parallel),
                cluster=Cluster.detect().subset([0]), steps=4, warmup=1)
    assert r.ok, r.error
    assert r.max_loss_rel_diff < 1e-3, (r.loss, r.reference_loss)


@pytest.mark.parametrize("name,crosses_integers", [("gpt2", False), ("bert", True),
                                                   ("t5", True)])
def test_every_input_a_stage_receives_gets_a_gradient(name, crosses_integers):
    """torch 2.11's PipelineStage sends a gradient back for every tensor a stage received:
    integer ones cross as float64 and, with masks, are tied to an output (zero gradient).
    GPT-2's causal mask, built from shapes, is gone from its graph (capture.attention):
    nothing integer crosses; BERT's padding mask, read from its input, still does."""
    from torch.utils import _pytree as pytree

    from autoplace.executor.pipeline import build_stage, example_values

    wl = workloads.get(f"tests.helpers.hf_models:{name}")
    g = capture_graph(wl)
    plan = split(g, pipeline=2, microbatches=2)
    inputs, _ = wl.make_batch(4, "cpu")
    values = example_values(g.module, inputs)
    cpu = torch.device("cpu")
    first = build_stage(g.module, plan, 0, inputs, cpu, values)
    second = build_stage(g.module, plan, 1, inputs, cpu, values)
    sent = first(*[x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)])
    received = [t.detach().requires_grad_(True) for t in (sent if isinstance(sent, tuple)
                                                          else (sent,))]
    assert all(t.is_floating_point() for t in received)
    assert any(t.dtype == torch.float64 for t in received) is crosses_integers
    out = second(*received)
    sum(t.float().sum() for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad).backward()
    assert all(t.grad is not None for t in received)


def test_profiles_t5_whose_bucket_indices_are_added_to_in_place():
    """The profiler times an in-place op on clones of every tensor it takes, integer ones
    too: timed a hundred times on the real value, T5's relative-position buckets (``add_``
    on a long tensor) went out of range for the embedding after them."""
    from autoplace.costs.profile import profile

    g = profile(workloads.get("tests.helpers.hf_models:t5"), "cpu", repeats=2)
    assert all(op.fwd_time_s.get("cpu") is not None for op in g)
    assert sum(op.fwd_time_s["cpu"] for op in g) > 0


def test_profiles_mixtral_whose_expert_counts_do_not_require_grad():
    """Mixtral counts tokens per expert with ``histc`` and an int32 ``cumsum``: the profiler
    gives an op's input a gradient only where the step's value has one (it made every float
    input a leaf requiring grad, and the int32 cumsum refused it)."""
    from autoplace.costs.profile import profile

    g = profile(workloads.get("tests.helpers.hf_models:mixtral"), "cpu", repeats=2)
    assert all(op.fwd_time_s.get("cpu") is not None for op in g)
    timed_bwd = [op for op in g if op.bwd_time_s.get("cpu", 0.0) > 0]
    assert len(timed_bwd) > len(g) // 3  # the differentiable ops keep their backward


def test_an_exported_graph_is_one_fsdp_unit_gathered_in_fp32():
    """An exported graph calls no submodules, so the executor's FSDP2 finds no blocks in it
    (one parameter group, the root's, gathered as the parameters are: fp32,
    ``lowering.gather_dtype``);
    the simulator's FSDP2 model says the same, and the graph file keeps how it was made."""
    from autoplace.graph import OpGraph
    from autoplace.sim import simulate
    from autoplace.sim.model import fsdp_units, graph_arrays

    g = capture_workload(workloads.get("tests.helpers.hf_models:gpt2", device="meta",
                                       autocast_dtype="bfloat16"))
    ga = graph_arrays(g)
    units = fsdp_units(ga, [0] * ga.n, 1)
    assert units.unit_bytes == [pytest.approx(float(ga.param_bytes.sum()))] and units.root == [True]
    assert ga.gather_scale == 1.0
    again = OpGraph.from_json(g.to_json())
    assert again.capture_method == "export" and graph_arrays(again).gather_scale == 1.0
    mem = simulate(g, single(g, data=2, shard="fsdp"), CPU2).memory_breakdown[0]
    assert mem["params"] == pytest.approx(float(ga.param_bytes.sum()))  # all of it gathered
    fx_graph = capture_workload(workloads.get("gpt-tiny", device="meta",
                                              autocast_dtype="bfloat16"))
    assert graph_arrays(fx_graph).gather_scale == 0.5  # blocks, gathered in bf16
    assert len(fsdp_units(graph_arrays(fx_graph), [0] * len(fx_graph), 1).unit_bytes) > 1
