"""The one exception type users see: a message that says what was wrong and what is valid."""

from __future__ import annotations

__all__ = ["AutoplaceError", "PlanError", "CaptureError", "OutOfMemoryError"]


class AutoplaceError(Exception):
    """A problem the user can act on; the CLI prints its message and exits non-zero."""


class PlanError(AutoplaceError):
    """A plan file that is corrupt, or does not fit the graph or the cluster."""


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
