"""Plans the executor tests run (a model cut into contiguous runs, or kept whole), and the
check of a run of one against unpartitioned training."""

from __future__ import annotations

from autoplace.plan import ParallelConfig, Plan


def split(graph, devices: int = 2, recompute=(), **parallel) -> Plan:
    """``graph``'s ops in program order cut into ``devices`` equal runs, run ``i`` on device
    ``i`` (a pipeline's stages with ``pipeline=devices``)."""
    n = len(graph.order)
    groups = {op: min(devices - 1, i * devices // n) for i, op in enumerate(graph.order)}
    return Plan.from_groups(graph, groups, list(range(devices)), recompute=set(recompute),
                            parallel=ParallelConfig(**parallel))


def single(graph, **parallel) -> Plan:
    """Every op on one device (a replica of it with ``data > 1``)."""
    return Plan.from_groups(graph, {op: 0 for op in graph.order}, [0],
                            parallel=ParallelConfig(**parallel))


def check_run(r, steps: int = 3, tol: float = 1e-4) -> None:
    """A run that worked, trained ``steps`` steps beside its unpartitioned reference, and
    whose losses are within ``tol`` (relative) of the reference's."""
    assert r.ok, r.error
    assert len(r.loss) == steps and len(r.reference_loss) == steps
    assert r.max_loss_rel_diff < tol, (r.loss, r.reference_loss)


def run_like_execute(pool, workload, plan, cluster, steps: int = 3, warmup: int = 1,
                     graph=None, **options):
    """What :func:`autoplace.executor.execute` does for ``plan`` (validated against the
    workload's graph and ``cluster``, trained ``steps`` steps beside the unpartitioned
    reference), with a multi-process plan run in ``pool``'s job for its process layout
    (a :class:`~autoplace.executor.pool.PlanPool` a test module keeps) instead of a
    torchrun of its own: the ranks run the same code, but start once per module.
    ``graph``: the workload's graph if the test captured it already (capturing by
    torch.export takes seconds). ``options``: execute's other run options (``reference``,
    ``checkpoint_dir``, ``resume``); a checkpoint folder is locked and checked first, as
    execute's launcher does."""
    import contextlib

    from autoplace.executor import execute
    from autoplace.executor.checkpoint import require_resumable
    from autoplace.executor.lifetime import folder_lock
    from autoplace.executor.runner import RunOptions, capture_graph
    from autoplace.executor.tensor_parallel import process_count
    from autoplace.lowering import validate

    if process_count(plan) == 1:
        return execute(workload, plan, cluster=cluster, steps=steps, warmup=warmup, **options)
    validate(graph if graph is not None else capture_graph(workload), plan, cluster)
    if options.get("checkpoint_dir") is not None:
        options["checkpoint_dir"] = str(options["checkpoint_dir"])
    opts = RunOptions(steps=steps, warmup=warmup, **options)
    with contextlib.ExitStack() as stack:
        if opts.checkpoint_dir:
            stack.enter_context(folder_lock(opts.checkpoint_dir))
            require_resumable(opts.checkpoint_dir, opts.resume, opts.steps)
        return pool.run(plan, workload, opts, cluster=cluster)
