"""scripts/bench/replay_report.py: the levers rows' simulated peaks before a change come from
the earlier run's ``replay.json`` (its functions run in a process of their own, beside the
script, as the bench scripts import each other by module name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import BENCH, pythonpath_with_root

CHECK = """
import json, sys
from pathlib import Path
import replay_report

def row(option, sim_gib, recipe="eager"):
    return {"run": "r", "case": "c", "option": option, "recipe": recipe, "family": "single",
            "measured_peak_gib": 2.0, "measured_reserved_gib": None, "sim_peak_gib": sim_gib}

folder = Path(sys.argv[1])
prev = replay_report.levers_before(folder)
pts = replay_report.memory_points([], [row("hand:eager", 1.9), row("new", 1.0, "compile-blocks")],
                                  prev)
print(json.dumps({"prev": [[list(k), v] for k, v in prev.items()],
                  "missing": replay_report.levers_before(folder / "missing"),
                  "before": [p["before"] for p in pts],
                  "text": replay_report.markdown([], pts, [], [], None)}))
"""


def test_levers_peaks_before_are_matched_by_run_case_and_option(tmp_path):
    rows = [{"run": "r", "case": "c", "option": o, "recipe": "eager", "family": "single",
             "measured_peak_gib": 2.0, "measured_reserved_gib": None, "sim_peak_gib": g}
            for o, g in (("hand:eager", 1.5), ("gone", 9.0))]
    (tmp_path / "replay.json").write_text(json.dumps({"levers": rows}))
    p = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], cwd=BENCH,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert dict((tuple(k), v) for k, v in out["prev"]) == {
        ("r", "c", "hand:eager"): 1.5 * 2**30, ("r", "c", "gone"): 9.0 * 2**30}
    assert out["missing"] == {}
    assert out["before"] == [1.5 * 2**30, None]
    # now 1.9 of 2.0 within 10%, 1.0 not; before 1.5 not
    assert "Within 10% of allocated: 1 of 2 plans (before: 0 of the 1 simulated then)." \
        in out["text"]


STALE = """
import json, sys
from pathlib import Path
import replay_report

root = Path(sys.argv[1])
fsdp_fix, ddp_fix, pipe_fix, graphs_fix = (c[0] for c in replay_report.EXECUTOR_CHANGES)
NAMES = (("oldest", "a1b2c3d+dirty"), ("between", ddp_fix + "~1"), ("graphed", pipe_fix),
         ("new", graphs_fix), ("unknown", ""))
for name, commit in NAMES:
    (root / name).mkdir()
    (root / name / "env.json").write_text(json.dumps({"commit": commit}))
FAMS = ("dp-none", "dp-none+zero1+recompute", "dp-fsdp", "dp-fsdp+compile+recompute",
        "dp-zero2+recompute", "dp-none+placement", "pipeline+recompute", "single+graphs")

def plan(family):
    return {"planner": family, "family": family, "split": family, "measured_s": 1.0,
            "sim_now_s": 1.0, "measured_peak_bytes": 2**30, "measured_reserved_bytes": None,
            "sim_peak_now_bytes": 2**30, "sim_peak_before_bytes": None, "same_split": True}

out = {}
for name, _ in NAMES:
    rows = [plan(f) for f in FAMS]
    replay_report.mark_stale(replay_report.changes_since(root / name), rows)
    pts = replay_report.memory_points([{"suite": name, "name": "x", "plans": rows}], [])
    out[name] = {"memory": [p["stale"] for p in pts],
                 "time": [r["family"] for r in replay_report.fresh(rows)]}
print(json.dumps(out))
"""


def test_plans_measured_before_an_executor_change_that_concerns_them_are_left_out(tmp_path):
    """A suite run before the executor kept DDP's first gradient buckets measured DDP's
    peak with the gradients twice: its DDP and ZeRO-1 plans (recomputing or not) are left
    out of the memory tables, their step times kept. One run before FSDP2 sharded each
    recomputed or compiled block as a unit of its own measured those plans gathering the
    whole model: their memory and step time are left out. One run before pipelines
    stepped without kept outputs measured their last stage holding every microbatch's
    output: their memory is left out, their step times kept. A placement's replicas (not
    DDP-wrapped) and plain FSDP2 stay, as does every plan of a suite run since; a suite
    whose commit is unknown counts as run before all of them."""
    p = subprocess.run([sys.executable, "-c", STALE, str(tmp_path)], cwd=BENCH,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    both = [True, True, False, True, True, False, True, True]
    assert out["oldest"]["memory"] == out["unknown"]["memory"] == both
    assert out["oldest"]["time"] == out["unknown"]["time"] == [
        "dp-none", "dp-none+zero1+recompute", "dp-fsdp", "dp-none+placement",
        "pipeline+recompute", "single+graphs"]
    assert out["between"]["memory"] == [True, True, False, False, False, False, True, True]
    assert len(out["between"]["time"]) == 8
    # a graphed plan's peak measured before the capture stopped holding torch's warm-up
    # gradients is the capture's: left out, its step time kept
    assert out["graphed"]["memory"] == [False] * 7 + [True]
    assert len(out["graphed"]["time"]) == 8
    assert out["new"]["memory"] == [False] * 8 and len(out["new"]["time"]) == 8


LEVERS_FAMILIES = """
import json
import replay_report as rr

