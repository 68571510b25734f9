"""FALLOCATE, which pyfuse3 does not dispatch, served through libfuse's own operations table;
and FOPEN_NOFLUSH on read opens, which pyfuse3's ``FileInfo`` cannot set.

pyfuse3 3.5 registers no ``fallocate`` handler, so libfuse answers the kernel's FALLOCATE with
ENOSYS, the kernel stops asking and every ``fallocate(2)`` on the mount fails with EOPNOTSUPP
(``posix_fallocate`` then falls back to writing zeros a block at a time). libfuse copies the
table it is given into its session (``struct fuse_session.op``), and that copy is what it
dispatches from. After ``pyfuse3.init`` this module finds the copy by comparing it, byte for byte,
with pyfuse3's own table (both symbols are in pyfuse3's ELF symbol table), checks that the slots
pyfuse3 fills are exactly the ones it fills at the offsets of libfuse's ``struct
fuse_lowlevel_ops``, and only then points the copy's ``fallocate`` slot at a ctypes callback. The
callback starts a trio task (it runs on pyfuse3's loop thread, inside libfuse's dispatch) that
calls ``Operations.fallocate`` and answers with ``fuse_reply_err``. If any check fails, nothing is
written and fallocate stays unsupported (logged once), so a pyfuse3 or libfuse whose layout
differs costs a feature, never a crash.

The same table's ``open`` slot is pointed at a ctypes callback that sets ``noflush`` in the
request's ``fuse_file_info`` when the file is opened for reading only, then calls pyfuse3's own
handler, which copies the struct and answers with it: libfuse turns the bit into FOPEN_NOFLUSH, and
the kernel's ``close`` of that file no longer sends FLUSH (a read handle has nothing to commit).
A read-only mount needs none of this (it answers the first FLUSH with ENOSYS, which stops them
all); on a read-write mount it is one FUSE request fewer per read open.

A read-only mount goes further and answers OPEN with ENOSYS: the kernel then stops sending OPEN
and RELEASE for every regular file (``fc->no_open``) and opens each with handle 0 and its page
cache kept, so a file the kernel caches costs no request at all. READs then carry handle 0, and
pyfuse3 passes its handler the handle, not the inode: ``InodeReads`` wraps the ``read`` slot to
put the inode into the request's ``fuse_file_info`` (and note which process reads, which pyfuse3
gives only to handlers that take a request context) before pyfuse3 copies it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import struct
from collections.abc import Callable

import pyfuse3
import trio

log = logging.getLogger(__name__)

# struct fuse_lowlevel_ops (libfuse 3.x; members are only ever appended): slot indexes
_SLOTS = ("init", "destroy", "lookup", "forget", "getattr", "setattr", "readlink", "mknod",
          "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "open", "read", "write",
          "flush", "release", "fsync", "opendir", "readdir", "releasedir", "fsyncdir", "statfs",
          "setxattr", "getxattr", "listxattr", "removexattr", "access", "create", "getlk",
          "setlk", "bmap", "ioctl", "poll", "write_buf", "retrieve_reply", "forget_multi",
          "flock", "fallocate", "readdirplus", "copy_file_range", "lseek")
_PYFUSE3_FILLS = frozenset({
    "init", "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink",
    "rmdir", "symlink", "rename", "link", "open", "read", "write", "flush", "release", "fsync",
    "opendir", "readdirplus", "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr",
    "listxattr", "removexattr", "access", "create", "forget_multi", "write_buf", "poll"})
_FH_OFFSET = 16
"""offsetof(struct fuse_file_info, fh): int flags, two 32-bit bit-field words, then fh."""
_SESSION_SEARCH = 1024
"""How far into struct fuse_session the table copy is looked for (it sits near the start)."""

_FLAGS_WORD = 4
"""offsetof(struct fuse_file_info, the first bit-field word) (after ``int flags``)."""
_NOFLUSH_BIT = 1 << 7
"""``noflush`` in that word: writepage, direct_io, keep_cache, flush, nonseekable,
flock_release, cache_readdir, noflush (libfuse 3.11+; GCC packs bit-fields from bit 0)."""
_NOFLUSH_SINCE = (3, 11)

_OPEN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
_OPEN_PYFUSE3 = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
"""pyfuse3's handler, called with the GIL held (as libfuse's dispatch calls it)."""

_READ = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                         ctypes.c_int64, ctypes.c_void_p)
_READ_PYFUSE3 = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                  ctypes.c_int64, ctypes.c_void_p)
_CTX_PID_OFFSET = 8
"""offsetof(struct fuse_ctx, pid): uid_t uid, gid_t gid, then pid_t pid."""

_FALLOCATE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


def _symbols(path: str, names: set[str]) -> dict[str, tuple[int, int]]:
    """(value, size) of the named symbols in an ELF64 little-endian file's .symtab."""
    out: dict[str, tuple[int, int]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            return out
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize)
                    for i in range(shnum)]
        for sh in sections:
            if sh[1] != 2:  # SHT_SYMTAB
                continue
            str_off = sections[sh[6]][4]
            for k in range(sh[5] // 24):
                name_off, _info, _other, _shndx, value, size = struct.unpack_from(
                    "<IBBHQQ", m, sh[4] + k * 24)
                end = m.find(b"\0", str_off + name_off)
                name = m[str_off + name_off:end].decode(errors="replace")
                if name in names:
                    out[name] = (value, size)
    return out


def _load_base(path: str) -> int | None:
    """Where the shared object at ``path`` is mapped in this process (its offset-0 mapping)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and os.path.realpath(parts[5]) == real and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    return None


_tables: dict[int, int] = {}
"""Session address -> address of its copy of the operations table (found once: once a slot is
changed, the copy no longer matches pyfuse3's table)."""


def _session_slot(name: str) -> int | str:
    """The address of slot ``name`` in the live session's copy of the operations table, or
    why it cannot be found (a layout this module does not know)."""
    so = pyfuse3.__file__
    syms = _symbols(so, {"__pyx_v_7pyfuse3_fuse_ops", "__pyx_v_7pyfuse3_session"})
    if len(syms) != 2:
        return "pyfuse3 was built without its symbol table"
    base = _load_base(so)
    if base is None:
        return "pyfuse3's mapping not found"
    session = ctypes.c_void_p.from_address(base + syms["__pyx_v_7pyfuse3_session"][0])
    if not session.value:
        return "no session (call after pyfuse3.init)"
    at = _tables.get(session.value)
    if at is None:
        table_addr, table_size = syms["__pyx_v_7pyfuse3_fuse_ops"]
        table_addr += base
        if table_size != len(_SLOTS) * 8:
            return f"struct fuse_lowlevel_ops is {table_size} bytes, not {len(_SLOTS) * 8}"
        table = ctypes.string_at(table_addr, table_size)
        slots = struct.unpack(f"<{len(_SLOTS)}Q", table)
        filled = {n for n, ptr in zip(_SLOTS, slots, strict=True) if ptr}
        if filled != _PYFUSE3_FILLS:
            return f"pyfuse3 fills other slots: {sorted(filled ^ _PYFUSE3_FILLS)}"
        window = ctypes.string_at(session.value, _SESSION_SEARCH + table_size)
        found = window.find(table)
        if found < 0 or found % 8 or window.find(table, found + 1) >= 0:
            return "the session's copy of the table was not found exactly once"
        at = _tables[session.value] = session.value + found
    return at + _SLOTS.index(name) * 8


@functools.cache
def _libfuse() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("fuse3") or "libfuse3.so.3")


def _libfuse_version() -> tuple[int, int]:
    lib = _libfuse()
    lib.fuse_version.restype = ctypes.c_int
    v = lib.fuse_version()  # major * 100 + minor (3.14 -> 314)
    return v // 100, v % 100


def _installed(attempt: Callable[[], str | None], without: str) -> bool:
    """Run ``attempt`` (None, or why the layout is unknown); False, logged with what the mount
    does ``without`` it, if it did not install."""
    try:
        why = attempt()
    except (OSError, ValueError, struct.error) as e:
        why = f"{type(e).__name__}: {e}"
    if why:
        log.info("%s on this mount: %s", without, why)
        return False
    return True


def _wrap(name: str, callback, pyfunctype) -> Callable | str:
    """Point the session's slot ``name`` at ``callback``; pyfuse3's own handler (to call on), or
    why it cannot be wrapped."""
    slot = _session_slot(name)
    if isinstance(slot, str):
        return slot
    ptr = ctypes.c_void_p.from_address(slot)
    if not ptr.value:
        return f"pyfuse3 has no {name} handler"
    handler = pyfunctype(ptr.value)
    ptr.value = ctypes.cast(callback, ctypes.c_void_p).value
    return handler


class NoFlushOnRead:
    """Sets FOPEN_NOFLUSH on opens for reading only (see the module docstring)."""

    def __init__(self) -> None:
        self._callback = _OPEN(self._open)  # kept alive as long as the session
        self._pyfuse3: Callable[[int, int, int], None] | None = None
        self.opens = 0

    def install(self) -> bool:
        """Wrap the session's open slot; False (and logged) if the layout is unknown."""
        return _installed(self._install, "read opens keep their FLUSH")

    def _install(self) -> str | None:
        if _libfuse_version() < _NOFLUSH_SINCE:
            return "libfuse is older than 3.11 (no noflush)"
        handler = _wrap("open", self._callback, _OPEN_PYFUSE3)
        if isinstance(handler, str):
            return handler
        self._pyfuse3 = handler
        return None

    def _open(self, req, ino, fi) -> None:
        """Serve libfuse's open callback, on the loop thread: mark a read-only open, then hand the
        request to pyfuse3 (never raise into C)."""
        try:
            flags = ctypes.c_int.from_address(fi).value
            if flags & (os.O_ACCMODE | os.O_TRUNC) == os.O_RDONLY:
                word = ctypes.c_uint32.from_address(fi + _FLAGS_WORD)
                word.value |= _NOFLUSH_BIT
                self.opens += 1
        except BaseException:  # noqa: BLE001 - nothing may unwind through libfuse
            log.exception("open: could not mark a read open")
        assert self._pyfuse3 is not None
        self._pyfuse3(req, ino, fi)


class InodeReads:
    """READs that name their inode when the kernel sends no OPEN (see the module docstring)."""

    def __init__(self) -> None:
        self._callback = _READ(self._read)  # kept alive as long as the session
        self._pyfuse3: Callable[[int, int, int, int, int], None] | None = None
        self._req_ctx = _libfuse().fuse_req_ctx
        self._req_ctx.argtypes = [ctypes.c_void_p]
        self._req_ctx.restype = ctypes.c_void_p
        self.pids: dict[int, int] = {}
        """Inode -> the process whose READ of it came last, until its handler takes it."""
        self.installed = False
        """Whether READs name their inode now (the mount then answers OPEN with ENOSYS)."""

    def install(self) -> bool:
        """Wrap the session's read slot; False (and logged) if the layout is unknown, and then
        the mount must keep answering OPEN."""
        return _installed(self._install, "the kernel keeps sending OPEN and RELEASE")

    def _install(self) -> str | None:
        handler = _wrap("read", self._callback, _READ_PYFUSE3)
        if isinstance(handler, str):
            return handler
        self._pyfuse3 = handler
        self.installed = True
        return None

    def _read(self, req, ino, size, off, fi) -> None:
        """Serve libfuse's read callback, on the loop thread: a READ of a file the kernel opened
        itself (handle 0) gets the inode as its handle, then goes to pyfuse3 (never raise into
        C)."""
        try:
            fh = ctypes.c_uint64.from_address(fi + _FH_OFFSET)
            if fh.value == 0:
                fh.value = ino
                ctx = self._req_ctx(req)
                if ctx:
                    self.pids[ino] = ctypes.c_int32.from_address(ctx + _CTX_PID_OFFSET).value
        except BaseException:  # noqa: BLE001 - nothing may unwind through libfuse
            log.exception("read: could not name the inode")
        assert self._pyfuse3 is not None
        self._pyfuse3(req, ino, size, off, fi)


class Fallocate:
    """Installs and serves FALLOCATE for one mounted session (see the module docstring)."""

    def __init__(self, ops, nursery: trio.Nursery):
        self.ops = ops
        self.nursery = nursery
        self._callback = _FALLOCATE(self._request)  # kept alive as long as the session
        self._libfuse = _libfuse()
        self._libfuse.fuse_reply_err.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._libfuse.fuse_reply_err.restype = ctypes.c_int

    def install(self) -> bool:
        """Point the session's fallocate slot at our callback; False (and logged) if the
        layout is not the one this module knows."""
        return _installed(self._install, "fallocate stays unsupported")

    def _install(self) -> str | None:
        slot = _session_slot("fallocate")
        if isinstance(slot, str):
            return slot
        ctypes.c_void_p.from_address(slot).value = ctypes.cast(self._callback,
                                                               ctypes.c_void_p).value
        return None

    def _request(self, req, ino, mode, offset, length, fi) -> None:
        """Serve libfuse's callback, on the loop thread: answer in a task (never raise into
        C)."""
        try:
            fh = ctypes.c_uint64.from_address(fi + _FH_OFFSET).value
            self.nursery.start_soon(self._serve, req, fh, mode, offset, length)
        except BaseException:  # noqa: BLE001 - nothing may unwind through libfuse
            log.exception("fallocate request could not be started")
            self._libfuse.fuse_reply_err(req, errno.EIO)

    async def _serve(self, req, fh: int, mode: int, offset: int, length: int) -> None:
        err = errno.EINTR
        try:
            await self.ops.fallocate(fh, mode, offset, length)
            err = 0
        except pyfuse3.FUSEError as e:
            err = e.errno
        finally:
            self._libfuse.fuse_reply_err(req, err)


__all__ = ["Fallocate", "InodeReads", "NoFlushOnRead"]
