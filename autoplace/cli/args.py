"""Options shared by the commands, and the checks every command's options pass before
any work starts (output paths, picture formats, numbers in range, memory sizes, model
names, workload options).

A config field's metadata says what to check: ``out="file" | "picture" | "dir"`` for
outputs, ``min=N`` for numbers, ``guard=True`` for a default output path that must not
replace an existing file unless ``--force`` (or the path is named on the command line).
``when="FIELD"``: an output written only when that option is on. A config may add its own
checks in a ``check()`` method.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplace.errors import AutoplaceError
from autoplace.files import PICTURE_FORMATS, check_output_dir, check_output_file

__all__ = ["ClusterArgs", "ModelArgs", "TrustArgs", "check_config", "flag_of", "opt",
           "parse_options", "req"]


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its ``--help`` line (and checks, see the module docstring)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def req(help: str, **kw: Any) -> Any:
    """A required config field (a positional argument unless ``flag=True``)."""
    return field(metadata={"help": help, "required": True, **kw})


def flag_of(f: dataclasses.Field) -> str:
    """The option that sets field ``f``, as a user typed it (``-o/--out``)."""
    long = f"--{f.name.replace('_', '-')}"
    if f.metadata.get("positional"):
        return f.name.upper()
    return f"{f.metadata['flag']}/{long}" if "flag" in f.metadata else long


# ---------------------------------------------------------------- shared options
@dataclass(kw_only=True)
class ModelArgs:
    model: str = opt("gpt-tiny", "zoo workload name or package.module:factory")
    batch_size: int | None = opt(None, "global batch size (default: the workload's)", min=1)
    option: list[str] = opt([], "workload option KEY=VALUE (repeatable)", action="append")


@dataclass(kw_only=True)
class ClusterArgs:
    cluster: str = opt("detect", "cluster preset name, 'detect', or a cluster JSON path")
    memory_cap: str | None = opt(None, "cap every device's memory, with a unit: 16GB, 512MB")


@dataclass(kw_only=True)
class TrustArgs:
    """Options of commands that rebuild the model a plan file names."""

    model: str | None = opt(None, "the model the plan was made for; naming a "
                                  "package.module:factory here allows importing it")
    trust_model: bool = opt(False, "build the package.module:factory model the plan names "
                                   "without naming it with --model (runs the plan's code)")


_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def parse_options(cfg: Any) -> dict[str, Any]:
    """``--option KEY=VALUE`` (values read as JSON when they are, else strings) and
    ``--batch-size`` as the workload's keyword options."""
    options: dict[str, Any] = {}
    for kv in getattr(cfg, "option", []):
        key, sep, value = kv.partition("=")
        if not sep or not key.strip():
            raise AutoplaceError(f"--option takes KEY=VALUE, got {kv!r}")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    if getattr(cfg, "batch_size", None) is not None:
        options["batch_size"] = cfg.batch_size
    return options


def _check_model_name(name: str, flag: str = "--model") -> None:
    if ":" in name and not _SPEC.fullmatch(name):
        raise AutoplaceError(f"{flag} {name!r} is not a model: write a zoo name (autoplace "
                             "models lists them) or package.module:factory")


def check_config(cfg: Any, given: set[str] | None = None) -> None:
    """Check ``cfg``'s options before any work; raise :class:`AutoplaceError` naming the
    first one that is wrong. ``given``: fields the user named on the command line."""
    given = given or set()
    force = bool(getattr(cfg, "force", False))
    listing = getattr(cfg, "list", False) is True  # --list writes nothing
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        meta = f.metadata
        if value is None or meta.get("unused"):
            continue
        if meta.get("out") and (listing or not getattr(cfg, meta.get("when", f.name), True)):
            continue  # an output this run does not write
        flag = flag_of(f)
        if "min" in meta and isinstance(value, (int, float)) and value < meta["min"]:
            raise AutoplaceError(f"{flag} must be at least {meta['min']}, got {value}")
        out = meta.get("out")
        keep = bool(meta.get("guard")) and f.name not in given and not force
        if out == "file":
            check_output_file(value, flag, force=not keep)
        elif out == "picture":
            check_output_file(value, flag, force=not keep, suffixes=PICTURE_FORMATS)
        elif out == "dir":
            check_output_dir(value, flag)
        elif meta.get("exists") and not Path(value).is_file():
            raise AutoplaceError(f"{flag} {value}: no such file")
    if isinstance(cfg, ModelArgs) or isinstance(cfg, TrustArgs):
        if getattr(cfg, "model", None):
            _check_model_name(cfg.model)
    if isinstance(cfg, ModelArgs):
        parse_options(cfg)
    if getattr(cfg, "memory_cap", None) is not None:
        from autoplace.cluster import parse_bytes

        try:
            parse_bytes(cfg.memory_cap)
        except AutoplaceError as e:
            raise AutoplaceError(f"--memory-cap: {e}") from None
    check = getattr(cfg, "check", None)
    if check is not None:
        check()
