"""Tables one batch fills and the next batch refills, kept between calls.

A chunk of 256 plans of a 1,000-op graph at 8 devices fills about 100 MB of tables. Mapped
afresh on every call, each page faults when first written: on a 2-core VM that was a
quarter to a third of a batch's time (26,000 faults a call). So the largest tables are
views into buffers kept per thread, named by what they hold, grown when a batch needs
more and reused by the next batch; :func:`release` hands them back. A table is valid
until its name is asked for again: every name is used once per chunk.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["release", "table", "take"]

_local = threading.local()


def table(name: str, shape: tuple[int, ...], dtype: np.dtype | type,
          fill: float | int | None = None) -> np.ndarray:
    """A ``shape`` array of ``dtype`` on buffer ``name``, filled with ``fill`` (left as it
    was when None: the caller writes every cell)."""
    bufs = _buffers()
    dtype = np.dtype(dtype)
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = bufs.get(name)
    if buf is None or buf.nbytes < need:
        buf = np.empty(max(need, 8), np.uint8)
        bufs[name] = buf
    out = buf[:need].view(dtype).reshape(shape)
    if fill is not None:
        out.fill(fill)
    return out


def take(name: str, values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values.reshape(-1).take(index)`` written into table ``name``."""
    out = table(name, index.shape, values.dtype)
    return np.take(values.reshape(-1), index, out=out)


def release() -> None:
    """Drop this thread's buffers (the next batch maps its tables afresh)."""
    _local.bufs = {}


def _buffers() -> dict[str, np.ndarray]:
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    return bufs
