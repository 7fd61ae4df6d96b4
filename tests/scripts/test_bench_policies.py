"""bench_policies.py and bench_generalization.py end to end (tiny budgets, as subprocesses)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import BENCH, ROOT
from tests.helpers.cli_process import run_script

pytest.importorskip("autoplace.envs")


@pytest.mark.parametrize("script,prefix", [("bench_policies.py", "policies"),
                                           ("bench_generalization.py", "generalization")])
def test_script_quick(tmp_path, script, prefix):
    run = run_script(BENCH / script, "--quick", "--out",
                     str(tmp_path), cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads((tmp_path / f"{prefix}.json").read_text())
    assert data["rows"] and all(r.get("ratio_to_lower_bound", 1) >= 0.99 for r in data["rows"])
    table = (tmp_path / f"{prefix}.md").read_text()
    assert table.count("\n| ") >= len(data["rows"]) + 1
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["tag"] == prefix and run_json["summary"]
    assert json.loads((tmp_path / "env.json").read_text())["card"] == "cpu"
