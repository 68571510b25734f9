"""A naive pyfuse3 passthrough of a local directory: what a FUSE layer alone costs here.

``jpfs bench mount --phases namespace`` runs its workload on the local filesystem, through this
mount of a local directory and through JPFS, in the same run. This file system does nothing but
forward each request to the matching system call on the directory below, on one trio loop, with
the kernel settings of a read-write JPFS mount (entry and attribute timeouts of 1 s,
``default_permissions``): the distance from it to the local filesystem is what the kernel's
FUSE round trips and a Python daemon cost on this machine, and the distance from JPFS to it is
what JPFS itself costs (the network hops to the shards and storage nodes, durability, the
caches).

Run as ``python -m jpfs_bench.passthrough SOURCE MOUNTPOINT``; it mounts, writes ``ready`` to
stdout, and serves until unmounted or sent SIGTERM/SIGINT. Nothing of JPFS is imported.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

TIMEOUT = 1.0
"""Entry and attribute timeouts, as a read-write JPFS mount's."""


def _fuse_errors(fn):
    async def wrapper(*args):
        try:
            return await fn(*args)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

    wrapper.__name__ = fn.__name__
    return wrapper


class Passthrough(pyfuse3.Operations):
    """Every request forwarded to the directory ``source`` (inode numbers are the source's)."""

    enable_writeback_cache = False

    def __init__(self, source: str):
        super().__init__()
        self.source = source
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: source}
        self.lookups: dict[int, int] = {}
        self.fds: dict[int, int] = {}

    # ---- inodes
    def _path(self, ino: int) -> str:
        try:
            return self.paths[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def _entry(self, path: str) -> pyfuse3.EntryAttributes:
        st = os.lstat(path)
        e = pyfuse3.EntryAttributes()
        e.st_ino = pyfuse3.ROOT_INODE if path == self.source else st.st_ino
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                     "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(e, name, getattr(st, name))
        e.entry_timeout = e.attr_timeout = TIMEOUT
        return e

    def _remember(self, path: str) -> pyfuse3.EntryAttributes:
        e = self._entry(path)
        self.paths[e.st_ino] = path
        self.lookups[e.st_ino] = self.lookups.get(e.st_ino, 0) + 1
        return e

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._path(parent), os.fsdecode(name))

    async def forget(self, inode_list) -> None:
        """FORGET: drop the kernel's lookups; an inode no longer looked up forgets its path."""
        for ino, n in inode_list:
            left = self.lookups.get(ino, 0) - n
            if left > 0:
                self.lookups[ino] = left
            else:
                self.lookups.pop(ino, None)
                if ino != pyfuse3.ROOT_INODE:
                    self.paths.pop(ino, None)

    # ---- names
    @_fuse_errors
    async def lookup(self, parent, name, ctx=None):
        """LOOKUP: the entry of ``name`` in ``parent`` (``lstat`` below)."""
        return self._remember(self._child(parent, name))

    @_fuse_errors
    async def getattr(self, inode, ctx=None):
        """GETATTR: the inode's ``lstat``."""
        return self._entry(self._path(inode))

    @_fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        """SETATTR: truncate, chmod, chown, utime below as asked; the attributes after."""
        path = self._path(inode)
        if fields.update_size:
            os.truncate(path, attr.st_size)
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            os.chown(path, attr.st_uid if fields.update_uid else -1,
                     attr.st_gid if fields.update_gid else -1, follow_symlinks=False)
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(path)
            os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                               attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns),
                     follow_symlinks=False)
        return self._entry(path)

    @_fuse_errors
    async def mkdir(self, parent, name, mode, ctx):
        """MKDIR below; the new directory's entry."""
        path = self._child(parent, name)
        os.mkdir(path, mode)
        return self._remember(path)

    @_fuse_errors
    async def rmdir(self, parent, name, ctx):
        """RMDIR below."""
        os.rmdir(self._child(parent, name))

    @_fuse_errors
    async def unlink(self, parent, name, ctx):
        """UNLINK below."""
        os.unlink(self._child(parent, name))

    @_fuse_errors
    async def rename(self, parent_old, name_old, parent_new, name_new, flags, ctx):
        """RENAME below (no flags: EINVAL for RENAME_NOREPLACE/EXCHANGE)."""
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old, new = self._child(parent_old, name_old), self._child(parent_new, name_new)
        ino = os.lstat(old).st_ino
        os.rename(old, new)
        if ino in self.paths:
            self.paths[ino] = new

    # ---- files
    @_fuse_errors
    async def create(self, parent, name, mode, flags, ctx):
        """CREATE: open(O_CREAT) below; the descriptor is the handle."""
        path = self._child(parent, name)
        fd = os.open(path, flags | os.O_CREAT, mode)
        e = self._remember(path)
        self.fds[fd] = fd
        return pyfuse3.FileInfo(fh=fd), e

    @_fuse_errors
    async def open(self, inode, flags, ctx):
        """OPEN below; the descriptor is the handle."""
        fd = os.open(self._path(inode), flags & ~os.O_CREAT)
        self.fds[fd] = fd
        return pyfuse3.FileInfo(fh=fd)

    @_fuse_errors
    async def read(self, fh, off, size):
        """READ: ``pread`` on the handle's descriptor."""
        return os.pread(fh, size, off)

    @_fuse_errors
    async def write(self, fh, off, buf):
        """WRITE: ``pwrite`` on the handle's descriptor; the bytes written."""
        return os.pwrite(fh, buf, off)

    async def flush(self, fh):
        """FLUSH: nothing to do (writes went below at once)."""
        pass

    @_fuse_errors
    async def fsync(self, fh, datasync):
        """FSYNC: fdatasync or fsync the handle's descriptor."""
        (os.fdatasync if datasync else os.fsync)(fh)

    @_fuse_errors
    async def release(self, fh):
        """RELEASE: close the handle's descriptor."""
        if self.fds.pop(fh, None) is not None:
            os.close(fh)

    # ---- directories
    @_fuse_errors
    async def opendir(self, inode, ctx):
        """OPENDIR: the inode is the handle."""
        self._path(inode)
        return inode

    @_fuse_errors
    async def readdir(self, fh, start_id, token):
        """READDIR: the directory's entries in name order, each with its ``lstat``."""
        path = self._path(fh)
        names = sorted(os.listdir(path))
        for k in range(start_id, len(names)):
            child = os.path.join(path, names[k])
            e = self._entry(child)
            if not pyfuse3.readdir_reply(token, os.fsencode(names[k]), e, k + 1):
                return
            self.paths[e.st_ino] = child  # pyfuse3 answers READDIRPLUS: each entry is a lookup
            self.lookups[e.st_ino] = self.lookups.get(e.st_ino, 0) + 1

    async def releasedir(self, fh):
        """RELEASEDIR: nothing to free."""
        pass

    @_fuse_errors
    async def statfs(self, ctx):
        """STATFS: the source directory's ``statvfs``."""
        st = os.statvfs(self.source)
        s = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(s, name, getattr(st, name))
        return s

    # ---- extended attributes (the kernel asks for security.capability before every write)
    @_fuse_errors
    async def getxattr(self, inode, name, ctx):
        """GETXATTR below (symlinks not followed); ENODATA where it is not set."""
        try:
            return os.getxattr(self._path(inode), os.fsdecode(name), follow_symlinks=False)
        except OSError as e:
            raise pyfuse3.FUSEError(errno.ENODATA if e.errno == errno.ENODATA else
                                    e.errno or errno.EIO) from None

    @_fuse_errors
    async def listxattr(self, inode, ctx):
        """LISTXATTR below (symlinks not followed)."""
        return [os.fsencode(n) for n in os.listxattr(self._path(inode), follow_symlinks=False)]


def main(argv: list[str]) -> None:
    """``python -m jpfs_bench.passthrough SOURCE MOUNTPOINT``: mount, print ``ready``, serve until
    unmounted or SIGTERM/SIGINT."""
    source, mountpoint = argv
    ops = Passthrough(os.path.abspath(source))
    pyfuse3.init(ops, mountpoint, {"fsname=jpfs-bench-passthrough", "default_permissions"})

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            async def stop() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

            nursery.start_soon(stop)
            print("ready", flush=True)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main(sys.argv[1:])
