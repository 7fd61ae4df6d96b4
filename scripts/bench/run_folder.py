"""Where a benchmark writes: the folder ``--out`` names, or a new run folder.

Every script here takes ``--out DIR``; without it a run goes to a new
``bench/results/<date>-<card>x<n>-<tag>/`` (:func:`results.new_run_dir`). Either way the
folder gets the run's ``env.json`` (:func:`results.write_env`), and the script writes its
tables there and a ``run.json`` (:func:`results.write_run`) at the end.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from results import new_run_dir, write_env

__all__ = ["output_folder"]


def output_folder(out: str | Path | None, tag: str, *, card: str | None = "cpu",
                  gpus: int = 1, **env: Any) -> Path:
    """The folder a run writes into, with its ``env.json`` written.

    Args:
        out: a folder to write into (created if missing); None for a new run folder
            under ``bench/results``.
        tag: what ran, lower-case words joined by dashes (the run folder's last part).
        card: the device model the run used ("NVIDIA H200"); "cpu" for CPU runs.
        gpus: devices the run used (1 for a CPU run).
        **env: more ``env.json`` fields (``driver``, ``notes``, ...).

    Returns:
        The folder.
    """
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    if out is None:
        folder = new_run_dir(date, card, gpus, tag)
    else:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
    write_env(folder, card=card, gpus=gpus, **env)
    return folder
