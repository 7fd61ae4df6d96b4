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


@pytest.fixture(scope="session")
def single_plan_file(tmp_path_factory):
    """``autoplace plan --model gpt-tiny --cluster cpu-x2 --planner single -o plan.json``,
    run once a session as a user runs it, for the command-line tests that need a plan
    file to run, show or refuse (they read it, never change it)."""
    from tests.reliability._run import cli

    path = tmp_path_factory.mktemp("single-plan") / "plan.json"
    p = cli("plan", "--model", "gpt-tiny", "--cluster", "cpu-x2", "--planner", "single",
            "-o", str(path))
    assert p.returncode == 0, p.stderr
    return path


@pytest.fixture(scope="module")
def cpu_pool():
    """One torchrun job per process layout (2 and 4 CPU ranks, gloo) for a test module's
    runs that train beside the reference (``tests.helpers.plans.run_like_execute``): each
    run builds its workload and trains it afresh, but the ranks start once a module (a
    layout's job when its first run comes; kept a session, idle jobs would cost more of the
    2-core CI machine than their starts). The tests about launching and killing start their
    own processes."""
    from autoplace.cluster import preset
    from autoplace.executor.pool import PlanPool

    with PlanPool(preset("cpu-x4"), timeout_s=240) as pool:
        yield pool
