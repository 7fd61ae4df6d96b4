"""The one exception type users see: a message that says what was wrong and what is valid."""

from __future__ import annotations

__all__ = ["AutoplaceError", "PlanError", "CaptureError", "OutOfMemoryError", "WorkloadError",
           "TIME_LIMIT_MESSAGE"]

#: in the error of a run stopped at its time limit (the pool's and the launcher's)
TIME_LIMIT_MESSAGE = "was stopped at its time limit"


class AutoplaceError(Exception):
    """A problem the user can act on; the CLI prints its message and exits non-zero."""


class PlanError(AutoplaceError):
    """A plan file that is corrupt, or does not fit the graph or the cluster."""


class WorkloadError(AutoplaceError):
    """A workload that cannot be built: an unknown name, a bad option, a spec read from a
    file that autoplace was not allowed to import, or the user's own factory raising (the
    message names its module, function and exception; ``__cause__`` is that exception)."""


class CaptureError(AutoplaceError):
    """A model that neither torch.fx nor torch.export could capture."""


class OutOfMemoryError(AutoplaceError):
    """A device ran out of memory while executing a plan.

    Attributes:
        device: the device that ran out (``"cuda:1"``), when known.
    """

    def __init__(self, message: str, device: str | None = None) -> None:
        super().__init__(message)
        self.device = device