recipes = ["eager", "checkpoint-blocks+compile", "fsdp+offload", "fsdp+offload+checkpoint-blocks",
           "fsdp+checkpoint-blocks+compile", "ddp+compile"]
fams = [rr.suite_family(r) for r in recipes]
rows = [{"family": f} for f in fams]
rr.mark_stale(list(rr.EXECUTOR_CHANGES), rows)
pts = rr.memory_points([], [{"run": "r", "case": "c", "option": "o", "recipe": "x",
                             "family": "offload", "measured_peak_gib": 1.0,
                             "measured_reserved_gib": None, "sim_peak_gib": 1.0,
                             "stale_memory": True}])
print(json.dumps({"families": fams, "stale": [r["stale_memory"] for r in rows],
                  "point_stale": pts[0]["stale"]}))
"""


def test_a_levers_recipe_is_judged_by_the_executor_changes_as_a_suite_plan_is():
    """A one-GPU levers run before FSDP2 sharded each recomputed block as a unit of its own
    measured its offloaded, recomputed recipe gathering the whole model: its peak is left
    out like a suite's plan of the same family; DDP recipes are the DDP change's."""
    p = subprocess.run([sys.executable, "-c", LEVERS_FAMILIES], cwd=BENCH,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["families"] == ["single", "single+recompute+compile", "dp-fsdp",
                               "dp-fsdp+recompute", "dp-fsdp+recompute+compile",
                               "dp-none+compile"]
    assert out["stale"] == [False, False, False, True, True, True]
    assert out["point_stale"] is True


CAPTURED = """
import json, sys
from pathlib import Path
import replay_report as rr

root = Path(sys.argv[1])
gpt2 = {"model": "tests.helpers.hf_models:gpt2", "options": {}, "card": "NVIDIA H200"}
llama = {"model": "tests.helpers.hf_models:llama", "options": {}, "card": "NVIDIA H200"}
for name, commit, run in (("old", "ad26a0d", gpt2), ("unknown", "", gpt2),
                          ("masks-gone", "a1989b9", llama)):
    (root / name).mkdir()
    (root / name / "levers.json").write_text(json.dumps(run))
    (root / name / "env.json").write_text(json.dumps({"commit": commit}))
left = []
rows = rr.replay_levers(root, left)
print(json.dumps({"gpt2": rr.exported_attention(gpt2),
                  "zoo": rr.exported_attention({"model": "gpt-tiny", "options": {}}),
                  "vit": rr.exported_attention({"model": "tests.helpers.hf_models:vit",
                                                "options": {}}),
                  "gqa": [rr.exported_grouped_query(gpt2), rr.exported_grouped_query(llama)],
                  "rows": rows, "left": left}))
"""


def test_a_levers_run_measured_before_the_attention_rewrite_is_left_out(tmp_path):
    """A levers run of an exported model that attends, measured before capture.attention
    gave its causal mask back to attention (a1989b9), ran another graph than today's
    capture gives: it is left out of the replay, with the reason; so is a grouped-query
    model's run measured before its keys and values went to attention unrepeated
    (13c6dda). A zoo model (traced by torch.fx) is not such a model."""
    p = subprocess.run([sys.executable, "-c", CAPTURED, str(tmp_path)], cwd=BENCH,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["gpt2"] is True and out["vit"] is True and out["zoo"] is False
    assert out["gqa"] == [False, True]  # GPT-2 has as many key as query heads
    assert out["rows"] == []
    # a Llama measured after the masks went but before its grouped keys and values did
    why = dict(out["left"])
    assert sorted(why) == ["masks-gone", "old", "unknown"]
    assert "before 13c6dda" in why["masks-gone"]
    assert "before a1989b9" in why["old"] and "before a1989b9" in why["unknown"]
