"""The ``jpfs`` command: one subcommand group per module of this package.

Each module listed in ``GROUPS`` has ``register(subparsers)``, which adds its subcommands and sets
``func`` (called with the parsed args; its return value is the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from jpfs import __version__
from jpfs.errors import JPFSError

GROUPS = ("cluster", "fs", "data", "mount", "lerobot", "bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jpfs",
        description="JPFS: a parallel filesystem for robot-learning training data. Paths inside "
        "JPFS are written jpfs:/a/b (local paths stay plain).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"jpfs {__version__}")
    p.add_argument("--cluster", metavar="FILE",
                   help="cluster file or directory (default: $JPFS_CLUSTER, then ./jpfs-cluster)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in GROUPS:
        try:
            module = importlib.import_module(f"jpfs.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"jpfs.cli.{name}":
                continue
            raise
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, JPFSError, OSError, ValueError, BaseExceptionGroup) as e:
        reported = _reportable(e)
        if reported is None or (args.verbose >= 2 and reported is not KeyboardInterrupt):
            raise
        if reported is KeyboardInterrupt:
            print("jpfs: interrupted", file=sys.stderr)
            return 130
        print(f"jpfs: error: {_describe(reported)}", file=sys.stderr)
        return 1


def _reportable(e: BaseException) -> BaseException | type[KeyboardInterrupt] | None:
    """What a user is told about ``e``: KeyboardInterrupt (Ctrl-C or SIGTERM, even where trio
    wrapped it in an exception group), the first of a group's errors when they all are ordinary
    errors, or None for a bug (its traceback is shown)."""
    if isinstance(e, BaseExceptionGroup):
        interrupted, _ = e.split(KeyboardInterrupt)
        if interrupted is not None:
            return KeyboardInterrupt
        ordinary, other = e.split((JPFSError, OSError, ValueError))
        if ordinary is None or other is not None:
            return None
        while isinstance(ordinary, BaseExceptionGroup):
            ordinary = ordinary.exceptions[0]
        return ordinary
    return KeyboardInterrupt if isinstance(e, KeyboardInterrupt) else e


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
