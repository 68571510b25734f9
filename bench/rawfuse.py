"""A read-only passthrough that speaks the FUSE protocol itself, on several threads.

What would a mount daemon that is not tied to one event loop read at? pyfuse3 reads its
``/dev/fuse`` descriptor in its own loop, one request after another on one thread: the naive
pyfuse3 passthrough (``passthrough.py``) shows that ceiling. This file system answers the kernel
directly: it mounts with mount(2), answers INIT, then clones the session's descriptor
(``FUSE_DEV_IOC_CLONE``) once per extra thread. Clones share the connection's queue of requests;
each thread reads a request from its own descriptor, serves it with a system call on the
directory below (``pread``, ``lstat``, ``listdir``) and writes the answer to that same
descriptor, since the kernel looks a request up among the ones its reader's descriptor handed
out. Reads and writes of the descriptor and ``pread`` release the GIL, so threads overlap where
the bytes are.

It serves what reading needs (LOOKUP, GETATTR, READLINK, OPEN, READ, RELEASE, OPENDIR,
READDIR, RELEASEDIR, STATFS, FLUSH, FORGET) and, with ``--read-write``, what the namespace
phase's writers do (CREATE, MKDIR, UNLINK, RMDIR, RENAME, SETATTR, WRITE, FSYNC, GETXATTR:
the kernel asks for ``security.capability`` before each write, as through the pyfuse3 one),
with that passthrough's kernel settings: entry and attribute timeouts of 1 s,
``default_permissions``, cached pages kept across opens, no writeback cache, up to 1 MiB a
request. Anything else is answered ENOSYS.

Run as ``python -m jpfs_bench.rawfuse SOURCE MOUNTPOINT [--threads N] [--read-write]`` (root);
it mounts, writes ``ready`` to stdout, and serves until unmounted or sent SIGTERM/SIGINT.
Nothing of JPFS is imported.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import os
import signal
import stat
import struct
import sys
import threading
import time

TIMEOUT = 1
"""Entry and attribute timeouts in seconds, as the pyfuse3 passthrough's."""

MAX_PAGES = 256
"""Pages per request: reads of up to 1 MiB, as libfuse asks for."""

BUFSIZE = MAX_PAGES * 4096 + 4096
"""A request's largest size; the kernel refuses a smaller read of its descriptor."""

# <linux/fuse.h>: protocol 7.31 (max_pages is 7.28); the kernel speaks older minors to us.
MAJOR, MINOR = 7, 31
FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_SETATTR, FUSE_READLINK = 1, 2, 3, 4, 5
FUSE_MKDIR, FUSE_UNLINK, FUSE_RMDIR, FUSE_RENAME = 9, 10, 11, 12
FUSE_OPEN, FUSE_READ, FUSE_WRITE, FUSE_STATFS, FUSE_RELEASE = 14, 15, 16, 17, 18
FUSE_FSYNC, FUSE_GETXATTR, FUSE_CREATE, FUSE_RENAME2 = 20, 22, 35, 45
FUSE_FLUSH, FUSE_INIT, FUSE_OPENDIR, FUSE_READDIR, FUSE_RELEASEDIR = 25, 26, 27, 28, 29
FUSE_INTERRUPT, FUSE_DESTROY, FUSE_BATCH_FORGET = 36, 38, 42
NO_REPLY = {FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT}
FUSE_ASYNC_READ, FUSE_BIG_WRITES, FUSE_PARALLEL_DIROPS, FUSE_MAX_PAGES = 1, 1 << 5, 1 << 18, 1 << 22
FOPEN_KEEP_CACHE = 1 << 1
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2

IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # 64 bytes
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (+ nsec); then attr
ATTR_OUT = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy; then attr
OPEN_OUT = struct.Struct("<QII")  # fh, open_flags, padding
READ_IN = struct.Struct("<QQI")  # fh, offset, size (then read_flags, lock_owner, flags)
RELEASE_IN = struct.Struct("<Q")  # fh
DIRENT = struct.Struct("<QQII")  # ino, off, namelen, type; then the name, padded to 8
STATFS_OUT = struct.Struct("<QQQQQIII28x")  # blocks, bfree, bavail, files, ffree, bsize,
# namelen, frsize; padding and spare
OPEN_IN = struct.Struct("<I")  # flags
CREATE_IN = struct.Struct("<IIII")  # flags, mode, umask, open_flags; then the name
MKDIR_IN = struct.Struct("<II")  # mode, umask; then the name
RENAME_IN = struct.Struct("<Q")  # newdir; then both names
RENAME2_IN = struct.Struct("<QII")  # newdir, flags, padding; then both names
WRITE_IN = struct.Struct("<QQI4xQI4x")  # fh, offset, size, (write_flags), lock_owner, flags
WRITE_OUT = struct.Struct("<II")  # size, padding
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # valid, pad, fh, size, lock_owner, atime,
# mtime, ctime, atimensec, mtimensec, ctimensec, mode, unused, uid, gid, unused
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE, FATTR_ATIME, FATTR_MTIME = 1, 2, 4, 8, 16, 32
FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 7, 1 << 8
GETXATTR_IN = struct.Struct("<II")  # size, padding; then the name


def names(body: memoryview) -> list[bytes]:
    """The NUL-terminated names that end a request."""
    return bytes(body).split(b"\0")


def attr_bytes(st: os.stat_result, ino: int) -> bytes:
    """A ``fuse_attr`` of ``st`` under node id ``ino``."""
    return ATTR.pack(ino, st.st_size, st.st_blocks, int(st.st_atime), int(st.st_mtime),
                     int(st.st_ctime), st.st_atime_ns % 10**9, st.st_mtime_ns % 10**9,
                     st.st_ctime_ns % 10**9, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                     st.st_rdev, st.st_blksize, 0)


