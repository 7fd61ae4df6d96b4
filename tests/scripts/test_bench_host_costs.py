"""scripts/bench/bench_host_costs.py on CPU (gloo, a group of one): every mode of every synthetic
stack is measured, FSDP2's units are its blocks, and the fit has its terms."""

from __future__ import annotations

import json

import pytest

from tests.helpers import BENCH
from tests.helpers.cli_process import run_script


@pytest.mark.slow
def test_measures_every_mode_and_fits_the_stacks(tmp_path):
    r = run_script(BENCH / "bench_host_costs.py", "--cpu",
                   "--scenarios", "", "--synthetic", "2x1,2x3,4x1", "--modes",
                   "plain,ddp,fsdp", "--steps", "3", "--warmup", "1", "--out", str(tmp_path),
                   timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "host-costs.json").read_text())
    assert [m["name"] for m in data["models"]] == ["stack-2x1", "stack-2x3", "stack-4x1"]
    for m, (blocks, layers) in zip(data["models"], [(2, 1), (2, 3), (4, 1)]):
        assert set(m["modes"]) == {"plain", "ddp", "fsdp"}
        assert all(v["step_s"] > 0 and v["param_tensors"] == 2 * blocks * layers
                   for v in m["modes"].values())
        assert m["modes"]["fsdp"]["fsdp_units"] == blocks
        assert m["modes"]["plain"]["fsdp_units"] == 0
    assert set(data["fits"]["fsdp"]) == {"per_tensor_s", "per_unit_s", "const_s"}
    assert set(data["fits"]["ddp"]) == {"per_tensor_s", "const_s"}
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["tag"] == "host-costs" and "fsdp" in run["summary"] and "per unit" in run["summary"]
    assert json.loads((tmp_path / "env.json").read_text())["card"] == "cpu"
