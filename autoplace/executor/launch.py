"""Start a multi-process plan under torchrun and read its report back.

``run_plan`` writes the plan, cluster, workload spec and options to one JSON file
and starts ``python -m torch.distributed.run --standalone --nproc-per-node N -m
autoplace.executor.worker --config FILE`` (one config file, so no option can be
mistaken for an abbreviation of torchrun's own). Rank 0 writes the report as JSON;
a rank that runs out of memory writes its own report and ends the run. NCCL is
used on GPUs (with ``NCCL_NVLS_ENABLE=0``), gloo on CPUs. A rank that dies raises
:class:`~autoplace.errors.AutoplaceError` naming it; the output file is written only
by a run that finished, so nothing is overwritten.

Over several nodes (``node``: a :class:`~autoplace.executor.nodes.NodeLaunch`), each
node's launcher starts its torchrun agent with ``--nnodes --node-rank --nproc-per-node
--rdzv-backend c10d --rdzv-endpoint --rdzv-id`` instead of ``--standalone``; the node
whose process is global rank 0 gets the report, the others return None.

Command line: ``python -m autoplace.executor.launch PLAN.json --workload gpt-tiny
[--cluster cpu-x2] [--steps 10] [--out report.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from autoplace import workloads
from autoplace.cluster import Cluster, resolve
from autoplace.errors import TIME_LIMIT_MESSAGE, AutoplaceError, PlanError
from autoplace.executor.checkpoint import require_resumable
from autoplace.executor.lifetime import LAUNCHER_ENV, child_preexec, folder_lock, stop_group
from autoplace.executor.nodes import NodeLaunch, torchrun_node_args
from autoplace.executor.report import RunReport
from autoplace.executor.runner import RunOptions, capture_graph, run_here
from autoplace.executor.tensor_parallel import process_count
from autoplace.lowering import validate
from autoplace.plan import Plan
from autoplace.workloads import Workload

__all__ = ["main", "run_plan", "workload_spec"]


def workload_spec(workload: Workload | str | dict[str, Any]) -> dict[str, Any]:
    """``{"spec": name, "options": {...}, "seed": s}`` that rebuilds ``workload`` elsewhere."""
    if isinstance(workload, str):
        return {"spec": workload, "options": {}}
    if isinstance(workload, dict):
        spec = dict(workload)
    else:
        spec = dict(workload.spec or {})
    if not spec.get("spec"):
        raise AutoplaceError(
            "a multi-process plan rebuilds the workload in every process, but this workload "
            "has no spec; build it with autoplace.workloads.get(name or 'module:factory')"
        )
    spec.setdefault("options", {})
    return spec


def _signal_name(code: int) -> str:
    import signal

    try:
        return signal.Signals(-code).name if code < 0 else f"exit code {code}"
    except ValueError:
        return f"signal {-code}"


def _failure_message(log: str, rc: int, nproc: int) -> str:
    ranks = re.findall(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n){0,3}?\s*exitcode\s*:\s*(-?\d+)", log)
    if ranks:
        parts = [f"rank {r} ({_signal_name(int(c))})" for r, c in ranks]
        first = f"training process {', '.join(parts)} of {nproc} died"
    else:
        first = f"torchrun exited with code {rc}"
    lines = log.strip().splitlines()
    causes = list(dict.fromkeys(
        line for line in lines
        if re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b.*:", line)
        and "ChildFailedError" not in line))
    cause = ("\n--- errors raised ---\n" + "\n".join(causes[:5])) if causes else ""
    tail = "\n".join(lines[-15:])
    return f"{first}; no report was written.{cause}\n--- last lines of the run's log ---\n{tail}"


def short_error(text: str) -> str:
    """One line for a failed run: the error's first line and the exceptions its ranks
    raised (:func:`_failure_message`'s "errors raised" section)."""
    lines = text.splitlines()
    raised = []
    if "--- errors raised ---" in lines:
        i = lines.index("--- errors raised ---")
        raised = [x for x in lines[i + 1:i + 4] if not x.startswith("---")]
    return " | ".join([lines[0][:160], *(x[:200] for x in raised)]) if lines else text


def run_plan(
    plan: Plan | str | Path,
    workload: Workload | str | dict[str, Any],
    *,
    cluster: Cluster | str | None = None,
    options: RunOptions | None = None,
    out: str | Path | None = None,
    timeout_s: float | None = None,
    trusted: bool = True,
    node: NodeLaunch | None = None,
    **option_fields: Any,
) -> RunReport | None:
    """Run ``plan`` for ``workload`` in one process or under torchrun; return rank 0's report.

    The devices the plan needs must be present (checked before any process starts). A
    run with a checkpoint folder holds its lock (:func:`~autoplace.executor.lifetime.folder_lock`)
    while it runs. torchrun and its workers end with this process, however it ends.

    Args:
        plan: a Plan or the path of a plan file.
        workload: a Workload with a spec, a zoo name, or a ``{"spec", "options", "seed"}`` dict.
        cluster: a Cluster, a preset name or a JSON path (default: detect).
        options: run options (or pass their fields as keywords: ``steps=20``).
        out: also write the report JSON there (only when the run finished).
        timeout_s: wall-clock limit of the run.
        trusted: whether the workload spec may import a module (``module:factory``): the
            caller named it, or allowed the plan file that did
            (:func:`autoplace.workloads.check_trusted`). Passed on to every worker.
        node: this machine's share of a run over several nodes (None: all on this one).
            Returns None on a node whose processes finished without global rank 0's
            report. Node 0 holds the checkpoint folder's lock.
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if cluster is None:
        cluster = Cluster.detect()
    elif not isinstance(cluster, Cluster):
        cluster = resolve(cluster)
    opts = options or RunOptions(**option_fields)
    spec = workload_spec(workload)
    nproc = process_count(plan)
    _check_layout(plan, cluster, nproc)
    if node is not None and node.nnodes * node.nproc_per_node != nproc:
        raise AutoplaceError(f"{node.nnodes} nodes x {node.nproc_per_node} processes is not "
                             f"the plan's {nproc} processes ({plan.split()})")
    with contextlib.ExitStack() as stack:
        if opts.checkpoint_dir:
            if node is None or node.node_rank == 0:
                stack.enter_context(folder_lock(opts.checkpoint_dir))
            require_resumable(opts.checkpoint_dir, opts.resume, opts.steps)
        if node is not None:
            report = _torchrun(plan, spec, cluster, opts, nproc, timeout_s, trusted, node)
        else:
            report = _run(plan, workload, spec, cluster, opts, nproc, timeout_s, trusted)
    if out is not None and report is not None:
        report.save(out)
    return report


def _check_layout(plan: Plan, cluster: Cluster, nproc: int) -> None:
    """What a run needs of the plan and the machine, checked before any process starts."""
    p = plan.parallel.pipeline
    used = sorted(set(plan.placement))
    if p > 1 and used != list(range(p)):
        raise PlanError(f"a {p}-stage pipeline must place ops on local devices 0..{p - 1}, "
                        f"one stage each; the plan uses devices {used}")
    cluster.require_present(max(plan.num_devices, nproc), what=f"the plan ({plan.split()})")


def _run(plan: Plan, workload: Any, spec: dict[str, Any], cluster: Cluster, opts: RunOptions,
         nproc: int, timeout_s: float | None, trusted: bool) -> RunReport:
    if nproc == 1:
        wl = workload if isinstance(workload, Workload) else workloads.get(
            spec["spec"], seed=spec.get("seed", 0), trusted=trusted, **spec["options"])
        validate(capture_graph(wl), plan, cluster)
        return run_here(wl, plan, cluster, opts)
    return _torchrun(plan, spec, cluster, opts, nproc, timeout_s, trusted)


def _torchrun(plan: Plan, spec: dict[str, Any], cluster: Cluster, opts: RunOptions,
              nproc: int, timeout_s: float | None, trusted: bool = True,
              node: NodeLaunch | None = None) -> RunReport | None:
    with tempfile.TemporaryDirectory(prefix="autoplace-run-") as tmp:
        cfg = Path(tmp) / "config.json"
        result = Path(tmp) / "report.json"
        cfg.write_text(json.dumps({
            "plan": plan.to_json(), "cluster": cluster.to_json(), "workload": spec,
            "trusted": bool(trusted), "options": asdict(opts), "out": str(result),
        }, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))
        env = dict(os.environ)
        env["NCCL_NVLS_ENABLE"] = "0"
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env[LAUNCHER_ENV] = str(os.getpid())
        where = (["--standalone", f"--nproc-per-node={nproc}"] if node is None
                 else torchrun_node_args(node))
        cmd = [sys.executable, "-m", "torch.distributed.run", *where,
               "-m", "autoplace.executor.worker", "--config", str(cfg)]
        log_path = Path(tmp) / "log.txt"
        rc = _run_logged(cmd, env, log_path, timeout_s, echo=opts.progress)
        text = log_path.read_text(errors="replace")
        if os.environ.get("AUTOPLACE_RUN_LOG"):  # keep the whole log for debugging
            Path(os.environ["AUTOPLACE_RUN_LOG"]).write_text(text)
        if rc == 0 and result.exists():
            return RunReport.from_json(json.loads(result.read_text()))
        for path in sorted(Path(tmp).glob("report.json.rank*")):  # a rank's failed report
            return RunReport.from_json(json.loads(path.read_text()))
        if rc is None:
            raise AutoplaceError(f"the run took longer than {timeout_s} s and {TIME_LIMIT_MESSAGE}")
        if node is None:
            raise AutoplaceError(_failure_message(text, rc, nproc))
        if rc == 0:  # global rank 0 ran on another node: the report is there
            return None
        raise AutoplaceError(
            f"the run over {node.nnodes} nodes failed on node {node.node_rank} (a node whose "
            "processes die, or whose agent is stopped, ends the run on every node): "
            + _failure_message(text, rc, nproc))


def _run_logged(cmd: list[str], env: dict[str, str], log_path: Path,
                timeout_s: float | None, echo: bool) -> int | None:
    """Run ``cmd`` (torchrun) in a process group of its own, tied to this process; its
    output goes to ``log_path`` and, with ``echo``, to stdout as it comes (each rank's
    progress lines). The group is stopped whenever this returns or raises (Ctrl-C, a
    signal turned into an exception). Returns the exit code, None on timeout."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=child_preexec)
        reader = threading.Thread(target=_copy_output, args=(proc.stdout, log, echo),
                                  daemon=True)
        reader.start()
        try:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
        finally:
            if proc.poll() is None:
                stop_group(proc.pid)
                proc.wait()
            reader.join(timeout=10)
    return rc


def _copy_output(stream: Any, log: Any, echo: bool) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
    stream.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m autoplace.executor.launch PLAN --workload NAME``: run and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan", help="plan JSON file")
    ap.add_argument("--workload", required=True, help="zoo name or module:factory")
    ap.add_argument("--options", default="{}", help="workload options as JSON")
    ap.add_argument("--cluster", default="detect", help="preset name, detect, or JSON path")
    ap.add_argument("--steps", type=int, default=10, help="training steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps not timed")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference run")
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoints there")
    ap.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    ap.add_argument("--out", default=None, help="write the report JSON there")
    a = ap.parse_args(argv)
    try:
        report = run_plan(
            a.plan, {"spec": a.workload, "options": json.loads(a.options)}, cluster=a.cluster,
            out=a.out, steps=a.steps, warmup=a.warmup, reference=not a.no_reference,
            checkpoint_dir=a.checkpoint_dir, resume=a.resume)
    except AutoplaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.dumps())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
