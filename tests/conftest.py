"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

import pytest
import torch


def _share_the_cores_between_workers() -> None:
    """Under ``pytest -n N`` each worker (and the command lines and ranks it starts) gets
    its share of the cores as torch threads, unless OMP_NUM_THREADS says otherwise: with
    torch's default of a thread per core in every worker, the workers' threads contend
    for the same cores and every test on the 2-core CI machine runs 2-6 times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the subprocesses' share
    torch.set_num_threads(threads)


_share_the_cores_between_workers()


@pytest.fixture
def one_thread():
    """One intra-op torch thread: on the 2-core CI machine, tiny tensors only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_SINGLE_PLAN: list = []


@pytest.fixture(scope="module")
def single_plan_file(tmp_path_factory):
    """``autoplace plan --model gpt-tiny --cluster cpu-x2 --planner single -o plan.json``,
    run as a user runs it once per test process (each worker of ``pytest -n``), for the
    command-line tests that need a plan file to run, show or refuse (they read it, never
    change it)."""
    if not _SINGLE_PLAN:
        from tests.reliability._run import cli

        path = tmp_path_factory.mktemp("single-plan") / "plan.json"
        p = cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "single",
                "-o", str(path))
        assert p.returncode == 0, p.stderr
        _SINGLE_PLAN.append(path)
    return _SINGLE_PLAN[0]


@pytest.fixture(scope="module")
def cpu_pool():
    """One torchrun job per process layout (2 and 4 CPU ranks, gloo) for a test module's
    runs that train beside the reference (``tests.helpers.plans.run_like_execute``): each
    run builds its workload and trains it afresh, but the ranks start once a module (a
    layout's job when its first run comes; kept for the whole test run, idle jobs would cost
    the 2-core CI machine more than their starts). The tests about launching and killing
    start their own processes."""
    from autoplace.cluster import preset
    from autoplace.executor.pool import PlanPool

    with PlanPool(preset("cpu-x4"), timeout_s=240) as pool:
        yield pool
