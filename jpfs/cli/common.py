"""Helpers shared by the ``jpfs`` subcommands: finding the cluster, naming paths, printing."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path

from .. import config, uri


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
    """A path inside JPFS for commands that only work there: ``jpfs:/a`` or plain ``/a``."""
    return uri.to_path(text) if uri.is_jpfs(text) else uri.normalize(text)


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
