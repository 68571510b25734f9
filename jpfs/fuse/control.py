"""The ``.jpfs`` control directory at the mount root: stats, metrics and prefetch hints.

- ``.jpfs/stats``: the mount's counters as one JSON object (a fresh snapshot per open; on a
  read-only mount, where the kernel opens files without asking, per lookup of the name, which
  the kernel makes on every open of a path since control entries are never cached).
- ``.jpfs/metrics``: the same in the Prometheus text format (also served over HTTP with
  ``--metrics HOST:PORT``).
- ``.jpfs/prefetch``: write paths to it, one per line, in the order they will be read, and the
  mount fetches them ahead of the reader. Paths may be absolute under the mount point, relative to
  the mount root, or ``jpfs:/...``. A write fails with EINVAL on a malformed line and ENOENT on a
  path that does not exist, and then queues nothing of that write; reading the file shows the
  queue, the counters and the last errors.
- ``.jpfs/socket``: the path of a Unix socket that takes the same lines. A ``--read-only`` mount
  is read-only in the kernel too (``ro``), so nothing on it can be opened for writing: hints go
  to the socket there (``jpfs.torch`` does this by itself).

The directory is not listed in the root (``find``, ``du``, ``rsync`` and ``cp -r`` never see it)
but can always be looked up. Its inode numbers sit at the very top of the 64-bit range, where no
JPFS inode lives (that would take metadata shard 65535).
"""

from __future__ import annotations

import errno
import json
import posixpath
import stat
import time

from ..errors import error
from ..types import Attr

CONTROL_NAME = b".jpfs"
CONTROL_DIR = (1 << 64) - 256
STATS = CONTROL_DIR + 1
METRICS = CONTROL_DIR + 2
PREFETCH = CONTROL_DIR + 3
SOCKET = CONTROL_DIR + 4
FILES: dict[bytes, int] = {b"stats": STATS, b"metrics": METRICS, b"prefetch": PREFETCH,
                           b"socket": SOCKET}
MAX_LINE = 4096
USAGE = ("write paths to this file, one per line, in the order they will be read: absolute under "
         "the mount point, relative to the mount root, or jpfs:/...")

_BOOT_NS = time.time_ns()


def is_control(ino: int) -> bool:
    """Whether ``ino`` is the control directory or one of its files."""
    return ino >= CONTROL_DIR


def attr(ino: int, size: int = 0, mtime_ns: int = _BOOT_NS) -> Attr:
    """The attributes of a control inode (owned by root; only the hint file is writable).

    Where the kernel opens files without asking the mount (a read-only mount), a file's size
    and mtime are those of its latest snapshot: the kernel reads no further than the size, and
    drops its cached pages of the file when either changes."""
    if ino == CONTROL_DIR:
        mode, nlink = stat.S_IFDIR | 0o555, 2
    elif ino == PREFETCH:
        mode, nlink = stat.S_IFREG | 0o666, 1
    else:
        mode, nlink = stat.S_IFREG | 0o444, 1
    return Attr(ino, mode, nlink, 0, 0, size, mtime_ns, mtime_ns, mtime_ns)


def parse_hints(text: bytes, mountpoint: str) -> list[str]:
    """Paths inside JPFS (``/a/b``) from complete lines written to ``.jpfs/prefetch``.

    Raises EINVAL naming the first bad line: not UTF-8, control characters, too long, outside
    the mount point, or naming the root. ``..`` at the root stays at the root, as in the kernel.
    """
    out = []
    mp = mountpoint.rstrip("/")
    for n, raw in enumerate(text.split(b"\n"), 1):
        line = raw.strip(b" \t\r")
        if not line or line.startswith(b"#"):
            continue
        if len(line) > MAX_LINE:
            raise error(errno.EINVAL, f"prefetch hint line {n}: longer than {MAX_LINE} bytes")
        try:
            p = line.decode("utf-8")
        except UnicodeDecodeError:
            raise error(errno.EINVAL, f"prefetch hint line {n}: not UTF-8 text") from None
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in p if ch != "\t"):
            raise error(errno.EINVAL, f"prefetch hint line {n}: control characters in "
                        f"{p[:60]!r}")
        if p.startswith("jpfs:"):
            p = "/" + p[5:].lstrip("/")
        elif p.startswith("/"):
            if p != mp and not p.startswith(mp + "/"):
                raise error(errno.EINVAL, f"prefetch hint line {n}: {p!r} is not under the "
                            f"mount point {mp}")
            p = p[len(mp):] or "/"
        else:
            p = "/" + p
        norm = "/" + posixpath.normpath(p).lstrip("/")
        if norm == "/":
            raise error(errno.EINVAL, f"prefetch hint line {n}: {p!r} does not name a file "
                        "inside the mount")
        out.append(norm)
    return out


def prefetch_status(pf_stats: dict, errors: list[str]) -> bytes:
    """What reading ``.jpfs/prefetch`` shows: the hint counters, recent errors, the usage."""
    keys = ("enabled", "hint_paths", "hint_files", "hint_opened", "hint_errors", "hints_queued")
    doc = {k: pf_stats.get(k) for k in keys}
    doc["last_errors"] = errors
    doc["usage"] = USAGE
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def stats_json(snapshot: dict) -> bytes:
    """``.jpfs/stats``: the mount's snapshot as indented JSON."""
    return (json.dumps(snapshot, indent=1, sort_keys=True, default=str) + "\n").encode()


__all__ = ["CONTROL_DIR", "CONTROL_NAME", "FILES", "METRICS", "PREFETCH", "STATS", "attr",
           "is_control", "parse_hints", "prefetch_status", "stats_json"]
