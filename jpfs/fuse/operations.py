"""pyfuse3 Operations over the JPFS client: what the kernel asks a mount, answered.

The cost of a mount is FUSE requests per file (PERF.md: one pyfuse3 daemon answers ~7.5k mixed
requests/s), so the handlers are built to be asked rarely and to answer from memory:

- entries and attributes carry timeouts (long with ``read_only``), and lookups in directories
  being read are answered from prefetched listings;
- an open of a file whose bytes the kernel already caches (same version) is answered at once with
  ``keep_cache``: a re-read costs OPEN and RELEASE only; with ``read_only``, FLUSH is answered
  ENOSYS once, so the kernel stops sending it;
- a small file is fetched whole at open (usually already prefetched) and pushed into the kernel's
  page cache (``notify_store``), so its reads never reach us.

Errors: handlers raise ``JPFSError`` (or let the client's through); the ``fuse_op`` decorator is the
one place where they become ``FUSEError``. Unreachable servers read as EIO.

Write semantics: writes are buffered per file on this mount and committed on close (FLUSH),
fsync and when 64 MiB are dirty; a commit is one metadata transaction guarded by the version the
writer started from, so other nodes see the old bytes or the new, never a mix. Another node sees
the new bytes when it next opens the file (an open revalidates the layout unless ``read_only``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections import deque
from contextlib import aclosing
from dataclasses import dataclass

import pyfuse3
import trio
from prometheus_client import generate_latest

from ..client.cache import BlobCache
from ..client.client import AsyncClient
from ..client.data import assemble, zeros
from ..client.files import AsyncFile
from ..client.prefetch import Prefetcher
from ..errors import JPFSError, errno_name, error
from ..types import ROOT_INO, Attr, Layout
from . import control
from .handles import ControlHandle, DirHandle, FileHandle, Handles, WriteState
from .inodes import Inodes, Node
from .stats import MountStats, registry_for

log = logging.getLogger(__name__)

BLKSIZE = 1 << 20
"""st_blksize: tools size their I/O by it (Python's buffers, cp), and bigger I/O means fewer
requests."""
READDIR_PAGE = 1000
HINT_BUFFER_MAX = 16 << 20

_ACL = b"system.posix_acl_"

_TO_EIO = frozenset({errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EPROTO, errno.ECONNREFUSED,
                     errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE})
_EXPECTED = frozenset({errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENODATA, errno.EISDIR,
                       errno.ENOTDIR, errno.EROFS, errno.ENOSYS, errno.EINVAL, errno.EPERM,
                       errno.EACCES, errno.EXDEV, errno.ENAMETOOLONG, errno.ERANGE,
                       errno.EOPNOTSUPP, errno.EBADF})


@dataclass
class FuseConfig:
    """How the mount answers; see ``jpfs.fuse.mount.MountOptions`` for the user-facing knobs."""

    mountpoint: str = ""
    read_only: bool = False
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    negative_timeout: float = 0.0
    open_cache: float = 0.0
    """Read-write mounts: trust a file's layout this long at open instead of revalidating."""
    small_file: int = 4 << 20
    notify_store: bool = True


def fuse_op(name: str):
    """Count the request, and turn errors into FUSEError: the one place where that happens."""

    def deco(fn):
        @functools.wraps(fn)
        async def handler(self, *args):
            self.stats.requests[name] += 1
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError:
                raise
            except OSError as e:
                err = e.errno or errno.EIO
                if err in _TO_EIO:
                    err = errno.EIO
                if err not in _EXPECTED:
                    log.warning("%s: %s", name, e.strerror or e)
                self.stats.errors[errno_name(err)] = self.stats.errors.get(errno_name(err), 0) + 1
                raise pyfuse3.FUSEError(err) from None
            except Exception:
                log.exception("%s failed", name)
                self.stats.errors["EIO"] = self.stats.errors.get("EIO", 0) + 1
                raise pyfuse3.FUSEError(errno.EIO) from None

        return handler

    return deco


def _outcome(sources: set[str]) -> str:
    for s in ("fetched", "joined", "disk", "prefetched"):
        if s in sources:
            return s
    return "memory"


class Operations(pyfuse3.Operations):
    """The mount's request handlers; all state lives on the trio loop that runs pyfuse3."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, client: AsyncClient, cache: BlobCache, prefetcher: Prefetcher,
                 config: FuseConfig, root: Attr):
        super().__init__()
        if client.data is None or client.storage is None:
            raise error(errno.ENODEV, "this cluster has no storage nodes")
        self.client = client
        self.meta = client.meta
        self.data = client.data
        self.fetch = client.storage.get
        self.cache = cache
        self.prefetcher = prefetcher
        self.config = config
        self.ro = config.read_only
        self.inodes = Inodes(root)
        self.handles = Handles()
        self.stats = MountStats()
        self.hint_errors: deque[str] = deque(maxlen=20)
        self._listing_age = float("inf") if self.ro else config.entry_timeout
        self._attr_age = float("inf") if self.ro else config.attr_timeout
        self._statfs: tuple[float, pyfuse3.StatvfsData | None] = (0.0, None)
        self.registry = registry_for(self.snapshot)
        self.initialized = trio.Event()
        """Set when the kernel's INIT has been answered (its settings then apply)."""
        prefetcher.kernel_has = self.inodes.kernel_has

    def init(self) -> None:
        self.initialized.set()

    # ------------------------------------------------------------------ helpers

    def _entry(self, a: Attr, node: Node | None = None) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        size = a.size
        if node is not None and node.writer is not None:
            size = node.writer.file.size
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = self.config.entry_timeout
        e.attr_timeout = self.config.attr_timeout
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = a.uid
        e.st_gid = a.gid
        e.st_rdev = a.rdev
        e.st_size = size
        e.st_blksize = BLKSIZE
        e.st_blocks = (size + 511) // 512
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

    def _writable(self) -> None:
        if self.ro:
            raise error(errno.EROFS, "the mount is read-only")

    def _changed_dir(self, ino: int) -> None:
        self.prefetcher.forget_dir(ino)

    async def _node(self, ino: int) -> Node:
        node = self.inodes.get(ino)
        if node is None:
            attr = await self.meta.getattr(ino)
            node = self.inodes.get(ino) or self.inodes.remember(attr, 0, b"", lookup=False)
        return node

    def snapshot(self) -> dict:
        """Everything the mount counts, as one JSON-able object."""
        cfg = self.config
        return {
            "mount": {
                "mountpoint": cfg.mountpoint, "read_only": cfg.read_only,
                "entry_timeout": cfg.entry_timeout, "attr_timeout": cfg.attr_timeout,
                "small_file": cfg.small_file, "notify_store": cfg.notify_store,
                "inodes": len(self.inodes), "handles": len(self.handles),
                "cluster": str(self.client.cluster.path or ""),
            },
            "fuse": self.stats.as_dict(),
            "cache": self.cache.as_dict(),
            "prefetch": self.prefetcher.as_dict(),
        }

    # ------------------------------------------------------------------ names

    @fuse_op("lookup")
    async def lookup(self, parent: int, name: bytes, ctx) -> pyfuse3.EntryAttributes:
        if control.is_control(parent) or (parent == ROOT_INO and name == control.CONTROL_NAME):
            self._ctl("lookup")
            if parent == ROOT_INO:
                return self._entry(control.attr(control.CONTROL_DIR))
            ino = control.FILES.get(name) if parent == control.CONTROL_DIR else None
            if ino is None:
                raise error(errno.ENOENT, "no such control file")
            return self._entry(control.attr(ino))
        lst = self.prefetcher.listings.get(parent, self._listing_age)
        if lst is not None:
            i = lst.pos.get(name)
            if i is not None:
                node = self.inodes.remember(lst.attrs[i], parent, name, fetched=lst.fetched)
                return self._entry(node.attr, node)
            if lst.complete:
                return self._negative()
        try:
            attr = await self.meta.lookup(parent, name)
        except JPFSError as e:
            if e.errno == errno.ENOENT:
                return self._negative()
            raise
        node = self.inodes.remember(attr, parent, name)
        return self._entry(node.attr, node)

    @fuse_op("forget")
    async def forget(self, inode_list) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    @fuse_op("getattr")
    async def getattr(self, inode: int, ctx) -> pyfuse3.EntryAttributes:
        if control.is_control(inode):
            self._ctl("getattr")
            return self._entry(control.attr(inode))
        node = self.inodes.get(inode)
        if node is not None and time.monotonic() - node.fetched < self._attr_age:
            return self._entry(node.attr, node)
        try:
            attr = await self.meta.getattr(inode)
        except JPFSError as e:
            if e.errno == errno.ENOENT and node is not None and (node.opens or node.writer):
                return self._entry(node.attr.with_(nlink=0), node)  # removed, still open
            raise
        node = self.inodes.update(attr)
        return self._entry(attr, node)

    @fuse_op("setattr")
    async def setattr(self, inode: int, attr, fields, fh, ctx) -> pyfuse3.EntryAttributes:
        if control.is_control(inode):
            self._ctl("setattr")
            raise error(errno.EPERM, "control files cannot be changed")
        self._writable()
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
        node = self.inodes.get(inode)
        st: WriteState | None = node.writer if node is not None else None  # type: ignore
        before = node.attr.version if node is not None else None
        if fields.update_size:
            if st is not None:
                async with st.lock:
                    await st.file.truncate(attr.st_size)
                self._committed(node, st)
            else:
                changes["size"] = attr.st_size
        elif st is not None and ("mtime_ns" in changes or "atime_ns" in changes):
            await self._commit(node, st)  # a later commit would overwrite the times set now
        if changes:
            new = await self.meta.setattr(inode, **changes)
        else:
            new = await self.meta.getattr(inode)
        node = self.inodes.update(new)
        if node is not None and node.kernel_version == before and fields.update_size:
            node.kernel_version = new.version  # the kernel truncated its own pages
            node.layout = None
        if node is not None and node.parent:
            self._changed_dir(node.parent)
        return self._entry(new, node)

    @fuse_op("readlink")
    async def readlink(self, inode: int, ctx) -> bytes:
        return await self.meta.readlink(inode)

    @fuse_op("mknod")
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx):
        self._writable()
        self._no_control(parent, name)
        if stat.S_IFMT(mode) not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK):
            raise error(errno.EPERM, "JPFS stores no device files")
        attr, _ = await self.meta.create(parent, name, mode, ctx.uid, ctx.gid, exclusive=True)
        self._changed_dir(parent)
        node = self.inodes.remember(attr, parent, name)
        return self._entry(attr, node)

    @fuse_op("mkdir")
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx):
        self._writable()
        self._no_control(parent, name)
        attr = await self.meta.mkdir(parent, name, mode & 0o7777, ctx.uid, ctx.gid)
        self._changed_dir(parent)
        node = self.inodes.remember(attr, parent, name)
        return self._entry(attr, node)

    @fuse_op("symlink")
    async def symlink(self, parent: int, name: bytes, target: bytes, ctx):
        self._writable()
        self._no_control(parent, name)
        attr = await self.meta.symlink(parent, name, target, ctx.uid, ctx.gid)
        self._changed_dir(parent)
        node = self.inodes.remember(attr, parent, name)
        return self._entry(attr, node)

    @fuse_op("link")
    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx):
        self._writable()
        self._no_control(new_parent, new_name)
        if control.is_control(inode):
            raise error(errno.EPERM, "control files cannot be linked")
        attr = await self.meta.link(inode, new_parent, new_name)
        self._changed_dir(new_parent)
        node = self.inodes.remember(attr, new_parent, new_name)
        return self._entry(attr, node)

    @fuse_op("unlink")
    async def unlink(self, parent: int, name: bytes, ctx) -> None:
        self._writable()
        self._no_control(parent, name)
        await self.meta.unlink(parent, name)
        self._changed_dir(parent)

    @fuse_op("rmdir")
    async def rmdir(self, parent: int, name: bytes, ctx) -> None:
        self._writable()
        self._no_control(parent, name)
        await self.meta.rmdir(parent, name)
        self._changed_dir(parent)
        self.inodes.moved()

    @fuse_op("rename")
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx) -> None:
        self._writable()
        self._no_control(parent_old, name_old)
        self._no_control(parent_new, name_new)
        await self.meta.rename(parent_old, name_old, parent_new, name_new, flags)
        self._changed_dir(parent_old)
        self._changed_dir(parent_new)
        self.inodes.moved()
        # keep the names of moved inodes right: co-access learning works on paths
        pairs = [(parent_new, name_new)]
        if flags & pyfuse3.RENAME_EXCHANGE:
            pairs.append((parent_old, name_old))
        for p, n in pairs:
            try:
                a = await self.meta.lookup(p, n)
            except JPFSError:
                continue
            node = self.inodes.get(a.ino)
            if node is not None:
                node.parent, node.name = p, n
                self.inodes.update(a)
                self.prefetcher.forget_dir(a.ino)

    def _no_control(self, parent: int, name: bytes) -> None:
        if control.is_control(parent) or (parent == ROOT_INO and name == control.CONTROL_NAME):
            raise error(errno.EPERM, "the .jpfs control directory cannot be changed")

    # ------------------------------------------------------------------ files

    @fuse_op("open")
    async def open(self, inode: int, flags: int, ctx) -> pyfuse3.FileInfo:
        if control.is_control(inode):
            self._ctl("open")
            return await self._control_open(inode, flags)
        node = self.inodes.get(inode)
        if node is None:
            node = await self._node(inode)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            return await self._open_write(node, flags)
        if node.writer is not None:  # being written on this mount: reads go through it
            node.opens += 1
            self.stats.opens["memory"] += 1
            return pyfuse3.FileInfo(fh=self.handles.add(FileHandle(node)), keep_cache=True)
        if self.ro and node.kernel_version == node.attr.version and node.layout is not None:
            # the kernel holds these bytes: nothing to fetch, nothing to check
            node.opens += 1
            self.stats.opens["kernel"] += 1
            return pyfuse3.FileInfo(fh=self.handles.add(FileHandle(node, node.layout)),
                                    keep_cache=True)
        return await self._open_read(node, ctx.pid)

    async def _open_read(self, node: Node, stream: int) -> pyfuse3.FileInfo:
        ino = node.ino
        cfg = self.config
        layout: Layout | None = None
        if self.ro:
            layout = node.layout or self.prefetcher.layout(ino)
        elif cfg.open_cache > 0 and node.layout is not None \
                and time.monotonic() - node.fetched < cfg.open_cache:
            layout = node.layout
        if layout is None:
            layout = await self.meta.get_layout(ino)
            self.inodes.update(layout.attr)
        elif node.attr.version != layout.attr.version:
            self.inodes.update(layout.attr)
        node.layout = layout
        attr = layout.attr
        version = attr.version
        keep = node.kernel_version == version
        stale = node.kernel_version is not None and not keep
        h = FileHandle(node, layout)
        fh = self.handles.add(h)
        node.opens += 1
        try:
            if node.parent and self.prefetcher.enabled:
                path = self.inodes.path(node)
                if path is not None:
                    ready = all(not self.cache.needs(c.blob) for c in layout.chunks)
                    self.prefetcher.opened(stream, ino, node.parent, node.name, path, attr,
                                           ready)
            if keep:
                outcome = "kernel"
            elif not layout.chunks or attr.size == 0:
                outcome = "empty"
            elif attr.size <= cfg.small_file:
                outcome = await self._fetch_whole(h, layout)
                if h.data is not None and not stale and node.opens == 1 and cfg.notify_store:
                    # Only when no other handle is open: then no READ of this inode can hold
                    # page locks that the store would wait for while we cannot answer.
                    try:
                        pyfuse3.notify_store(ino, 0, h.data)
                    except OSError as e:
                        log.debug("notify_store of inode %d failed: %s", ino, e)
                    else:
                        keep = True
                        self.stats.notify_store_bytes += len(h.data)
                        self.cache.delivered([c.blob for c in layout.chunks])
            else:
                outcome = "deferred"
        except BaseException:
            self.handles.pop(fh)
            node.opens -= 1
            raise
        if stale and not self.ro:
            try:  # the kernel's size may be stale too: make it ask again
                pyfuse3.invalidate_inode(ino, attr_only=True)
            except OSError:
                pass
        node.kernel_version = version
        self.stats.opens[outcome] += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    async def _fetch_whole(self, h: FileHandle, layout: Layout) -> str:
        sources: set[str] = set()
        try:
            blobs = await self.cache.get(layout.chunks, self.fetch, sources)
        except JPFSError as e:
            log.warning("cannot read %s: %s", self._name(h.node), e.strerror)
            raise
        h.data = assemble(layout, blobs)
        return _outcome(sources)

    def _name(self, node: Node) -> str:
        return self.inodes.path(node) or f"inode {node.ino}"

    async def _open_write(self, node: Node, flags: int, *, new: Layout | None = None
                          ) -> pyfuse3.FileInfo:
        self._writable()
        if node.attr.is_dir:
            raise error(errno.EISDIR, "is a directory")
        st: WriteState | None = node.writer  # type: ignore[assignment]
        if st is None:
            layout = new or await self.meta.get_layout(node.ino)
            st = node.writer  # type: ignore[assignment]
            if st is None:
                f = AsyncFile(self.data, self._name(node), "r+b", layout, node.parent)
                st = node.writer = WriteState(f)
                self.inodes.update(layout.attr)
        st.refs += 1
        node.opens += 1
        h = FileHandle(node, write=st, readable=flags & os.O_ACCMODE == os.O_RDWR)
        fh = self.handles.add(h)
        try:
            if flags & os.O_TRUNC and (st.file.size or st.dirty):
                async with st.lock:
                    await st.file.truncate(0)
                self._committed(node, st)
        except BaseException:
            self.handles.pop(fh)
            await self._drop_writer(node, st)
            raise
        keep = node.kernel_version == st.file.version
        node.kernel_version = st.file.version
        self.stats.opens["write"] += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    @fuse_op("create")
    async def create(self, parent: int, name: bytes, mode: int, flags: int, ctx):
        self._writable()
        self._no_control(parent, name)
        attr, created = await self.meta.create(parent, name, mode, ctx.uid, ctx.gid,
                                               exclusive=bool(flags & os.O_EXCL))
        self._changed_dir(parent)
        node = self.inodes.remember(attr, parent, name)
        if created:
            node.kernel_version = attr.version
        new = Layout(attr, self.data.chunk_size, ()) if created else None
        fi = await self._open_write(node, flags, new=new)
        return fi, self._entry(node.attr, node)

    @fuse_op("read")
    async def read(self, fh: int, off: int, size: int):
        h = self.handles.get(fh)
        if h is None:
            raise error(errno.EBADF, "no such handle")
        if type(h) is ControlHandle:
            self._ctl("read")
            return h.content[off:off + size]
        assert type(h) is FileHandle
        if h.data is not None:
            out = h.data[off:off + size]
            self.stats.read_bytes += len(out)
            return out
        node = h.node
        st: WriteState | None = node.writer  # type: ignore[assignment]
        if st is not None:
            async with st.lock:
                st.file.seek(off)
                out = await st.file.read(size)
            self.stats.read_bytes += len(out)
            return out
        layout = h.layout
        if layout is None:
            layout = h.layout = node.layout or await self.meta.get_layout(node.ino)
        out = await self._read_layout(fh, h, layout, off, size)
        self.stats.read_bytes += len(out)
        return out

    async def _read_layout(self, fh: int, h: FileHandle, layout: Layout, off: int, size: int):
        fsize = layout.attr.size
        if off >= fsize or size <= 0:
            return b""
        n = min(size, fsize - off)
        if fsize <= self.config.small_file:
            blobs = await self.cache.get(layout.chunks, self.fetch)
            h.data = assemble(layout, blobs)
            return h.data[off:off + n]
        cs = layout.chunk_size
        chunks = h.chunks
        if chunks is None:
            chunks = h.chunks = {c.index: c for c in layout.chunks}
        self.prefetcher.read(fh, layout, off, n)
        first, last = off // cs, (off + n - 1) // cs
        if first == last:
            out = await self._piece(chunks.get(first), off - first * cs, n)
        else:
            out = bytearray(n)
            pos = 0
            for i in range(first, last + 1):
                start = max(off, i * cs) - i * cs
                take = min(cs - start, n - pos)
                out[pos:pos + take] = await self._piece(chunks.get(i), start, take)
                pos += take
        end = off + n
        if end % cs == 0 or end == fsize:
            # read to the end of a chunk: the kernel's page cache holds it now (keep_cache),
            # so the chunk's memory goes back for the next one (see BlobCache.delivered)
            done = chunks.get(last)
            if done is not None:
                self.cache.delivered([done.blob])
        return out

    async def _piece(self, c, start: int, n: int):
        """``n`` bytes of a chunk from ``start`` (zeros for a hole or past its stored length)."""
        if c is None:
            return zeros(n)
        view = self.cache.peek(c)
        if view is None:
            (view,) = await self.cache.get([c], self.fetch)
        end = start + n
        if end <= c.length:
            return view[start:end]
        have = max(0, c.length - start)
        return bytes(view[start:start + have]) + bytes(n - have)

    @fuse_op("write")
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handles.get(fh)
        if h is None:
            raise error(errno.EBADF, "no such handle")
        if type(h) is ControlHandle:
            self._ctl("write")
            return await self._hint_write(h, buf)
        assert type(h) is FileHandle
        st = h.write
        if st is None:
            raise error(errno.EBADF, "not open for writing")
        async with st.lock:
            st.file.seek(off)
            n = await st.file.write(buf)
        if st.file.version != h.node.attr.version:
            self._committed(h.node, st)  # it passed the dirty bound and committed
        self.stats.write_bytes += n
        return n

    @fuse_op("flush")
    async def flush(self, fh: int) -> None:
        h = self.handles.get(fh)
        if type(h) is ControlHandle:
            self._ctl("flush")
            if h.pending:
                await self._hint_submit(h, bytes(h.pending))
            return
        if self.ro:
            # nothing to commit, ever: ENOSYS tells the kernel to stop sending FLUSH
            raise error(errno.ENOSYS, "flush is not needed")
        if type(h) is FileHandle and h.write is not None:
            await self._commit(h.node, h.write)

    @fuse_op("fsync")
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self.handles.get(fh)
        if type(h) is FileHandle and h.write is not None:
            await self._commit(h.node, h.write)

    @fuse_op("release")
    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh)
        if h is None:
            return
        if type(h) is ControlHandle:
            self._ctl("release")
            if h.pending:
                try:
                    await self._hint_submit(h, bytes(h.pending))
                except JPFSError:
                    pass  # logged; release cannot report it
            return
        assert type(h) is FileHandle
        node = h.node
        node.opens -= 1
        st = h.write
        if st is not None:
            await self._drop_writer(node, st)
        elif h.chunks is not None:
            self.prefetcher.closed(fh)
        if node.lookups <= 0:
            self.inodes.drop_if_unused(node)

    async def _drop_writer(self, node: Node, st: WriteState) -> None:
        st.refs -= 1
        if st.refs > 0:
            return
        try:
            await self._commit(node, st)
        finally:
            if st.refs == 0 and node.writer is st:
                node.writer = None
                if node.lookups <= 0:
                    self.inodes.drop_if_unused(node)

    async def _commit(self, node: Node, st: WriteState) -> None:
        async with st.lock:
            if not st.dirty or st.discarded:
                return
            try:
                await st.file.flush()
            except JPFSError as e:
                if e.errno != errno.ENOENT:
                    raise
                st.discarded = True  # removed while open: its bytes go with it, as in POSIX
                log.debug("%s was removed while open; its unwritten bytes are dropped",
                          self._name(node))
                return
        self._committed(node, st)

    def _committed(self, node: Node, st: WriteState) -> None:
        f = st.file
        now = time.time_ns()
        node.attr = node.attr.with_(size=f.size, version=f.version, mtime_ns=now, ctime_ns=now)
        node.fetched = 0.0  # ask the metadata service next time
        node.layout = None
        node.kernel_version = f.version  # the kernel's pages were written through it
        self.stats.commits += 1
        if node.parent:
            self._changed_dir(node.parent)

    # ------------------------------------------------------------------ directories

    @fuse_op("opendir")
    async def opendir(self, inode: int, ctx) -> int:
        if control.is_control(inode):
            self._ctl("opendir")
            h = DirHandle(inode, [(n, control.attr(i)) for n, i in control.FILES.items()],
                          done=True)
            return self.handles.add(h)
        return self.handles.add(DirHandle(inode))

    @fuse_op("readdir")
    async def readdir(self, fh: int, start_id: int, token) -> None:
        h = self.handles.get(fh)
        if type(h) is not DirHandle:
            raise error(errno.EBADF, "not a directory handle")
        ctl = control.is_control(h.ino)
        if ctl:
            self._ctl("readdir")
        # ids: 1 after ".", 2 after "..", then 3 + i after entry i
        if start_id == 0:
            me = control.attr(h.ino) if ctl else (await self._node(h.ino)).attr
            if not pyfuse3.readdir_reply(token, b".", self._entry(me), 1):
                return
        if start_id <= 1:
            up = self._parent_attr(h.ino)
            if not pyfuse3.readdir_reply(token, b"..", self._entry(up), 2):
                return
        i = max(0, start_id - 2)
        if i < h.base:  # rewound past what is kept: list again from the start
            h.entries, h.base, h.done, h.after = [], 0, False, b""
        elif i - h.base > READDIR_PAGE:  # keep a window, not a million entries
            cut = min(i - h.base, len(h.entries))
            del h.entries[:cut]
            h.base += cut
        while True:
            if i - h.base >= len(h.entries) and not h.done:
                await self._more(h, i)
            k = i - h.base
            if k >= len(h.entries):
                return
            name, attr = h.entries[k]
            if not pyfuse3.readdir_reply(token, name, self._entry(attr), i + 3):
                return
            if not ctl:
                self.inodes.remember(attr, h.ino, name)
            i += 1

    def _parent_attr(self, ino: int) -> Attr:
        if control.is_control(ino):
            return self.inodes.get(ROOT_INO).attr  # type: ignore[union-attr]
        node = self.inodes.get(ino)
        up = self.inodes.get(node.parent) if node is not None and node.parent else None
        return (up or node or self.inodes.get(ROOT_INO)).attr  # type: ignore[union-attr]

    async def _more(self, h: DirHandle, want: int) -> None:
        """Fetch pages until entry ``want`` is held (or the directory ends)."""
        while not h.done and want - h.base >= len(h.entries):
            got, raw = [], 0
            async with aclosing(self.meta.readdir(h.ino, plus=True, page=READDIR_PAGE,
                                                  after=h.after)) as it:
                async for e in it:
                    raw += 1
                    if e.attr is not None and not (h.ino == ROOT_INO
                                                   and e.name == control.CONTROL_NAME):
                        got.append((e.name, e.attr))
                    h.after = e.name
                    if raw >= READDIR_PAGE:
                        break
            h.entries.extend(got)
            if raw < READDIR_PAGE:
                h.done = True

    @fuse_op("releasedir")
    async def releasedir(self, fh: int) -> None:
        h = self.handles.pop(fh)
        if type(h) is DirHandle and control.is_control(h.ino):
            self._ctl("releasedir")

    @fuse_op("fsyncdir")
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    # ------------------------------------------------------------------ filesystem

    @fuse_op("statfs")
    async def statfs(self, ctx) -> pyfuse3.StatvfsData:
        at, cached = self._statfs
        if cached is not None and time.monotonic() - at < 1.0:
            return cached
        totals = await self.meta.statfs()
        storage = self.client.storage
        nodes: list[dict] = []

        async def one(i: int) -> None:
            try:
                nodes.append(await storage.stats(i))
            except JPFSError:
                pass

        async with trio.open_nursery() as nursery:
            for i in range(storage.n_nodes):
                nursery.start_soon(one, i)
        r = max(1, self.client.cluster.replicas)
        bs = 4096
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = bs
        s.f_blocks = sum(n.get("disk_total", 0) for n in nodes) // r // bs
        s.f_bfree = s.f_bavail = sum(n.get("disk_free", 0) for n in nodes) // r // bs
        free_inodes = 1 << 40
        s.f_files = totals.get("inodes", 0) + free_inodes
        s.f_ffree = s.f_favail = free_inodes
        s.f_namemax = 255
        self._statfs = (time.monotonic(), s)
        return s

    @fuse_op("getxattr")
    async def getxattr(self, inode: int, name: bytes, ctx) -> bytes:
        if control.is_control(inode):
            self._ctl("getxattr")
            raise error(errno.ENODATA, "no such attribute")
        if name.startswith(_ACL):  # asked by ls and cp for every file; never stored
            raise error(errno.ENODATA, "no such attribute")
        return await self.meta.getxattr(inode, name)

    @fuse_op("setxattr")
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx) -> None:
        self._writable()
        if control.is_control(inode):
            raise error(errno.EPERM, "control files have no attributes")
        if name.startswith(_ACL):
            raise error(errno.EOPNOTSUPP, "JPFS has no POSIX ACLs (mode bits only)")
        await self.meta.setxattr(inode, name, value, 0)

    @fuse_op("listxattr")
    async def listxattr(self, inode: int, ctx) -> list[bytes]:
        if control.is_control(inode):
            self._ctl("listxattr")
            return []
        return await self.meta.listxattr(inode)

    @fuse_op("removexattr")
    async def removexattr(self, inode: int, name: bytes, ctx) -> None:
        self._writable()
        if control.is_control(inode):
            raise error(errno.EPERM, "control files have no attributes")
        await self.meta.removexattr(inode, name)

    # ------------------------------------------------------------------ control files

    async def _control_open(self, inode: int, flags: int) -> pyfuse3.FileInfo:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if inode == control.CONTROL_DIR:
            raise error(errno.EISDIR, "is a directory")
        if writing and inode != control.PREFETCH:
            raise error(errno.EACCES, "read-only control file")
        if inode == control.STATS:
            content = control.stats_json(self.snapshot())
        elif inode == control.METRICS:
            content = generate_latest(self.registry)
        else:
            content = control.prefetch_status(self.prefetcher.as_dict(), list(self.hint_errors))
        h = ControlHandle(inode, content, writable=writing)
        return pyfuse3.FileInfo(fh=self.handles.add(h), direct_io=True, keep_cache=False)

    async def _hint_write(self, h: ControlHandle, buf: bytes) -> int:
        if not h.writable:
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
        if not keep_pending:
            h.pending.clear()
        try:
            paths = control.parse_hints(text, self.config.mountpoint)
            await self.prefetcher.hint(paths)
        except JPFSError as e:
            msg = e.strerror or str(e)
            self.hint_errors.append(msg)
            log.warning("prefetch hints rejected: %s", msg)
            raise


__all__ = ["BLKSIZE", "FuseConfig", "Operations", "fuse_op"]
