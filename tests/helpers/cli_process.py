"""``python -m autoplace.cli ARGS`` and ``python SCRIPT ARGS`` as real processes, forked from
one that has imported the command line (and torch) already.

Each command a test runs is its own process, started in the folder and with the environment
the test gives, its output captured and its exit status returned as ``subprocess.run``
returns them; only imports are done once, in a parent kept for the whole test run, instead
of once a command: seconds a command on the 2-core CI machine. The parent imports what every
command starts with (torch, autoplace's command line) and what the command line loads only
when a command uses it but so many of the tests' commands use that each would pay its
seconds: the placement policies (torch_geometric and torch's compiler among their imports)
and the pictures (matplotlib, on its Agg backend as ``autoplace.viz`` sets it). A forked
process runs ``autoplace.cli`` as ``python -m`` does (``runpy``, the working folder first on
``sys.path``) and a script as ``python SCRIPT`` does (its folder first on ``sys.path``): an
exception it raises prints its traceback and exits 1, ``sys.exit`` exits with its code, and
exit handlers run.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PARENT = r"""
import json, os, runpy, sys
import autoplace.cli  # what every command imports first
import autoplace.policies  # what train, the policy planners and their checks import (seconds)
import autoplace.viz  # what every picture a command draws imports (matplotlib, Agg)

for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the command: no try here, it ends as `python -m` ends
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY)
            os.dup2(f, fd)
            os.close(f)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(os.devnull)
        if req["script"]:
            sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
            sys.argv = [req["script"], *req["args"]]
            runpy.run_path(req["script"], run_name="__main__")
        else:
            sys.path[0] = os.getcwd()
            sys.argv = ["autoplace.cli", *req["args"]]
            runpy.run_module("autoplace.cli", run_name="__main__", alter_sys=True)
        sys.exit(0)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

#: env vars read when torch and the command line are imported: a parent per their values
_IMPORT_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_parents: dict[tuple, subprocess.Popen] = {}
_pending: dict[int, bytes] = {}  # a parent's output read past its last whole line


def _parent(env: dict[str, str]) -> subprocess.Popen:
    key = tuple(env.get(k) for k in _IMPORT_ENV)
    proc = _parents.get(key)
    if proc is None or proc.poll() is not None:
        proc = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        _parents[key] = proc
        _pending[proc.pid] = b""
    return proc


def _readline(proc: subprocess.Popen, deadline: float | None) -> str | None:
    """The parent's next line, or None past ``deadline``."""
    fd = proc.stdout.fileno()
    while b"\n" not in _pending[proc.pid]:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0 or not select.select([fd], [], [], wait)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            raise RuntimeError("the forking parent of `autoplace.cli` ended")
        _pending[proc.pid] += chunk
    line, _pending[proc.pid] = _pending[proc.pid].split(b"\n", 1)
    return line.decode()


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | str | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python -m autoplace.cli ARGS`` with ``env`` (default: this process's) in ``cwd``:
    exit code, stdout and stderr (text), as ``subprocess.run(..., capture_output=True,
    text=True)``; killed and ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    return _run(None, args, env, cwd, timeout)


def run_script(script: Path | str, *args: str, env: dict[str, str] | None = None,
               cwd: Path | str | None = None, timeout: float | None = None
               ) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS``, as :func:`run_cli` runs the command line."""
    return _run(str(script), args, env, cwd, timeout)


def _run(script: str | None, args: tuple[str, ...], env: dict[str, str] | None,
         cwd: Path | str | None, timeout: float | None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *([script] if script else ["-m", "autoplace.cli"]), *args]
    env = dict(os.environ) if env is None else env
    proc = _parent(env)
    with tempfile.TemporaryDirectory(prefix="autoplace-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        try:
            proc.stdin.write(json.dumps({
                "script": script, "args": list(args), "env": env,
                "cwd": str(cwd or os.getcwd()), "out": str(out), "err": str(err)}).encode()
                + b"\n")
            proc.stdin.flush()
            deadline = None if timeout is None else time.monotonic() + timeout
            pid = int(_readline(proc, None))
            line = _readline(proc, deadline)
            if line is None:
                os.kill(pid, signal.SIGKILL)
                _readline(proc, None)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
        except subprocess.TimeoutExpired:
            raise
        except BaseException:  # interrupted between a request and its answer: start afresh
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(cmd, int(line), out.read_text(), err.read_text())


@atexit.register
def _close() -> None:
    for proc in _parents.values():
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
