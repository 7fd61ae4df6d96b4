"""The benchmark scripts' tests: ``scripts/bench`` on ``sys.path``, as when a script runs."""

from __future__ import annotations

import pytest

from tests.helpers import BENCH


@pytest.fixture(autouse=True)
def bench_on_path(monkeypatch):
    """Import ``bench_plans``, ``replay_suite``, ... by name, as they import each other."""
    monkeypatch.syspath_prepend(str(BENCH))
