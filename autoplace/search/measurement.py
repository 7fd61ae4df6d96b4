"""What the ``auto`` search (:mod:`autoplace.search.auto`) reads of a measurement: its
budget as seconds, a ``measure`` called with each run's time limit, and a report's step
time and peak memory."""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from typing import Any

from autoplace.errors import AutoplaceError
from autoplace.plan import Plan

__all__ = ["limited", "measured_peak", "parse_duration", "step_of"]


def parse_duration(text: str | float | int) -> float:
    """``"90s"``, ``"5m"``, ``"1h"`` or a number of seconds -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|h|)\s*", str(text))
        if not m:
            raise AutoplaceError(f"cannot read a duration from {text!r}; write 90s, 5m or 1h")
        seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0:  # 0: only what is always measured
        raise AutoplaceError(f"a duration must be finite and >= 0, got {text!r}; write 90s, "
                             "5m or 1h")
    return seconds


def limited(measure: Callable[..., Any]) -> Callable[[Plan, float | None], Any]:
    """``measure`` as ``(plan, time_limit_s) -> report``: the limit passed on where
    ``measure`` takes a ``time_limit_s`` keyword, dropped where it takes the plan alone."""
    try:
        params = inspect.signature(measure).parameters.values()
    except (TypeError, ValueError):
        params = ()
    if any(p.name == "time_limit_s" or p.kind is p.VAR_KEYWORD for p in params):
        return lambda plan, limit: measure(plan, time_limit_s=limit)
    return lambda plan, limit: measure(plan)


def step_of(rep: Any) -> float | None:
    """The step time of a measurement: a RunReport's, or a bare number of seconds."""
    return rep if isinstance(rep, (int, float)) else getattr(rep, "step_time_s", None)


def measured_peak(m: dict[str, Any]) -> float:
    """A measured candidate's peak memory on its fullest device."""
    return max(getattr(m["report"], "peak_memory_bytes", None) or [0])
