"""Batch scaling: fixed parts of op times (profiled at two batch sizes) and the simulator."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import autoplace.costs.profile as prof
from autoplace.capture import capture
from autoplace.cluster import Cluster, Device
from autoplace.costs.profile import apply_cached, profile
from autoplace.graph import OpGraph, OpNode, random_dag
from autoplace.grouping import group_costs
from autoplace.plan import ParallelConfig, Plan
from autoplace.planners.stage_split import split_costs
from autoplace.sim import lower_bound, simulate, simulate_batch
from autoplace.sim.model import fixed_part, scaled
from tests.helpers.capture_models import LSTMTagger, ResidualMLP

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ------------------------------------------------------------------ profiling
def _check_fixed_parts(g: OpGraph, kind: str = "cpu") -> None:
    for op in g:
        for t, f in ((op.fwd_time_s[kind], op.fwd_fixed_s[kind]),
                     (op.bwd_time_s[kind], op.bwd_fixed_s[kind])):
            assert 0.0 <= f <= t, (op.name, f, t)


def test_profile_fits_fixed_parts_that_survive_cache_and_json(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = ResidualMLP(dim=64, hidden=256)
    x = torch.randn(64, 64)
    g = profile(capture(model, (x,)), "cpu", repeats=3, inputs=(x,), cache_dir=tmp_path)
    info = g.profile_info["cpu"]
    assert info["fixed_parts"] == "measured"
    assert info["batch_size"] == 64 and info["small_batch"] == 8 and info["share"] == 0.125
    assert 0.25 <= info["small_calibration"]["fwd_scale"] <= 4
    _check_fixed_parts(g)
    # ops with work: the fitted part is finite, and inputs / outputs cost nothing
    assert g["x"].fwd_fixed_s["cpu"] == 0.0 and g["output"].bwd_fixed_s["cpu"] == 0.0
    assert all(math.isfinite(op.fwd_fixed_s["cpu"]) for op in g)
    assert not np.isnan(g.fwd_fixed_times("cpu")).any()
    assert not np.isnan(g.bwd_fixed_times("cpu")).any()

    # the record: fixed parts and the small-batch times they were fitted from
    data = json.loads((tmp_path / f"{g.fingerprint}-cpu.json").read_text())
    assert data["small_batch"] == 8 and data["share"] == 0.125
    for name in g.order:
        t, ts, f = data["fwd_time_s"][name], data["fwd_small_s"][name], data["fwd_fixed_s"][name]
        if t > 0:  # the clipped two-point fit
            want = min(max((ts - 0.125 * t) / 0.875, 0.0), t)
            assert f == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert data["fwd_fixed_s"]["ups_0"] == g["ups_0"].fwd_fixed_s["cpu"]

    # cache round trip: no second measurement, the same fixed parts
    def boom(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(prof, "_measure", boom)
    g2 = profile(capture(model, (x,)), ["cpu"], cache_dir=tmp_path)
    assert g2.fwd_fixed_times("cpu").tolist() == g.fwd_fixed_times("cpu").tolist()
    assert g2.bwd_fixed_times("cpu").tolist() == g.bwd_fixed_times("cpu").tolist()

    # graph JSON round trip; the fingerprint does not depend on fixed parts
    g3 = OpGraph.from_json(json.loads(json.dumps(g.to_json())))
    assert g3.fwd_fixed_times("cpu").tolist() == g.fwd_fixed_times("cpu").tolist()
    assert g3.bwd_fixed_times("cpu").tolist() == g.bwd_fixed_times("cpu").tolist()
    assert g3.fingerprint == g.fingerprint
    bare = g.to_json()
    for d in bare["nodes"]:  # a file written before the fields existed
        del d["fwd_fixed_s"], d["bwd_fixed_s"]
    old = OpGraph.from_json(bare)
    assert old.fingerprint == g.fingerprint and all(not op.fwd_fixed_s for op in old)
    assert np.isnan(old.fwd_fixed_times("cpu")).all()


def test_old_cache_record_loads_without_fixed_parts(tmp_path):
    model = LSTMTagger()
    tokens = torch.randint(0, 100, (8, 6))
    g = profile(capture(model, (tokens,)), "cpu", repeats=2, inputs=(tokens,),
                cache_dir=tmp_path)
    assert g["lstm"].fwd_fixed_s["cpu"] <= g["lstm"].fwd_time_s["cpu"]
    path = tmp_path / f"{g.fingerprint}-cpu.json"
    data = json.loads(path.read_text())
    for key in ("fixed_parts", "batch_size", "small_batch", "share", "small_calibration",
                "fwd_small_s", "bwd_small_s", "fwd_fixed_s", "bwd_fixed_s"):
        del data[key]
    path.write_text(json.dumps(data))
    # applied to the same graph: the fixed parts of the earlier profile are dropped
    assert apply_cached(g, tmp_path, ["cpu"]) == ["cpu"]
    assert all("cpu" not in op.fwd_fixed_s and "cpu" not in op.bwd_fixed_s for op in g)
    assert g["lstm"].fwd_time_s["cpu"] == data["fwd_time_s"]["lstm"]
    assert g.profile_info["cpu"]["fixed_parts"].startswith("absent")


class _BakedView(nn.Module):
    """The batch size is baked in: ``view(8, -1)`` fails at any other batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)).view(8, -1))


