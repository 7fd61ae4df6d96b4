"""A persistent measuring worker: a subprocess that executes plans and reports step times.

The env's ``real`` backend talks to it over a JSON-lines pipe (one request on the
worker's stdin, one reply on its stdout; everything the worker or the executor
prints goes to stderr). The worker builds each workload once and keeps it between
requests, so an episode costs only the measured steps. It survives what a plan can
do to it: an out-of-memory error is caught and reported (caches are emptied, so
device memory returns to where it was); a crash or a hang is survived by the
client (:class:`MeasuringWorker`), which kills the process group and starts a
fresh worker.

Requests (JSON objects):

* ``{"cmd": "ping"}`` -> ``{"ok": true, "pid": ...}``
* ``{"cmd": "measure", "workload": {"spec", "options", "seed"}, "cluster": {...},
  "plan": {...}, "steps": 5, "warmup": 2, "inject": null | "oom" | "hang" | "crash"}``
  -> ``{"ok": true, "report": {...RunReport JSON...}, "allocated_bytes": [...],
  "reserved_bytes": [...]}`` or ``{"ok": false, "oom": bool, "error": "...", ...}``; the
  byte counts are per GPU after the run, once the caches are emptied.
  ``inject`` is a test hook: raise ``torch.OutOfMemoryError``, sleep forever, or exit.
* ``{"cmd": "exit"}``

Run as ``python -m autoplace.envs.real_worker``.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any

from autoplace.executor.lifetime import child_preexec

__all__ = ["MeasuringWorker", "WorkerDied", "WorkerTimeout", "main"]


class WorkerDied(RuntimeError):
    """The worker process exited (crashed or was killed) before replying."""


class WorkerTimeout(RuntimeError):
    """The worker did not reply within the timeout; it has been killed."""


# ----------------------------------------------------------------- client side
class MeasuringWorker:
    """Client of one worker subprocess; starts it lazily and restarts it after a death.

    Args:
        startup_timeout_s: seconds the worker may take to import torch and answer a ping.
        env: extra environment variables for the worker.
    """

    def __init__(self, *, startup_timeout_s: float = 120.0, env: dict[str, str] | None = None):
        self.startup_timeout_s = startup_timeout_s
        self._env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._replies: queue.Queue[bytes | None] = queue.Queue()
        self.restarts = 0  #: workers started after the first (after a crash, kill or hang)
        self._started = False
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the running worker (None before the first request)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> None:
        """Start the worker (if it is not running) and wait until it answers."""
        if self.pid is not None:
            return
        if self._started:
            self.restarts += 1
        self._started = True
        env = {**os.environ, **self._env, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "autoplace.envs.real_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            # its own process group (a kill takes its children too), killed by the kernel
            # when this process dies, kill -9 included
            preexec_fn=child_preexec,
        )
        self._replies = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, self._replies),
                         daemon=True).start()
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        self._send({"cmd": "ping"})
        self._receive(self.startup_timeout_s)

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``message`` and return the reply.

        Raises:
            WorkerDied: the worker exited before replying (it restarts on the next call).
            WorkerTimeout: no reply in ``timeout_s``; the worker was killed.
        """
        if self.pid is None:
            self.start()
        try:
            self._send(message)
        except (BrokenPipeError, OSError):
            self._reap()
            raise WorkerDied("the measuring worker died before the request") from None
        return self._receive(timeout_s)

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        self._proc.stdin.flush()

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self._reap()
            raise WorkerTimeout(f"the measuring worker did not answer in {timeout_s:.0f} s; "
                                "killed it") from None
        if line is None:
            code = self._reap()
            raise WorkerDied(f"the measuring worker died (exit code {code})")
        return json.loads(line)

    def _reap(self) -> int | None:
        """Kill the worker's process group and collect its exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if self._finalizer is not None:
            self._finalizer.detach()
        return _kill(proc)

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                self._send({"cmd": "exit"})
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._reap()


def _pump(stream: Any, out: queue.Queue[bytes | None]) -> None:
    """Forward reply lines from the worker's stdout; None marks its end."""
    for line in iter(stream.readline, b""):
        out.put(line)
    out.put(None)


def _kill(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
    return code


# ----------------------------------------------------------------- worker side
def main() -> None:
    """The worker's loop: read requests on stdin, answer on the original stdout."""
    reply = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt replies
    workloads: dict[str, Any] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        cmd = request.get("cmd")
        if cmd == "exit":
            break
        if cmd == "ping":
            answer: dict[str, Any] = {"ok": True, "pid": os.getpid()}
        elif cmd == "measure":
            answer = _measure(request, workloads)
        else:
            answer = {"ok": False, "oom": False, "error": f"unknown command {cmd!r}"}
        reply.write(json.dumps(answer) + "\n")


def _measure(request: dict[str, Any], workloads: dict[str, Any]) -> dict[str, Any]:
    import torch

    from autoplace.cluster import Cluster
    from autoplace.errors import OutOfMemoryError
    from autoplace.executor import execute
    from autoplace.plan import Plan
    from autoplace.workloads import get

    spec = request["workload"]
    key = json.dumps(spec, sort_keys=True)
    answer: dict[str, Any]
    try:
        if key not in workloads:
            workloads[key] = get(spec["spec"], seed=spec.get("seed", 0), **spec.get("options", {}))
        inject = request.get("inject")
        if inject == "oom":
            raise torch.OutOfMemoryError("injected out-of-memory error (test hook)")
        if inject == "hang":
            time.sleep(10**6)
        if inject == "crash":
            os._exit(3)
        report = execute(
            workloads[key], Plan.from_json(request["plan"]),
            cluster=Cluster.from_json(request["cluster"]),
            steps=int(request.get("steps", 5)), warmup=int(request.get("warmup", 2)),
            reference=False, timeout_s=request.get("timeout_s"),
        )
        answer = {"ok": True, "report": report.to_json()}
    except (torch.OutOfMemoryError, OutOfMemoryError) as e:
        answer = {"ok": False, "oom": True, "error": f"out of memory: {_first_line(e)}"}
    except Exception as e:  # a plan the executor cannot run must not end the worker
        traceback.print_exc(file=sys.stderr)
        answer = {"ok": False, "oom": False, "error": f"{type(e).__name__}: {_first_line(e)}"}
    gc.collect()
    answer["allocated_bytes"], answer["reserved_bytes"] = _release_memory()
    return answer


def _release_memory() -> tuple[list[int], list[int]]:
    """Empty the CUDA caches; return the bytes still allocated and reserved per GPU."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return [], []
    allocated, reserved = [], []
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        allocated.append(int(torch.cuda.memory_allocated(i)))
        reserved.append(int(torch.cuda.memory_reserved(i)))
    return allocated, reserved


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    main()
