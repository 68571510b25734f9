"""pyfuse3 Operations: the kernel's requests, translated to VFS calls.

This layer decides nothing about files. Each handler translates pyfuse3's arguments, calls
``jpfs.client.vfs.core.VFS`` and translates the answer (attributes with the kernel's timeouts, open
flags, directory entries). The ``.jpfs`` control directory (stats, metrics, prefetch hints) is a
mount feature and is answered here, before the VFS is asked.

Errors become ``FUSEError`` at one place, the ``fuse_op`` decorator, and nothing a handler raises
can end the mount: an errno-carrying error is answered as its errno; anything else (a bug, an
exception group, a cancellation that leaked from another task) is answered EIO and logged with
the operation, the path and the cause, and the mount goes on. Only a cancellation of the mount
itself (unmount, a signal) passes through.

On a read-only mount the kernel opens regular files without asking (``kernel_opens`` False: OPEN
is answered ENOSYS, see ``jpfs.fuse.lowlevel``): a READ's handle is then its inode, the VFS opens
the file at its first READ, and the control files are snapshots taken at each lookup of their
names, whose entries the kernel never keeps.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections import deque
from contextlib import aclosing
from dataclasses import dataclass

import pyfuse3
import trio
from prometheus_client import generate_latest

from ..client.vfs.core import VFS
from ..client.vfs.handles import DirHandle
from ..errors import JPFSError, errno_name, error
from ..types import ROOT_INO, Attr
from . import control
from .stats import MountStats, registry_for

log = logging.getLogger(__name__)

BLKSIZE = 1 << 20
"""st_blksize: tools size their I/O by it (Python's buffers, cp), and bigger I/O means fewer
requests."""
HINT_BUFFER_MAX = 16 << 20
CONTROL_FH = 1 << 62
"""Handles of control files are numbered from here (VFS handles count up from 1)."""

_TO_EIO = frozenset({errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EPROTO, errno.ECONNREFUSED,
                     errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE})
_EXPECTED = frozenset({errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENODATA, errno.EISDIR,
                       errno.ENOTDIR, errno.EROFS, errno.ENOSYS, errno.EINVAL, errno.EPERM,
                       errno.EACCES, errno.EXDEV, errno.ENAMETOOLONG, errno.ERANGE,
                       errno.EOPNOTSUPP, errno.EBADF, errno.ELOOP})
_NAMES = {e: errno_name(e) for e in _EXPECTED}
_FH_OPS = frozenset({"read", "write", "flush", "fsync", "release", "readdir", "releasedir",
                     "fsyncdir", "fallocate"})


@dataclass
class FuseConfig:
    """How the mount answers the kernel; see ``jpfs.fuse.mount.MountOptions``."""

    mountpoint: str = ""
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    negative_timeout: float = 0.0


@dataclass(slots=True, eq=False)
class ControlHandle:
    ino: int
    content: bytes = b""
    pending: bytearray | None = None
    writable: bool = False


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in _leaves(sub)]
    return [e]


def fuse_op(name: str):
    """Count the request, and turn whatever the handler raised into the kernel's answer: the
    one place where errors become FUSEError."""

    def deco(fn):
        @functools.wraps(fn)
        async def handler(self, *args):
            self.stats.requests[name] += 1
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError:
                raise
            except BaseException as e:  # noqa: BLE001 - the boundary: nothing may end the mount
                raise self._answer(name, args, e) from None

        return handler

    return deco


class Operations(pyfuse3.Operations):
    """The mount's request handlers, over one VFS; all state lives on pyfuse3's trio loop."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, vfs: VFS, config: FuseConfig, hint_socket: str = ""):
        super().__init__()
        self.vfs = vfs
        self.config = config
        self.stats = MountStats()
        self.hint_errors: deque[str] = deque(maxlen=20)
        self.registry = registry_for(self.snapshot)
        self.initialized = trio.Event()
        """Set when the kernel's INIT has been answered (its settings then apply)."""
        self.hint_socket = hint_socket
        """The Unix socket that takes prefetch hints ("" when there is none)."""
        self._controls: dict[int, ControlHandle] = {}
        self._next_control = CONTROL_FH
        self.kernel_opens = True
        """False once the mount answers OPEN with ENOSYS (read-only mounts whose READs name
        their inode): see the module docstring."""
        self.read_pids: dict[int, int] = {}
        """Inode -> the process of its latest READ (``lowlevel.InodeReads`` fills it)."""
        self._snapshots: dict[int, tuple[bytes, int]] = {}
        self._last_snapshot_ns = 0

    def init(self) -> None:
        """INIT: the kernel's settings are in force; sets ``initialized``."""
        self.initialized.set()

    # ------------------------------------------------------------------ the error boundary

    def _answer(self, op: str, args: tuple, e: BaseException) -> pyfuse3.FUSEError:
        """The FUSEError for an exception out of handler ``op``; re-raises what must end the
        mount (our own cancellation, KeyboardInterrupt, SystemExit)."""
        if isinstance(e, OSError) and e.errno in _EXPECTED:
            return self._counted(e.errno)  # the common case at once: ENOENT of lookups, ENODATA
            # of the capability check before every write
        leaves = _leaves(e)
        if any(isinstance(x, KeyboardInterrupt | SystemExit | GeneratorExit) for x in leaves):
            raise e
        if any(isinstance(x, trio.Cancelled) for x in leaves) \
                and trio.current_effective_deadline() == float("-inf"):
            raise e  # the mount itself is being cancelled (unmount, signal)
        os_errors = [x for x in leaves if isinstance(x, OSError)]
        if len(leaves) == 1 and os_errors and os_errors[0].errno:
            err = os_errors[0].errno
            if err in _TO_EIO:
                err = errno.EIO
            if err not in _EXPECTED:
                log.warning("%s of %s: %s", op, self._what(op, args),
                            os_errors[0].strerror or os_errors[0])
        else:
            err = errno.EIO
            log.error("%s of %s failed; answered EIO", op, self._what(op, args),
                      exc_info=(type(e), e, e.__traceback__))
        return self._counted(err)

    def _counted(self, err: int) -> pyfuse3.FUSEError:
        name = _NAMES.get(err) or errno_name(err)
        self.stats.errors[name] = self.stats.errors.get(name, 0) + 1
        return pyfuse3.FUSEError(err)

    def _what(self, op: str, args: tuple) -> str:
        """The path (or inode) a request was about, for log lines."""
        if not args or not isinstance(args[0], int):
            return "the mount"
        first = args[0]
        if op in _FH_OPS and (self.kernel_opens or op != "read"):
            h = self.vfs.handles.get(first)
            node = getattr(h, "node", None)
            return self.vfs.name_of(node) if node is not None else f"handle {first}"
        node = self.vfs.inodes.get(first)
        return self.vfs.name_of(node) if node is not None else f"inode {first}"

    # ------------------------------------------------------------------ translation

    def _entry(self, a: Attr, attr_timeout: float | None = None) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = self.config.entry_timeout
        e.attr_timeout = self.config.attr_timeout if attr_timeout is None else min(
            attr_timeout, self.config.attr_timeout)
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = a.uid
        e.st_gid = a.gid
        e.st_rdev = a.rdev
        e.st_size = a.size
        e.st_blksize = BLKSIZE
        e.st_blocks = a.blocks
        e.st_atime_ns = a.atime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.ctime_ns
        return e

    def _negative(self) -> pyfuse3.EntryAttributes:
        if self.config.negative_timeout <= 0:
            raise error(errno.ENOENT, "no such entry")
        e = pyfuse3.EntryAttributes()
        e.st_ino = 0
        e.entry_timeout = self.config.negative_timeout
        return e

    def _ctl(self, op: str) -> None:
        """Move a request on the control files out of the data counters."""
        self.stats.requests[op] -= 1
        self.stats.control_requests += 1

    @staticmethod
    def _no_control(parent: int, name: bytes) -> None:
        if control.is_control(parent) or (parent == ROOT_INO and name == control.CONTROL_NAME):
            raise error(errno.EPERM, "the .jpfs control directory cannot be changed")

    def snapshot(self) -> dict:
        """Everything the mount counts, as one JSON-able object."""
        vfs = self.vfs
        v = vfs.snapshot()
        return {
            "mount": {
                "mountpoint": self.config.mountpoint, "read_only": vfs.config.read_only,
                "kernel_opens": self.kernel_opens,
                "entry_timeout": self.config.entry_timeout,
                "attr_timeout": self.config.attr_timeout,
                "small_file": vfs.config.small_file, "notify_store": vfs.config.notify_store,
                "dir_leases": vfs.config.dir_leases, "write_behind": vfs.config.write_behind,
                "inodes": v["inodes"], "handles": v["handles"] + len(self._controls),
                "cluster": str(vfs.client.cluster.path or ""),
            },
            "fuse": self.stats.as_dict(v),
            "cache": vfs.cache.as_dict(),
            "prefetch": vfs.prefetcher.as_dict(),
            "storage": vfs.client.storage.as_dict() if vfs.client.storage else {},
            "names": v["names"],
            "leases": v["leases"],
        }

    # ------------------------------------------------------------------ names

    @fuse_op("lookup")
    async def lookup(self, parent: int, name: bytes, ctx) -> pyfuse3.EntryAttributes:
        """LOOKUP of ``name`` in ``parent``: its entry, or a negative entry (cached for
        ``negative_timeout``) where it does not exist; ENOENT when negative entries are off."""
        if control.is_control(parent) or (parent == ROOT_INO and name == control.CONTROL_NAME):
            self._ctl("lookup")
            if parent == ROOT_INO:
                return self._entry(control.attr(control.CONTROL_DIR))
            ino = control.FILES.get(name) if parent == control.CONTROL_DIR else None
            if ino is None:
                raise error(errno.ENOENT, "no such control file")
            return self._control_entry(ino, fresh=True)
        try:
            a = await self.vfs.lookup(parent, name)  # perhaps from memory: as old as it is
            return self._entry(a, self.vfs.fresh_for(a.ino))
        except JPFSError as e:
            if e.errno == errno.ENOENT:
                return self._negative()
            raise

    @fuse_op("forget")
    async def forget(self, inode_list) -> None:
        """FORGET: the kernel dropped these ``(inode, nlookup)`` references."""
        self.vfs.forget(inode_list)

    @fuse_op("getattr")
    async def getattr(self, inode: int, ctx) -> pyfuse3.EntryAttributes:
        """GETATTR: the inode's attributes."""
        if control.is_control(inode):
            self._ctl("getattr")
            return self._control_entry(inode)
        return self._entry(await self.vfs.getattr(inode))

    @fuse_op("setattr")
    async def setattr(self, inode: int, attr, fields, fh, ctx) -> pyfuse3.EntryAttributes:
        """SETATTR (chmod, chown, utimens, truncate): the attributes after the change; EPERM on
        control files."""
        if control.is_control(inode):
            self._ctl("setattr")
            raise error(errno.EPERM, "control files cannot be changed")
        changes: dict[str, int] = {}
        if fields.update_mode:
            changes["mode"] = attr.st_mode & 0o7777
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        if fields.update_ctime:
            changes["ctime_ns"] = attr.st_ctime_ns
        size = attr.st_size if fields.update_size else None
        return self._entry(await self.vfs.setattr(inode, changes, size))

    @fuse_op("readlink")
    async def readlink(self, inode: int, ctx) -> bytes:
        """READLINK: the symlink's target."""
        return await self.vfs.readlink(inode)

    @fuse_op("mknod")
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx):
        """MKNOD: the new node's entry (owned by the caller); EPERM inside ``.jpfs``."""
        self._no_control(parent, name)
        return self._entry(await self.vfs.mknod(parent, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_op("mkdir")
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx):
        """MKDIR: the new directory's entry (owned by the caller); EPERM inside ``.jpfs``."""
        self._no_control(parent, name)
        return self._entry(await self.vfs.mkdir(parent, name, mode, ctx.uid, ctx.gid))

    @fuse_op("symlink")
    async def symlink(self, parent: int, name: bytes, target: bytes, ctx):
        """SYMLINK: the new link's entry (owned by the caller); EPERM inside ``.jpfs``."""
        self._no_control(parent, name)
        return self._entry(await self.vfs.symlink(parent, name, target, ctx.uid, ctx.gid))

    @fuse_op("link")
    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx):
        """LINK: a new name for ``inode``, answered with its entry; EPERM for control files."""
        self._no_control(new_parent, new_name)
        if control.is_control(inode):
            raise error(errno.EPERM, "control files cannot be linked")
        return self._entry(await self.vfs.link(inode, new_parent, new_name))

    @fuse_op("unlink")
    async def unlink(self, parent: int, name: bytes, ctx) -> None:
        """UNLINK of ``name`` in ``parent``; EPERM inside ``.jpfs``."""
        self._no_control(parent, name)
        await self.vfs.unlink(parent, name)

    @fuse_op("rmdir")
    async def rmdir(self, parent: int, name: bytes, ctx) -> None:
        """RMDIR of ``name`` in ``parent``; EPERM inside ``.jpfs``."""
        self._no_control(parent, name)
        await self.vfs.rmdir(parent, name)

    @fuse_op("rename")
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx) -> None:
        """RENAME (``flags``: RENAME_NOREPLACE, RENAME_EXCHANGE); EPERM for control files."""
        self._no_control(parent_old, name_old)
        self._no_control(parent_new, name_new)
        await self.vfs.rename(parent_old, name_old, parent_new, name_new, flags)

    # ------------------------------------------------------------------ files

    @fuse_op("open")
    async def open(self, inode: int, flags: int, ctx) -> pyfuse3.FileInfo:
        """OPEN: a file handle; ENOSYS once the mount has stopped taking OPENs
        (``kernel_opens``)."""
        if not self.kernel_opens:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel opens files itself from now on
        if control.is_control(inode):
            self._ctl("open")
            return self._control_open(inode, flags)
        f = await self.vfs.open(inode, flags, ctx.pid)
        return pyfuse3.FileInfo(fh=f.fh, keep_cache=f.keep_cache)

    @fuse_op("create")
    async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx):
        """CREATE: a handle on the new (or, without O_EXCL, existing) file and its entry; EEXIST
        with O_EXCL."""
        self._no_control(parent, name)
        f, attr = await self.vfs.create(parent, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=f.fh, keep_cache=f.keep_cache), self._entry(attr)

    @fuse_op("read")
    async def read(self, fh: int, off: int, size: int):
        """READ: up to ``size`` bytes at ``off`` (fewer at end of file); without OPENs ``fh`` is
        the inode."""
        if not self.kernel_opens:  # no OPEN: the handle is the inode (lowlevel.InodeReads)
            if control.is_control(fh):
                self._ctl("read")
                return self._snapshot(fh)[0][off:off + size]
            return await self.vfs.read_unopened(fh, off, size, self.read_pids.pop(fh, 0))
        if fh >= CONTROL_FH:
            self._ctl("read")
            return self._control(fh).content[off:off + size]
        return await self.vfs.read(fh, off, size)

    @fuse_op("write")
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        """WRITE: the bytes taken (all of ``buf``); on the hints control file, a prefetch hint."""
        if fh >= CONTROL_FH:
            self._ctl("write")
            return await self._hint_write(self._control(fh), buf)
        return await self.vfs.write(fh, off, buf)

    @fuse_op("flush")
    async def flush(self, fh: int) -> None:
        """FLUSH (each close of a descriptor): commit the handle's writes; ENOSYS on read-only
        mounts, so that the kernel stops sending it."""
        if fh >= CONTROL_FH:
            self._ctl("flush")
            h = self._control(fh)
            if h.pending:
                await self._hint_submit(h, bytes(h.pending))
            return
        if self.vfs.ro:  # nothing to commit, ever: ENOSYS tells the kernel to stop sending FLUSH
            raise error(errno.ENOSYS, "flush is not needed")
        await self.vfs.flush(fh)

    @fuse_op("fsync")
    async def fsync(self, fh: int, datasync: bool) -> None:
        """FSYNC: make the handle's writes durable (nothing to do on read-only mounts)."""
        if fh < CONTROL_FH and not self.vfs.ro:  # a read-only mount has nothing to make durable
            await self.vfs.fsync(fh)

    @fuse_op("release")
    async def release(self, fh: int) -> None:
        """RELEASE (the last close of a handle): commit what is left and free the handle."""
        if fh >= CONTROL_FH:
            self._ctl("release")
            h = self._controls.pop(fh, None)
            if h is not None and h.pending:
                try:
                    await self._hint_submit(h, bytes(h.pending))
                except JPFSError:
                    pass  # logged; release cannot report it
            return
        await self.vfs.release(fh)

    @fuse_op("fallocate")
    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """FALLOCATE: reserve ``length`` bytes at ``off`` (modes 0 and KEEP_SIZE); EOPNOTSUPP on
        control files."""
        if fh >= CONTROL_FH:
            raise error(errno.EOPNOTSUPP, "control files take no space")
        await self.vfs.fallocate(fh, mode, off, length)

    # ------------------------------------------------------------------ directories

    @fuse_op("opendir")
    async def opendir(self, inode: int, ctx) -> int:
        """OPENDIR: a directory handle."""
        if control.is_control(inode):
            self._ctl("opendir")
            return self._add_control(ControlHandle(inode))
        return self.vfs.opendir(inode)

    @fuse_op("readdir")
    async def readdir(self, fh: int, start_id: int, token) -> None:
        """READDIR from ``start_id``: entries with their attributes (readdirplus) until the kernel's
        buffer is full; ``.jpfs`` in the root is the control directory's."""
        if fh >= CONTROL_FH:
            self._ctl("readdir")
            h = self._control(fh)
            entries = [(b".", self._entry(control.attr(h.ino))),
                       (b"..", self._entry(self.vfs.inodes.root.attr))]
            entries += [(n, self._control_entry(i)) for n, i in control.FILES.items()]
            for k in range(start_id, len(entries)):
                name, e = entries[k]
                if not pyfuse3.readdir_reply(token, name, e, k + 1):
                    return
            return
        dh = self.vfs.handles.get(fh)
        in_root = isinstance(dh, DirHandle) and dh.ino == ROOT_INO
        async with aclosing(self.vfs.readdir(fh, start_id)) as it:
            async for name, attr, nxt in it:
                if name == control.CONTROL_NAME and in_root:
                    continue  # a stored entry of that name is hidden by the control directory
                if not pyfuse3.readdir_reply(token, name, self._entry(attr), nxt):
                    return

    @fuse_op("releasedir")
    async def releasedir(self, fh: int) -> None:
        """RELEASEDIR: free the directory handle."""
        if fh >= CONTROL_FH:
            self._ctl("releasedir")
            self._controls.pop(fh, None)
            return
        self.vfs.releasedir(fh)

    @fuse_op("fsyncdir")
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """FSYNCDIR: make the directory's changes durable; EBADF for a handle opendir did not
        give."""
        if fh >= CONTROL_FH:
            return
        h = self.vfs.handles.get(fh)
        if not isinstance(h, DirHandle):  # the kernel fsyncs only what opendir opened
            raise error(errno.EBADF, "no such directory handle")
        await self.vfs.fsyncdir(h.ino)

    # ------------------------------------------------------------------ filesystem

    @fuse_op("statfs")
    async def statfs(self, ctx) -> pyfuse3.StatvfsData:
        """STATFS: the filesystem's totals (``statvfs``)."""
        st = await self.vfs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = st.block_size
        s.f_blocks = st.blocks
        s.f_bfree = s.f_bavail = st.blocks_free
        s.f_files = st.files
        s.f_ffree = s.f_favail = st.files_free
        s.f_namemax = st.name_max
        return s

    @fuse_op("getxattr")
    async def getxattr(self, inode: int, name: bytes, ctx) -> bytes:
        """GETXATTR: the attribute's value; ENODATA where it is not set."""
        if control.is_control(inode):
            self._ctl("getxattr")
            raise error(errno.ENODATA, "no such attribute")
        return await self.vfs.getxattr(inode, name)

    @fuse_op("setxattr")
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx) -> None:
        """SETXATTR: set the attribute; EPERM on control files."""
        if control.is_control(inode):
            raise error(errno.EPERM, "control files have no attributes")
        await self.vfs.setxattr(inode, name, value)

    @fuse_op("listxattr")
    async def listxattr(self, inode: int, ctx) -> list[bytes]:
        """LISTXATTR: the names of the inode's extended attributes."""
        if control.is_control(inode):
            self._ctl("listxattr")
            return []
        return await self.vfs.listxattr(inode)

    @fuse_op("removexattr")
    async def removexattr(self, inode: int, name: bytes, ctx) -> None:
        """REMOVEXATTR: remove the attribute; EPERM on control files."""
        if control.is_control(inode):
            raise error(errno.EPERM, "control files have no attributes")
        await self.vfs.removexattr(inode, name)

    # ------------------------------------------------------------------ control files

    def _add_control(self, h: ControlHandle) -> int:
        fh = self._next_control
        self._next_control += 1
        self._controls[fh] = h
        return fh

    def _control(self, fh: int) -> ControlHandle:
        h = self._controls.get(fh)
        if h is None:
            raise error(errno.EBADF, "no such control handle")
        return h

    def _control_content(self, inode: int) -> bytes:
        if inode == control.STATS:
            return control.stats_json(self.snapshot())
        if inode == control.METRICS:
            return generate_latest(self.registry)
        if inode == control.SOCKET:
            return (self.hint_socket + "\n").encode() if self.hint_socket else b""
        return control.prefetch_status(self.vfs.prefetcher.as_dict(), list(self.hint_errors))

    def _control_open(self, inode: int, flags: int) -> pyfuse3.FileInfo:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if inode == control.CONTROL_DIR:
            raise error(errno.EISDIR, "is a directory")
        if writing and inode != control.PREFETCH:
            raise error(errno.EACCES, "read-only control file")
        h = ControlHandle(inode, self._control_content(inode),
                          bytearray() if writing else None, writing)
        return pyfuse3.FileInfo(fh=self._add_control(h), direct_io=True, keep_cache=False)

    def _snapshot(self, inode: int, fresh: bool = False) -> tuple[bytes, int]:
        """A control file's content and its mtime, taken now if ``fresh`` or never taken (the
        mtime always moves, so the kernel drops the pages of the previous one)."""
        snap = self._snapshots.get(inode)
        if snap is None or fresh:
            self._last_snapshot_ns = max(time.time_ns(), self._last_snapshot_ns + 1)
            snap = self._snapshots[inode] = (self._control_content(inode),
                                             self._last_snapshot_ns)
        return snap

    def _control_entry(self, inode: int, fresh: bool = False) -> pyfuse3.EntryAttributes:
        """A control file's entry; where the kernel opens files itself, with its snapshot's
        size and mtime, and kept by the kernel for no time (every open looks the name up)."""
        if self.kernel_opens or inode == control.CONTROL_DIR:
            return self._entry(control.attr(inode))
        content, mtime_ns = self._snapshot(inode, fresh)
        e = self._entry(control.attr(inode, len(content), mtime_ns))
        e.entry_timeout = e.attr_timeout = 0
        return e

    async def _hint_write(self, h: ControlHandle, buf: bytes) -> int:
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
            await self._hint_submit(h, text, keep_pending=True)
        return len(buf)

    async def _hint_submit(self, h: ControlHandle, text: bytes, keep_pending: bool = False
                           ) -> None:
        if not keep_pending and h.pending is not None:
            h.pending.clear()
        await self.submit_hints(text)

    async def submit_hints(self, text: bytes) -> None:
        """Queue the paths of complete hint lines (the control file's and the socket's);
        JPFSError, recorded for ``.jpfs/prefetch`` to show, if one is bad."""
        try:
            paths = control.parse_hints(text, self.config.mountpoint)
            await self.vfs.prefetcher.hint(paths)
        except JPFSError as e:
            msg = e.strerror or str(e)
            self.hint_errors.append(msg)
            log.warning("prefetch hints rejected: %s", msg)
            raise


__all__ = ["BLKSIZE", "FuseConfig", "Operations", "fuse_op"]
