"""Processes kept alive between runs: many multi-process plans without a torchrun each.

Starting a torchrun job costs seconds a plan (process start, imports, CUDA and NCCL
set-up, building the model) before the first step. A :class:`PlanPool` keeps one
torchrun job per process layout alive (``python -m autoplace.executor.worker --serve
DIR``) and hands it plan after plan: the driver writes ``DIR/cmd-K.json``, rank 0 of
the job reads it and broadcasts it to the other ranks (gloo), every rank runs its part
with :func:`~autoplace.executor.runner.run_here` (on the initial weights loaded afresh
from ``RunOptions.weights_file``, or on a copy of a workload it built once), and rank 0
writes ``DIR/rep-K.json``.

A multi-process run that fails on any rank (out of memory, a killed rank, an
exception) ends the job: a peer may be waiting in a collective that will never
complete, so the failing rank writes its report (``rep-K.json.rank<R>``) and exits, and
torchrun stops the rest. A run past ``timeout_s`` has its job killed. Either way the
driver reads what there is and starts the replacement job at once, in the background.
A one-process job survives its own out-of-memory runs. A job that still holds memory on
a GPU after a run (more than ``worker.RETIRE_HELD_BYTES`` once collected and the cache
emptied: CUDA-graph pools of a failed capture, a model that keeps tensors) reports it as
``extra["job_retired"]`` and ends; the driver starts its replacement at once.

Every plan runs in a job, one-process plans too (in a one-process job); a job serves
one layout (number of processes and the first device of each), and the pool keeps one
job per layout it has seen. With ``spares=True`` it also keeps an idle spare job for
each multi-process layout, started with the first: a failed run's replacement is then
the spare, often already up (a start costs 10-20 s on a GPU host: torchrun, imports,
NCCL), and the next spare starts in the background.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from autoplace.cluster import Cluster
from autoplace.errors import TIME_LIMIT_MESSAGE, AutoplaceError
from autoplace.executor.launch import _failure_message, workload_spec
from autoplace.executor.lifetime import LAUNCHER_ENV, child_preexec
from autoplace.executor.report import RunReport
from autoplace.executor.runner import RunOptions
from autoplace.executor.tensor_parallel import process_count, rank_cluster_device
from autoplace.plan import Plan
from autoplace.workloads import Workload

__all__ = ["PlanPool", "rank_devices", "write_atomic"]

_POLL_S = 0.02


def rank_devices(plan: Plan, cluster: Cluster) -> tuple[str, ...]:
    """The first device of every process of ``plan`` (the device its process group uses)."""
    return tuple(cluster.devices[rank_cluster_device(plan, r)].name
                 for r in range(process_count(plan)))


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a reader polling for it never sees
    half a file)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, default=lambda o: sorted(o)
                                  if isinstance(o, (set, frozenset)) else str(o)))


class _Job:
    """One torchrun job serving one process layout."""

    def __init__(self, proc: subprocess.Popen, folder: Path, log_path: Path, log: Any) -> None:
        self.proc, self.dir, self.log_path, self.log = proc, folder, log_path, log
        self.count = 0  # commands sent

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Rank 0 has joined and preloaded (it writes ``ready``): it reads commands now."""
        return (self.dir / "ready").exists()


