"""The demo: the main job of the README's first command. Its table (each distinct plan
executed once; the shipped GNN's zero-shot plan as a row of its own) and its policy row, a
policy trained from random weights whose learning is printed and drawn from update 0 (the
untrained samples) through the warm start and REINFORCE."""

from __future__ import annotations

import json
import math

import pytest

from autoplace import workloads
from autoplace.capture import capture_workload
from autoplace.cluster import resolve
from autoplace.demo import DEMO_GROUPS, ZERO_SHOT, run_demo
from autoplace.demo_learning import (
    MOST_POINTS,
    LivePrinter,
    plot_learning,
    progress_lines,
    thin_updates,
    write_learning,
)
from autoplace.policies import best_shard_variant, train
from autoplace.search.auto import signature
from autoplace.sim import simulate


@pytest.mark.slow
def test_demo_on_one_device_runs_each_distinct_plan_once(tmp_path, capsys):
    rows = run_demo("gpt-tiny", "cpu-x1", out_dir=tmp_path, budget="2ep", steps=3)
    measured = [r for r in rows if r.get("measured_step_time_s")]
    assert len(measured) >= 3  # the policy's plan, the top baselines and single
    sigs = {}
    for r in measured:
        sigs.setdefault(signature(r["plan"]), []).append(r)
    for same in sigs.values():  # one run each: one report file, one figure shared
        assert sum(1 for r in same if not r.get("same_plan_as")) == 1
        assert len({r["measured_step_time_s"] for r in same}) == 1
    shared = [r for r in measured if r.get("same_plan_as")]
    assert shared, "on one device the planners' plans coincide"
    assert len(list(tmp_path.glob("report-*.json"))) == len(sigs)
    out = capsys.readouterr().out
    assert f"{shared[0]['planner']}: the same plan as {shared[0]['same_plan_as']}" in out
    assert all(r["max_loss_rel_diff"] < 1e-5 for r in measured)
    assert (tmp_path / "best_plan.json").exists() and (tmp_path / "compare.png").exists()
    assert (tmp_path / "policy_learning.png").exists()  # the policy's learning curve
    learning = json.loads((tmp_path / "policy_learning.json").read_text())
    assert len(learning["history"]["sample_mean_step_s"]) >= 1
    assert ZERO_SHOT not in {r["planner"] for r in rows}  # the shipped GNN places on 2, 4, 8


@pytest.mark.slow
def test_demo_on_two_devices_shows_the_zero_shot_plan_and_an_untrained_start(tmp_path,
                                                                           capsys):
    rows = run_demo("gpt-tiny", "cpu-x2", out_dir=tmp_path, budget="3", steps=3,
                    execute_top=0, profile_ops=False)
    by_name = {r["planner"]: r for r in rows}
    zero_shot = by_name[ZERO_SHOT]  # the shipped model's plan, simulated, in the table
    assert zero_shot["plan"].planner["name"] == "pretrained"
    assert 0 < zero_shot["sim_step_time_s"] < math.inf and zero_shot["search_time_s"] < 5
    assert f"| {ZERO_SHOT} |" in capsys.readouterr().out
    learning = json.loads((tmp_path / "policy_learning.json").read_text())
    assert learning["start"]["sample_mean_step_s"] > 0  # update 0: the untrained samples
    assert len(learning["history"]["sample_mean_step_s"]) == 3
    assert learning["chosen_step_time_s"] == by_name["policy:gnn"]["sim_step_time_s"]
    assert by_name["policy:gnn"]["measured_step_time_s"] > 0