class _BakedRows(nn.Module):
    """A per-row parameter of the full batch: at batch 1 it broadcasts silently."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.rows = nn.Parameter(torch.randn(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.rows


@pytest.mark.parametrize("model, why", [
    (_BakedView(), "skipped: running at batch 1 failed: "),
    (_BakedRows(), "skipped: running at batch 1 failed: AutoplaceError: an output keeps"),
])
def test_model_failing_at_a_smaller_batch_skips_fixed_parts(tmp_path, model, why):
    x = torch.randn(8, 16)
    g = profile(capture(model, (x,)), "cpu", repeats=2, inputs=(x,), cache_dir=tmp_path)
    assert g.has_costs("cpu") and g["fc"].fwd_time_s["cpu"] > 0
    assert all(not op.fwd_fixed_s and not op.bwd_fixed_s for op in g)
    assert g.profile_info["cpu"]["fixed_parts"].startswith(why)
    data = json.loads((tmp_path / f"{g.fingerprint}-cpu.json").read_text())
    assert data["fixed_parts"].startswith(why) and data["small_batch"] == 1
    assert "fwd_fixed_s" not in data
    assert all(p.grad is None for p in model.parameters())


def test_batch_of_one_and_unbatched_inputs_skip_fixed_parts():
    g = profile(capture(ResidualMLP(), (torch.randn(1, 16),)), "cpu", repeats=2,
                inputs=(torch.randn(1, 16),))
    assert g.profile_info["cpu"]["fixed_parts"] == "skipped: batch size 1 < 2"
    assert all(not op.fwd_fixed_s for op in g)
    graph = capture(ResidualMLP(), (torch.randn(4, 16),))
    assert prof._cut_batch(graph, (torch.randn(4, 16), torch.randn(3, 2))) == \
        "tensor inputs disagree on the size of dim 0 ([3, 4])"
    assert prof._cut_batch(graph, (torch.tensor(2.0), 3)) == "no tensor input has a batch dimension"
    graph.batch_size = 5
    assert prof._cut_batch(graph, (torch.randn(4, 16),)) == \
        "dim 0 of the inputs (4) is not the batch size (5)"
    graph.batch_size = 16
    x, mask = torch.randn(16, 3), torch.tensor(1.0)
    (cx, cm, k), big, b = prof._cut_batch(graph, (x, mask, 7))
    assert (big, b, k) == (16, 2, 7) and cm is mask and torch.equal(cx, x[:2])


def test_fit_of_fixed_parts():
    full = {"flat": 8.0, "linear": 8.0, "between": 8.0, "noisy_hi": 1.0, "noisy_lo": 1.0,
            "none": 0.0}
    small = {"flat": 8.0, "linear": 1.0, "between": 4.5, "noisy_hi": 2.0, "noisy_lo": 0.0,
             "none": 1e-6}
    out = prof._fit_fixed(full, small, 0.125)
    assert out["flat"] == 8.0 and out["linear"] == 0.0 and out["none"] == 0.0
    assert out["between"] == pytest.approx(4.0)  # 4 + (8 - 4) / 8 = 4.5
    assert out["noisy_hi"] == 1.0 and out["noisy_lo"] == 0.0


# ------------------------------------------------------------------ simulator
def _cluster(n: int = 2, overhead: float = 0.0) -> Cluster:
    dev = Device(name="cpu", kind="cpu", memory_bytes=8 * 2**30, peak_flops=50e9,
                 memory_bandwidth=10e9, launch_overhead_s=overhead, host_dispatch_s=0.0)
    return Cluster.uniform(f"cpu-x{n}", dev, n, alpha_s=50e-6, bandwidth=5e9)


def _chain(n: int = 4, fwd: float = 1e-3) -> OpGraph:
    nodes = [OpNode(name=f"op{i}", kind="Linear", module_path=f"layers.{i}",
                    output_bytes=2**16, param_bytes=2**16, activation_bytes=2**16,
                    fwd_time_s={"cpu": fwd}, bwd_time_s={"cpu": 2 * fwd}) for i in range(n)]
    edges = [(f"op{i}", f"op{i + 1}", 2**16) for i in range(n - 1)]
    return OpGraph(f"chain{n}", nodes, edges)


def test_fixed_part_makes_microbatches_pay_again():
    cluster = _cluster(2, overhead=0.0)
    plain, fixed = _chain(), _chain()
    fixed["op1"].fwd_fixed_s["cpu"] = 1e-3  # the whole time: does not shrink at all
    fixed["op1"].bwd_fixed_s["cpu"] = 2e-3
    # one device, 4 microbatches: op1 runs 4 times at full time instead of 4 quarters
    one = Plan.single(plain).with_parallel(microbatches=4)
    a, b = simulate(plain, one, cluster), simulate(fixed, one, cluster)
    assert b.step_time_s - a.step_time_s == pytest.approx(3 * 3e-3, rel=1e-9)
    assert b.busy_time_s[0] - a.busy_time_s[0] == pytest.approx(3 * 3e-3, rel=1e-9)
    # a 2-stage pipeline of 4 microbatches: slower with the fixed part
    groups = {f"op{i}": i // 2 for i in range(4)}
    pipe = Plan.from_groups(plain, groups, [0, 1],
                            parallel=ParallelConfig(pipeline=2, microbatches=4))
    pa, pb = simulate(plain, pipe, cluster), simulate(fixed, pipe, cluster)
    assert pb.step_time_s > pa.step_time_s + 2 * 3e-3
    # without a split the fixed part changes nothing
    whole = Plan.single(plain)
    assert simulate(fixed, whole, cluster).step_time_s == simulate(plain, whole, cluster).step_time_s
    # the lower bound's critical path counts op1's whole time (and no launch overhead)
    assert lower_bound(plain, cluster) == pytest.approx(4 * 3e-3 / 2 + 7 * 4 * 2**16 / 10e9 / 2)
    assert pb.step_time_s >= pb.lower_bound_s == lower_bound(fixed, cluster)
    # every op's whole time fixed: no split shortens the chain, 8 devices or not
    rigid = _chain()
    for op in rigid:
        op.fwd_fixed_s["cpu"], op.bwd_fixed_s["cpu"] = op.fwd_time_s["cpu"], op.bwd_time_s["cpu"]
    wide = _cluster(8, overhead=0.0)
    assert lower_bound(plain, wide) < 2e-3
    assert lower_bound(rigid, wide) == pytest.approx(4 * 3e-3)
    ddp = Plan.single(rigid).with_parallel(data=8)
    assert simulate(rigid, ddp, wide).step_time_s >= 4 * 3e-3


def test_fixed_part_is_capped_at_the_op_time_and_falls_back_per_op():
    t = np.array([1.0, 1.0, 1.0, 0.5])
    fixed = np.array([np.nan, 0.25, 3.0, np.nan])
    assert fixed_part(t, fixed, 0.1).tolist() == [0.1, 0.25, 1.0, 0.1]
    assert scaled(t, fixed, 0.1, 0.5).tolist() == pytest.approx([0.55, 0.625, 1.0, 0.3])


def test_no_fixed_parts_equal_the_launch_overhead_rule():
    rng = np.random.default_rng(0)
    t = rng.uniform(0, 1e-3, 200)
    oh = rng.choice([0.0, 2e-5, 5e-4], 200)
    share = 1.0 / 6
    old = (t - np.minimum(t, oh)) * share + np.minimum(t, oh)
    assert scaled(t, np.full(200, np.nan), oh, share).tolist() == old.tolist()
    assert scaled(t, None, oh, share).tolist() == old.tolist()
    # a graph whose profiled fixed parts are exactly min(t, overhead) simulates the same,
    # bit for bit, as one without fixed parts
    o = 2e-4
    cluster = _cluster(4, overhead=o)
    plain = random_dag(40, seed=4)
    same = random_dag(40, seed=4)
    for op in same:
        op.fwd_fixed_s["cpu"] = min(op.fwd_time_s["cpu"], o)
        op.bwd_fixed_s["cpu"] = min(op.bwd_time_s["cpu"], o)
    plans = _plans(plain, cluster, random.Random(3), 20)
    for p in plans:
        assert simulate(same, p, cluster).step_time_s == simulate(plain, p, cluster).step_time_s
    assert (simulate_batch(same, plans, cluster).step_time_s
            == simulate_batch(plain, plans, cluster).step_time_s).all()
    assert lower_bound(same, cluster) == lower_bound(plain, cluster)


def _plans(graph: OpGraph, cluster: Cluster, rng: random.Random, count: int) -> list[Plan]:
    ng = 4
    groups = {op.name: i * ng // len(graph) for i, op in enumerate(graph)}
    out = [Plan.from_groups(graph, groups, [0, 0, 1, 1],
                            parallel=ParallelConfig(pipeline=2, microbatches=4)),
           Plan.from_groups(graph, groups, [0, 0, 1, 1],
                            parallel=ParallelConfig(data=2, pipeline=2, microbatches=2,
                                                    schedule="1f1b"))]
    while len(out) < count:
        placement = [rng.randrange(2) for _ in range(ng)]
        k = max(placement) + 1
        d = rng.choice([x for x in (1, 2) if x * k <= cluster.num_devices])
        par = ParallelConfig(data=d, microbatches=rng.choice([1, 2, 3, 8]),
                             shard=rng.choice(["none", "zero2"]) if d > 1 and k == 1
                             else "none")
        rc = {g for g in range(ng) if rng.random() < 0.2}
        out.append(Plan.from_groups(graph, groups, placement, parallel=par, recompute=rc))
    return out


def test_scalar_equals_batch_with_fixed_parts():
    cluster = _cluster(4, overhead=2e-5)
    rng = random.Random(11)
    graph = random_dag(60, seed=9)
    for op in graph:
        r = rng.random()
        if r < 0.6:  # known fixed parts, at least the overhead rule's, some above the
            # op's time (capped there)
            for t, f in ((op.fwd_time_s, op.fwd_fixed_s), (op.bwd_time_s, op.bwd_fixed_s)):
                f["cpu"] = max(t["cpu"] * rng.uniform(0.0, 1.3), min(t["cpu"], 2e-5))
    bare = random_dag(60, seed=9)
    plans = _plans(graph, cluster, rng, 40)
    batch = simulate_batch(graph, plans, cluster)
    scalar = [simulate(graph, p, cluster) for p in plans]
    np.testing.assert_allclose(batch.step_time_s, [r.step_time_s for r in scalar], rtol=1e-12)
    np.testing.assert_array_equal(batch.peak_memory_bytes, [r.peak_memory_bytes for r in scalar])
    # fixed parts above launch overhead never make a split plan faster, and make some slower
    base = simulate_batch(bare, plans, cluster).step_time_s
    assert (batch.step_time_s >= base * (1 - 1e-12)).all()
    split = [i for i, p in enumerate(plans) if p.parallel.microbatches * p.parallel.data > 1]
    assert (batch.step_time_s[split] > base[split]).all()
    assert (batch.step_time_s >= batch.lower_bound_s * (1 - 1e-12)).all()
    assert batch.lower_bound_s > lower_bound(bare, cluster)


def test_group_sums_carry_fixed_parts():
    g = _chain(4)
    for name in ("op0", "op1", "op2"):
        g[name].fwd_fixed_s["cpu"] = 2.5e-4
        g[name].bwd_fixed_s["cpu"] = 5e-4
    groups = {"op0": 0, "op1": 0, "op2": 1, "op3": 1}
    sums = group_costs(g, groups, "cpu")
    assert sums["fwd_fixed_s"][0] == pytest.approx(5e-4) and np.isnan(sums["fwd_fixed_s"][1])
    assert sums["bwd_fixed_s"][0] == pytest.approx(1e-3) and np.isnan(sums["bwd_fixed_s"][1])
    assert np.isnan(group_costs(g, groups, None)["fwd_fixed_s"]).all()
    # the hybrid-dp stage split model uses the same fixed parts as the simulator
    sc = split_costs(g, _cluster(2, overhead=1e-4), groups)
    assert sc.fwd_fixed_s.tolist() == pytest.approx([5e-4, 2.5e-4 + 1e-4])
    assert sc.fixed_s.tolist() == pytest.approx([1.5e-3, 7.5e-4 + 2e-4])
    assert (sc.fixed_s + sc.var_s).tolist() == pytest.approx([6e-3, 6e-3])
