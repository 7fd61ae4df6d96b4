"""Helpers the tests share: tiny plans, models, graphs and environments (no tests here).

Modules here are imported as ``tests.helpers.<name>``, and workloads they define are named
``tests.helpers.<module>:<factory>``: worker processes find them with :data:`ROOT` on
``PYTHONPATH``."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: the folder that holds ``tests/`` and ``scripts/``."""


def pythonpath_with_root() -> str:
    """``PYTHONPATH`` with the repository's root first, for subprocesses that import tests' models."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

BENCH = ROOT / "scripts" / "bench"
"""The benchmark scripts' folder: they import each other (and ``results``) by module name."""