def test_a_fresh_policy_learns_from_its_untrained_start_on_the_demo_default(tmp_path,
                                                                          capsys, monkeypatch):
    """The demo's default model and cluster (op costs estimated), trained as the demo trains
    (nothing written): update 0's sampled plans are slower than the end's, the warm start's
    plan starts the best so far, the lines printed as it trains and after say so, and the
    curve is drawn."""
    cluster = resolve("cpu-x2")
    graph = capture_workload(workloads.get("gpt-small", device="meta"))
    monkeypatch.chdir(tmp_path)
    res = train(graph, cluster, "gnn", budget="4", max_groups=DEMO_GROUPS, progress=False,
                on_update=LivePrinter("4"), checkpoint_every=0, batch_size=8)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, plan or events written
    live = capsys.readouterr().err
    assert "policy: update 0 (untrained): sampled plans mean" in live
    assert "policy: update 1 (" in live
    start, history = res.start_samples, res.history
    end = history["sample_mean_step_s"][-1]
    assert 0 < start["sample_best_step_s"] <= start["sample_mean_step_s"] < math.inf
    assert end < start["sample_mean_step_s"]  # the untrained policy samples slower plans
    target = res.warm_start["targets"][next(iter(res.warm_start["targets"]))]
    assert history["best_step_time_s"][0] <= target["step_time_s"]
    assert res.best_step_time_s <= target["step_time_s"]
    lines = progress_lines(history, res.warm_start, start)
    assert lines[0].startswith("  policy: update 0 (untrained)")
    assert "warm start imitates" in lines[1] and "update 4 (" in lines[-2]
    assert "ms before training -> " in lines[-1] and "faster)" in lines[-1]
    chosen, _ = best_shard_variant(graph, res.best_plan, cluster)
    plot_learning(history, tmp_path / "learning.png", heuristic_s=target["step_time_s"],
                  start=start, warm_s=target["step_time_s"],
                  chosen_s=simulate(graph, chosen, cluster).step_time_s, title="gpt-small")
    assert (tmp_path / "learning.png").stat().st_size > 1000


def _history(means: list[float]) -> dict[str, list[float]]:
    n = len(means)
    return {"sample_mean_step_s": means, "sample_best_step_s": means,
            "best_step_time_s": [min(means)] * n, "elapsed_s": [float(i) for i in range(n)]}


@pytest.mark.parametrize(("end", "says"), [(0.1003, "(unchanged)"), (0.0997, "(unchanged)"),
                                           (0.09, "(10.0% faster)"), (0.11, "(10.0% slower)")])
def test_the_summary_says_unchanged_within_half_a_percent(end, says):
    start = {"sample_mean_step_s": 0.1, "sample_best_step_s": 0.1, "sample_ran_frac": 1.0}
    last = progress_lines(_history([0.1] * 9 + [end]), {}, start)[-1]
    assert last.endswith(says), last


def test_the_curve_file_keeps_the_first_updates_the_last_and_an_even_stride_between(
        tmp_path):
    """A minute's training makes thousands of updates: the file and the plot keep at most
    MOST_POINTS of them, numbered in ``updates``; the printed summary reads them all."""
    assert thin_updates(7) == list(range(1, 8))
    kept = thin_updates(5886)
    assert len(kept) <= MOST_POINTS and kept[:100] == list(range(1, 101)) and kept[-1] == 5886
    strides = {b - a for a, b in zip(kept[100:], kept[101:], strict=False)}
    assert strides == {14, 15}, strides  # even: updates 101 to 5,886 in 399 strides
    n = 5886
    means = [0.2 - 0.1 * i / n for i in range(n)]
    history = {**_history(means), "best_step_time_s": [0.1] * n, "entropy": [1.0] * n}
    start = {"sample_mean_step_s": 0.2, "sample_best_step_s": 0.15, "sample_ran_frac": 0.5}
    write_learning(tmp_path, history, start=start, warm={}, chosen_s=0.1, heuristic_s=0.1,
                   title="thinned")
    saved = json.loads((tmp_path / "policy_learning.json").read_text())
    assert saved["updates"] == kept and saved["updates_total"] == n
    assert "the first 100, the last and an even stride" in saved["thinned"]
    assert set(saved["history"]) == set(history) - {"entropy"}  # the curve's series only
    for key, series in saved["history"].items():
        assert series == [history[key][u - 1] for u in kept], key
    assert (tmp_path / "policy_learning.json").stat().st_size < 100_000
    assert (tmp_path / "policy_learning.png").stat().st_size > 1000
    last = progress_lines(history, {}, start)[-1]  # the summary from every update
    assert last.endswith("200.0 ms before training -> 105.0 ms over the last tenth of the "
                         "updates (47.5% faster)"), last
