"""What the reliability tests share: the command line as a subprocess, and its checks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import pythonpath_with_root
from tests.helpers.cli_process import run_cli

ROOT = Path(__file__).resolve().parents[2]


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment :func:`cli` gives a command: this one with the repository on the
    path (tests.* importable), and ``env`` over it."""
    return dict(os.environ, PYTHONPATH=pythonpath_with_root(), **(env or {}))


def cli(*args: str, cwd: Path | None = None, timeout: float = 300,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m autoplace.cli ARGS`` with the repository on the path (tests.* importable),
    a process of its own (:func:`tests.helpers.cli_process.run_cli`)."""
    return run_cli(*args, env=cli_env(env), cwd=cwd, timeout=timeout)


def clean_error(p: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """Assert a one-line error without a traceback, exit ``code``, naming every needle."""
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr
    assert "internal error" not in p.stderr, p.stderr
    lines = [x for x in p.stderr.strip().splitlines() if x.startswith("autoplace:")]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
