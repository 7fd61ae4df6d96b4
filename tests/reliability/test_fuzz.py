"""Files are data: fuzzed plan, cluster, graph, profile, calibration and checkpoint files
either load or raise the project's own error, and reading them imports nothing.

A fixed budget (200 examples per loader, derandomized) keeps CI's time and results the
same from run to run."""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplace import workloads
from autoplace.cluster import Cluster, preset
from autoplace.costs.profile_cache import apply_cached
from autoplace.errors import AutoplaceError
from autoplace.executor.checkpoint import checkpoint_step
from autoplace.graph import OpGraph, random_dag
from autoplace.plan import ParallelConfig, Plan
from autoplace.policies import checkpoint as policy_ckpt
from autoplace.search.calibration import Calibration, calibration_path

BUDGET = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["os:system", "subprocess:getoutput", "fuzz_planted:f",
                              "gpt-tiny", "autoplace.plan/1", "autoplace.cluster/1"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

GRAPH = random_dag(6, seed=0)
PLAN = Plan.single(GRAPH, parallel=ParallelConfig(microbatches=2)).to_json()
PLAN["model"] = {"spec": "gpt-tiny", "options": {"n_layers": 2}, "seed": 0}
CLUSTER = preset("cpu-x2").to_json()
CLUSTER["bandwidth"] = [[None if x is None else x for x in row] for row in CLUSTER["bandwidth"]]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw, base: Any) -> Any:
    """``base`` with one to three places replaced by random JSON, or removed."""
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(obj)))
        value = draw(JSON)
        if not path:
            obj = value
            continue
        parent = obj
        try:
            for key in path[:-1]:
                parent = parent[key]
            if draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            pass
    return obj


def _imports_nothing(fn):
    """Run ``fn``; fail if a module was imported meanwhile (warm-up done by the caller)."""
    before = set(sys.modules)
    try:
        fn()
    except AutoplaceError:
        pass
    new = set(sys.modules) - before
    assert not new, f"reading a file imported {sorted(new)}"
    assert "fuzz_planted" not in sys.modules


def _warm(fn) -> None:
    try:
        fn()
    except AutoplaceError:
        pass


_warm(lambda: Plan.from_json(PLAN))


@BUDGET
@given(mutated(PLAN))
def test_plan_from_json(data):
    _imports_nothing(lambda: Plan.from_json(data))


@BUDGET
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_plan_from_bytes(raw):
    _imports_nothing(lambda: Plan.loads(raw))


_warm(lambda: workloads.check_trusted("gpt-tiny", source="plan"))  # the zoo is autoplace's


@BUDGET
@given(mutated(PLAN))
def test_a_plans_model_is_checked_without_importing(data):
    spec = data.get("model", {}).get("spec") if isinstance(data, dict) and isinstance(
        data.get("model"), dict) else data
    _imports_nothing(lambda: workloads.check_trusted(spec, source="plan fuzz.json"))


_warm(lambda: Cluster.from_json(CLUSTER))


@BUDGET
@given(mutated(CLUSTER))
def test_cluster_from_json(data):
    _imports_nothing(lambda: Cluster.from_json(data))


_warm(lambda: OpGraph.from_json(GRAPH.to_json()))


@BUDGET
@given(mutated(GRAPH.to_json()))
def test_graph_from_json(data):
    _imports_nothing(lambda: OpGraph.from_json(data))


PROFILE = {"format": "autoplace.profile/1", "fingerprint": GRAPH.fingerprint,
           "fwd_time_s": {n: 1e-4 for n in GRAPH.order},
           "bwd_time_s": {n: 2e-4 for n in GRAPH.order},
           "fwd_fixed_s": {n: 1e-5 for n in GRAPH.order}}


def _profile_loads(data: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"{GRAPH.fingerprint}-cpu.json").write_text(json.dumps(data))
        graph = OpGraph.from_json(GRAPH.to_json())
        apply_cached(graph, d, ["cpu"])


