"""Writing outputs safely: whole or not at all, and never into a folder that is missing.

:func:`write_atomic` writes a temporary file in the target's folder, flushes it to disk,
and renames it over the target: a reader, or a crash, never sees half a file, and the
old content stays until the new one is complete. An existing file keeps its mode; a new
one gets the mode the umask gives (as ``open`` would), not ``mkstemp``'s 0600.

:func:`check_output_file` and :func:`check_output_dir` are for argument parsing: they
say what is wrong with an output path before any work starts.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from autoplace.errors import AutoplaceError

__all__ = ["PICTURE_FORMATS", "check_output_dir", "check_output_file", "write_atomic", "write_json_atomic"]


#: picture formats autoplace writes (:mod:`autoplace.viz`; the file's suffix picks one)
PICTURE_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename).

    Raises:
        AutoplaceError: the folder does not exist or cannot be written.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise AutoplaceError(f"cannot write {path}: folder {folder} does not exist")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:
        raise AutoplaceError(f"cannot write {path}: {e.strerror or e}") from None
    raw = data.encode() if isinstance(data, str) else bytes(data)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise AutoplaceError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise AutoplaceError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 1,
                      **dumps_kw: Any) -> Path:
    """:func:`write_atomic` of ``json.dumps(obj)``; the text is made before the file is
    touched, so an object that is not JSON leaves the old file as it was."""
    return write_atomic(path, json.dumps(obj, indent=indent, **dumps_kw))


def check_output_file(path: str | Path, flag: str, *, force: bool = True,
                      suffixes: tuple[str, ...] | None = None) -> None:
    """Raise :class:`AutoplaceError` unless ``path`` can be written as a file.

    Args:
        path: the output file.
        flag: the option that named it (for the message).
        force: False: an existing file is refused (it would be overwritten).
        suffixes: the file name must end with one of these (picture formats).
    """
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.name in ("", ".", ".."):
        raise AutoplaceError(f"{flag} {path}: not a file name")
    if suffixes is not None and p.suffix.lower().lstrip(".") not in suffixes:
        raise AutoplaceError(f"{flag} {path}: unknown picture format {p.suffix or '(none)'!r}; "
                             f"valid: {', '.join('.' + s for s in suffixes)}")
    if not folder.is_dir():
        raise AutoplaceError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AutoplaceError(f"{flag} {path}: folder {folder} is not writable")
    if p.is_dir():
        raise AutoplaceError(f"{flag} {path}: is a folder, not a file")
    if not force and p.exists():
        raise AutoplaceError(f"{flag} {path}: the file exists and would be overwritten; "
                             "pass --force to replace it, or name another file")


def check_output_dir(path: str | Path, flag: str) -> None:
    """Raise :class:`AutoplaceError` unless ``path`` is a folder, or can be made one (its
    nearest existing parent is a writable folder)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise AutoplaceError(f"{flag} {path}: exists and is not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise AutoplaceError(f"{flag} {path}: folder is not writable")
        return
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise AutoplaceError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AutoplaceError(f"{flag} {path}: cannot create it, {parent} is not writable")
