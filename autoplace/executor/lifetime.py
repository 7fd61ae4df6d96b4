"""A run's processes live no longer than the run, and one folder serves one run at a time.

:func:`child_preexec` runs in a launched ``torchrun`` before it starts: the child gets
a process group of its own (so the launcher can stop it and what it started) and
``PR_SET_PDEATHSIG``: the kernel kills it when the launcher dies, ``kill -9``
included. torchrun starts each worker detached from its own group, so workers call
:func:`die_with_parent` (killed when torchrun dies) and :func:`watch_launcher` (they
end when the launcher's process is gone, whatever happened to torchrun).

:func:`folder_lock` marks a checkpoint folder as in use by this process: a second run
on it is refused with a message naming the process, until that process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from autoplace.errors import AutoplaceError

__all__ = ["LAUNCHER_ENV", "LOCK_NAME", "child_preexec", "die_with_parent", "folder_lock",
           "pid_alive", "stop_group", "watch_launcher"]

#: environment variable holding the pid of the process that launched a run
LAUNCHER_ENV = "AUTOPLACE_LAUNCHER_PID"
#: the lock file a run keeps in its checkpoint folder
LOCK_NAME = ".autoplace-run.lock"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).
    Whether it could; async-signal-safe enough for a ``preexec_fn``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_preexec() -> None:
    """``preexec_fn`` of a launched torchrun: its own process group, killed with the
    launcher."""
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def watch_launcher(interval_s: float = 1.0) -> None:
    """In a worker: end this process (exit code 1) once the launcher named by
    :data:`LAUNCHER_ENV` is gone. A daemon thread; does nothing without the variable."""
    try:
        pid = int(os.environ.get(LAUNCHER_ENV, "0"))
    except ValueError:
        return
    if pid <= 0:
        return

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(interval_s)
        print(f"autoplace: the launching process {pid} is gone; stopping this worker",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="autoplace-launcher-watch", daemon=True).start()


def stop_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM process group ``pgid`` (torchrun stops its workers on it), then SIGKILL
    what is left after ``grace_s``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str = "checkpoint folder") -> Iterator[Path]:
    """Hold ``folder``'s lock file while the block runs (the folder is made if missing).

    Raises:
        AutoplaceError: another live process holds it (the message names the process).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    record = json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                         "argv": sys.argv[:8]})
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:  # maybe being written this instant: look again
                time.sleep(0.2)
                holder = _holder(path)
            if holder is not None and holder.get("pid") != os.getpid() \
                    and pid_alive(int(holder.get("pid", 0))):
                raise AutoplaceError(
                    f"{what} {folder} is in use by another run (process {holder['pid']}, "
                    f"started {holder.get('started', '?')}); wait for it to end or stop it "
                    f"(kill {holder['pid']}), then run again") from None
            with contextlib.suppress(FileNotFoundError):  # a dead run's lock
                path.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(record)
        break
    else:
        raise AutoplaceError(f"cannot take the lock {path}")
    try:
        yield path
    finally:
        holder = _holder(path)
        if holder is not None and holder.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _holder(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        return None
    return data
