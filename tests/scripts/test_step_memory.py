"""scripts/bench/step_memory.py: one executor step's peak on the CPU, measured storage by
storage, against the simulator's (run as a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import BENCH, ROOT, pythonpath_with_root
from tests.helpers.cli_process import run_script


def test_measured_and_simulated_peak_of_a_logits_heavy_step(tmp_path):
    out = tmp_path / "cases.json"
    proc = run_script(BENCH / "step_memory.py", "--options",
                      "vocab_size=2048,seq_len=32,d_model=16,n_layers=1,n_heads=2,batch_size=4",
                      "--recipes", "single", "--autocast", "bfloat16", "--microbatches", "1,2",
                      "--json", str(out),
                      cwd=ROOT, timeout=300,
                      env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert proc.returncode == 0, proc.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [c["microbatches"] for c in cases] == [1, 2]
    f32 = 4 * 32 * 2048 * 4  # the float32 logits of the whole batch
    for c in cases:
        assert "_log_softmax_backward_data" in c["peak_op"]
        # the kept log-softmax and the two gradients, each of a microbatch's logits
        big = [n for n, _ in c["alive_at_peak"] if n == f32 // c["microbatches"]]
        assert len(big) >= 3
        assert c["simulated_bytes"] == pytest.approx(c["measured_bytes"], rel=0.01)
    assert "simulated" in proc.stdout and "peak at" in proc.stdout


def test_an_unknown_recipe_names_the_valid_ones():
    proc = run_script(BENCH / "step_memory.py", "--options",
                      "vocab_size=256,seq_len=8,d_model=16,n_layers=1,n_heads=2,batch_size=2",
                      "--recipes", "nope", "--autocast", "none",
                      cwd=ROOT, timeout=300,
                      env={**os.environ, "PYTHONPATH": pythonpath_with_root()})
    assert proc.returncode != 0
    assert "'nope' unknown" in proc.stderr and "checkpoint-blocks" in proc.stderr