class PlanPool:
    """Run plans in torchrun jobs that stay alive between runs, one job per process layout.

    Every plan runs in a job, one-process plans too (a one-process job), so a run that
    hangs or crashes never takes the caller with it, and the caller holds no GPU memory.

    Example::

        with PlanPool(cluster) as pool:
            for plan in plans:
                report = pool.run(plan, spec, RunOptions(steps=23, warmup=3, reference=False))

    Args:
        cluster: the devices plans run on.
        timeout_s: wall-clock limit of one run (its job is stopped past it).
        start_timeout_s: how long a job still starting may take to be ready (joined and
            preloaded) before a run's ``timeout_s`` starts to count.
        log_dir: keep each job's log there (default: a temporary folder, removed on close).
        spares: keep an idle spare job per multi-process layout (its processes hold a
            CUDA context and NCCL buffers on each device of the layout, outside any run's
            memory cap), so the job that replaces a failed one is usually up already.
    """

    def __init__(self, cluster: Cluster, *, timeout_s: float = 300.0,
                 start_timeout_s: float = 120.0, log_dir: str | Path | None = None,
                 spares: bool = False) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="autoplace-pool-")
        self.dir = Path(self._tmp.name)
        self.log_dir = Path(log_dir) if log_dir else self.dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[tuple[str, ...], _Job] = {}
        self.spares = spares
        self._spares: dict[tuple[str, ...], _Job] = {}
        self._n = 0
        self._preload: dict[str, Any] | None = None
        self.starts = 0
        """Jobs started so far, spares included."""
        self.replaced = 0
        """Jobs that ended in a run (failed or stopped) and were replaced."""

    # ------------------------------------------------------------------ public
    def warm(self, plans: Plan | list[Plan], workload: Workload | str | dict[str, Any],
             weights_file: str | None = None, *, cluster: Cluster | None = None) -> None:
        """Stop every job and start fresh ones for ``plans``' process layouts, in the
        background.

        Their processes build ``workload`` (from ``weights_file`` when given) while the
        caller does other work, so the next :meth:`run` of those layouts finds them ready.
        After a failed run the pool starts the replacement job the same way at once.
        Fresh processes also start with no memory held from earlier runs.
        """
        self._preload = {"workload": workload_spec(workload), "weights_file": weights_file}
        self._stop_all()
        self.ensure(plans, cluster=cluster)

    def ensure(self, plans: Plan | list[Plan], *, cluster: Cluster | None = None) -> None:
        """Start, in the background, a job for each layout of ``plans`` that has none,
        preloading what the last :meth:`warm` named; running jobs are kept."""
        for plan in [plans] if isinstance(plans, Plan) else plans:
            layout = rank_devices(plan, cluster or self.cluster)
            job = self._jobs.get(layout)
            if job is not None and not job.alive():
                self._close(layout)
                job = None
            if job is None:
                self._start(layout)

    def run(self, plan: Plan, workload: Workload | str | dict[str, Any],
            options: RunOptions | None = None, *, cluster: Cluster | None = None,
            timeout_s: float | None = None) -> RunReport:
        """Run ``plan`` and return rank 0's report (an out-of-memory run is a report with
        ``oom=True``, not an exception).

        ``cluster``: the devices of this run (default: the pool's), e.g. the pool's with a
        memory cap (:func:`autoplace.cluster.resolve`); its devices must be the pool's.
        ``timeout_s``: this run's wall-clock limit instead of the pool's, from when its job
        is ready (a job still starting has ``start_timeout_s`` more).

        Raises:
            AutoplaceError: a rank died without a report, or the run passed ``timeout_s``.
        """
        opts = options or RunOptions()
        cluster = cluster or self.cluster
        spec = workload_spec(workload)
        layout = rank_devices(plan, cluster)
        job = self._jobs.get(layout)
        if job is None or not job.alive():
            if job is not None:
                self._close(layout)
            job = self._start(layout)
        job.count += 1
        k = job.count
        cmd = {"op": "run", "plan": plan.to_json(), "cluster": cluster.to_json(),
               "workload": spec, "options": asdict(opts)}
        _write_json(job.dir / f"cmd-{k}.json", cmd)
        limit = self.timeout_s if timeout_s is None else timeout_s
        report = self._wait(layout, job, k, limit)
        if report.extra.get("job_retired") and self._jobs.get(layout) is job:
            # the job ends by itself after this report (it holds memory it cannot give
            # back); its replacement starts now, in the background
            try:
                job.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass  # _replace kills it
            self._replace(layout)
        return report

    def ready(self, plan: Plan, cluster: Cluster | None = None) -> bool:
        """Whether the job that would run ``plan`` is up and idle-ready (started, joined,
        its workload preloaded), so a run of it now waits for no start."""
        job = self._jobs.get(rank_devices(plan, cluster or self.cluster))
        return job is not None and job.alive() and job.ready()

    def close(self) -> None:
        """Stop every job and remove the pool's files."""
        self._stop_all()
        self._tmp.cleanup()

    def __enter__(self) -> PlanPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- the jobs
    def _start(self, layout: tuple[str, ...]) -> _Job:
        """Make a job serve ``layout``: its spare if it has a live one, else a new job;
        then (``spares``) start the layout's next spare."""
        job = self._spares.pop(layout, None)
        if job is not None and not job.alive():
            self._end(job)
            job = None
        if job is None:
            job = self._launch(layout)
        self._jobs[layout] = job
        if self.spares and len(layout) > 1 and layout not in self._spares:
            self._spares[layout] = self._launch(layout)
        return job

    def _launch(self, layout: tuple[str, ...]) -> _Job:
        self._n += 1
        folder = self.dir / f"job{self._n}"
        folder.mkdir()
        cfg = folder / "serve.json"
        _write_json(cfg, {"devices": list(layout), "parent_pid": os.getpid(),
                          "preload": self._preload, "launched_at": time.time()})
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   PYTHONUNBUFFERED="1", **{LAUNCHER_ENV: str(os.getpid())})
        env.setdefault("OMP_NUM_THREADS", "1")
        log_path = self.log_dir / f"pool-job{self._n}.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed in _close
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(layout)}", "-m", "autoplace.executor.worker",
               "--serve", str(cfg)]
        # a group of its own, killed with this process (lifetime.child_preexec)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=child_preexec)
        self.starts += 1
        return _Job(proc, folder, log_path, log)

    def _replace(self, layout: tuple[str, ...]) -> None:
        """End ``layout``'s job (killed if still alive) and start its replacement."""
        self._close(layout, polite=False)
        self._start(layout)
        self.replaced += 1

    def _close(self, layout: tuple[str, ...], *, polite: bool = True) -> None:
        self._end(self._jobs.pop(layout), polite=polite)

    def _end(self, job: _Job, *, polite: bool = True) -> None:
        if job.alive():
            # a job still starting reads no command until it is up: kill it, don't wait
            if polite and job.ready():
                _write_json(job.dir / f"cmd-{job.count + 1}.json", {"op": "stop"})
                try:
                    job.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._kill(job.proc)
            else:
                self._kill(job.proc)
        job.log.close()

    def _stop_all(self) -> None:
        for layout in list(self._jobs):
            self._close(layout)
        while self._spares:
            self._end(self._spares.popitem()[1])

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def _wait(self, layout: tuple[str, ...], job: _Job, k: int, limit_s: float) -> RunReport:
        """Rank 0's report of run ``k``; the run is stopped ``limit_s`` after the job is
        ready (a job still starting has ``start_timeout_s`` more to get there)."""
        rep = job.dir / f"rep-{k}.json"
        t0 = time.monotonic()
        t_ready = t0 if job.ready() else None
        timed_out = False
        while True:
            if rep.exists():
                return RunReport.from_json(json.loads(rep.read_text()))
            if not job.alive():
                break
            now = time.monotonic()
            if t_ready is None and job.ready():
                t_ready = now
            if now - (t0 + self.start_timeout_s if t_ready is None else t_ready) > limit_s:
                timed_out = True
                break
            time.sleep(_POLL_S)
        # the job ended (or is stopped now) without rank 0's report; its replacement
        # starts at once, so the next run of this layout need not wait for a start
        rc = job.proc.poll()
        self._replace(layout)
        for path in sorted(job.dir.glob(f"rep-{k}.json.rank*")):  # a failing rank's
            return RunReport.from_json(json.loads(path.read_text()))
        text = job.log_path.read_text(errors="replace")
        if timed_out:
            raise AutoplaceError(f"the run took longer than {limit_s:.0f} s and {TIME_LIMIT_MESSAGE}; "
                                 f"last lines of its log:\n" + "\n".join(text.splitlines()[-15:]))
        raise AutoplaceError(_failure_message(text, rc if rc is not None else -9, len(layout)))
