"""sim.mesh: the closed-form mesh model reads the graph's blocks and behaves as the levers
say (tensor parallel and checkpointing cut memory, microbatches cut the pipeline bubble)."""

from __future__ import annotations

import pytest

from autoplace import planners, workloads
from autoplace.capture import capture_workload
from autoplace.cluster import preset
from autoplace.errors import AutoplaceError
from autoplace.sim.mesh import (
    FITTED,
    MeshConfig,
    MeshFit,
    block_table,
    default_fit,
    estimate,
    estimate_config,
)


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get("llama3-tiny", device="meta", batch_size=16,
                                          n_layers=4, autocast_dtype="bfloat16"))


@pytest.fixture(scope="module")
def cluster():
    return preset("h100x8-n2")


def test_block_table_sums_the_graph(graph, cluster):
    t = block_table(graph, cluster)
    assert t.num_blocks == 4 and t.names[1] == "layers.0"
    assert t.param_bytes.sum() == graph.param_bytes
    assert t.tokens_per_sample == 32 and t.batch_size == 16
    for i in range(1, 5):  # keeping less means recomputing more
        assert t.kept["none"][i] > t.kept["selective"][i] > t.kept["full"][i] > 0
        assert t.recompute_var["none_lin"][i] == 0
        assert t.recompute_var["full_lin"][i] > 0 == t.recompute_var["selective_lin"][i]


def _cfg(**kw):
    base = dict(data=2, tensor=1, pipeline=1, microbatches=1, shard="fsdp", batch_size=16)
    return MeshConfig(**{**base, **kw})


def test_levers_move_time_and_memory_the_right_way(graph, cluster):
    t = block_table(graph, cluster)
    none = estimate_config(t, _cfg(ac_of_block=("none",) * 4), cluster)
    full = estimate_config(t, _cfg(ac_of_block=("full",) * 4), cluster)
    assert full.peak_memory_bytes < none.peak_memory_bytes
    # recompute adds compute; this step is bound by FSDP's exposed collectives, which hide it
    assert full.breakdown_s["pipeline_compute"] > none.breakdown_s["pipeline_compute"]
    assert full.step_time_s >= none.step_time_s * (1 - 1e-9)
    tp = estimate_config(t, _cfg(tensor=4), cluster)
    assert tp.peak_memory_bytes < none.peak_memory_bytes
    assert tp.breakdown_s["tp_per_microbatch"] > 0 == none.breakdown_s["tp_per_microbatch"]
    stages = (0, 0, 1, 1)
    pp2 = estimate_config(t, _cfg(pipeline=2, microbatches=2, stage_of_block=stages), cluster)
    pp8 = estimate_config(t, _cfg(pipeline=2, microbatches=8, stage_of_block=stages), cluster)
    assert pp8.breakdown_s["bubble"] < pp2.breakdown_s["bubble"]
    slow = estimate_config(t, _cfg(), cluster, fit=MeshFit(compute_scale=2.0))
    assert slow.step_time_s > none.step_time_s
    over = estimate_config(t, _cfg(), cluster, fit=MeshFit(memory_overhead_bytes=2**30))
    assert over.peak_memory_bytes == pytest.approx(none.peak_memory_bytes + 2**30)
    n = none.num_gpus
    assert none.tokens_per_s_per_gpu == pytest.approx(16 * 32 / none.step_time_s / n)


def test_a_plan_reads_back_as_its_mesh(graph, cluster):
    plan = planners.get("mesh")(graph, cluster)
    res = estimate(graph, plan, cluster)
    assert res.step_time_s == pytest.approx(plan.predicted["step_time_s"])
    assert res.num_gpus == plan.num_devices


def test_errors_name_the_problem(graph, cluster):
    t = block_table(graph, cluster)
    with pytest.raises(AutoplaceError, match="does not split"):
        estimate_config(t, _cfg(data=3), cluster)
    with pytest.raises(AutoplaceError, match="needs 32 devices"):
        estimate_config(t, _cfg(data=32), cluster)


def test_sequence_parallel_term(graph, cluster):
    t = block_table(graph, cluster)
    assert (t.stream_var["fwd"][1:5] > 0).all()  # norms and residual adds in every block
    assert t.stream_var["fwd"][0] == t.stream_var["fwd"][5] == 0
    assert (t.stream_var["fwd"][1:5] < t.var["fwd_other"][1:5]).all()  # rotary, SiLU split
    on = estimate_config(t, _cfg(tensor=4, sequence_parallel=True), cluster)
    off = estimate_config(t, _cfg(tensor=4), cluster)
    assert off.peak_memory_bytes > on.peak_memory_bytes  # the stream's activations whole
    assert off.breakdown_s["pipeline_compute"] > on.breakdown_s["pipeline_compute"]
    # all-reduces without it, all-gathers and reduce-scatters with it: the same ring traffic
    assert off.breakdown_s["tp_per_microbatch"] == pytest.approx(
        on.breakdown_s["tp_per_microbatch"], rel=0.05)
    one = estimate_config(t, _cfg(sequence_parallel=True), cluster)
    assert one.step_time_s == estimate_config(t, _cfg(), cluster).step_time_s  # t = 1
    assert len(on.stage_peak_bytes) == 1 and on.stage_peak_bytes[0] == on.peak_memory_bytes


def test_fitted_constants_are_the_default_on_their_device_kind(graph):
    h96, h80 = preset("h100-96x8-n2"), preset("h100x8-n2")
    assert default_fit(h96) == FITTED["h100-96"] and default_fit(h80) == MeshFit()
    t = block_table(graph, h96)
    fitted = estimate_config(t, _cfg(), h96)
    assert fitted.step_time_s == estimate_config(t, _cfg(), h96, fit=FITTED["h100-96"]).step_time_s
    assert fitted.step_time_s > estimate_config(t, _cfg(), h96, fit=MeshFit()).step_time_s
