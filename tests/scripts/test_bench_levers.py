"""scripts/bench/bench_levers.py --smoke on CPU: every hand-written option and every per-block
recipe autoplace executes is measured, each loss matches eager's, and auto's choice is there."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.helpers import BENCH
from tests.helpers.cli_process import run_script


def test_bench_levers_smoke(tmp_path):
    r = run_script(BENCH / "bench_levers.py", "--smoke", "--out",
                   str(tmp_path), timeout=300)
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
    # the results index's form: a scenario per case, the option's name without its kind
    assert run["tag"] == "levers-gpt-tiny" and run["scenarios"] == ["levers:gpt-tiny"]
    (head,) = run["headline"]
    assert head["scenario"] == "levers:gpt-tiny" and head["case"] == case["name"]
    assert head["auto_plan"] == (auto["same_as"] or auto["split"])
    assert "hand:" + head["best_hand_written"] == case["best_hand"]
    assert json.loads((tmp_path / "env.json").read_text())["gpus"] == 1


def test_an_execution_check_runs_only_the_options_named_and_heads_no_scenario(tmp_path):
    r = run_script(BENCH / "bench_levers.py", "--smoke", "--no-auto", "--hand",
                   "eager,checkpoint", "--recipes", "eager-blocks,checkpoint-blocks", "--out",
                   str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (case,) = json.loads((tmp_path / "levers.json").read_text())["cases"]
    assert set(case["options"]) == {"hand:eager", "hand:checkpoint",
                                    "autoplace:eager-blocks", "autoplace:checkpoint-blocks"}
    # autoplace's eager execution of the blocks stands beside eager by hand
    assert case["options"]["autoplace:eager-blocks"]["same_by_hand"] == "eager"
    assert case["options"]["autoplace:eager-blocks"]["throughput_vs_same_by_hand"] > 0
    ahead, rounds = case["options"]["autoplace:eager-blocks"]["rounds_ahead"]
    assert rounds == 1 and ahead in (0, 1)  # the rounds autoplace's was the faster in
    assert case["options"]["hand:eager"]["rounds_ahead"] is None
    assert f"ahead in {ahead} of 1 rounds" in (tmp_path / "levers.md").read_text()
    assert "skipped" in case["auto"] and "auto_plan not run" in (tmp_path / "levers.md").read_text()
    run = json.loads((tmp_path / "run.json").read_text())
    # an execution check is no result of auto's: the index's headline keeps the last one
    assert run["headline"] == [] and run["scenarios"] == ["levers-execution:gpt-tiny"]
    (check,) = run["execution"]
    assert check["checkpoint-blocks_vs_by_hand"] > 0 and check["auto_ms"] is None
    # a run on a CPU replays on the CPU's preset, with no peak memory measured to compare
    r = run_script(BENCH / "bench_levers.py", "--replay", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    sim = json.loads((tmp_path / "sim-check.json").read_text())
    assert sim["cluster"].startswith("cpu-x1 preset")
    (case,) = sim["cases"]
    assert case["plans"] == 3 and case["median_abs_peak_err"] is None
    assert all(r["sim_ms"] > 0 for r in sim["rows"])


def test_a_hand_written_option_it_does_not_know_is_refused_before_any_work(tmp_path):
    r = run_script(BENCH / "bench_levers.py", "--smoke", "--hand", "eager,fsdp", "--out",
                   str(tmp_path / "run"), timeout=120)
    assert r.returncode == 2 and "--hand: unknown fsdp; valid for gpt-tiny: eager" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_a_hand_written_checkpoint_is_simulated_on_the_blocks_it_wraps():
    """By hand a user wraps the members of the model's ModuleLists; the replay simulates
    that, not autoplace's blocks: a U-Net's `bottom` stage (an nn.Sequential of six layers
    outside any list, six one-op blocks of the graph) is not among them."""
    code = """
import json
import bench_levers, user_models
from autoplace.capture import capture_workload
from autoplace.lowering import block_group_ids, block_groups
wl = user_models.unet()
graph = capture_workload(wl)
groups = block_groups(graph)
hand = bench_levers.hand_block_groups(graph, wl.model)
paths = {groups[op.name]: op.module_path for op in graph.ops if op.module_path}
print(json.dumps({"hand": sorted(hand), "blocks": sorted(block_group_ids(graph, groups)),
                  "paths": {str(g): p for g, p in paths.items()}}))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=BENCH, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    hand, paths = set(out["hand"]), {int(g): p for g, p in out["paths"].items()}
    assert hand < set(out["blocks"])
    assert {paths[g].split(".")[0] for g in hand} == {"down", "lift", "up"}
    assert not any(p.startswith("bottom") for g, p in paths.items() if g in hand)
    assert any(p.startswith("bottom") for p in paths.values())
