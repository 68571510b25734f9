"""FALLOCATE, which pyfuse3 does not dispatch, served through libfuse's own operations table.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import struct

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


class Fallocate:
    """Installs and serves FALLOCATE for one mounted session (see the module docstring)."""

    def __init__(self, ops, nursery: trio.Nursery):
        self.ops = ops
        self.nursery = nursery
        self._callback = _FALLOCATE(self._request)  # kept alive as long as the session
        name = ctypes.util.find_library("fuse3")
        self._libfuse = ctypes.CDLL(name or "libfuse3.so.3")
        self._libfuse.fuse_reply_err.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._libfuse.fuse_reply_err.restype = ctypes.c_int

    def install(self) -> bool:
        """Point the session's fallocate slot at our callback; False (and logged) if the
        layout is not the one this module knows."""
        try:
            why = self._install()
        except (OSError, ValueError, struct.error) as e:
            why = f"{type(e).__name__}: {e}"
        if why:
            log.info("fallocate stays unsupported on this mount: %s", why)
            return False
        return True

    def _install(self) -> str | None:
        so = pyfuse3.__file__
        syms = _symbols(so, {"__pyx_v_7pyfuse3_fuse_ops", "__pyx_v_7pyfuse3_session"})
        if len(syms) != 2:
            return "pyfuse3 was built without its symbol table"
        base = _load_base(so)
        if base is None:
            return "pyfuse3's mapping not found"
        table_addr, table_size = syms["__pyx_v_7pyfuse3_fuse_ops"]
        table_addr += base
        if table_size != len(_SLOTS) * 8:
            return f"struct fuse_lowlevel_ops is {table_size} bytes, not {len(_SLOTS) * 8}"
        table = ctypes.string_at(table_addr, table_size)
        slots = struct.unpack(f"<{len(_SLOTS)}Q", table)
        filled = {name for name, ptr in zip(_SLOTS, slots, strict=True) if ptr}
        if filled != _PYFUSE3_FILLS:
            return f"pyfuse3 fills other slots: {sorted(filled ^ _PYFUSE3_FILLS)}"
        session = ctypes.c_void_p.from_address(base + syms["__pyx_v_7pyfuse3_session"][0])
        if not session.value:
            return "no session (call after pyfuse3.init)"
        window = ctypes.string_at(session.value, _SESSION_SEARCH + table_size)
        at = window.find(table)
        if at < 0 or at % 8 or window.find(table, at + 1) >= 0:
            return "the session's copy of the table was not found exactly once"
        slot = session.value + at + _SLOTS.index("fallocate") * 8
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


__all__ = ["Fallocate"]
