"""The ``jpfs`` command: one subcommand group per module of this package.

Each module in ``GROUPS`` has ``register(subparsers)``, which adds its subcommands and sets
``func`` (called with the parsed args; its return value is the exit status).

Every error a user sees has one shape, ``jpfs CMD: PATH: reason`` (``jpfs CMD: reason`` where no
path is involved), with JPFS paths echoed as the command line writes them (``jpfs:/a``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import signal
import sys
import textwrap
import threading
from typing import NoReturn

from jpfs import __version__, uri
from jpfs.errors import JPFSError

from . import bench, cluster, data, fs, lerobot, mount, mount_install, node, scrub, shard
from .common import PATH_RULE

# Each group module keeps its heavy imports (trio clients, pyarrow, torch) inside its functions,
# so importing all of them here costs little: `jpfs --help` starts in about 0.25 s.
GROUPS = (cluster, node, shard, fs, data, mount, mount_install, lerobot, bench, scrub)
SUBCOMMANDS = ("cluster_command", "node_command", "lerobot", "bench")  # the groups' own dests
JPFS_ONLY = {"ls", "stat", "mkdir", "rm", "mv", "cat", "du"}  # their paths all name JPFS files
_URL = re.compile(r"\bjpfs://")
NATIVE_POOLS = {"pyarrow", "torch"}
"""Modules whose C++ threads can abort the process's exit (see ``entry``)."""

DESCRIPTION = f"""\
JPFS: a parallel filesystem for robot-learning training data.

{textwrap.fill(PATH_RULE, 78)}
The cluster is found from --cluster, else $JPFS_CLUSTER, else ./jpfs-cluster.

examples:
  jpfs cluster up --dir ./jpfs-cluster       # a local cluster on loopback
  jpfs import /data/ds jpfs:/datasets/ds      # copy a local directory in
  jpfs ls -l jpfs:/datasets/ds
  jpfs COMMAND --help                         # what COMMAND does, and its options
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jpfs",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"jpfs {__version__}")
    p.add_argument("--cluster", metavar="FILE",
                   help="cluster file or directory (default: $JPFS_CLUSTER, then ./jpfs-cluster)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in GROUPS:
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
            _ignore_late_interrupts()
            print(f"{_command(args)}: interrupted", file=sys.stderr)
            return 130
        assert isinstance(reported, BaseException)
        print(f"{_command(args)}: {_describe(reported, args)}", file=sys.stderr)
        return 1


def _ignore_late_interrupts() -> None:
    """The interrupted command has cleaned up and is ending: a second Ctrl-C, or a SIGINT or
    SIGTERM that arrives while the interpreter shuts down (when Python's own handlers are
    already gone), must not turn exit status 130 into a traceback or a death by signal."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread: nothing to protect here
            return


def _command(args: argparse.Namespace) -> str:
    """``jpfs ls``, ``jpfs lerobot convert``: the command as typed, for error messages."""
    parts = ["jpfs", args.command] + [getattr(args, k) for k in SUBCOMMANDS
                                      if isinstance(getattr(args, k, None), str)]
    return " ".join(parts)


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
        first: BaseException = ordinary
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return first
    return KeyboardInterrupt if isinstance(e, KeyboardInterrupt) else e


def _describe(e: BaseException, args: argparse.Namespace) -> str:
    """``PATH: reason``, the path as the user wrote it."""
    if isinstance(e, OSError) and e.strerror:
        text = f"{_echo(e.filename, args)}: {e.strerror}" if e.filename else e.strerror
    else:
        text = str(e)
    return _URL.sub("jpfs:/", text)


def _echo(name: object, args: argparse.Namespace) -> str:
    """A path from an error, spelled as on the command line: an argument's own text where it is
    one (``jpfs://a`` and ``/a`` both came from ``jpfs:/a``); inside JPFS, ``jpfs:/PATH``."""
    name = str(name)
    values = [v for value in vars(args).values()
              for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    if name in values:
        return name
    for given in values:
        if uri.is_jpfs(given) and name in (
                uri.to_path(given), uri.to_url(uri.to_path(given))):
            return given
    if uri.is_jpfs(name):
        return uri.SCHEME + uri.to_path(name)
    if args.command in JPFS_ONLY and name.startswith("/"):
        return uri.SCHEME + name
    return name


def entry() -> NoReturn:
    """The ``jpfs`` program: :func:`main`, then an exit that a C++ library's threads cannot abort.

    pyarrow's thread pools (parquet reads, dataset writes) can still hold a joinable
    ``std::thread`` when the process's static destructors run, and then ``exit()`` aborts with
    "terminate called without an active exception" after the command has succeeded (apache/arrow
    #34314; it failed a CI run of ``jpfs bench convert`` here). Once such a library
    is loaded, the command's end runs what Python's own shutdown would (joining non-daemon
    threads, atexit handlers, flushing) and leaves with ``os._exit``, skipping the destructors."""
    rc = main()
    if not NATIVE_POOLS.intersection(sys.modules):
        sys.exit(rc)
    # What Py_Finalize does first: shut executors down and join non-daemon threads, then atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    entry()
