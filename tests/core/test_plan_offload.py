"""``parallel.offload``: written only when on, valid only with FSDP2, one device allowed."""

from __future__ import annotations

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.errors import PlanError
from autoplace.plan import ParallelConfig, Plan


@pytest.fixture(scope="module")
def graph():
    return capture_workload(workloads.get("gpt-tiny", device="meta"))


def test_json_only_when_on():
    assert "offload" not in ParallelConfig(data=2, shard="fsdp").to_json()
    on = ParallelConfig(shard="fsdp", offload=True)
    assert on.to_json()["offload"] is True
    assert ParallelConfig.from_json(on.to_json()) == on
    assert on.describe() == "fsdp offload"
    assert ParallelConfig(data=2, shard="fsdp", offload=True).describe() == "dp=2/fsdp offload"


@pytest.mark.parametrize("fields, message", [
    (dict(offload=True), "needs shard='fsdp', got shard='none'"),
    (dict(data=2, shard="zero2", offload=True), "needs shard='fsdp', got shard='zero2'"),
    (dict(shard="fsdp", offload=True, graphs=True), "parallel.graphs = false"),
    (dict(data=2, shard="fsdp", pipeline=2, microbatches=2, offload=True),
     "parallel.pipeline = 1, got 2"),
    (dict(data=2, shard="fsdp", tensor=2, offload=True), "parallel.tensor = 1, got 2"),
    (dict(shard="fsdp", offload="yes"), "must be true or false"),
])
def test_invalid_combinations_say_what_is_valid(fields, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**fields)


def test_one_device_sharded_only_when_offloaded(graph):
    one = {op: 0 for op in graph.order}
    Plan.from_groups(graph, one, [0], parallel=ParallelConfig(shard="fsdp", offload=True)) \
        .validate(graph)
    with pytest.raises(PlanError, match="needs parallel.data > 1 .*parallel.offload"):
        Plan.from_groups(graph, one, [0], parallel=ParallelConfig(shard="fsdp")).validate(graph)
