"""``auto`` and the offload recipes: offloaded plans compete only where nothing else fits.

Measurements are the simulator's own step times (no device runs): a model whose
parameters, gradients and AdamW state (1.6 GB) outgrow a 1000 MiB cap while its
activations are small (gpt-medium at 2 x 64 tokens) trains only offloaded.
"""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.planners.manual import hand_written, lever_plans
from autoplace.search.auto import auto_plan, family
from autoplace.sim import simulate

SPEC = {"spec": "gpt-medium", "options": {"batch_size": 2, "seq_len": 64}}
CAP = 1000 * 2**20


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get(SPEC["spec"], device="meta", **SPEC["options"]))


def simulated(graph, cluster, log):
    def measure(plan):
        log.append(plan)
        return simulate(graph, plan, cluster).step_time_s
    return measure


def test_recipes_on_gpus_only(graph):
    one, two = lever_plans(graph, preset("h200x1")), lever_plans(graph, preset("h200x2"))
    for recipes, data in ((one, 1), (two, 2)):
        for name in ("fsdp+offload", "fsdp+offload+checkpoint-blocks"):
            par = recipes[name].parallel
            assert par.offload and par.shard == "fsdp" and par.data == data
        assert recipes["fsdp+offload+checkpoint-blocks"].recompute
    assert family(one["fsdp+offload"]) == "dp-fsdp+offload"
    assert not any(p.parallel.offload for p in lever_plans(graph, preset("cpu-x2")).values())


def test_auto_offloads_when_nothing_else_fits(graph):
    cluster = preset("h200x1").with_memory_cap(CAP)
    plans = hand_written(graph, cluster)
    # the premise: every plan a user writes by hand runs out of memory but the offloaded
    assert all(simulate(graph, p, cluster).oom for p in plans.values() if not p.parallel.offload)
    assert not simulate(graph, plans["fsdp+offload"], cluster).oom
    log = []
    plan = auto_plan(SPEC, cluster, budget="2m", graph=graph, planners=["single"],
                     measure=simulated(graph, cluster, log), progress=False, pretrained=False)
    assert plan.parallel.offload and plan.parallel.shard == "fsdp" and plan.parallel.data == 1
    assert plan.measured["step_time_s"] == pytest.approx(simulate(graph, plan, cluster).step_time_s)
    assert log and all(p.parallel.offload for p in log)


def test_auto_leaves_offload_alone_where_plans_fit(graph):
    cluster = preset("h200x1")
    log = []
    plan = auto_plan(SPEC, cluster, budget="2m", graph=graph, planners=["single"],
                     measure=simulated(graph, cluster, log), progress=False, pretrained=False)
    assert not plan.parallel.offload
    assert log and not any(p.parallel.offload for p in log)
