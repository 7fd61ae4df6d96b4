"""Fixtures of the env tests."""

from __future__ import annotations

import pytest
from envtools import small_graph

from autoplace.graph import OpGraph


@pytest.fixture
def graph() -> OpGraph:
    return small_graph()
