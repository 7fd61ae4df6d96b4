from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace.cluster import preset
from autoplace.errors import PlanError
from autoplace.graph import random_dag
from autoplace.plan import ParallelConfig, Plan


@pytest.fixture(scope="module")
def graph():
    return random_dag(40, seed=2)


def _two_halves(graph) -> Plan:
    half = len(graph) // 2
    return Plan.from_assignment(graph, {n: int(i >= half) for i, n in enumerate(graph.order)})


def test_round_trip(tmp_path, graph):
    plan = _two_halves(graph).with_parallel(microbatches=4)
    path = tmp_path / "p.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "autoplace.plan/1"
    assert set(data) >= {"groups", "placement", "parallel", "model", "cluster", "predicted",
                         "measured", "planner"}
    assert data["parallel"] == {"data": 1, "pipeline": 1, "microbatches": 4,
                                "schedule": "gpipe", "shard": "none"}
    again = Plan.load(path)
    assert again == plan
    again.validate(graph, preset("h100x2"))


def test_device_count(graph):
    plan = _two_halves(graph).with_parallel(data=2)
    assert plan.devices_per_replica == 2 and plan.num_devices == 4
    assert plan.replica_devices(1) == [2, 3]
    plan.validate(graph, preset("h100x4"))
    with pytest.raises(PlanError, match="needs 4 devices .* has 2"):
        plan.validate(graph, preset("h100x2"))


def test_device_out_of_range(graph):
    plan = Plan.single(graph, device=3)
    with pytest.raises(PlanError, match="device index 3 is out of range"):
        plan.validate(graph, preset("h100x2"))


def test_other_graph(graph):
    plan = Plan.single(random_dag(40, seed=9))
    with pytest.raises(PlanError, match="another graph"):
        plan.validate(graph)


def test_pipeline_chain(graph):
    ok = _two_halves(graph).with_parallel(pipeline=2, microbatches=2)
    ok.validate(graph, preset("h100x2"))
    dev = {n: i % 2 for i, n in enumerate(graph.order)}
    bad = Plan.from_assignment(graph, dev, parallel=ParallelConfig(pipeline=2, microbatches=4))
    with pytest.raises(PlanError, match="do not form a chain"):
        bad.validate(graph, preset("h100x2"))


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(data=0), "parallel.data"),
        (dict(schedule="zb"), "valid: gpipe, 1f1b"),
        (dict(shard="zero3"), "valid: none, zero2, fsdp"),
        (dict(pipeline=4, microbatches=2), "at least 4 microbatches"),
        (dict(graphs=1), "parallel.graphs must be true or false"),
        (dict(graphs=True, data=2), "valid only for a plan run in one process"),
        (dict(graphs=True, pipeline=2, microbatches=2), "valid only for a plan run in one"),
        (dict(shard_optimizer=True), r"needs parallel.data = 2 or more, got 1"),
        (dict(shard_optimizer=True, data=2, shard="zero2"), "needs parallel.shard = 'none'"),
        (dict(shard_optimizer=True, data=2, pipeline=2, microbatches=2),
         "needs parallel.pipeline = 1"),
        (dict(shard_optimizer="yes", data=2), "must be true or false"),
    ],
)
def test_parallel_errors(kw, msg):
    with pytest.raises(PlanError, match=msg):
        ParallelConfig(**kw)


def test_graphs_round_trip_and_older_plans(graph):
    """``parallel.graphs`` is written only when on, so plans without it read as before."""
    plain = Plan.single(graph)
    assert "graphs" not in plain.to_json()["parallel"]
    graphed = plain.with_parallel(graphs=True, microbatches=2)
    assert Plan.loads(json.dumps(graphed.to_json())).parallel.graphs is True
    assert graphed.split() == "mb=2 graphs"
    assert graphed.parallel != plain.with_parallel(microbatches=2).parallel
    with pytest.raises(PlanError, match="cannot be combined with recompute"):
        Plan.from_groups(graph, graphed.groups, list(graphed.placement),
                         parallel=graphed.parallel, recompute={0}).validate(graph)


def test_shard_optimizer_round_trip_and_one_device_replicas(graph):
    """ZeRO-1 is written only when on, reads back, names itself in the split, and is
    refused for a replica spread over several devices (not one DDP module)."""
    assert "shard_optimizer" not in Plan.single(graph).to_json()["parallel"]
    plan = Plan.single(graph).with_parallel(data=2, shard_optimizer=True)
    back = Plan.loads(json.dumps(plan.to_json()))
    assert back.parallel.shard_optimizer is True and back.split() == "dp=2/zero1"
    plan.validate(graph, preset("h100x2"))
    spread = Plan.from_groups(graph, {op: i % 2 for i, op in enumerate(graph.order)}, [0, 1],
                              parallel=plan.parallel)
    with pytest.raises(PlanError, match="one device each"):
        spread.validate(graph, preset("h100x4"))


def test_shard_needs_data(graph):
    plan = Plan.single(graph).with_parallel(shard="zero2")
    with pytest.raises(PlanError, match="needs parallel.data > 1"):
        plan.validate(graph)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"format": "x"}', "not an autoplace plan"),
        ('{"format": "autoplace.plan/1", "groups": {"a": 0}, "placement": [0], "bogus": 1}',
         "unknown keys"),
        ('{"format": "autoplace.plan/1", "groups": {"a": 1}, "placement": [0]}',
         "out of range"),
        ('{"format": "autoplace.plan/1", "groups": {"a": 0}, "placement": [-1]}', ">= 0"),
    ],
)
def test_corrupt(text, msg):
    with pytest.raises(PlanError, match=msg):
        Plan.loads(text)


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "none.json")


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_bytes(raw):
    try:
        plan = Plan.loads(raw)
    except PlanError:
        return
    assert isinstance(plan, Plan)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 5) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)
_plan_like = st.fixed_dictionaries(
    {"format": st.just("autoplace.plan/1")},
    optional={
        "groups": st.dictionaries(st.text(max_size=4), st.integers(-2, 4) | _json, max_size=4),
        "placement": st.lists(st.integers(-2, 4) | _json, max_size=4),
        "parallel": st.dictionaries(
            st.sampled_from(["data", "pipeline", "microbatches", "schedule", "shard", "x"]),
            st.integers(-1, 4) | st.sampled_from(["gpipe", "1f1b", "none", "zero2", "no"]) | _json,
        ),
        "recompute": _json,
        "model": _json,
        "predicted": _json,
    },
)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(_json, _plan_like))
def test_fuzz_json(data):
    try:
        plan = Plan.from_json(data)
    except PlanError:
        return
    assert isinstance(plan, Plan)
    assert all(0 <= g < plan.num_groups for g in plan.groups.values())
    Plan.loads(json.dumps(plan.to_json()))
