"""pyfuse3 Operations: the kernel's requests, translated to VFS calls.

This layer decides nothing about files. Each handler translates pyfuse3's arguments, calls
``jpfs.client.vfs.core.VFS`` and translates the answer (attributes with the kernel's timeouts, open
flags, directory entries). The ``.jpfs`` control directory (stats, metrics, prefetch hints) is a
mount feature, answered by ``jpfs.fuse.control.ControlTree``: ``fuse_op`` sends it every request
on its inodes, names and handles before the handler (and so the VFS) is reached, the one place
the adapter tells the two apart.

Errors become ``FUSEError`` at one place, the ``fuse_op`` decorator, and nothing a handler raises
can end the mount: an errno-carrying error is answered as its errno; anything else (a bug, an
exception group, a cancellation that leaked from another task) is answered EIO and logged with
the operation, the path and the cause, and the mount goes on. Only a cancellation of the mount
itself (unmount, a signal) passes through.

On a read-only mount the kernel opens regular files without asking (``kernel_opens`` False once
``lowlevel.InodeReads`` is installed in the session: OPEN is answered ENOSYS, for control files
too): a READ's handle is then its inode, the VFS opens the file at its first READ, and the control
files are snapshots taken at each lookup of their names, whose entries the kernel never keeps.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyfuse3
import trio

from ..client.vfs.core import VFS
from ..client.vfs.handles import DirHandle
from ..errors import JPFSError, errno_name, error
from ..types import ROOT_INO, Attr
from . import control
from .control import ControlTree
from .dirreply import readdir_reply
from .stats import MountStats

if TYPE_CHECKING:
    from .lowlevel import InodeReads

log = logging.getLogger(__name__)

BLKSIZE = 1 << 20
"""st_blksize: tools size their I/O by it (Python's buffers, cp), and bigger I/O means fewer
requests."""

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
    cluster: str = ""
    """The cluster file (the stats name it)."""
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    negative_timeout: float = 0.0


def _leaves(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in _leaves(sub)]
    return [e]


_COUNTED_AS_DATA = frozenset({"mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename",
                              "create", "readlink", "fsync", "fallocate", "fsyncdir", "setxattr",
                              "removexattr"})
"""Requests on the control tree counted with the data requests, as they always were: attempts
to change the tree, and requests that reading it never sends. Reading it (lookups, attributes,
opens, reads, listings, hints) is counted apart, so that reading the stats changes no figure."""

Route = Callable[[Any, tuple], bool]
"""Whether a request (the adapter, the request's arguments) is the control tree's."""


def _inode(ops, args: tuple) -> bool:
    return control.is_control(args[0])


def _name(ops, args: tuple) -> bool:
    return control.in_tree(args[0], args[1])


def _handle(ops, args: tuple) -> bool:
    return control.is_handle(args[0])


def _opened(ops, args: tuple) -> bool:
    return ops.kernel_opens and control.is_control(args[0])  # else ENOSYS, as for any file


def _read(ops, args: tuple) -> bool:  # without OPENs the handle is the inode
    return control.is_handle(args[0]) if ops.kernel_opens else control.is_control(args[0])


def _renamed(ops, args: tuple) -> bool:
    return control.in_tree(args[0], args[1]) or control.in_tree(args[2], args[3])


def _linked(ops, args: tuple) -> bool:
    return control.is_control(args[0]) or control.in_tree(args[1], args[2])


def fuse_op(name: str, control_if: Route | None = None):
    """Count the request, send it to the control tree where ``control_if`` says it is the
    tree's (the one place the adapter routes ``.jpfs``; counted apart but for
    ``_COUNTED_AS_DATA``), and turn whatever was raised into the kernel's answer: the one place
    where errors become FUSEError."""
    to_data = name in _COUNTED_AS_DATA

    def deco(fn):
        @functools.wraps(fn)
        async def handler(self, *args):
            try:
                if control_if is not None and control_if(self, args):
                    if to_data:
                        self.stats.requests[name] += 1
                    else:
                        self.stats.control_requests += 1
                    return await getattr(self.control, name)(*args)
                self.stats.requests[name] += 1
                return await fn(self, *args)
            except pyfuse3.FUSEError:
                raise
            except BaseException as e:  # noqa: BLE001 - the boundary: nothing may end the mount
                raise self._answer(name, args, e) from None

        handler.control_if = control_if  # type: ignore[attr-defined]
        return handler

    return deco


class HasStats(Protocol):
    """A part whose counters the stats show."""

    def as_dict(self) -> dict:
        """Its counters, as one JSON-able object."""
        ...


class Operations(pyfuse3.Operations):
    """The mount's request handlers, over one VFS; all state lives on pyfuse3's trio loop.

    Args:
        vfs: the filesystem served.
        config: how entries are answered, and what the stats name.
        hint_socket: the Unix socket that takes prefetch hints ("" when there is none).
        storage: the storage client under the VFS, whose counters the stats show (None: none).
        reads: on a read-only mount that stops the kernel's OPENs, what makes READs name their
            inode; the kernel opens files itself once it is installed in the session (after
            ``pyfuse3.init``, before the first request). None: the kernel always sends OPEN.
        shared_snapshots: where the control files' snapshots are kept when several processes
            serve the mount (None: in memory).
    """

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, vfs: VFS, config: FuseConfig, *, hint_socket: str = "",
                 shared_snapshots: Path | None = None,
                 storage: HasStats | None = None, reads: InodeReads | None = None):
        super().__init__()
        self.vfs = vfs
        self.config = config
        self.stats = MountStats()
        self.initialized = trio.Event()
        """Set when the kernel's INIT has been answered (its settings then apply)."""
        self._storage = storage
        self._reads = reads
        self.serving: dict = {"engine": "pyfuse3"}
        """Who answers the kernel, for the stats: the engine, and which of its workers this is
        (each worker of the jpfs engine counts its own requests)."""
        self._read_pids: dict[int, int] = reads.pids if reads is not None else {}
        """Inode -> the process of its latest READ (``reads`` fills it)."""
        self.control = ControlTree(
            entry=self._entry, root_attr=lambda: vfs.inodes.root.attr,
            kernel_opens=lambda: self.kernel_opens, stats=self.snapshot,
            prefetch=vfs.prefetcher, mountpoint=config.mountpoint, hint_socket=hint_socket,
            shared_snapshots=shared_snapshots)
        """The ``.jpfs`` directory: ``fuse_op`` sends it the requests that are its."""

    @property
    def kernel_opens(self) -> bool:
        """False once the mount answers OPEN with ENOSYS (read-only mounts whose READs name
        their inode): see the module docstring."""
        return self._reads is None or not self._reads.installed

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

    def snapshot(self) -> dict:
        """Everything the mount counts, as one JSON-able object: the adapter's counters and
        settings, the VFS's snapshot and its parts' (settings, cache, prefetcher), the storage
        client's."""
        vfs = self.vfs
        v = vfs.snapshot()
        vc = vfs.config
        return {
            "mount": {
                "mountpoint": self.config.mountpoint, "read_only": vc.read_only,
                "kernel_opens": self.kernel_opens,
                "entry_timeout": self.config.entry_timeout,
                "attr_timeout": self.config.attr_timeout,
                "small_file": vc.small_file, "notify_store": vc.notify_store,
                "dir_leases": vc.dir_leases, "write_behind": vc.write_behind,
                "inodes": v["inodes"], "handles": v["handles"] + self.control.open_handles,
                "cluster": self.config.cluster, **self.serving,
            },
            "fuse": self.stats.as_dict(v),
            "cache": vfs.cache.as_dict(),
            "prefetch": vfs.prefetcher.as_dict(),
            "storage": self._storage.as_dict() if self._storage is not None else {},
            "names": v["names"],
            "leases": v["leases"],
        }

    # ------------------------------------------------------------------ names

    @fuse_op("lookup", _name)
    async def lookup(self, parent: int, name: bytes, ctx) -> pyfuse3.EntryAttributes:
        """LOOKUP of ``name`` in ``parent``: its entry, or a negative entry (cached for
        ``negative_timeout``) where it does not exist; ENOENT when negative entries are off."""
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

    @fuse_op("getattr", _inode)
    async def getattr(self, inode: int, ctx) -> pyfuse3.EntryAttributes:
        """GETATTR: the inode's attributes."""
        return self._entry(await self.vfs.getattr(inode))

    @fuse_op("setattr", _inode)
    async def setattr(self, inode: int, attr, fields, fh, ctx) -> pyfuse3.EntryAttributes:
        """SETATTR (chmod, chown, utimens, truncate): the attributes after the change."""
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

    @fuse_op("readlink", _inode)
    async def readlink(self, inode: int, ctx) -> bytes:
        """READLINK: the symlink's target."""
        return await self.vfs.readlink(inode)

    @fuse_op("mknod", _name)
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx):
        """MKNOD: the new node's entry (owned by the caller)."""
        return self._entry(await self.vfs.mknod(parent, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_op("mkdir", _name)
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx):
        """MKDIR: the new directory's entry (owned by the caller)."""
        return self._entry(await self.vfs.mkdir(parent, name, mode, ctx.uid, ctx.gid))

    @fuse_op("symlink", _name)
    async def symlink(self, parent: int, name: bytes, target: bytes, ctx):
        """SYMLINK: the new link's entry (owned by the caller)."""
        return self._entry(await self.vfs.symlink(parent, name, target, ctx.uid, ctx.gid))

    @fuse_op("link", _linked)
    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx):
        """LINK: a new name for ``inode``, answered with its entry."""
        return self._entry(await self.vfs.link(inode, new_parent, new_name))

    @fuse_op("unlink", _name)
    async def unlink(self, parent: int, name: bytes, ctx) -> None:
        """UNLINK of ``name`` in ``parent``."""
        await self.vfs.unlink(parent, name)

    @fuse_op("rmdir", _name)
    async def rmdir(self, parent: int, name: bytes, ctx) -> None:
        """RMDIR of ``name`` in ``parent``."""
        await self.vfs.rmdir(parent, name)

    @fuse_op("rename", _renamed)
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx) -> None:
        """RENAME (``flags``: RENAME_NOREPLACE, RENAME_EXCHANGE)."""
        await self.vfs.rename(parent_old, name_old, parent_new, name_new, flags)

    # ------------------------------------------------------------------ files

    @fuse_op("open", _opened)
    async def open(self, inode: int, flags: int, ctx) -> pyfuse3.FileInfo:
        """OPEN: a file handle; ENOSYS once the mount has stopped taking OPENs
        (``kernel_opens``)."""
        if not self.kernel_opens:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel opens files itself from now on
        f = await self.vfs.open(inode, flags, ctx.pid)
        return pyfuse3.FileInfo(fh=f.fh, keep_cache=f.keep_cache)

    @fuse_op("create", _name)
    async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx):
        """CREATE: a handle on the new (or, without O_EXCL, existing) file and its entry; EEXIST
        with O_EXCL."""
        f, attr = await self.vfs.create(parent, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=f.fh, keep_cache=f.keep_cache), self._entry(attr)

    @fuse_op("read", _read)
    async def read(self, fh: int, off: int, size: int):
        """READ: up to ``size`` bytes at ``off`` (fewer at end of file); without OPENs ``fh`` is
        the inode."""
        if not self.kernel_opens:  # no OPEN: the handle is the inode (lowlevel.InodeReads)
            return await self.vfs.read_unopened(fh, off, size, self._read_pids.pop(fh, 0))
        return await self.vfs.read(fh, off, size)

    @fuse_op("write", _handle)
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        """WRITE: the bytes taken (all of ``buf``)."""
        return await self.vfs.write(fh, off, buf)

    @fuse_op("flush", _handle)
    async def flush(self, fh: int) -> None:
        """FLUSH (each close of a descriptor): commit the handle's writes; ENOSYS on read-only
        mounts, so that the kernel stops sending it."""
        if self.vfs.ro:  # nothing to commit, ever: ENOSYS tells the kernel to stop sending FLUSH
            raise error(errno.ENOSYS, "flush is not needed")
        await self.vfs.flush(fh)

    @fuse_op("fsync", _handle)
    async def fsync(self, fh: int, datasync: bool) -> None:
        """FSYNC: make the handle's writes durable (nothing to do on read-only mounts)."""
        if not self.vfs.ro:  # a read-only mount has nothing to make durable
            await self.vfs.fsync(fh)

    @fuse_op("release", _handle)
    async def release(self, fh: int) -> None:
        """RELEASE (the last close of a handle): commit what is left and free the handle."""
        await self.vfs.release(fh)

    @fuse_op("fallocate", _handle)
    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """FALLOCATE: reserve ``length`` bytes at ``off`` (modes 0 and KEEP_SIZE)."""
        await self.vfs.fallocate(fh, mode, off, length)

    # ------------------------------------------------------------------ directories

    @fuse_op("opendir", _inode)
    async def opendir(self, inode: int, ctx) -> int:
        """OPENDIR: a directory handle."""
        return self.vfs.opendir(inode)

    @fuse_op("readdir", _handle)
    async def readdir(self, fh: int, start_id: int, token) -> None:
        """READDIR from ``start_id``: entries with their attributes (readdirplus) until the kernel's
        buffer is full; a stored ``.jpfs`` in the root is hidden by the control directory."""
        dh = self.vfs.handles.get(fh)
        in_root = isinstance(dh, DirHandle) and dh.ino == ROOT_INO
        async with aclosing(self.vfs.readdir(fh, start_id)) as it:
            async for name, attr, nxt in it:
                if name == control.CONTROL_NAME and in_root:
                    continue
                if not readdir_reply(token, name, self._entry(attr), nxt):
                    return

    @fuse_op("releasedir", _handle)
    async def releasedir(self, fh: int) -> None:
        """RELEASEDIR: free the directory handle."""
        self.vfs.releasedir(fh)

    @fuse_op("fsyncdir", _handle)
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """FSYNCDIR: make the directory's changes durable; EBADF for a handle opendir did not
        give."""
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

    @fuse_op("getxattr", _inode)
    async def getxattr(self, inode: int, name: bytes, ctx) -> bytes:
        """GETXATTR: the attribute's value; ENODATA where it is not set."""
        return await self.vfs.getxattr(inode, name)

    @fuse_op("setxattr", _inode)
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx) -> None:
        """SETXATTR: set the attribute."""
        await self.vfs.setxattr(inode, name, value)

    @fuse_op("listxattr", _inode)
    async def listxattr(self, inode: int, ctx) -> list[bytes]:
        """LISTXATTR: the names of the inode's extended attributes."""
        return await self.vfs.listxattr(inode)

    @fuse_op("removexattr", _inode)
    async def removexattr(self, inode: int, name: bytes, ctx) -> None:
        """REMOVEXATTR: remove the attribute."""
        await self.vfs.removexattr(inode, name)


__all__ = ["BLKSIZE", "FuseConfig", "Operations", "fuse_op"]
