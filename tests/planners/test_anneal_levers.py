"""Anneal searches the levers with the placement: recompute per group (whole or
selective) under a memory cap, and compile on GPUs."""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.planners import get
from autoplace.sim import simulate


@pytest.fixture(scope="module")
def gpt():
    return capture_workload(workloads.get("gpt-small", device="meta", batch_size=64))


def test_anneal_compiles_on_gpus_and_not_on_cpus(gpt, monkeypatch):
    """Where compiling pays on the simulator anneal compiles (here with the compiled
    pieces' calls free: gpt-small's pieces would not pay for them), never on CPUs."""
    from autoplace.sim import compiled

    monkeypatch.setattr(compiled, "COMPILED_CALL_HOST_S", 0.0)
    plan = get("anneal")(gpt, preset("h200x1"), time_budget_s=30, max_evaluations=400, seed=0)
    assert plan.parallel.compile
    cpu = get("anneal")(gpt, preset("cpu-x1"), time_budget_s=30, max_evaluations=200, seed=0)
    assert not cpu.parallel.compile


def test_anneal_recomputes_what_the_cap_needs(gpt):
    cluster = preset("h200x1")
    single = simulate(gpt, get("single")(gpt, cluster), cluster)
    capped = cluster.with_memory_cap(int(0.8 * max(single.peak_memory_bytes)))
    plan = get("anneal")(gpt, capped, time_budget_s=30, max_evaluations=600, seed=0)
    res = simulate(gpt, plan, capped)
    assert not res.oom
    assert plan.recompute or plan.selective
