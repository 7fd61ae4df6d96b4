"""Fixtures of the policy tests: one thread (tiny tensors), and the toy env."""

from __future__ import annotations

import pytest

from tests.helpers.placement_toy import ToyPlacementEnv


@pytest.fixture(autouse=True)
def _one_thread_everywhere(one_thread):
    """Every policy test runs on one torch thread (fixture in tests/conftest.py)."""
    yield


@pytest.fixture
def toy() -> ToyPlacementEnv:
    return ToyPlacementEnv()