def test_the_profile_seed_record_is_read():
    from autoplace.costs import profile_cache

    record = dict(PROFILE, format=profile_cache.PROFILE_FORMAT)
    PROFILE["format"] = record["format"]
    with tempfile.TemporaryDirectory() as d:
        Path(d, f"{GRAPH.fingerprint}-cpu.json").write_text(json.dumps(record))
        assert apply_cached(OpGraph.from_json(GRAPH.to_json()), d, ["cpu"]) == ["cpu"]


_warm(lambda: _profile_loads(PROFILE))


@BUDGET
@given(mutated(PROFILE))
def test_profile_cache(data):
    _imports_nothing(lambda: _profile_loads(data))


_CAL_CLUSTER = preset("cpu-x2")
CALIBRATION = {"format": "autoplace.calibration/1", "fingerprint": GRAPH.fingerprint,
               "device_kind": "cpu", "num_devices": 2,
               "samples": [{"family": "single", "planner": "single", "sim_step_time_s": 0.01,
                            "measured_step_time_s": 0.02, "sim_peak_bytes": 1e6,
                            "measured_peak_bytes": 2e6}]}


def _calibration_loads(data: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = calibration_path(d, GRAPH, _CAL_CLUSTER)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        cal = Calibration.load(d, GRAPH, _CAL_CLUSTER)
        cal.time_factors  # noqa: B018 - what the samples are read for
        cal.step_time(Plan.single(GRAPH), 0.01)
        cal.peak_bytes(Plan.single(GRAPH), 1e6)


_warm(lambda: _calibration_loads(CALIBRATION))


@BUDGET
@given(mutated(CALIBRATION))
def test_calibration(data):
    _imports_nothing(lambda: _calibration_loads(data))


PLAIN = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats()
                     | st.text(max_size=8) | st.just(torch.zeros(2)),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10)
POLICY_KEYS = st.fixed_dictionaries({
    "format": st.sampled_from([policy_ckpt.CHECKPOINT_FORMAT, "other"]),
    "policy": st.one_of(PLAIN, st.fixed_dictionaries({
        "name": st.sampled_from(["seq2seq", "gnn", "hierarchical", "nope"]),
        "config": st.dictionaries(st.sampled_from(["num_features", "num_devices", "hidden",
                                                   "max_groups", "bogus"]), PLAIN,
                                  max_size=3)})),
    "policy_state": PLAIN})


def _policy_loads(payload: Any, raw: bytes | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "checkpoint.pt")
        if raw is not None:
            path.write_bytes(raw)
        else:
            torch.save(payload, path)
        data = policy_ckpt.load(path)
        policy_ckpt.load_policy(data)


_warm(lambda: _policy_loads({"format": "x"}, None))
_warm(lambda: _policy_loads(None, b"PK\x03\x04junk"))


@BUDGET
@given(POLICY_KEYS | PLAIN, st.none() | st.binary(max_size=200))
def test_policy_checkpoint(payload, raw):
    _imports_nothing(lambda: _policy_loads(payload, raw))


def _run_checkpoint(latest: str | None, raw: bytes | None, step_dir: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        if latest is not None:
            Path(d, "latest").write_text(latest)
            if step_dir:
                Path(d, latest.strip() if latest.strip() and "/" not in latest
                     and latest.strip() not in (".", "..") and "\x00" not in latest
                     else "step-1").mkdir(exist_ok=True)
        elif raw is not None:
            Path(d, "checkpoint.pt").write_bytes(raw)
        checkpoint_step(d)


_warm(lambda: _run_checkpoint("step-3", None, True))


@BUDGET
@given(st.none() | st.text(max_size=20) | st.from_regex(r"step-[0-9]{1,4}", fullmatch=True),
       st.none() | st.binary(max_size=200), st.booleans())
def test_run_checkpoint_metadata(latest, raw, step_dir):
    _imports_nothing(lambda: _run_checkpoint(latest, raw, step_dir))
