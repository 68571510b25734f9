"""The FUSE wire protocol (``<linux/fuse.h>``): opcodes, the structs JPFS reads and writes, and
the encoders of its answers. Pure: no descriptor, no state, so every message is testable alone.

A request is a ``fuse_in_header`` and an opcode's body; an answer is a ``fuse_out_header``
(its ``error`` a negative errno, or 0) and the opcode's body; a notification is an answer with
``unique`` 0 and the notification's code as ``error``. Protocol 7.31 is what JPFS speaks (the
kernel speaks the older minor where it is older); the fields added later are padding here.
"""

from __future__ import annotations

import stat
import struct
from dataclasses import dataclass

MAJOR, MINOR = 7, 31
"""The protocol version JPFS speaks: 7.28 brought ``max_pages``, 7.31 is libfuse 3.10's."""

PAGE = 4096
MAX_PAGES = 256
"""Pages per request: reads and writes of up to 1 MiB, as libfuse asks for."""
BUFSIZE = MAX_PAGES * PAGE + PAGE
"""The largest request (a 1 MiB WRITE and its header); the kernel refuses a smaller read."""

# opcodes
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK = 8, 9, 10, 11, 12, 13
OPEN, READ, WRITE, STATFS, RELEASE, FSYNC = 14, 15, 16, 17, 18, 20
SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW = 27, 28, 29, 30, 31, 32, 33
ACCESS, CREATE, INTERRUPT, BMAP, DESTROY, IOCTL, POLL = 34, 35, 36, 37, 38, 39, 40
NOTIFY_REPLY, BATCH_FORGET, FALLOCATE, READDIRPLUS, RENAME2 = 41, 42, 43, 44, 45
LSEEK, COPY_FILE_RANGE, SYNCFS, TMPFILE, STATX = 46, 47, 50, 51, 52

NAMES = {v: k.lower() for k, v in dict(globals()).items()
         if k.isupper() and isinstance(v, int) and 1 <= v <= 52 and k not in (
             "MAJOR", "MINOR", "MAX_PAGES")}
"""Opcode -> its name (for log lines and counters)."""

NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})
"""Requests the kernel expects no answer to (an INTERRUPT is answered through its request)."""

CHANGES = frozenset({SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE,
                     SETXATTR, REMOVEXATTR, CREATE, FALLOCATE, RENAME2, COPY_FILE_RANGE,
                     TMPFILE})
"""Requests that change the tree or a file."""

# INIT flags (the first 32 bits; ``flags2`` holds the rest from 7.36)
ASYNC_READ, ATOMIC_O_TRUNC, BIG_WRITES = 1 << 0, 1 << 3, 1 << 5
AUTO_INVAL_DATA, DO_READDIRPLUS, READDIRPLUS_AUTO = 1 << 12, 1 << 13, 1 << 14
ASYNC_DIO, WRITEBACK_CACHE, NO_OPEN_SUPPORT, PARALLEL_DIROPS = 1 << 15, 1 << 16, 1 << 17, 1 << 18
MAX_PAGES_FLAG, CACHE_SYMLINKS, NO_OPENDIR_SUPPORT = 1 << 22, 1 << 23, 1 << 24

# open flags of an answer
FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NONSEEKABLE, FOPEN_CACHE_DIR = 1, 2, 4, 8
FOPEN_NOFLUSH = 1 << 5

# notification codes
NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY, NOTIFY_STORE = 2, 3, 4

IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # major, minor, max_readahead, flags,
# max_background, congestion_threshold, max_write, time_gran, max_pages, map_alignment,
# flags2, max_stack_depth; unused: 64 bytes
ATTR = struct.Struct("<QQQqqqIIIIIIIIII")  # fuse_attr: ino, size, blocks, a/m/ctime,
# a/m/ctime nsec, mode, nlink, uid, gid, rdev, blksize, flags: 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (+ nsec); then attr
ATTR_OUT = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy; then attr
OPEN_IN = struct.Struct("<II")  # flags, open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
READ_IN = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, padding
RELEASE_IN = struct.Struct("<QIIQ")  # fh, flags, release_flags, lock_owner
FSYNC_IN = struct.Struct("<QII")  # fh, fsync_flags, padding
FORGET_IN = struct.Struct("<Q")  # nlookup
BATCH_FORGET_IN = struct.Struct("<II")  # count, dummy; then count x FORGET_ONE
FORGET_ONE = struct.Struct("<QQ")  # nodeid, nlookup
INTERRUPT_IN = struct.Struct("<Q")  # unique
GETXATTR_IN = struct.Struct("<II")  # size, padding; then the name
GETXATTR_OUT = struct.Struct("<II")  # size, padding
STATFS_OUT = struct.Struct("<QQQQQIII28x")  # blocks, bfree, bavail, files, ffree, bsize,
# namelen, frsize; padding, spare: 80 bytes
DIRENT = struct.Struct("<QQII")  # ino, off, namelen, type; then the name, padded to 8
NOTIFY_STORE_OUT = struct.Struct("<QQII")  # nodeid, offset, size, padding
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino, off, len
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent, namelen, flags; then the name, NUL

