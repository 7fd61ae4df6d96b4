"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op torch thread: on the 2-core CI machine, tiny tensors only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_pool():
    """One torchrun job per process layout (2 and 4 CPU ranks, gloo) for a test module's
    runs that train beside the reference (``tests.helpers.plans.run_like_execute``): each
    run builds its workload and trains it afresh, but the ranks start once a module. The
    tests about launching, killing and resuming start their own processes."""
    from autoplace.cluster import preset
    from autoplace.executor.pool import PlanPool

    with PlanPool(preset("cpu-x4"), timeout_s=240) as pool:
        yield pool
