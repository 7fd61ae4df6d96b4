"""The command line's small promises: help that tells the truth, resuming said aloud,
the trace summary as a subcommand, and the package's two entry points."""

from __future__ import annotations

import json
import re

import pytest

from autoplace.cli import COMMANDS, build_parser
from autoplace.policies.reinforce import parse_budget
from tests.helpers.cli_process import run_script
from tests.reliability._run import cli, cli_env


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sub.format_help()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_each_default_once_and_never_none(command):
    text = " ".join(_help(command).split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default[^)]*\) \(default", text), text


def test_every_budget_the_help_offers_parses():
    text = " ".join(_help("train").split())
    for example in re.findall(r"\((\d+[a-z]+)\)", text):
        parse_budget(example)
    assert parse_budget("100up") == ("updates", 100.0)


def _trace(path, steps=2):
    events = []
    for s in range(steps):
        t = s * 1000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"autoplace step {s}",
                       "ts": t, "dur": 900.0, "pid": 0, "tid": 0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 10,
                       "dur": 500.0, "pid": 0, "tid": 0})
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_summary_subcommand(tmp_path):
    trace = _trace(tmp_path / "trace-rank0.json")
    out = tmp_path / "summary.json"
    p = cli("trace-summary", str(trace), "--top", "3", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "aten::mm" in p.stdout
    assert json.loads(out.read_text())[0]["steps"] == 2
    assert cli("trace-summary", str(tmp_path / "none.json")).returncode != 0


def test_both_entry_points(tmp_path):
    script = tmp_path / "entry.py"  # a user's script calling the library's entry point
    script.write_text("import sys\n\nfrom autoplace.cli import main\n\n"
                      "sys.exit(main(['models', '--json']))\n")
    p = run_script(script, env=cli_env(), timeout=120)  # the environment cli() gives commands
    assert p.returncode == 0 and "gpt-tiny" in p.stdout
    p = cli("--help")
    assert p.returncode == 0 and "trace-summary" in p.stdout
