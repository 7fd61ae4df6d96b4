"""Fixtures of the env tests."""

from __future__ import annotations

import pytest

from autoplace.graph import OpGraph
from tests.helpers.graphs import small_graph


@pytest.fixture
def graph() -> OpGraph:
    return small_graph()