assert IN_HEADER.size == 40 and INIT_OUT.size == 64 and ATTR.size == 88
assert ENTRY_OUT.size + ATTR.size == 128 and STATFS_OUT.size == 80 and READ_IN.size == 40


@dataclass(slots=True)
class Request:
    """One request: its header's fields and its body (a copy: the read buffer is reused)."""

    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    body: bytes

    @property
    def name(self) -> str:
        """The opcode's name (``lookup``), or ``opcode N``."""
        return NAMES.get(self.opcode, f"opcode {self.opcode}")

    def names(self, skip: int = 0) -> list[bytes]:
        """The NUL-terminated names that end the body, after its first ``skip`` bytes."""
        return self.body[skip:].split(b"\0")[:-1]


class ProtocolError(ValueError):
    """A message from the kernel that does not parse (answered EIO, never fatal)."""


def parse(buf: bytes | bytearray | memoryview, n: int) -> Request:
    """The request in the first ``n`` bytes read into ``buf``."""
    if n < IN_HEADER.size:
        raise ProtocolError(f"a request of {n} bytes is shorter than its header")
    length, opcode, unique, nodeid, uid, gid, pid, _ = IN_HEADER.unpack_from(buf)
    if length != n:
        raise ProtocolError(f"request {unique}: the header says {length} bytes, {n} were read")
    return Request(opcode, unique, nodeid, uid, gid, pid, bytes(buf[IN_HEADER.size:n]))


def header(unique: int, size: int, error: int = 0) -> bytes:
    """An answer's header for ``size`` bytes of body; ``error`` is a positive errno or 0."""
    return OUT_HEADER.pack(OUT_HEADER.size + size, -error, unique)


def split_ns(ns: int) -> tuple[int, int]:
    """Nanoseconds since the epoch as (seconds, nanoseconds), for times before 1970 too."""
    return divmod(ns, 1_000_000_000)


def timeout(seconds: float) -> tuple[int, int]:
    """A validity in seconds as the protocol's (seconds, nanoseconds)."""
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


@dataclass(slots=True)
class Attributes:
    """What ``fuse_attr`` carries, with the validity of the entry and of the attributes."""

    ino: int
    mode: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    size: int = 0
    blocks: int = 0
    blksize: int = PAGE
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    entry_timeout: float = 0.0
    attr_timeout: float = 0.0
    generation: int = 0


def attr_bytes(a: Attributes) -> bytes:
    """``fuse_attr`` of ``a``."""
    asec, ansec = split_ns(a.atime_ns)
    msec, mnsec = split_ns(a.mtime_ns)
    csec, cnsec = split_ns(a.ctime_ns)
    return ATTR.pack(a.ino, a.size, a.blocks, asec, msec, csec, ansec, mnsec, cnsec, a.mode,
                     a.nlink, a.uid, a.gid, a.rdev, a.blksize, 0)


def entry_out(a: Attributes) -> bytes:
    """``fuse_entry_out``: a LOOKUP's answer (``ino`` 0: a negative entry, cached for
    ``entry_timeout``)."""
    es, ens = timeout(a.entry_timeout)
    as_, ans = timeout(a.attr_timeout)
    return ENTRY_OUT.pack(a.ino, a.generation, es, as_, ens, ans) + attr_bytes(a)


def attr_out(a: Attributes) -> bytes:
    """``fuse_attr_out``: a GETATTR's (or SETATTR's) answer."""
    s, ns = timeout(a.attr_timeout)
    return ATTR_OUT.pack(s, ns, 0) + attr_bytes(a)


