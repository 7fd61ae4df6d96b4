"""scripts/bench/bench_levers.py --smoke on CPU: every hand-written option and every per-block
recipe autoplace executes is measured, each loss matches eager's, and auto's choice is there."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import BENCH


def test_bench_levers_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / "bench_levers.py"), "--smoke", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads((tmp_path / "levers.json").read_text())
    assert out["model"] == "gpt-tiny" and out["compile_backend"] == "aot_eager"
    assert not out["partial"]
    (case,) = out["cases"]
    rows = case["options"]
    hand = {"eager", "compile", "checkpoint", "checkpoint+compile"}  # gpt-tiny is no HF model
    recipes = {"checkpoint-blocks", "selective-blocks", "compile-blocks"}
    assert {f"hand:{o}" for o in hand} | {f"autoplace:{k}" for k in recipes} <= set(rows)
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        assert math.isfinite(row["step_time_s"]) and row["step_time_s"] > 0, key
        assert len(row["round_medians_s"]) == 1  # --smoke: one round
        # same weights, same data, deterministic CPU ops: the same losses as eager's
        assert row["loss_rel_diff"] is not None and row["loss_rel_diff"] <= 1e-4, key
        assert len(row["loss"]) == out["warmup"] + out["steps"]
    # autoplace's execution of a recipe is set beside the same written by hand
    assert rows["autoplace:checkpoint-blocks"]["same_by_hand"] == "checkpoint"
    assert rows["autoplace:compile-blocks"]["throughput_vs_same_by_hand"] > 0
    assert case["best_hand"] in {f"hand:{o}" for o in hand}
    # auto's choice: measured as a run of its own, or as the recipe it equals
    auto = case["auto"]
    assert auto["plan"] and auto["split"] and auto["step_time_s"] > 0
    assert f"autoplace:{auto['same_as'] or 'auto'}" in rows
    md = (tmp_path / "levers.md").read_text()
    assert "hand:checkpoint+compile" in md and "autoplace chose" in md
    assert (tmp_path / "plans" / "gpt-tiny-no-cap-checkpoint-blocks.json").is_file()
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["tag"] == "levers-gpt-tiny" and run["scenarios"] == [case["name"]]
    assert run["headline"][0]["auto_plan"] == auto["split"]
    assert json.loads((tmp_path / "env.json").read_text())["gpus"] == 1


def test_replay_applies_a_profile_by_name_where_the_export_differs(tmp_path, monkeypatch):
    """A profile taken on another torch version's graph (other view ops, so another
    fingerprint) is applied by op name: its ops get its times, the graph's others keep
    estimated costs; a profile naming an op the graph lacks is refused."""
    monkeypatch.syspath_prepend(str(BENCH))
    from bench_levers import apply_by_name

    from autoplace import workloads
    from autoplace.capture import capture_workload

    graph = capture_workload(workloads.get("gpt-tiny", device="meta"))
    names = [op.name for op in graph]
    dropped = names[3]
    rec = {"format": "autoplace.profile/1", "fingerprint": "another",
           "fwd_time_s": {n: 1e-3 for n in names if n != dropped},
           "bwd_time_s": {n: 2e-3 for n in names if n != dropped}}
    (tmp_path / "another-h200.json").write_text(json.dumps(rec))
    assert apply_by_name(graph, tmp_path, "h200") == 1
    assert graph[names[0]].fwd_time_s["h200"] == 1e-3
    assert graph[names[0]].bwd_time_s["h200"] == 2e-3
    assert graph[dropped].fwd_time_s["h200"] not in (0.0, 1e-3)  # estimated
    rec["fwd_time_s"]["not-in-the-graph"] = 1e-3
    (tmp_path / "another-h200.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="does not have"):
        apply_by_name(capture_workload(workloads.get("gpt-tiny", device="meta")), tmp_path,
                      "h200")