class RawPassthrough:
    """The directory ``source``, served; inode numbers are the source's (1 its root)."""

    def __init__(self, source: str):
        self.source = source
        self.paths: dict[int, str] = {1: source}  # never forgotten: a benchmark's lifetime
        self.listings: dict[int, list[tuple[int, int, bytes]]] = {}
        self.next_dir = 1
        self.lock = threading.Lock()

    # ---- answers: each returns the reply's payload or raises OSError (its errno is the answer)
    def _ino(self, path: str, st: os.stat_result) -> int:
        return 1 if path == self.source else st.st_ino

    def _child(self, nodeid: int, name: bytes | memoryview) -> str:
        return os.path.join(self.paths[nodeid], os.fsdecode(bytes(name)))

    def _entry(self, path: str) -> bytes:
        st = os.lstat(path)
        ino = self._ino(path, st)
        self.paths[ino] = path
        return ENTRY_OUT.pack(ino, 0, TIMEOUT, TIMEOUT, 0, 0) + attr_bytes(st, ino)

    def lookup(self, nodeid: int, body: memoryview) -> bytes:
        """LOOKUP: the entry of the name in ``nodeid``."""
        return self._entry(self._child(nodeid, names(body)[0]))

    def getattr(self, nodeid: int, body: memoryview) -> bytes:
        """GETATTR: the node's ``lstat``, valid for ``TIMEOUT`` seconds."""
        st = os.lstat(self.paths[nodeid])
        return ATTR_OUT.pack(TIMEOUT, 0, 0) + attr_bytes(st, nodeid)

    def readlink(self, nodeid: int, body: memoryview) -> bytes:
        """READLINK: the symlink's target."""
        return os.fsencode(os.readlink(self.paths[nodeid]))

    def open(self, nodeid: int, body: memoryview) -> bytes:
        """OPEN: a descriptor below as the handle, pages kept across opens (FOPEN_KEEP_CACHE)."""
        flags = OPEN_IN.unpack_from(body)[0] & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY)
        fd = os.open(self.paths[nodeid], flags | os.O_CLOEXEC)
        return OPEN_OUT.pack(fd, FOPEN_KEEP_CACHE, 0)

    # ---- changes (--read-write)
    def create(self, nodeid: int, body: memoryview) -> bytes:
        """CREATE: open(O_CREAT) below; the entry and the descriptor as the handle."""
        flags, mode = CREATE_IN.unpack_from(body)[:2]
        path = self._child(nodeid, names(body[CREATE_IN.size:])[0])
        fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, mode)
        try:
            return self._entry(path) + OPEN_OUT.pack(fd, FOPEN_KEEP_CACHE, 0)
        except OSError:
            os.close(fd)
            raise

    def mkdir(self, nodeid: int, body: memoryview) -> bytes:
        """MKDIR below; the new directory's entry."""
        mode = MKDIR_IN.unpack_from(body)[0]
        path = self._child(nodeid, names(body[MKDIR_IN.size:])[0])
        os.mkdir(path, mode)
        return self._entry(path)

    def unlink(self, nodeid: int, body: memoryview) -> bytes:
        """UNLINK below."""
        os.unlink(self._child(nodeid, names(body)[0]))
        return b""

    def rmdir(self, nodeid: int, body: memoryview) -> bytes:
        """RMDIR below."""
        os.rmdir(self._child(nodeid, names(body)[0]))
        return b""

    def rename(self, nodeid: int, body: memoryview) -> bytes:
        """RENAME below (no flags)."""
        return self._rename(nodeid, RENAME_IN.unpack_from(body)[0], 0, body[RENAME_IN.size:])

    def rename2(self, nodeid: int, body: memoryview) -> bytes:
        """RENAME2 below, with its flags."""
        newdir, flags, _ = RENAME2_IN.unpack_from(body)
        return self._rename(nodeid, newdir, flags, body[RENAME2_IN.size:])

    def _rename(self, nodeid: int, newdir: int, flags: int, body: memoryview) -> bytes:
        if flags:
            raise OSError(errno.EINVAL, "rename flags")
        old_name, new_name = names(body)[:2]
        old, new = self._child(nodeid, old_name), self._child(newdir, new_name)
        ino = os.lstat(old).st_ino
        os.rename(old, new)
        if ino in self.paths:
            self.paths[ino] = new
        return b""

    def setattr(self, nodeid: int, body: memoryview) -> bytes:
        """SETATTR: truncate, chmod, chown, utime below as ``valid`` says; the attributes after."""
        (valid, _, _, size, _, atime, mtime, _, atime_ns, mtime_ns, _, mode, _, uid, gid,
         _) = SETATTR_IN.unpack_from(body)
        path = self.paths[nodeid]
        if valid & FATTR_SIZE:
            os.truncate(path, size)
        if valid & FATTR_MODE:
            os.chmod(path, stat.S_IMODE(mode))
        if valid & (FATTR_UID | FATTR_GID):
            os.chown(path, uid if valid & FATTR_UID else -1, gid if valid & FATTR_GID else -1,
                     follow_symlinks=False)
        if valid & (FATTR_ATIME | FATTR_MTIME | FATTR_ATIME_NOW | FATTR_MTIME_NOW):
            st = os.lstat(path)
            now = time.time_ns()
            a = now if valid & FATTR_ATIME_NOW else \
                atime * 10**9 + atime_ns if valid & FATTR_ATIME else st.st_atime_ns
            m = now if valid & FATTR_MTIME_NOW else \
                mtime * 10**9 + mtime_ns if valid & FATTR_MTIME else st.st_mtime_ns
            os.utime(path, ns=(a, m), follow_symlinks=False)
        return self.getattr(nodeid, body)

    def write(self, nodeid: int, body: memoryview) -> bytes:
        """WRITE: ``pwrite`` on the handle's descriptor; the bytes written."""
        fh, offset, size = WRITE_IN.unpack_from(body)[:3]
        data = body[WRITE_IN.size:WRITE_IN.size + size]
        return WRITE_OUT.pack(os.pwrite(fh, data, offset), 0)

    def fsync(self, nodeid: int, body: memoryview) -> bytes:
        """FSYNC: fdatasync or fsync the handle's descriptor."""
        fh, flags = struct.unpack_from("<QI", body)
        (os.fdatasync if flags & 1 else os.fsync)(fh)
        return b""

    def getxattr(self, nodeid: int, body: memoryview) -> bytes:
        """GETXATTR below: the value, or its size when asked with size 0; ERANGE if it does not
        fit."""
        size = GETXATTR_IN.unpack_from(body)[0]
        name = os.fsdecode(names(body[GETXATTR_IN.size:])[0])
        value = os.getxattr(self.paths[nodeid], name, follow_symlinks=False)
        if size == 0:
            return WRITE_OUT.pack(len(value), 0)
        if len(value) > size:
            raise OSError(errno.ERANGE, "xattr too large")
        return value

    def release(self, nodeid: int, body: memoryview) -> bytes:
        """RELEASE: close the handle's descriptor."""
        os.close(RELEASE_IN.unpack_from(body)[0])
        return b""

    def opendir(self, nodeid: int, body: memoryview) -> bytes:
        """OPENDIR: list the directory once, in name order; the listing's number is the handle."""
        path = self.paths[nodeid]
        entries = []
        with os.scandir(path) as it:
            for e in sorted(it, key=lambda e: e.name):
                st = e.stat(follow_symlinks=False)
                entries.append((st.st_ino, stat.S_IFMT(st.st_mode) >> 12, os.fsencode(e.name)))
        with self.lock:
            fh = self.next_dir
            self.next_dir += 1
            self.listings[fh] = entries
        return OPEN_OUT.pack(fh, 0, 0)

    def readdir(self, nodeid: int, body: memoryview) -> bytes:
        """READDIR: the listing's entries from ``offset`` that fit in ``size`` bytes."""
        fh, offset, size = READ_IN.unpack_from(body)
        out = bytearray()
        entries = self.listings[fh]
        for k in range(offset, len(entries)):
            ino, kind, name = entries[k]
            rec = DIRENT.pack(ino, k + 1, len(name), kind) + name
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return bytes(out)

    def releasedir(self, nodeid: int, body: memoryview) -> bytes:
        """RELEASEDIR: forget the listing."""
        self.listings.pop(RELEASE_IN.unpack_from(body)[0], None)
        return b""

    def statfs(self, nodeid: int, body: memoryview) -> bytes:
        """STATFS: the source directory's ``statvfs``."""
        s = os.statvfs(self.source)
        return STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree,
                               s.f_bsize, s.f_namemax, s.f_frsize)

    def flush(self, nodeid: int, body: memoryview) -> bytes:
        """FLUSH: nothing to do (writes went below at once)."""
        return b""

    # ---- the protocol
    def serve(self, fd: int, read_write: bool = False) -> None:
        """Read requests from ``fd`` and answer them on it, until the mount goes away."""
        buf = bytearray(BUFSIZE)
        view = memoryview(buf)
        data = bytearray(MAX_PAGES * 4096)
        dview = memoryview(data)
        handlers = {FUSE_LOOKUP: self.lookup, FUSE_GETATTR: self.getattr,
                    FUSE_READLINK: self.readlink, FUSE_OPEN: self.open,
                    FUSE_RELEASE: self.release, FUSE_OPENDIR: self.opendir,
                    FUSE_READDIR: self.readdir, FUSE_RELEASEDIR: self.releasedir,
                    FUSE_STATFS: self.statfs, FUSE_FLUSH: self.flush}
        if read_write:
            handlers.update({
                FUSE_CREATE: self.create, FUSE_MKDIR: self.mkdir, FUSE_UNLINK: self.unlink,
                FUSE_RMDIR: self.rmdir, FUSE_RENAME: self.rename, FUSE_RENAME2: self.rename2,
                FUSE_SETATTR: self.setattr, FUSE_WRITE: self.write, FUSE_FSYNC: self.fsync,
                FUSE_GETXATTR: self.getxattr})
        while True:
            try:
                n = os.readv(fd, [buf])
            except OSError as e:
                if e.errno == errno.ENODEV:  # unmounted
                    return
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                raise
            length, opcode, unique, nodeid = IN_HEADER.unpack_from(buf)[:4]
            body = view[IN_HEADER.size:min(n, length)]
            if opcode in NO_REPLY:
                continue
            parts: list = []
            err = 0
            try:
                if opcode == FUSE_READ:
                    fh, offset, size = READ_IN.unpack_from(body)
                    got = os.preadv(fh, [dview[:size]], offset)
                    parts = [dview[:got]]
                elif opcode == FUSE_DESTROY:
                    pass
                else:
                    handler = handlers.get(opcode)
                    if handler is None:
                        err = errno.ENOSYS
                    else:
                        parts = [handler(nodeid, body)]
            except KeyError:  # a node id this file system never gave (or a stale one)
                err = errno.ENOENT
            except OSError as e:
                err = e.errno or errno.EIO
            except Exception as e:  # a request it cannot parse: answered, and the thread goes on
                print(f"rawfuse: opcode {opcode}: {e!r}", file=sys.stderr)
                err = errno.EIO
            if err:
                parts = []
            size = OUT_HEADER.size + sum(len(p) for p in parts)
            try:
                os.writev(fd, [OUT_HEADER.pack(size, -err, unique), *parts])
            except OSError as e:  # ENOENT: the request was interrupted meanwhile
                if e.errno == errno.ENODEV:
                    return
                if e.errno != errno.ENOENT:
                    raise


