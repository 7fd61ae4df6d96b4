"""Apply a Plan to a real model and train it: local placement, pipeline, data parallel.

:func:`execute` runs a plan and returns a :class:`RunReport`. Plans of one process
(``data == 1`` and ``pipeline == 1``, any DAG placement over the replica's devices)
run in this process; others run under ``torchrun``, started by
:func:`autoplace.executor.launch.run_plan`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from autoplace.cluster import Cluster
from autoplace.errors import PlanError
from autoplace.executor.checkpoint import require_resumable
from autoplace.executor.launch import run_plan
from autoplace.executor.lifetime import folder_lock
from autoplace.executor.report import RunReport
from autoplace.executor.runner import RunOptions, capture_graph, run_here
from autoplace.executor.tensor_parallel import process_count
from autoplace.lowering import validate
from autoplace.plan import Plan
from autoplace.workloads import Workload

__all__ = ["RunReport", "execute", "run_plan"]


def execute(
    workload: Workload,
    plan: Plan,
    *,
    cluster: Cluster | None = None,
    steps: int = 10,
    warmup: int = 2,
    reference: bool = True,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    seed: int = 0,
    progress: bool = False,
    checkpoint_every: int = 1,
    timeout_s: float | None = None,
) -> RunReport:
    """Train ``workload`` for ``steps`` steps under ``plan`` and measure it.

    Args:
        workload: the model, batch maker and loss. Multi-process plans rebuild it in
            every process from ``workload.spec`` (a zoo name or ``module:factory``).
        plan: the plan; validated against the workload's graph and ``cluster`` first.
        cluster: the devices (default: :meth:`Cluster.detect`); memory caps of its
            devices are enforced on GPUs.
        steps: training steps, warm-up included.
        warmup: steps left out of the timing.
        reference: also train the unpartitioned model on one device on the same batches.
        checkpoint_dir: save model + optimizer + step there every ``checkpoint_every`` steps.
        resume: continue from the latest checkpoint in ``checkpoint_dir``.
        seed: the batch of step ``s`` is drawn after ``torch.manual_seed(seed + s)``.
        progress: print a line per step.
        checkpoint_every: steps between checkpoints.
        timeout_s: wall-clock limit of a multi-process run (None: none).

    Returns:
        The report; on out-of-memory it has ``oom=True``, ``oom_device`` and ``error``.

    Raises:
        PlanError: the plan does not fit the model or the cluster.
        AutoplaceError: a training process died (the message names the rank).
    """
    cluster = cluster if cluster is not None else Cluster.detect()
    opts = RunOptions(steps=steps, warmup=warmup, reference=reference,
                      checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                      checkpoint_every=checkpoint_every, resume=resume, seed=seed,
                      progress=progress)
    validate(capture_graph(workload), plan, cluster)
    _check_present(plan, cluster)
    if process_count(plan) == 1:
        with contextlib.ExitStack() as stack:  # as run_plan: one run per checkpoint folder
            if opts.checkpoint_dir:
                stack.enter_context(folder_lock(opts.checkpoint_dir))
                require_resumable(opts.checkpoint_dir, opts.resume, opts.steps)
            return run_here(workload, plan, cluster, opts)
    return run_plan(plan, workload, cluster=cluster, options=opts, timeout_s=timeout_s)


def _check_present(plan: Plan, cluster: Cluster) -> None:
    names = [cluster.devices[i].name for i in range(plan.num_devices)]
    cuda = [n for n in names if n.startswith("cuda")]
    if cuda:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        top = max(int(n.split(":")[1]) if ":" in n else 0 for n in cuda)
        if top >= have:
            raise PlanError(
                f"plan needs device {names[-1]} ({plan.num_devices} devices), but this machine "
                f"has {have} GPU(s)"
            )

