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
JPFS inode lives (that would take metadata shard 65535), and the handles of its open files and
directory just below them, from ``CONTROL_FH``, far above the VFS's (which count up from 1).

``ControlTree`` answers every request on these inodes and handles, with pyfuse3's arguments and
answers; the adapter (``jpfs.fuse.operations``) sends it those requests at one place, its
``fuse_op`` boundary, which also turns the tree's errors into the kernel's. Nothing in the tree
can be changed: creating, removing or renaming names in it, or setting attributes, is EPERM.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import stat
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import pyfuse3
from prometheus_client import generate_latest

from ..errors import JPFSError, error
from ..types import ROOT_INO, Attr
from .dirreply import readdir_reply
from .stats import registry_for

log = logging.getLogger(__name__)

CONTROL_NAME = b".jpfs"
CONTROL_DIR = (1 << 64) - 256
STATS = CONTROL_DIR + 1
METRICS = CONTROL_DIR + 2
PREFETCH = CONTROL_DIR + 3
SOCKET = CONTROL_DIR + 4
FILES: dict[bytes, int] = {b"stats": STATS, b"metrics": METRICS, b"prefetch": PREFETCH,
                           b"socket": SOCKET}
CONTROL_FH = 1 << 62
"""Handles of control files are numbered from here (VFS handles count up from 1), below the
control inodes: a READ that names its inode (no OPEN) is told from one on a handle by number."""
MAX_LINE = 4096
HINT_BUFFER_MAX = 16 << 20
"""Bytes of a hint line written to ``.jpfs/prefetch`` before its newline, at most."""
USAGE = ("write paths to this file, one per line, in the order they will be read: absolute under "
         "the mount point, relative to the mount root, or jpfs:/...")

_BOOT_NS = time.time_ns()


def is_control(ino: int) -> bool:
    """Whether ``ino`` is the control directory or one of its files."""
    return ino >= CONTROL_DIR


def in_tree(parent: int, name: bytes) -> bool:
    """Whether the entry ``name`` of directory ``parent`` is the control directory or in it."""
    return parent >= CONTROL_DIR or (parent == ROOT_INO and name == CONTROL_NAME)


def is_handle(fh: int) -> bool:
    """Whether ``fh`` is a handle of the control tree (or, on a READ without OPEN, its inode)."""
    return fh >= CONTROL_FH


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


@dataclass(slots=True, eq=False)
class ControlHandle:
    """An open control file (its content as it was at the open) or the open directory."""

    ino: int
    content: bytes = b""
    pending: bytearray | None = None
    """Hint bytes written after the last complete line (a handle open for writing)."""
    writable: bool = False


class Prefetch(Protocol):
    """What the tree needs of the prefetcher: its counters and its hint queue."""

    def as_dict(self) -> dict:
        """The prefetch counters (shown by ``.jpfs/prefetch``)."""
        ...

    async def hint(self, paths: Sequence[str]) -> int:
        """Queue these files for fetching ahead of their reader."""
        ...


def _refuse(err: int, why: str) -> Callable[..., Any]:
    """A handler that answers every request of its kind with ``err``."""

    async def refuse(self: ControlTree, *args: Any) -> NoReturn:
        raise error(err, why)

    return refuse


