"""The benchmark scripts run end to end (tiny budgets, as subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("autoplace.envs")


@pytest.mark.parametrize("script,prefix", [("bench_policies.py", "policies"),
                                           ("bench_generalization.py", "generalization")])
def test_script_quick(tmp_path, script, prefix):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--quick", "--out",
                          str(tmp_path), "--tag", "t"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads((tmp_path / f"{prefix}_t.json").read_text())
    assert data["rows"] and all(r.get("ratio_to_lower_bound", 1) >= 0.99 for r in data["rows"])
    table = (tmp_path / f"{prefix}_t.md").read_text()
    assert table.count("\n| ") >= len(data["rows"]) + 1
