"""A run's processes die with it, and a multi-process run shows its progress as it goes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoplace.executor.lifetime import pid_alive
from tests.reliability._run import ROOT, cli

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="parent-death signals are Linux's")


def _children() -> dict[int, int]:
    """pid -> parent pid of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                out[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants(pid: int) -> set[int]:
    parents = _children()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


@pytest.fixture(scope="module")
def ddp_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("procs") / "ddp.json"
    p = cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "ddp",
            "-o", str(path))
    assert p.returncode == 0, p.stderr
    return path


def test_kill_9_of_run_leaves_no_process(ddp_plan, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.Popen(
        [sys.executable, "-m", "autoplace.cli", "run", str(ddp_plan), "--cluster", "cpu-x2",
         "--steps", "100000", "--no-reference", "--checkpoint-dir", str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 180
        for line in run.stdout:  # rank 0's lines arrive while it trains, not at the end
            seen.append(line)
            if line.startswith("step 3:") or time.monotonic() > deadline:
                break
        assert any(x.startswith("step 3:") for x in seen), "".join(seen[-30:])
        workers = _descendants(run.pid)
        assert len(workers) >= 3, "torchrun and two workers"
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(pid_alive(p) for p in workers):
            time.sleep(0.2)
        alive = [p for p in workers if pid_alive(p)]
        assert not alive, f"processes outlived the run: {alive}"
    finally:
        if run.poll() is None:
            run.kill()
        for p in _descendants(run.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigterm_of_run_stops_its_processes(ddp_plan):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.Popen(
        [sys.executable, "-m", "autoplace.cli", "run", str(ddp_plan), "--cluster", "cpu-x2",
         "--steps", "100000", "--no-reference"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        for line in run.stdout:
            if line.startswith("step 1:"):
                break
        workers = _descendants(run.pid)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(pid_alive(p) for p in workers):
            time.sleep(0.2)
        assert not [p for p in workers if pid_alive(p)]
    finally:
        if run.poll() is None:
            run.kill()


def test_kill_9_of_the_env_leaves_no_measuring_worker(tmp_path):
    """The real backend's measuring worker dies with the process that started it, even
    while its request pipe stays open (a forked child of the owner holds it here, as a
    measurement in flight would keep the worker from reading it)."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import os, sys, time\n"
        "from autoplace.envs.real_worker import MeasuringWorker\n"
        "w = MeasuringWorker()\n"
        "w.start()\n"
        "holder = os.fork()\n"
        "if holder == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(w.pid, holder, flush=True)\n"
        "time.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        worker, holder = map(int, owner.stdout.readline().split())
        assert pid_alive(worker)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pid_alive(worker):
            time.sleep(0.2)
        assert not pid_alive(worker), "the measuring worker outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in (worker, holder) if "holder" in locals() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
