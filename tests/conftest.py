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
