"""Fixtures of the policy tests: one thread (tiny tensors), and the toy env."""

from __future__ import annotations

import pytest
import torch
from _placement_toy import ToyPlacementEnv


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def toy() -> ToyPlacementEnv:
    return ToyPlacementEnv()
