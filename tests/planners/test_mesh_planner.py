"""The mesh planner: valid plans of block groups on multi-node clusters, within a minute."""

from __future__ import annotations

import time

import numpy as np
import pytest

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.lowering import block_groups
from autoplace.planners.mesh import balanced_stages
from autoplace.search.auto import auto_plan


@pytest.fixture(scope="module")
def tiny():
    return capture_workload(workloads.get("llama3-tiny", device="meta", batch_size=32,
                                          n_layers=8, autocast_dtype="bfloat16"))


def test_balanced_stages_are_contiguous_and_even():
    assert balanced_stages(np.r_[0.0, np.ones(8), 0.0], 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    heavy_ends = balanced_stages(np.r_[3.0, np.ones(8), 3.0], 2)
    assert heavy_ends == (0, 0, 0, 0, 1, 1, 1, 1)
    with pytest.raises(AutoplaceError, match="each stage needs a block"):
        balanced_stages(np.ones(4), 3)


def test_mesh_plan_on_two_nodes_is_valid(tiny):
    cluster = preset("h100x8-n2")
    t0 = time.perf_counter()
    plan = planners.get("mesh")(tiny, cluster)
    assert time.perf_counter() - t0 < 60
    plan.validate(tiny, cluster)
    assert plan.num_devices <= cluster.num_devices
    assert plan.groups == block_groups(tiny)
    assert plan.predicted["simulator"] == "mesh" and not plan.predicted["oom"]
    assert plan.planner["searched"] > 100
    par = plan.parallel
    assert par.data * par.tensor * par.pipeline == plan.num_devices
    assert 32 % (par.data * par.microbatches) == 0


def test_nothing_fits_names_the_smallest_peak(tiny):
    cluster = preset("h100x8-n2").with_memory_cap(2**12)
    with pytest.raises(AutoplaceError, match="smallest peak"):
        planners.get("mesh")(tiny, cluster)


def test_auto_on_several_nodes_uses_the_mesh_planner(tiny):
    plan = auto_plan({"spec": "llama3-tiny", "options": {}}, preset("h100x8-n2"), graph=tiny,
                     progress=False)
    assert plan.planner["name"] == "auto" and plan.planner["chosen"] == "mesh"
    assert plan.planner["simulation_only"] is True  # no GPUs here


@pytest.mark.slow
def test_llama3_8b_on_eight_nodes_within_a_minute():
    graph = capture_workload(workloads.get("llama3-8b", device="meta", batch_size=64))
    cluster = preset("h100x8-n8")
    t0 = time.perf_counter()
    plan = planners.get("mesh")(graph, cluster)
    assert time.perf_counter() - t0 < 60
    plan.validate(graph, cluster)
    assert plan.num_devices == 64
    assert plan.predicted["peak_memory_bytes"][0] <= cluster.devices[0].usable_memory_bytes
