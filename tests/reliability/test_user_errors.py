"""A user's mistake is reported as theirs: what was wrong, where, and what is valid."""

from __future__ import annotations

import pytest
import torch

from autoplace import workloads
from autoplace.errors import WorkloadError
from tests.reliability._run import clean_error, cli


def test_a_factory_that_raises_is_the_users_error():
    line = clean_error(cli("capture", "--model", "tests.reliability.user_models:raising"),
                       "tests.reliability.user_models.raising", "user_models.py:",
                       "ValueError", "width 4 is not supported")
    assert "internal error" not in line
    with pytest.raises(WorkloadError) as info:
        workloads.get("tests.reliability.user_models:raising", width=8)
    assert isinstance(info.value.__cause__, ValueError)  # kept for AUTOPLACE_DEBUG


def test_options_of_the_wrong_type():
    clean_error(cli("capture", "--model", "gpt-tiny", "--option", "n_layers=abc"),
                "option n_layers", "must be an integer", "'abc'")
    clean_error(cli("capture", "--model", "gpt-tiny", "--option", "n_layers"), "KEY=VALUE")
    clean_error(cli("capture", "--model", "gpt-tiny", "--option", "colour=red"),
                "unknown option", "colour")


@pytest.mark.parametrize("model", [":foo", "foo:", "a b:c", "pkg.:f"])
def test_malformed_model_names(model):
    clean_error(cli("capture", "--model", model), "is not a model", "package.module:factory")


def test_a_file_that_is_not_a_policy_checkpoint(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    line = clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--policy",
                           str(text), "-o", str(tmp_path / "p.json")),
                       "not an autoplace policy checkpoint", "torch.save")
    pickled = tmp_path / "pickled.pt"
    torch.save({"format": "x", "obj": WorkloadError("code")}, pickled)
    line = clean_error(cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--policy",
                           str(pickled), "-o", str(tmp_path / "p.json")),
                       "objects other than tensors", "weights_only=True")
    assert "weights_only=False" not in line
    clean_error(cli("plan", "--model", "gpt-tiny", "--policy", str(tmp_path / "missing.pt")),
                "--policy", "no such file")
