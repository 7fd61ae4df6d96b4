"""Memory sizes as people write them: ``"16GB"`` in, ``16GB`` out (binary units)."""

from __future__ import annotations

import re

from autoplace.errors import AutoplaceError

__all__ = ["GiB", "parse_bytes", "format_bytes"]

GiB = 2**30

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
          "mib": 2**20, "g": GiB, "gb": GiB, "gib": GiB, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"16GB"`` -> bytes (binary units: 1 GB = 2**30 bytes). A string needs its unit
    (``"16"`` is refused: 16 bytes is never what a memory cap means); an int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise AutoplaceError(f"a memory size must be positive, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise AutoplaceError(
            f"cannot read a memory size from {text!r}; write a number with a unit, like 16GB or 512MB"
        )
    if not m.group(2):
        raise AutoplaceError(
            f"memory size {text!r} has no unit; write one, like {m.group(1)}GB or "
            f"{m.group(1)}MB (binary units: 1GB = 2**30 bytes; B for bytes)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise AutoplaceError(f"a memory size must be positive, got {text!r}")
    return n


def format_bytes(n: float) -> str:
    """Bytes as a short human string (``16GB``)."""
    for unit, size in (("TB", 2**40), ("GB", GiB), ("MB", 2**20), ("KB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"
