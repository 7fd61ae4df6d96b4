"""Pictures are written, non-trivial, and every function returns its path."""

from __future__ import annotations

from autoplace.cluster import preset
from autoplace.graph import random_dag
from autoplace.plan import ParallelConfig, Plan
from autoplace.sim import simulate
from autoplace.viz import bar_chart, gantt, mesh_picture, placement_picture, training_curve
from tests.helpers import ROOT

PNG_MAGIC = b"\x89PNG"


def _is_picture(path, min_bytes: int = 5000) -> bool:
    data = path.read_bytes()
    return data[:4] == PNG_MAGIC and len(data) > min_bytes


def test_gantt_of_a_data_parallel_split(tmp_path):
    graph = random_dag(40, seed=1)
    plan = Plan.from_assignment(graph, {op.name: int(i >= 20) for i, op in enumerate(graph)},
                                parallel=ParallelConfig(data=2, microbatches=2))
    res = simulate(graph, plan, preset("cpu-x4"), timeline=True)
    out = gantt(res.timeline, tmp_path / "g" / "gantt.png", title="dp=2 mb=2")
    assert out == tmp_path / "g" / "gantt.png" and _is_picture(out, 10000)
    assert {"coll0", "coll1"} & {e.resource for e in res.timeline}


def test_gantt_of_a_pipeline(tmp_path):
    graph = random_dag(40, seed=1)
    plan = Plan.from_assignment(graph, {op.name: int(i >= 20) for i, op in enumerate(graph)},
                                parallel=ParallelConfig(pipeline=2, microbatches=4,
                                                        schedule="1f1b"))
    res = simulate(graph, plan, preset("cpu-x2"), timeline=True)
    assert _is_picture(gantt(res.timeline, tmp_path / "pipe.png"))


def test_placement_picture_small_and_large(tmp_path):
    for n in (20, 300):
        graph = random_dag(n, seed=2)
        plan = Plan.from_assignment(graph, {op.name: (i * 3) // n for i, op in enumerate(graph)})
        out = placement_picture(graph, plan, tmp_path / f"place{n}.png")
        assert _is_picture(out)


def test_mesh_picture_of_replicas_tensor_ranks_and_stages(tmp_path):
    graph = random_dag(40, seed=1)
    tp = Plan.single(graph, parallel=ParallelConfig(data=8, shard="fsdp", replicate=2, tensor=8))
    assert _is_picture(mesh_picture(tp, 8, tmp_path / "tp.png"), 10000)
    pp = Plan.from_assignment(graph, {op.name: int(i >= 20) for i, op in enumerate(graph)},
                              parallel=ParallelConfig(data=256, pipeline=2, microbatches=2))
    assert _is_picture(mesh_picture(pp, 8, tmp_path / "pp.png"), 10000)  # 512 GPUs


def test_training_curve_and_bar_chart(tmp_path):
    values = [1.0 / (1 + 0.1 * i) for i in range(50)]
    out = training_curve({"seq2seq": values, "gnn": values[::-1]}, tmp_path / "curve.png",
                         smooth=5, hlines={"lower bound": 0.2})
    assert _is_picture(out)
    svg = training_curve(values, tmp_path / "one.svg")
    assert svg.read_text().lstrip().startswith("<?xml") and svg.stat().st_size > 5000
    rows = [{"planner": "single", "step_time_s": 0.108, "spread_s": 0.002},
            {"planner": "ddp", "step_time_s": None},
            {"planner": "rl", "step_time_s": 0.07, "spread_s": 0.004}]
    out = bar_chart(rows, tmp_path / "bars.png", error="spread_s", scale=1e3, ylabel="ms")
    assert _is_picture(out)
    assert _is_picture(bar_chart({"a": 1.0, "b": 2.0}, tmp_path / "plain.png"))


def test_suite_figure_from_a_stored_suite(tmp_path):
    """The benchmark suite's figure (bench_plans.py writes it beside the JSON) from the
    stored 2026-11-27 2x H200 suite: one row per scenario; a suite without plans is refused."""
    import json

    import pytest

    from autoplace.viz import suite_figure

    suite = json.loads((ROOT / "bench/results/2026-11-27-h200x2-suite/suite.json").read_text())
    out = suite_figure(suite, tmp_path / "suite.png")
    assert _is_picture(out, 50000)
    with pytest.raises(ValueError, match="no scenario"):
        suite_figure({"scenarios": []}, tmp_path / "none.png")
