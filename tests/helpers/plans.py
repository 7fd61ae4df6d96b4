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
