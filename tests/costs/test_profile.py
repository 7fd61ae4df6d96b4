"""profile: per-op times measured on the CPU, the cache, link measurement."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplace.costs.profile as prof
from autoplace import workloads
from autoplace.capture import capture, capture_workload
from autoplace.costs.profile import measure_links, profile
from autoplace.errors import AutoplaceError
from autoplace.workloads import Workload
from tests.helpers.capture_models import CausalAttention, LSTMTagger, ResidualMLP

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_profile_mlp_on_cpu_times_every_op():
    torch.manual_seed(0)
    model = ResidualMLP(dim=128, hidden=512)
    x = torch.randn(64, 128)
    g = capture(model, (x,))
    before = model(x).detach()
    assert profile(g, ["cpu"], repeats=3, inputs=(x,)) is g
    assert g.has_costs("cpu")
    assert g["x"].fwd_time_s["cpu"] == 0.0 and g["output"].bwd_time_s["cpu"] == 0.0
    for name in ("ups_0", "relu", "downs_0", "add", "head"):
        assert g[name].fwd_time_s["cpu"] > 0
    # a 64x128x512 matmul (8.4 MFLOP) outweighs an add of 8K elements, both ways
    assert g["ups_0"].fwd_time_s["cpu"] > 3 * g["add"].fwd_time_s["cpu"]
    assert g["ups_0"].bwd_time_s["cpu"] > g["add"].bwd_time_s["cpu"]
    assert g["ups_0"].bwd_time_s["cpu"] > 0
    cal = g.profile_info["cpu"]["calibration"]
    assert 0.25 <= cal["fwd_scale"] <= 4 and cal["whole_step_s"] > cal["whole_fwd_s"] > 0
    torch.testing.assert_close(model(x), before)  # profiling left the weights alone
    assert all(p.grad is None for p in model.parameters())


def test_cache_round_trip(tmp_path, monkeypatch):
    model = LSTMTagger()
    tokens = torch.randint(0, 100, (4, 10))
    g = profile(capture(model, (tokens,)), "cpu", repeats=2, inputs=(tokens,),
                cache_dir=tmp_path)
    path = tmp_path / f"{g.fingerprint}-cpu.json"
    data = json.loads(path.read_text())
    assert data["format"] == "autoplace.profile/1" and data["device_kind"] == "cpu"
    assert data["fwd_time_s"]["lstm"] == g["lstm"].fwd_time_s["cpu"] > 0
    assert g["lstm"].bwd_time_s["cpu"] > 0

    def boom(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(prof, "_measure", boom)
    g2 = profile(capture(model, (tokens,)), ["cpu"], cache_dir=tmp_path)
    assert g2.fwd_times("cpu").tolist() == g.fwd_times("cpu").tolist()
    assert g2.bwd_times("cpu").tolist() == g.bwd_times("cpu").tolist()


def test_profile_exported_graph_with_synthesized_inputs():
    # large enough that the backward's time stands well above autograd's setup cost
    g = capture(CausalAttention(dim=128), (torch.randn(4, 128, 128),))
    assert g.capture_method == "export"
    profile(g, ["cpu"], repeats=2, calibrate=False)
    # uncalibrated, each backward has autograd's setup cost (timed on a one-element op)
    # taken off and is clipped at 0: a backward of microseconds can read 0 on a loaded
    # machine (two test workers on two cores), the graph's whole backward cannot
    assert g["linear"].fwd_time_s["cpu"] > 0 and "cpu" in g["linear"].bwd_time_s
    assert sum(op.bwd_time_s["cpu"] for op in g) > 0
    assert g["qkv_weight"].fwd_time_s["cpu"] == 0.0
    assert g.profile_info["cpu"]["calibration"]["fwd_scale"] == 1.0


def test_profile_workload_with_inplace_ops():
    class InplaceNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            y = self.act(self.fc(x))
            return (y * 2.0).add_(x)

    wl = Workload(
        name="inplace",
        model=InplaceNet(),
        make_batch=lambda bs, dev: ((torch.randn(bs, 8, device=dev),), torch.zeros(bs, 8)),
        loss_fn=F.mse_loss,
        batch_size=4,
    )
    g = profile(wl, ["cpu"], repeats=2)
    assert g.name == "inplace" and g.batch_size == 4
    assert g["act"].fwd_time_s["cpu"] > 0 and g["add_"].fwd_time_s["cpu"] > 0
    x = torch.randn(3, 8)
    torch.testing.assert_close(g.module(x), wl.model(x))


def test_meta_graph_is_refused():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    g = capture(model, (torch.randn(2, 4, device="meta"),))
    with pytest.raises(AutoplaceError, match="meta"):
        profile(g, ["cpu"])


def test_fit_alpha_beta_recovers_exact_line():
    xs = [1024, 65536, 2**20]
    ts = [5e-6 + x / 2e9 for x in xs]
    alpha, bw = prof._fit_alpha_beta(xs, ts)
    assert alpha == pytest.approx(5e-6) and bw == pytest.approx(2e9)


def test_measure_links_cpu_pair():
    alpha, bw = measure_links(["cpu", "cpu"], sizes=(2**12, 2**18, 2**21), repeats=3)
    assert alpha[0][0] == 0.0 and bw[1][1] == float("inf")
    assert alpha[0][1] >= 0.0 and alpha[0][1] < 1e-3
    assert 1e8 < bw[0][1] < 1e13 and 1e8 < bw[1][0] < 1e13


def test_host_times_are_measured_and_scaled_to_a_whole_pass(tmp_path):
    """The profile's host side: per-op seconds to issue forward and backward, scaled down
    to the host time of a whole forward and backward where they exceed it, recorded, cached and applied (on a GPU
    ``profile`` records them; here the pass is asked for them on the CPU)."""
    import numpy as np

    from autoplace import workloads
    from autoplace.capture import capture_workload
    from autoplace.costs import profile as pr

    wl = workloads.get("gpt-tiny")
    g = capture_workload(wl)
    flat = wl.example_inputs(g.batch_size, "cpu")
    host: dict = {}
    fwd, _, calib = pr._timed_pass(g.module, flat, torch.device("cpu"), 3, True, "t", host)
    assert set(host["fwd"]) == set(host["bwd"]) == set(fwd)
    for d in ("fwd", "bwd"):  # scaled down to the whole pass's issue time, never up
        total, whole = sum(host[d].values()), calib[f"whole_{d}_host_s"]
        assert calib[f"{d}_host_scale"] <= 1.0
        assert total == pytest.approx(calib[f"sum_{d}_host_s"] * calib[f"{d}_host_scale"])
        if calib[f"sum_{d}_host_s"] > whole and calib[f"{d}_host_scale"] > 0.25:
            assert total == pytest.approx(whole)
    assert calib["whole_fwd_host_s"] > 0 and calib["whole_bwd_host_s"] > 0
    assert all(v >= 0 for v in (*host["fwd"].values(), *host["bwd"].values()))
    # a record with host times applies them; one without clears them
    rec = {"fwd_time_s": fwd, "bwd_time_s": {k: 0.0 for k in fwd}, "calibration": calib,
           "fwd_host_s": host["fwd"], "bwd_host_s": host["bwd"]}
    pr._apply(g, "h200", rec)
    assert np.isfinite(g.fwd_host_times("h200")).all()
    pr._apply(g, "h200", {k: v for k, v in rec.items() if "host" not in k})
    assert np.isnan(g.fwd_host_times("h200")).all()
    # the second pass at an eighth of the batch fits the host times' fixed parts
    bwd = {k: 0.0 for k in fwd}
    scaling = pr._small_batch_pass(g, g.module, flat, flat, torch.device("cpu"), 3, True,
                                   fwd, bwd, host)
    assert scaling["fixed_parts"] == "measured"
    for d in ("fwd", "bwd"):
        fixed = scaling[f"{d}_host_fixed_s"]
        assert set(fixed) == set(host[d])
        assert all(0.0 <= fixed[k] <= host[d][k] for k in fixed)
    pr._apply(g, "h200", {**rec, **scaling})
    assert np.isfinite(g.host_fixed_times("h200")).all()
    assert (g.host_fixed_times("h200", backward=True) <= g.bwd_host_times("h200")).all()


def test_a_profile_applies_by_name_where_the_export_differs():
    """A profile taken on another torch version's graph (other view ops, so another
    fingerprint) is applied by op name: its ops get its times, the graph's others keep
    estimated costs; a profile timing an op the graph lacks is refused."""
    from autoplace.cluster import resolve
    from autoplace.costs.profile_cache import apply_by_name

    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    names = [op.name for op in graph]
    dropped = names[3]
    rec = {"fwd_time_s": {n: 1e-3 for n in names if n != dropped},
           "bwd_time_s": {n: 2e-3 for n in names if n != dropped}}
    assert apply_by_name(graph, rec, "h200", resolve("h200x1")) == 1
    assert graph[names[0]].fwd_time_s["h200"] == 1e-3
    assert graph[names[0]].bwd_time_s["h200"] == 2e-3
    assert graph[dropped].fwd_time_s["h200"] not in (0.0, 1e-3)  # estimated
    assert dropped not in rec["fwd_time_s"]  # the record is not changed
    rec["fwd_time_s"]["not-in-the-graph"] = 1e-3
    with pytest.raises(ValueError, match="does not have"):
        apply_by_name(capture_workload(workloads.get("gpt-tiny", device="meta")), rec,
                      "h200", resolve("h200x1"))
