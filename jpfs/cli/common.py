"""Helpers shared by the ``jpfs`` subcommands: finding the cluster, naming paths, printing.

The path rule, the same for every command: a path is inside JPFS when it is written
``jpfs:/a/b`` (``jpfs://a/b``, the fsspec spelling, is accepted too); any other path is a local
one. A command that only works inside JPFS refuses a local path rather than guess.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
import time
from pathlib import Path

from .. import config, uri
from ..errors import JPFSError

PATH_RULE = ("Paths inside JPFS are written jpfs:/a/b; any other path is a local one (commands "
             "that only work inside JPFS refuse it).")


def cluster_dir(args: argparse.Namespace) -> Path:
    """The local cluster directory: --dir, else the folder of --cluster/$JPFS_CLUSTER, else
    ./jpfs-cluster."""
    if getattr(args, "dir", None):
        return Path(args.dir)
    given = args.cluster or os.environ.get(config.ENV_CLUSTER)
    if given:
        p = Path(given)
        return p if p.is_dir() or p.suffix != ".toml" else p.parent
    return Path("jpfs-cluster")


def connect(args: argparse.Namespace):
    from ..client import connect as _connect

    return _connect(args.cluster)


def jpfs_path(text: str) -> str:
    """The path inside JPFS that ``jpfs:/a`` names, for commands that only work there; a plain
    path is local, so it is refused with the spelling that would work."""
    if uri.is_jpfs(text):
        return uri.to_path(text)
    raise JPFSError(errno.EINVAL, f"a local path; this command works inside JPFS (write "
                    f"jpfs:/{text.lstrip('/')}, or use jpfs import/export/cp for local files)",
                    text)


NEXT_STEP = "run `jpfs cluster status` to see which daemons are down"
"""What an error caused by an unreachable daemon tells the user to do next."""

_DOWN = frozenset({errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET})


def reason(e: BaseException) -> str:
    """The text after ``jpfs CMD: PATH:`` for ``e``; a daemon that is down or does not answer
    adds the next step (``jpfs cluster status``)."""
    text = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or repr(e)
    if isinstance(e, OSError) and e.errno in _DOWN and "jpfs cluster status" not in text:
        text += f"; {NEXT_STEP}"
    return text


def report(command: str, given: str, e: BaseException) -> None:
    """Print ``jpfs CMD: PATH: reason`` to stderr (``given``: the path as the user wrote it)."""
    print(f"{command}: {given}: {reason(e)}", file=sys.stderr)


def shown(path: str) -> str:
    """A path inside JPFS as the command line writes it: ``/a/b`` -> ``jpfs:/a/b``."""
    return uri.SCHEME + uri.normalize(path)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 file``, ``2 files``, ``1,000 directories``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def print_json(obj) -> None:
    sys.stdout.flush()
    print(json.dumps(obj, sort_keys=True, default=str))


def mode_string(mode: int) -> str:
    return stat.filemode(mode)


def time_string(ns: int) -> str:
    t = ns / 1e9
    fmt = "%b %d %H:%M" if abs(time.time() - t) < 180 * 86400 else "%b %d  %Y"
    return time.strftime(fmt, time.localtime(t))


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
