"""Writes: opens for writing, create, write, fallocate, flush, fsync and release.

Writes are buffered in the file's ``FileWriter`` and committed as ``commits.py`` says (its
docstring has the write semantics and the write-behind of a file's close). A create in a
directory this VFS holds the write lease of is answered at once and committed behind in a batch
(``leases.py``), the file's first commit usually with it.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ...errors import error
from ...placement import shard_of
from ...proto.meta import check_name
from ...types import Attr, Layout
from ..data.writer import FileWriter
from .commits import Commits
from .handles import FileHandle
from .inodes import Node
from .leases import LeasedDir
from .leasing import Leasing
from .names import Names
from .namespace import Namespace
from .reads import Reads
from .shared import SharedState
from .types import OpenFile
from .xattrs import Xattrs

FALLOC_FL_KEEP_SIZE = 0x01


class Writes:
    """What the VFS does with handles that write (see the module docstring)."""

    def __init__(self, shared: SharedState, leasing: Leasing, xattrs: Xattrs, commits: Commits,
                 reads: Reads, names: Names, namespace: Namespace):
        self.shared = shared
        self.leasing = leasing
        self.xattrs = xattrs
        self.commits = commits
        self.reads = reads
        self.names = names
        self.namespace = namespace
        self.leases = leasing.leases
        self.meta = shared.meta
        self.data = shared.data
        self.reader = shared.reader
        self.inodes = shared.inodes
        self.handles = shared.handles
        self.stats = shared.stats
        self.known = shared.known

    async def open(self, ino: int, flags: int) -> OpenFile:
        """Open a file for writing (``O_WRONLY``/``O_RDWR``, or ``O_TRUNC``)."""
        await self.leasing.settle(ino)
        node = self.inodes.get(ino) or await self.shared.node(ino)
        return await self.open_write(node, flags)

    async def open_write(self, node: Node, flags: int, *, new: Layout | None = None
                         ) -> OpenFile:
        """Open ``node`` for writing (``new``: the layout of a file just made, not asked
        again); its writer is shared with the node's other writing handles."""
        self.shared.writable()
        if node.attr.is_dir:
            raise error(errno.EISDIR, "is a directory")
        if not node.attr.is_reg:
            raise error(errno.EINVAL, "JPFS stores bytes for regular files only")
        w = node.writer
        if w is None:
            layout = new or await self.meta.get_layout(node.ino)
            w = node.writer
            if w is None:
                w = node.writer = FileWriter(self.data, self.reader, layout, node.parent,
                                             self.shared.name_of(node))
                w.settle = self.leasing.settle  # (FileWriter takes them as attributes)
                if self.leases is not None:
                    w.attach = self.leases.book.attach
                self.inodes.update(layout.attr)
        w.refs += 1
        node.opens += 1
        fh = self.handles.add(FileHandle(node, writer=w))
        try:
            if flags & os.O_TRUNC and (w.size or w.dirty):
                async with w.lock:
                    await w.truncate(0)
                self.commits.committed(node, w)
        except BaseException:
            self.handles.pop(fh)
            node.opens -= 1
            await self.commits.drop_writer(node, w)
            raise
        keep = node.kernel_version == w.version
        node.kernel_version = w.version
        self.stats.opens["write"] += 1
        return OpenFile(fh, keep)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[OpenFile, Attr]:
        """open(O_CREAT): the file (made if missing; EEXIST with O_EXCL), opened."""
        self.shared.writable()
        await self.leasing.ready(parent)
        gid, mode = self.namespace.owner(parent, uid, gid, mode)
        sent = time.monotonic()
        leases = self.leases
        if leases is not None and leases.dirs and leases.book.entry(parent, name) is not None:
            if flags & os.O_EXCL:  # made from the lease, not sent yet: it exists all the same
                raise error(errno.EEXIST, "file exists")
            return await self._open_pending(parent, name, flags)
        if leases is not None and stat.S_IFMT(mode) in (0, stat.S_IFREG):
            ld = await leases.take(parent)
            if ld is not None and self.known is not None and \
                    self.known.absent(parent, check_name(name)):
                return await self._create_leased(ld, parent, name, mode, flags, uid, gid, sent)
        with self.namespace.names_of(parent), self.leasing.changing(parent):
            attr, created = await self.meta.create(parent, name, mode, uid, gid,
                                                   exclusive=bool(flags & os.O_EXCL))
        if created:
            self.namespace.made_in(parent, name, attr)
            self.xattrs.none_since(attr.ino, sent)  # a new file has no extended attributes
        elif self.known is not None:
            self.known.drop(parent)  # it was there (made elsewhere) after all
        node = self.inodes.remember(attr, parent, name)
        if created:
            node.kernel_version = attr.version
        new = Layout(attr, self.data.chunk_size, ()) if created else None
        try:
            opened = await self.open_write(node, flags, new=new)
        except BaseException:
            self.inodes.forget(node.ino, 1)  # the kernel never saw the entry
            raise
        return opened, self.shared.attr_of(node)

    async def _create_leased(self, ld: LeasedDir, parent: int, name: bytes, mode: int,
                             flags: int, uid: int, gid: int, sent: float
                             ) -> tuple[OpenFile, Attr]:
        """``create`` in a directory this VFS holds the lease of: answered now, committed
        behind (``leases.py``)."""
        assert self.leases is not None
        attr = self.leases.add(ld, name, mode, uid, gid)
        self.namespace.made_in(parent, name, attr, answered=True)
        self.xattrs.none_since(attr.ino, sent)
        node = self.inodes.remember(attr, parent, name)
        node.kernel_version = attr.version
        try:
            opened = await self.open_write(node, flags,
                                            new=Layout(attr, self.data.chunk_size, ()))
        except BaseException:
            self.inodes.forget(node.ino, 1)
            raise
        return opened, self.shared.attr_of(node)

    async def _open_pending(self, parent: int, name: bytes, flags: int
                            ) -> tuple[OpenFile, Attr]:
        """``create`` of a name this VFS made from a lease and has not sent: open that file."""
        attr = await self.names.lookup(parent, name)  # the kernel counts the entry create answers
        node = self.inodes.get(attr.ino)
        assert node is not None
        if node.writer is None:
            await self.leasing.settle(node.ino)  # its layout is read from the shard
        try:
            opened = await self.open_write(node, flags)
        except BaseException:
            self.inodes.forget(node.ino, 1)
            raise
        return opened, self.shared.attr_of(node)

    async def write(self, fh: int, off: int, buf) -> int:
        """Write ``buf`` at ``off`` through handle ``fh`` (buffered in the file's writer, committed
        past the dirty bound); the bytes taken. EBADF if the handle is not open for writing."""
        h = self.shared.file_handle(fh)
        w = h.writer
        if w is None:
            raise error(errno.EBADF, "not open for writing")
        if not w.lock.locked():  # no commit or read in progress: write at once, no yield
            now = w.write_now(off, buf)
            if now is not None:
                self.stats.write_bytes += now
                return now
        commits = w.commits
        async with w.lock:
            n = await w.write(off, buf)
        if w.commits != commits:
            self.commits.committed(h.node, w)  # it passed the dirty bound and committed
        self.stats.write_bytes += n
        return n

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """Allocate as ``fallocate(2)``: modes 0 and FALLOC_FL_KEEP_SIZE (others:
        EOPNOTSUPP)."""
        h = self.shared.file_handle(fh)
        if mode & ~FALLOC_FL_KEEP_SIZE:
            raise error(errno.EOPNOTSUPP, "fallocate: only modes 0 and FALLOC_FL_KEEP_SIZE")
        w = h.writer
        if w is None:
            raise error(errno.EBADF, "not open for writing")
        async with w.lock:
            await w.allocate(off, length, bool(mode & FALLOC_FL_KEEP_SIZE))

    async def flush(self, fh: int) -> None:
        """Commit what the handle wrote (close-to-open: the next open elsewhere sees it); on a
        write-behind mount a file made under a lease is committed behind the close (the module
        docstring)."""
        h = self.shared.file_handle(fh)
        if h.writer is not None and not self.commits.close_behind(h.node, h.writer):
            await self.commits.commit(h.node, h.writer)

    async def fsync(self, fh: int) -> None:
        """Commit, and return once the file's bytes and metadata are durable (its blobs are
        fsynced by the storage nodes before any commit; the shard's sync covers the rest)."""
        h = self.shared.file_handle(fh)
        if h.writer is not None:
            await self.commits.commit(h.node, h.writer)
        await self.leasing.settle(h.node.ino)
        await self.meta.sync([shard_of(h.node.ino)])
        self.commits.report_lost(h.node.ino, None)

    async def fsyncdir(self, ino: int) -> None:
        """Return once the directory's entries are durable, and the files closed behind before
        it have stored their bytes (EIO, once, for those that could not)."""
        await self.leasing.settle(ino)
        await self.commits.behind_settled()
        await self.meta.sync([shard_of(ino)])
        self.commits.report_lost(None, ino)

    async def release(self, fh: int) -> None:
        """RELEASE of handle ``fh``: the last handle writing a file commits what is left."""
        h = self.handles.get(fh)
        if type(h) is not FileHandle:
            self.handles.pop(fh)
            return
        if h.writer is None:
            self.reads.close_reader(fh)
            return
        self.handles.pop(fh)
        node = h.node
        node.opens -= 1
        try:
            await self.commits.drop_writer(node, h.writer)
        finally:
            if node.lookups <= 0:
                self.inodes.drop_if_unused(node)


__all__ = ["FALLOC_FL_KEEP_SIZE", "Writes"]