def open_out(fh: int, *, keep_cache: bool = False, direct_io: bool = False,
             noflush: bool = False, cache_dir: bool = False) -> bytes:
    """``fuse_open_out``: an OPEN's (or OPENDIR's) answer."""
    flags = (FOPEN_KEEP_CACHE if keep_cache else 0) | (FOPEN_DIRECT_IO if direct_io else 0) | \
        (FOPEN_NOFLUSH if noflush else 0) | (FOPEN_CACHE_DIR if cache_dir else 0)
    return OPEN_OUT.pack(fh, flags, 0)


def statfs_out(blocks: int, bfree: int, bavail: int, files: int, ffree: int, bsize: int,
               namelen: int, frsize: int) -> bytes:
    """``fuse_statfs_out``."""
    return STATFS_OUT.pack(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize)


def _padded(record: bytes) -> bytes:
    return record + b"\0" * (-len(record) % 8)


def dirent(name: bytes, a: Attributes, next_off: int) -> bytes:
    """One ``fuse_dirent`` of a READDIR answer; ``next_off`` is where the listing goes on."""
    return _padded(DIRENT.pack(a.ino, next_off, len(name), stat.S_IFMT(a.mode) >> 12) + name)


def direntplus(name: bytes, a: Attributes, next_off: int) -> bytes:
    """One ``fuse_direntplus`` of a READDIRPLUS answer: the entry (the kernel counts a lookup
    of it, but of "." and "..") and the directory entry."""
    return entry_out(a) + dirent(name, a, next_off)


def xattr_answer(value: bytes, size: int) -> bytes:
    """A GETXATTR's (or LISTXATTR's) body: the value's length when asked with ``size`` 0, else
    the value; raises OverflowError (ERANGE) when it does not fit."""
    if size == 0:
        return GETXATTR_OUT.pack(len(value), 0)
    if len(value) > size:
        raise OverflowError("the value is larger than the buffer")
    return value


def notify_store(nodeid: int, offset: int, size: int) -> bytes:
    """The header and ``fuse_notify_store_out`` of a store of ``size`` bytes at ``offset`` (the
    bytes follow)."""
    return OUT_HEADER.pack(OUT_HEADER.size + NOTIFY_STORE_OUT.size + size, NOTIFY_STORE, 0) \
        + NOTIFY_STORE_OUT.pack(nodeid, offset, size, 0)


def notify_inval_inode(nodeid: int, offset: int = 0, length: int = 0) -> bytes:
    """An invalidation of the inode's attributes and of its pages in [offset, offset+length)
    (``offset`` -1: the attributes only; ``length`` 0: to the end)."""
    body = NOTIFY_INVAL_INODE_OUT.pack(nodeid, offset, length)
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0) + body


def notify_inval_entry(parent: int, name: bytes) -> bytes:
    """An invalidation of the kernel's entry ``name`` in ``parent``."""
    body = NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_ENTRY, 0) + body


def init_out(major: int, minor: int, max_readahead: int, offered: int, wanted: int, *,
             max_background: int = 64, max_write: int = MAX_PAGES * PAGE) -> tuple[bytes, int]:
    """INIT's answer to a kernel speaking ``major.minor`` that ``offered`` these flags: the body
    and the flags in force (``wanted`` of them the kernel offered)."""
    if major != MAJOR:
        raise ProtocolError(f"the kernel speaks FUSE {major}.{minor}; JPFS speaks {MAJOR}.x")
    if minor < 28:
        raise ProtocolError(f"the kernel speaks FUSE 7.{minor}; JPFS needs 7.28 (Linux 4.20)")
    flags = offered & wanted
    body = INIT_OUT.pack(MAJOR, min(minor, MINOR), max_readahead, flags, max_background,
                         max_background * 3 // 4, max_write, 1, MAX_PAGES, 0, 0, 0)
    return body, flags


__all__ = ["BUFSIZE", "CHANGES", "MAJOR", "MINOR", "NAMES", "NO_REPLY", "Attributes",
           "ProtocolError", "Request", "attr_out", "direntplus", "dirent", "entry_out",
           "header", "init_out", "notify_inval_entry", "notify_inval_inode", "notify_store",
           "open_out", "parse", "statfs_out", "xattr_answer"]
