"""scripts/bench_copies.py: a suite's one-process plans run two ways side by side (CPU smoke)."""

from __future__ import annotations

import json
import sys

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))


def test_two_ways_of_each_plan_with_phases(tmp_path, capsys):
    import bench_copies

    out = tmp_path / "copies.json"
    rc = bench_copies.main(["--scenarios", "tiny-mlp", "--planners", "single,two-halves,expert",
                            "--ways", "to,pinned", "--steps", "2", "--warmup", "1",
                            "--rounds", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (sc,) = res["scenarios"]
    assert sc["name"] == "tiny-mlp"
    rows = {r["planner"]: r for r in sc["plans"]}
    assert set(rows) == {"single", "two-halves", "expert"}
    ran = [r for r in rows.values() if "same_plan_as" not in r]
    assert {r["planner"] for r in ran} >= {"single", "two-halves"}
    for r in ran:
        assert r["sim_step_time_s"] > 0
        for way in ("to", "pinned"):
            w = r[way]
            assert len(w["round_medians_s"]) == 2
            assert w["spread_s"][0] <= w["step_time_s"] <= w["spread_s"][1] * 1.5
            # the phases are parts of the step: together about its time
            parts = sum(w[f"{k}_s"] for k in bench_copies.PHASES)
            assert 0.5 * w["step_time_s"] < parts < 1.5 * w["step_time_s"]
        assert r["pinned_vs_to"] > 0
        # the same program and batch values: the same loss of batch 0
        assert r["loss_batch0"]["to"] == r["loss_batch0"]["pinned"]


def test_bad_arguments_are_refused(capsys):
    import bench_copies

    assert bench_copies.main(["--scenarios", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
    assert bench_copies.main(["--scenarios", "tiny-mlp", "--ways", "to,sideways"]) == 2
    assert "unknown way" in capsys.readouterr().err


def test_bench_copy_host_smoke(tmp_path):
    """The copy-host probe runs without GPUs (both ends on the CPU) and writes one row per
    size with the chains it subtracted."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_copy_host

    out = tmp_path / "copy-host.json"
    assert bench_copy_host.main(["--links", "4", "--repeats", "2", "--sizes", "4096,65536",
                                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["bytes"] for r in res["sizes"]] == [4096, 65536]
    for r in res["sizes"]:
        ch = r["forward_chain_s"]
        assert ch["crossing"] > 0 and ch["same_device"] > 0
        assert r["forward_host_s_per_copy"] == (ch["crossing"] - ch["same_device"]) / 4