def answer_init(fd: int) -> None:
    """Read the kernel's INIT from the session's descriptor and accept it."""
    buf = bytearray(BUFSIZE)
    os.readv(fd, [buf])
    _, opcode, unique = IN_HEADER.unpack_from(buf)[:3]
    if opcode != FUSE_INIT:
        raise RuntimeError(f"the first FUSE request was opcode {opcode}, not INIT")
    major, minor, max_readahead, offered = INIT_IN.unpack_from(buf, IN_HEADER.size)
    if major != MAJOR:
        raise RuntimeError(f"the kernel speaks FUSE {major}.{minor}; this speaks {MAJOR}.x")
    want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES
    out = INIT_OUT.pack(MAJOR, min(minor, MINOR), max_readahead, offered & want,
                        16, 12, 128 << 10, 1, MAX_PAGES, 0, 0, 0)
    os.writev(fd, [OUT_HEADER.pack(OUT_HEADER.size + len(out), 0, unique), out])


def clone(session_fd: int) -> int:
    """Another descriptor on the same FUSE connection (it shares the request queue)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", session_fd))
    return fd


def mount(mountpoint: str, fsname: str, read_write: bool = False) -> int:
    """A FUSE file system mounted at ``mountpoint`` by the system call (root): its session fd."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    st = os.stat(mountpoint)
    opts = (f"fd={fd},rootmode={stat.S_IFDIR:o},user_id={st.st_uid},group_id={st.st_gid},"
            f"allow_other,default_permissions,max_read={MAX_PAGES * 4096}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(fsname.encode(), mountpoint.encode(), f"fuse.{fsname}".encode(),
                  (0 if read_write else MS_RDONLY) | MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise OSError(e, f"mount {mountpoint}: {os.strerror(e)}")
    return fd


def unmount(mountpoint: str) -> None:
    """Detach the mount at ``mountpoint`` (umount2 MNT_DETACH; a failure is ignored)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(mountpoint.encode(), MNT_DETACH)


def main(argv: list[str]) -> None:
    """``python -m jpfs_bench.rawfuse SOURCE MOUNTPOINT [--threads N] [--read-write]``: mount and
    print ``ready``, serve until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("--threads", type=int, default=4, help="serving threads (default 4)")
    p.add_argument("--read-write", action="store_true",
                   help="serve changes too (default: a read-only mount)")
    args = p.parse_args(argv)
    fs = RawPassthrough(os.path.abspath(args.source))
    mountpoint = os.path.abspath(args.mountpoint)
    session = mount(mountpoint, "jpfs-bench-rawfuse", args.read_write)
    try:
        answer_init(session)
        fds = [session] + [clone(session) for _ in range(args.threads - 1)]
    except BaseException:
        unmount(mountpoint)
        raise
    done = threading.Event()  # set by a signal, or by a thread whose descriptor closed

    def serve(fd: int) -> None:
        try:
            fs.serve(fd, args.read_write)
        finally:
            done.set()

    threads = [threading.Thread(target=serve, args=(fd,), daemon=True) for fd in fds]
    for t in threads:
        t.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print("ready", flush=True)
    done.wait()
    unmount(mountpoint)
    for t in threads:
        t.join(timeout=5)


if __name__ == "__main__":
    main(sys.argv[1:])
