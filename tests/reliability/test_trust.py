"""Plan files are data: reading one never imports a module the user did not name."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from autoplace import workloads
from autoplace.errors import AutoplaceError, WorkloadError
from tests.reliability._run import clean_error, cli

USER = "tests.helpers.zoo_user_workload:tiny_regression"

EVIL = '''
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the plan ran my code")

def factory(**options):
    Path(__file__).with_name("CALLED").write_text(repr(options))
'''


@pytest.fixture(scope="module")
def plans(tmp_path_factory, single_plan_file) -> dict[str, Path]:
    """A zoo plan, the same plan naming a user's factory, and one naming a planted module."""
    folder = tmp_path_factory.mktemp("trust")
    zoo = folder / "zoo.json"
    shutil.copyfile(single_plan_file, zoo)  # gpt-tiny's single plan (tests/conftest.py)
    user = folder / "user.json"
    p = cli("plan", "--model", USER, "--cluster", "cpu-x2", "--planner", "single", "-o",
            str(user))
    assert p.returncode == 0, p.stderr
    data = json.loads(zoo.read_text())
    data["model"] = {"spec": "evil_plan_module:factory", "options": {"cmd": "touch pwned"}}
    evil = folder / "evil.json"
    evil.write_text(json.dumps(data))
    (folder / "evil_plan_module.py").write_text(EVIL)
    return {"zoo": zoo, "user": user, "evil": evil, "folder": folder}


@pytest.mark.parametrize("command", ["simulate", "show", "run"])
def test_a_plan_naming_a_module_runs_none_of_its_code(plans, command):
    folder = plans["folder"]
    p = cli(command, str(plans["evil"]), cwd=folder)  # the planted module is importable there
    clean_error(p, "evil_plan_module:factory", "not in the model zoo", "--trust-model",
                "--model evil_plan_module:factory")
    assert not (folder / "IMPORTED").exists() and not (folder / "CALLED").exists()
    assert not (folder / "pwned").exists()


def test_the_shell_command_of_the_issue_is_refused(plans, tmp_path):
    data = json.loads(plans["zoo"].read_text())
    data["model"] = {"spec": "subprocess:getoutput", "options": {"cmd": f"touch {tmp_path}/x"}}
    path = tmp_path / "shell.json"
    path.write_text(json.dumps(data))
    for command in ("simulate", "show", "run"):
        clean_error(cli(command, str(path)), "subprocess:getoutput", "--trust-model")
    assert not (tmp_path / "x").exists()


def test_a_users_model_is_built_when_named_or_trusted(plans):
    user = str(plans["user"])
    clean_error(cli("simulate", user), USER, "--trust-model")
    assert cli("simulate", user, "--model", USER).returncode == 0
    assert cli("simulate", user, "--trust-model").returncode == 0
    clean_error(cli("simulate", user, "--model", "gpt-tiny"), "made for the model", USER)
    assert cli("simulate", str(plans["zoo"])).returncode == 0  # zoo names need nothing


def test_the_library_says_what_it_may_build():
    workloads.check_trusted("gpt-tiny", source="plan p.json")
    workloads.check_trusted(USER, source="plan p.json", user_model=USER)
    workloads.check_trusted(USER, source="plan p.json", trust=True)
    for spec in (USER, "os:system", "subprocess:getoutput"):
        with pytest.raises(WorkloadError, match="--trust-model"):
            workloads.check_trusted(spec, source="plan p.json")
    with pytest.raises(WorkloadError, match="records no model spec"):
        workloads.check_trusted(None, source="plan p.json")
    sys.modules.pop("tests.reliability.never_imported", None)
    with pytest.raises(WorkloadError, match="not in the model zoo"):
        workloads.get("tests.reliability.never_imported:f", trusted=False)
    assert "tests.reliability.never_imported" not in sys.modules


def test_workers_get_the_trust_decision(tmp_path):
    """A multi-process run started without trust: its workers refuse the module too."""
    from autoplace.capture import capture_workload
    from autoplace.executor.launch import run_plan
    from autoplace.plan import ParallelConfig, Plan

    wl = workloads.get(USER, batch_size=4)
    plan = Plan.single(capture_workload(wl), parallel=ParallelConfig(data=2))
    with pytest.raises(AutoplaceError, match="not in the model zoo"):
        run_plan(plan, {"spec": USER, "options": {"batch_size": 4}}, cluster="cpu-x2",
                 steps=3, reference=False, trusted=False, timeout_s=120)
    report = run_plan(plan, {"spec": USER, "options": {"batch_size": 4}}, cluster="cpu-x2",
                      steps=3, reference=False, timeout_s=120)
    assert report.ok and len(report.loss) == 3
