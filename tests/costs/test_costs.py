"""estimate_costs: roofline numbers per device kind."""

from __future__ import annotations

import pytest
import torch

from autoplace.capture import capture
from autoplace.cluster import Cluster, Device, preset
from autoplace.costs.estimate import BWD_FACTOR_PARAM, VIEW_OVERHEAD_FRACTION, estimate_costs
from autoplace.graph import OpGraph, OpNode
from tests.helpers.capture_models import ResidualMLP


def _device(kind: str = "toy", **kw) -> Device:
    base = dict(name="cpu", kind=kind, memory_bytes=2**30, peak_flops=1e9,
                memory_bandwidth=1e9, launch_overhead_s=1e-6)
    return Device(**{**base, **kw})


def _chain() -> OpGraph:
    nodes = [
        OpNode(name="x", kind="input", output_bytes=4000),
        OpNode(name="fc", kind="Linear", output_bytes=8000, param_bytes=2000, flops=1e7),
        OpNode(name="relu", kind="relu", output_bytes=8000, flops=2000),
        OpNode(name="v", kind="view", output_bytes=8000),
        OpNode(name="out", kind="output"),
    ]
    edges = [("x", "fc", 4000), ("fc", "relu", 8000), ("relu", "v", 8000), ("v", "out", 8000)]
    return OpGraph("chain", nodes, edges)


def test_roofline_values():
    g = _chain()
    cl = Cluster.uniform("toy", _device(), 2, alpha_s=1e-5, bandwidth=1e9)
    assert estimate_costs(g, cl) is g
    fc = g["fc"]  # compute-bound: 1e7 / 1e9 = 10 ms > 14 KB / 1e9
    assert fc.fwd_time_s["toy"] == pytest.approx(1e-2 + 1e-6)
    assert fc.bwd_time_s["toy"] == pytest.approx(BWD_FACTOR_PARAM * (1e-2 + 1e-6))
    relu = g["relu"]  # memory-bound: (8000 + 8000) / 1e9 = 16 µs
    assert relu.fwd_time_s["toy"] == pytest.approx(16e-6 + 1e-6)
    assert relu.bwd_time_s["toy"] == pytest.approx(relu.fwd_time_s["toy"])
    assert g["v"].fwd_time_s["toy"] == pytest.approx(VIEW_OVERHEAD_FRACTION * 1e-6)
    for name in ("x", "out"):
        assert g[name].fwd_time_s["toy"] == 0.0 and g[name].bwd_time_s["toy"] == 0.0
    assert g.has_costs("toy")


def test_fills_only_missing_kinds_and_keeps_profiled_times():
    g = _chain()
    g["fc"].fwd_time_s["toy"] = 123.0
    g["fc"].bwd_time_s["toy"] = 456.0
    mixed = Cluster(
        name="mixed",
        devices=(_device("toy"), _device("fast", peak_flops=1e12, memory_bandwidth=1e12)),
        alpha_s=((0, 1e-5), (1e-5, 0)),
        bandwidth=((float("inf"), 1e9), (1e9, float("inf"))),
    )
    estimate_costs(g, mixed)
    assert g["fc"].fwd_time_s["toy"] == 123.0 and g["fc"].bwd_time_s["toy"] == 456.0
    assert g["fc"].fwd_time_s["fast"] == pytest.approx(1e7 / 1e12 + 1e-6)
    assert g.has_costs("toy") and g.has_costs("fast")


def test_captured_graph_gets_costs_on_presets():
    model = ResidualMLP(dim=256, hidden=1024)
    g = capture(model, (torch.randn(64, 256),), autocast_dtype="bfloat16")
    h100, cpu = preset("h100x2"), preset("cpu-x2")
    estimate_costs(g, h100)
    estimate_costs(g, cpu)
    up = g["ups_0"]
    dev = cpu.devices[0]
    assert up.fwd_time_s["cpu"] == pytest.approx(up.flops / dev.peak_flops + dev.launch_overhead_s,
                                                rel=1e-6)
    assert up.fwd_time_s["h100"] < up.fwd_time_s["cpu"] / 20
    assert g.fwd_times("h100").sum() > 0 and g.bwd_times("cpu").sum() > g.fwd_times("cpu").sum()
