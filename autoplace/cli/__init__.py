"""The ``autoplace`` command: the only face of the library.

Each subcommand has one ``@dataclass(kw_only=True)`` config whose field docs
(``metadata["help"]``) become its ``--help``; its options are checked
(:func:`autoplace.cli.args.check_config`) before any work starts. Errors the user can act
on (:class:`~autoplace.errors.AutoplaceError`) print one line and exit with status 2,
without a traceback; a run that failed on the devices exits with 3.

Commands by module: :mod:`~autoplace.cli.describe` (models, capture, cluster, simulate,
show), :mod:`~autoplace.cli.planning` (plan, compare), :mod:`~autoplace.cli.training`
(train), :mod:`~autoplace.cli.running` (run, profile, demo, trace-summary).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from autoplace.cli import describe, planning, running, training
from autoplace.cli.args import check_config
from autoplace.errors import AutoplaceError

__all__ = ["COMMANDS", "build_parser", "main"]

_ALL = {**describe.COMMANDS, **planning.COMMANDS, **running.COMMANDS, **training.COMMANDS}
#: name -> (config dataclass, function, one-line help), in the order ``--help`` lists them
COMMANDS: dict[str, tuple[type, Callable[[Any], int], str]] = {
    name: _ALL[name] for name in ("models", "capture", "cluster", "plan", "compare", "simulate",
                                  "show", "run", "train", "profile", "demo", "trace-summary")}


def _add_args(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        help_ = meta.get("help", "")
        if meta.get("positional"):
            parser.add_argument(f.name, help=help_, nargs=meta.get("nargs"))
            continue
        names = [f"--{f.name.replace('_', '-')}"]
        if "flag" in meta:
            names.insert(0, meta["flag"])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if meta.get("guard"):  # left out when not given: the config knows it was a default
            kw: dict[str, Any] = {"default": argparse.SUPPRESS}
        else:
            kw = {"default": default}
        if meta.get("action") == "append":
            parser.add_argument(*names, action="append", help=help_, dest=f.name,
                                **{"default": []})
        elif isinstance(default, bool):  # on by default: --no-<name> turns it off
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(*names, action=action, help=help_, dest=f.name, **kw)
        else:
            typ = int if isinstance(default, int) or "int" in str(f.type) else str
            shown = "" if default is None or "(default" in help_ else f" (default: {default})"
            parser.add_argument(*names, type=typ, dest=f.name, help=help_ + shown, **kw)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    p = argparse.ArgumentParser(
        prog="autoplace",
        description="Find and run the fastest way to train a PyTorch model on a set of devices.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (cls, _, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        _add_args(sp, cls)
    return p


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM as an exception: cleanups run (the processes a run started are stopped)."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Parse, check the options, run the command; errors become one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    cls, fn, _ = COMMANDS[args.command]
    values = {k: v for k, v in vars(args).items() if k != "command"}
    given = {f.name for f in dataclasses.fields(cls) if f.metadata.get("guard")} & set(values)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        cfg = cls(**values)
        check_config(cfg, given)
        return fn(cfg)
    except AutoplaceError as e:
        print(f"autoplace: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoplace: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked
        if os.environ.get("AUTOPLACE_DEBUG"):
            raise
        print(f"autoplace: internal error: {type(e).__name__}: {e} "
              "(set AUTOPLACE_DEBUG=1 to see the traceback)", file=sys.stderr)
        return 1