class ControlTree:
    """The ``.jpfs`` directory and its files: every request on their inodes and handles.

    Each method is the request of its name, with pyfuse3's arguments (the adapter passes them
    on as it got them) and pyfuse3's answer; errors are ``JPFSError``.

    Args:
        entry: the adapter's translation of attributes into an entry (with the mount's
            timeouts).
        root_attr: the root directory's attributes (the ``..`` of the listing).
        kernel_opens: whether the kernel still sends OPEN; where it does not (a read-only
            mount), each lookup of a file's name takes a snapshot of its content, and its READs
            name the inode.
        stats: the mount's stats snapshot (``.jpfs/stats``, ``.jpfs/metrics``).
        prefetch: the prefetcher that hints go to, and whose counters ``.jpfs/prefetch`` shows.
        mountpoint: where the mount is (hint paths may be absolute under it).
        hint_socket: the socket that takes hints ("" when there is none; ``.jpfs/socket``).
        shared_snapshots: a directory for the files' snapshots, when several processes serve
            the mount (None: kept in memory).
    """

    def __init__(self, *, entry: Callable[[Attr], pyfuse3.EntryAttributes],
                 root_attr: Callable[[], Attr], kernel_opens: Callable[[], bool],
                 stats: Callable[[], dict], prefetch: Prefetch, mountpoint: str,
                 hint_socket: str = "", shared_snapshots: Path | None = None):
        self._entry = entry
        self._root_attr = root_attr
        self._kernel_opens = kernel_opens
        self._stats = stats
        self._prefetch = prefetch
        self.mountpoint = mountpoint
        self.hint_socket = hint_socket
        self.shared_snapshots = shared_snapshots
        """Where snapshots go when several processes serve the mount: the one that answers a
        lookup takes the snapshot, another may answer its READs."""
        self.registry = registry_for(stats)
        """The Prometheus registry ``.jpfs/metrics`` shows."""
        self.hint_errors: deque[str] = deque(maxlen=20)
        """The latest rejected hints (``.jpfs/prefetch`` shows them)."""
        self._handles: dict[int, ControlHandle] = {}
        self._next_fh = CONTROL_FH
        self._snapshots: dict[int, tuple[bytes, int]] = {}
        self._last_snapshot_ns = 0

    @property
    def open_handles(self) -> int:
        """Control files and directories open now (the mount's stats count them)."""
        return len(self._handles)

    # ------------------------------------------------------------------ names and attributes

    async def lookup(self, parent: int, name: bytes, ctx) -> pyfuse3.EntryAttributes:
        """LOOKUP: ``.jpfs`` in the root, or a file in it (a fresh snapshot where the kernel
        opens files itself); ENOENT for any other name."""
        if parent == ROOT_INO:
            return self._entry(attr(CONTROL_DIR))
        ino = FILES.get(name) if parent == CONTROL_DIR else None
        if ino is None:
            raise error(errno.ENOENT, "no such control file")
        return self._file_entry(ino, fresh=True)

    async def getattr(self, inode: int, ctx) -> pyfuse3.EntryAttributes:
        """GETATTR: the control inode's attributes."""
        return self._file_entry(inode)

    setattr = mknod = mkdir = symlink = link = unlink = rmdir = rename = create = _refuse(
        errno.EPERM, "the .jpfs control directory cannot be changed")
    setxattr = removexattr = _refuse(errno.EPERM, "control files have no attributes")
    getxattr = _refuse(errno.ENODATA, "no such attribute")
    readlink = _refuse(errno.EINVAL, "control files are not symlinks")
    fallocate = _refuse(errno.EOPNOTSUPP, "control files take no space")

    async def listxattr(self, inode: int, ctx) -> list[bytes]:
        """LISTXATTR: none."""
        return []

    # ------------------------------------------------------------------ files

    async def open(self, inode: int, flags: int, ctx) -> pyfuse3.FileInfo:
        """OPEN: a handle on the file's content as it is now (read uncached); EACCES for
        writing but to ``prefetch``, EISDIR on the directory."""
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if inode == CONTROL_DIR:
            raise error(errno.EISDIR, "is a directory")
        if writing and inode != PREFETCH:
            raise error(errno.EACCES, "read-only control file")
        h = ControlHandle(inode, self._content(inode), bytearray() if writing else None, writing)
        return pyfuse3.FileInfo(fh=self._add(h), direct_io=True, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        """READ: of the handle's content; of the latest snapshot where the READ names the inode
        (the kernel opened the file itself)."""
        if is_control(fh):
            return self._snapshot(fh)[0][off:off + size]
        return self._handle(fh).content[off:off + size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        """WRITE to ``prefetch``: its complete lines are hints; all of ``buf`` is taken."""
        h = self._handle(fh)
        if not h.writable or h.pending is None:
            raise error(errno.EBADF, "not open for writing")
        h.pending += buf
        if len(h.pending) > HINT_BUFFER_MAX:
            h.pending.clear()
            self.hint_errors.append("a hint line longer than 16 MiB: dropped")
            raise error(errno.EINVAL, "prefetch hints: no newline in 16 MiB")
        nl = h.pending.rfind(b"\n")
        if nl >= 0:
            text = bytes(h.pending[:nl + 1])
            del h.pending[:nl + 1]
            await self.submit_hints(text)
        return len(buf)

    async def flush(self, fh: int) -> None:
        """FLUSH: a last line written without its newline is a hint too."""
        await self._submit_rest(self._handle(fh))

    async def fsync(self, fh: int, datasync: bool) -> None:
        """FSYNC: nothing to make durable."""

    async def release(self, fh: int) -> None:
        """RELEASE: free the handle (a hint left without its newline is submitted first)."""
        h = self._handles.pop(fh, None)
        if h is not None:
            try:
                await self._submit_rest(h)
            except JPFSError:
                pass  # logged; release cannot report it

    # ------------------------------------------------------------------ the directory

    async def opendir(self, inode: int, ctx) -> int:
        """OPENDIR: a handle on the listing."""
        return self._add(ControlHandle(inode))

    async def readdir(self, fh: int, start_id: int, token) -> None:
        """READDIR from ``start_id``: ``.``, ``..`` and the files, with their attributes."""
        h = self._handle(fh)
        entries = [(b".", self._entry(attr(h.ino))), (b"..", self._entry(self._root_attr()))]
        entries += [(n, self._file_entry(i)) for n, i in FILES.items()]
        for k in range(start_id, len(entries)):
            name, e = entries[k]
            if not readdir_reply(token, name, e, k + 1):
                return

    async def releasedir(self, fh: int) -> None:
        """RELEASEDIR: free the handle."""
        self._handles.pop(fh, None)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """FSYNCDIR: nothing to make durable."""

    # ------------------------------------------------------------------ hints

    async def submit_hints(self, text: bytes) -> None:
        """Queue the paths of complete hint lines (the control file's and the socket's);
        JPFSError, recorded for ``.jpfs/prefetch`` to show, if one is bad."""
        try:
            await self._prefetch.hint(parse_hints(text, self.mountpoint))
        except JPFSError as e:
            msg = e.strerror or str(e)
            self.hint_errors.append(msg)
            log.warning("prefetch hints rejected: %s", msg)
            raise

    async def _submit_rest(self, h: ControlHandle) -> None:
        if h.pending:
            text = bytes(h.pending)
            h.pending.clear()
            await self.submit_hints(text)

    # ------------------------------------------------------------------ handles and content

    def _add(self, h: ControlHandle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        return fh

    def _handle(self, fh: int) -> ControlHandle:
        h = self._handles.get(fh)
        if h is None:
            raise error(errno.EBADF, "no such control handle")
        return h

    def _content(self, inode: int) -> bytes:
        if inode == STATS:
            return stats_json(self._stats())
        if inode == METRICS:
            return generate_latest(self.registry)
        if inode == SOCKET:
            return (self.hint_socket + "\n").encode() if self.hint_socket else b""
        return prefetch_status(self._prefetch.as_dict(), list(self.hint_errors))

    def _snapshot(self, inode: int, fresh: bool = False) -> tuple[bytes, int]:
        """A control file's content and its mtime, taken now if ``fresh`` or never taken (the
        mtime always moves, so the kernel drops the pages of the previous one)."""
        if self.shared_snapshots is not None:
            return self._shared_snapshot(inode, fresh)
        snap = self._snapshots.get(inode)
        if snap is None or fresh:
            self._last_snapshot_ns = max(time.time_ns(), self._last_snapshot_ns + 1)
            snap = self._snapshots[inode] = (self._content(inode), self._last_snapshot_ns)
        return snap

    def _shared_snapshot(self, inode: int, fresh: bool) -> tuple[bytes, int]:
        """``_snapshot`` through files every worker reads: the latest any of them took."""
        assert self.shared_snapshots is not None
        path = self.shared_snapshots / str(inode)
        if not fresh:
            try:
                with open(path, "rb") as f:
                    return f.read(), os.fstat(f.fileno()).st_mtime_ns
            except FileNotFoundError:
                pass
        try:
            last = path.stat().st_mtime_ns
        except FileNotFoundError:
            last = 0
        content = self._content(inode)
        mtime_ns = max(time.time_ns(), last + 1)
        tmp = path.with_name(f".{inode}.{os.getpid()}")
        tmp.write_bytes(content)
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
        return content, mtime_ns

    def _file_entry(self, inode: int, fresh: bool = False) -> pyfuse3.EntryAttributes:
        """A control inode's entry; where the kernel opens files itself, a file's has its
        snapshot's size and mtime, and the kernel keeps it for no time (every open looks the
        name up)."""
        if inode == CONTROL_DIR or self._kernel_opens():
            return self._entry(attr(inode))
        content, mtime_ns = self._snapshot(inode, fresh)
        e = self._entry(attr(inode, len(content), mtime_ns))
        e.entry_timeout = e.attr_timeout = 0
        return e


__all__ = ["CONTROL_DIR", "CONTROL_FH", "CONTROL_NAME", "FILES", "METRICS", "PREFETCH", "STATS",
           "ControlHandle", "ControlTree", "attr", "in_tree", "is_control", "is_handle",
           "parse_hints", "prefetch_status", "stats_json"]
