"""Processes kept alive between runs: many multi-process plans without a torchrun each.

Starting a torchrun job costs seconds a plan (process start, imports, CUDA and NCCL
set-up, building the model) before the first step. A :class:`PlanPool` keeps one
torchrun job per process layout alive (``python -m autoplace.executor.worker --serve
DIR``) and hands it plan after plan: the driver writes ``DIR/cmd-K.json``, rank 0 of
the job reads it and broadcasts it to the other ranks (gloo), every rank runs its part
with :func:`~autoplace.executor.runner.run_here` on a copy of the workload it keeps
between runs, and rank 0 writes ``DIR/rep-K.json``.

A run that fails on any rank (out of memory, a killed rank, an exception) ends the
job: a peer may be waiting in a collective that will never complete, so the failing
rank writes its report (``rep-K.json.rank<R>``) and exits, and torchrun stops the rest.
The driver reads that report and starts a fresh job for the next plan. So a failure
costs one job start, as a torchrun per plan always did, and nothing else changes.

One-process plans run in the calling process, on a copy of a workload the pool builds
once.
A job serves one layout (number of processes and the device of each rank); a plan with
another layout replaces it.
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
from autoplace.errors import AutoplaceError
from autoplace.executor.launch import _failure_message, workload_spec
from autoplace.executor.report import RunReport
from autoplace.executor.runner import RunOptions
from autoplace.plan import Plan
from autoplace.workloads import Workload

__all__ = ["PlanPool", "rank_devices"]

_POLL_S = 0.02


def rank_devices(plan: Plan, cluster: Cluster) -> tuple[str, ...]:
    """The first device of every process of ``plan`` (the device its process group uses)."""
    par = plan.parallel
    nproc = par.data * par.pipeline
    k = plan.devices_per_replica
    return tuple(cluster.devices[r if par.pipeline > 1 else r * k].name for r in range(nproc))


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                              else str(o)))
    os.replace(tmp, path)


class PlanPool:
    """Run plans in torchrun jobs that stay alive between runs.

    Example::

        with PlanPool(cluster) as pool:
            for plan in plans:
                report = pool.run(plan, spec, RunOptions(steps=23, warmup=3, reference=False))

    Args:
        cluster: the devices plans run on.
        timeout_s: wall-clock limit of one run (the job is stopped past it).
        start_timeout_s: limit for a fresh job to join up, on top of ``timeout_s``.
        log_dir: keep each job's log there (default: a temporary folder, removed on close).
    """

    def __init__(self, cluster: Cluster, *, timeout_s: float = 300.0,
                 start_timeout_s: float = 120.0, log_dir: str | Path | None = None) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="autoplace-pool-")
        self.dir = Path(self._tmp.name)
        self.log_dir = Path(log_dir) if log_dir else self.dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None
        self._layout: tuple[str, ...] | None = None
        self._job = 0
        self._count = 0
        self._fresh = False
        self._local: dict[str, Workload] = {}
        self._preload: dict[str, Any] | None = None
        self.starts = 0
        """Jobs started so far (a failed run costs one)."""

    # ------------------------------------------------------------------ public
    def warm(self, plan: Plan, workload: Workload | str | dict[str, Any],
             weights_file: str | None = None, *, cluster: Cluster | None = None) -> None:
        """Start a fresh job for ``plan``'s process layout now, in the background.

        Its processes build ``workload`` (from ``weights_file`` when given) while the
        caller does other work, so the next :meth:`run` of that layout finds them ready.
        After a failed run the pool starts the replacement job the same way at once.
        Fresh processes also start with no memory held from earlier runs.
        """
        self._preload = {"workload": workload_spec(workload), "weights_file": weights_file}
        self._start(rank_devices(plan, cluster or self.cluster))

    def run(self, plan: Plan, workload: Workload | str | dict[str, Any],
            options: RunOptions | None = None, *, cluster: Cluster | None = None) -> RunReport:
        """Run ``plan`` and return rank 0's report (an out-of-memory run is a report with
        ``oom=True``, not an exception).

        ``cluster``: the devices of this run (default: the pool's), e.g. the pool's with a
        memory cap (:func:`autoplace.cluster.resolve`); its devices must be the pool's.

        Raises:
            AutoplaceError: a rank died without a report, or the run passed ``timeout_s``.
        """
        opts = options or RunOptions()
        cluster = cluster or self.cluster
        spec = workload_spec(workload)
        par = plan.parallel
        if par.data * par.pipeline == 1:
            return self._run_here(plan, workload, spec, opts, cluster)
        layout = rank_devices(plan, cluster)
        if self._proc is None or self._proc.poll() is not None or layout != self._layout:
            self._start(layout)
        self._count += 1
        k = self._count
        cmd = {"op": "run", "plan": plan.to_json(), "cluster": cluster.to_json(),
               "workload": spec, "options": asdict(opts)}
        _write_json(self._job_dir / f"cmd-{k}.json", cmd)
        limit = self.timeout_s + (self.start_timeout_s if self._fresh else 0.0)
        self._fresh = False
        report = self._wait(k, limit)
        return report

    def _run_here(self, plan: Plan, workload: Workload | str | dict[str, Any],
                  spec: dict[str, Any], opts: RunOptions, cluster: Cluster) -> RunReport:
        """A one-process plan, in this process, on a copy of a workload built once."""
        from autoplace import workloads
        from autoplace.executor.runner import capture_graph, run_here

        if isinstance(workload, Workload):
            wl = workload
        else:
            key = json.dumps(spec, sort_keys=True)
            if key not in self._local:
                self._local.clear()
                self._local[key] = workloads.get(spec["spec"], seed=spec.get("seed", 0),
                                                 **spec["options"])
            wl = self._local[key]
        plan.validate(capture_graph(wl), cluster)
        return run_here(wl, plan, cluster, opts)

    def close(self) -> None:
        """Stop the job (if any) and remove the pool's files."""
        self._stop()
        self._tmp.cleanup()

    def __enter__(self) -> PlanPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- the job
    def _start(self, layout: tuple[str, ...]) -> None:
        self._stop()
        self._job += 1
        self._count = 0
        self._job_dir = self.dir / f"job{self._job}"
        self._job_dir.mkdir()
        cfg = self._job_dir / "serve.json"
        _write_json(cfg, {"devices": list(layout), "parent_pid": os.getpid(),
                          "preload": self._preload})
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        self._log_path = self.log_dir / f"pool-job{self._job}.log"
        self._log = open(self._log_path, "w")  # noqa: SIM115 - closed in _stop
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(layout)}", "-m", "autoplace.executor.worker",
               "--serve", str(cfg)]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        self._layout = layout
        self._fresh = True
        self.starts += 1

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                _write_json(self._job_dir / f"cmd-{self._count + 1}.json", {"op": "stop"})
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._kill(proc)
            self._log.close()
        self._layout = None

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def _wait(self, k: int, limit_s: float) -> RunReport:
        rep = self._job_dir / f"rep-{k}.json"
        t0 = time.monotonic()
        while True:
            if rep.exists():
                return RunReport.from_json(json.loads(rep.read_text()))
            assert self._proc is not None
            rc = self._proc.poll()
            if rc is not None:
                break
            if time.monotonic() - t0 > limit_s:
                self._kill(self._proc)
                rc = None
                break
            time.sleep(_POLL_S)
        # the job ended (or was stopped) without rank 0's report
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            self._kill(proc)
        self._log.close()
        layout, job_dir, log_path = self._layout, self._job_dir, self._log_path
        nproc = len(layout or ())
        self._layout = None
        if layout is not None:  # the next run of this layout need not wait for a start
            self._start(layout)
        for path in sorted(job_dir.glob(f"rep-{k}.json.rank*")):  # a failing rank's
            return RunReport.from_json(json.loads(path.read_text()))
        text = log_path.read_text(errors="replace")
        if rc is None:
            raise AutoplaceError(f"the run took longer than {limit_s:.0f} s and was stopped; "
                                 f"last lines of its log:\n" + "\n".join(text.splitlines()[-15:]))
        raise AutoplaceError(_failure_message(text, rc, nproc))
