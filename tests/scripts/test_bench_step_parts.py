"""scripts/bench/bench_step_parts.py on CPU: every part of the loop is timed, beside the
profile's whole pass and the executor's one-device step."""

from __future__ import annotations

import json

from tests.helpers import BENCH
from tests.helpers.cli_process import run_script


def test_bench_step_parts_on_cpu(tmp_path):
    r = run_script(BENCH / "bench_step_parts.py", str(tmp_path),
                   "branchy-mlp", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads((tmp_path / "parts.json").read_text())
    (model,) = out["models"]
    assert model["model"] == "branchy-mlp" and model["params"] > 0
    assert model["calibration"]["whole_step_s"] > 0  # the profile's whole pass
    assert len(model["rounds"]) == 3
    for row in model["rounds"]:
        assert row["hand"]["step"] > 0 and row["graph_s"] > 0 and row["executor_s"] > 0
        parts = row["parts"]
        for name in ("fwd", "bwd", "opt"):
            assert 0 < parts[f"{name}_host"] <= parts[name]
        assert parts["zero_host"] > 0 and parts["step"] >= parts["fwd"] + parts["bwd"]
