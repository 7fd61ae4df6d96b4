"""Autocast's weight copies in a one-process step: the executor opens the autocast region
around the forward and the loss, so each cached copy dies with the backward of the ops
that saved it; a plan with selective checkpointing keeps the backward inside the region
(its recompute must issue the casts its forward issued), the copies held to the step's
end. Measured on a real step of the executor on the CPU (every tensor storage alive, op
by op) against the simulator's peak."""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.cluster import resolve
from autoplace.executor.runner import capture_graph
from autoplace.plan import Plan
from autoplace.planners.manual import lever_plans
from autoplace.sim import simulate
from autoplace.sim.memory import cast_weight_bytes
from autoplace.sim.model import graph_arrays
from autoplace.tools.step_memory import measure_step


@pytest.mark.parametrize("recipe", ["single", "checkpoint-blocks", "selective-blocks"])
def test_weight_copies_die_with_the_backward_unless_selective(recipe):
    """A GPT whose weights dwarf its activations (d=512, 16 tokens of 2 samples) peaks at
    the end of its backward, every gradient made: no bf16 weight copy is alive there, and
    the simulator's peak is the measured one; under the selective policy all the copies
    are (25 MiB here), in both."""
    wl = workloads.get("gpt-tiny", vocab_size=1024, d_model=512, n_layers=4, n_heads=4,
                       seq_len=16, batch_size=2, autocast_dtype="bfloat16")
    graph = capture_graph(wl)
    cluster = resolve("cpu-x1")
    plan = {"single": Plan.single(graph, cluster=cluster), **lever_plans(graph, cluster)}[recipe]
    step = measure_step(wl, graph, plan, cluster, "bfloat16", optimizer=False)
    copies = sum(n for n, what in step["alive_at_peak"] if what.startswith("torch.bfloat16"))
    expected = cast_weight_bytes(graph_arrays(graph)).sum()
    assert expected > 0.1 * step["measured_bytes"]
    if recipe == "selective-blocks":
        assert copies == pytest.approx(expected, rel=0.01)
    else:
        assert copies == 0
    simulated = simulate(graph, plan, cluster).peak_memory_bytes[0]
    assert simulated == pytest.approx(step["measured_bytes"], rel=0.01)
