"""JPFS's own FUSE engine: requests read from a session's descriptor, answered by ``Operations``.

The pyfuse3 adapter (``operations.Operations``) stays the one place requests become VFS calls and
errors become errnos; this engine replaces only what is under it: libfuse's loop and pyfuse3's
dispatch. Each worker process runs one ``Engine`` on its own clone of the session's descriptor
(``workers.py``), so a mount serves on as many cores as it has workers.

What the engine does itself:

- reads requests from a non-blocking descriptor in its trio loop and answers each in a task of
  its own (at most ``max_tasks`` at once), with ``os.writev`` of the header and the body (a
  READ's bytes are written from the buffer the VFS returned, never joined to the header);
- answers OPEN and OPENDIR with ENOSYS on a read-only mount: the kernel then opens files and
  directories itself, and READ and READDIRPLUS name the inode, so whichever worker reads the
  request can serve it, with no handle another worker made. Listings are kept per directory
  in a bounded table (``Listings``), the kernel caches them (``FOPEN_CACHE_DIR``);
- carries the VFS's notifications as messages written to the descriptor (``EngineNotifier``);
- turns anything a request raises into an errno answer and a log line: a request that does not
  parse gets EIO, an opcode it does not serve ENOSYS; only the end of the session (ENODEV) or
  a cancellation of the worker ends the loop.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import pyfuse3
import trio

from . import protocol as p
from .notifier import KernelNotifier
from .operations import Operations

log = logging.getLogger(__name__)

LISTINGS_MAX = 256
"""Directories whose listings a worker keeps open at once (the oldest is closed first)."""


def attributes(e: pyfuse3.EntryAttributes) -> p.Attributes:
    """The protocol's attributes of the adapter's entry."""
    return p.Attributes(
        ino=e.st_ino, mode=e.st_mode, nlink=e.st_nlink, uid=e.st_uid, gid=e.st_gid,
        rdev=e.st_rdev, size=e.st_size, blocks=e.st_blocks, blksize=e.st_blksize,
        atime_ns=e.st_atime_ns, mtime_ns=e.st_mtime_ns, ctime_ns=e.st_ctime_ns,
        entry_timeout=e.entry_timeout, attr_timeout=e.attr_timeout, generation=e.generation)


@dataclass(slots=True)
class Context:
    """What a handler learns of the process that asked (pyfuse3's ``RequestContext``)."""

    uid: int
    gid: int
    pid: int
    umask: int = 0o022


class EngineReads:
    """Tells ``Operations`` that READs name their inode (the kernel sends no OPEN), and which
    process reads each (for prefetch): the engine's stand-in for ``lowlevel.InodeReads``."""

    installed = True

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}


class DirBuffer:
    """A READDIR(PLUS) answer being filled: ``add`` returns False once an entry does not fit
    (the adapter then stops, and that entry is not counted as handed out)."""

    def __init__(self, size: int, plus: bool):
        self.size = size
        self.plus = plus
        self.parts: list[bytes] = []
        self.used = 0

    def add(self, name: bytes, entry: pyfuse3.EntryAttributes, next_id: int) -> bool:
        """Take one entry; False once it does not fit."""
        a = attributes(entry)
        rec = p.direntplus(name, a, next_id) if self.plus else p.dirent(name, a, next_id)
        if self.used + len(rec) > self.size:
            return False
        self.parts.append(rec)
        self.used += len(rec)
        return True


@dataclass
class Listing:
    """A directory opened by the engine for the kernel's READDIRs of it (no OPENDIR asked)."""

    fh: int
    lock: trio.Lock = field(default_factory=trio.Lock)


class Listings:
    """Directory handles by inode, for kernels that open directories themselves: a listing from
    position 0 opens the directory afresh (as an opendir would), later positions go on in the
    same handle; at most ``LISTINGS_MAX`` are kept."""

    def __init__(self, ops: Operations):
        self.ops = ops
        self._open: OrderedDict[int, Listing] = OrderedDict()

    async def get(self, ino: int, start: int, ctx: Context) -> Listing:
        """The listing to read ``ino`` from ``start`` in."""
        cur = self._open.get(ino)
        if cur is not None and start > 0:
            self._open.move_to_end(ino)
            return cur
        fh = await self.ops.opendir(ino, ctx)
        if cur is not None:
            await self._close(cur)
        listing = self._open[ino] = Listing(fh)
        self._open.move_to_end(ino)
        while len(self._open) > LISTINGS_MAX:
            _, old = self._open.popitem(last=False)
            await self._close(old)
        return listing

    async def _close(self, listing: Listing) -> None:
        async with listing.lock:  # a READDIR still reading it ends first
            await self.ops.releasedir(listing.fh)

    async def close_all(self) -> None:
        """Close every listing (the worker is ending)."""
        while self._open:
            _, old = self._open.popitem()
            await self._close(old)


class EngineNotifier(KernelNotifier):
    """The VFS's notifications, written to the session as the protocol's messages."""

    def __init__(self, fd: int, mountpoint: str = ""):
        super().__init__(mountpoint)
        self.fd = fd
        self.introduced: Callable[[], None] | None = None

    def store(self, ino: int, data: memoryview) -> bool:
        """NOTIFY_STORE of a whole file into the kernel's page cache (from a worker thread:
        the kernel may wait for a page a READ of ours holds locked)."""
        try:
            os.writev(self.fd, [p.notify_store(ino, 0, len(data)), data])
        except OSError as e:
            log.debug("notify_store of inode %d failed: %s", ino, e)
            return False
        return True

    async def introduce(self, path: str) -> bool:
        """``KernelNotifier.introduce``, then ``introduced()`` (``relay.Desk.drain``: where
        other workers answered the listing, the entries they handed are in by then)."""
        ok = await super().introduce(path)
        if self.introduced is not None:
            self.introduced()
        return ok

    def invalidate_attr(self, ino: int) -> None:
        """NOTIFY_INVAL_INODE of the attributes only."""
        try:
            os.write(self.fd, p.notify_inval_inode(ino, -1, 0))
        except OSError as e:
            log.debug("invalidate_inode %d failed: %s", ino, e)


class Engine:
    """Serves one descriptor of a session with ``ops`` (see the module docstring).

    Args:
        ops: the adapter (its VFS, control tree and error boundary), built with ``reads``.
        fd: a non-blocking descriptor of the session (a clone).
        reads: what tells the adapter which inode, and which process, each READ names.
        max_tasks: requests answered at once; more wait in the kernel's queue.
        forgotten: where several workers serve the session, what tells the others of the
            inodes a FORGET names (the kernel counts lookups over all workers, and sends the
            FORGET of an evicted inode to any of them): each then drops every lookup of those
            inodes (``forget_all``). None: one worker, whose counts are the kernel's.
        before_reply: called before each answer is written (``relay.Link.flush``: worker 0
            hears of the entries an answer hands the kernel before the kernel has them).
    """

    def __init__(self, ops: Operations, fd: int, reads: EngineReads, *, max_tasks: int = 256,
                 forgotten: Callable[[list[int]], None] | None = None,
                 before_reply: Callable[[], None] | None = None):
        self.ops = ops
        self.before_reply = before_reply
        self.fd = fd
        self.reads = reads
        self.forgotten = forgotten
        self.listings = Listings(ops)
        self._slots = trio.Semaphore(max_tasks)
        self._handlers = {
            p.LOOKUP: self._lookup, p.GETATTR: self._getattr, p.READLINK: self._readlink,
            p.OPEN: self._open, p.READ: self._read, p.RELEASE: self._nothing,
            p.OPENDIR: self._opendir, p.READDIR: self._readdir, p.READDIRPLUS: self._readdir,
            p.RELEASEDIR: self._nothing, p.STATFS: self._statfs, p.GETXATTR: self._getxattr,
            p.LISTXATTR: self._listxattr, p.FLUSH: self._flush, p.FSYNC: self._fsync,
            p.FSYNCDIR: self._nothing, p.DESTROY: self._nothing,
        }

    async def serve(self) -> None:
        """Answer requests until the session ends (unmounted: ENODEV)."""
        buf = bytearray(p.BUFSIZE)
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    try:
                        n = os.readv(self.fd, [buf])
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(self.fd)
                        continue
                    except OSError as e:
                        if e.errno == errno.ENODEV:  # unmounted
                            return
                        if e.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: interrupted
                            continue
                        raise
                    try:
                        req = p.parse(buf, n)
                    except p.ProtocolError as e:
                        log.error("a FUSE request that does not parse: %s", e)
                        unique = p.IN_HEADER.unpack_from(buf)[2] if n >= p.IN_HEADER.size \
                            else 0
                        if unique:
                            self._write(unique, [], errno.EIO)
                        continue
                    if req.opcode in p.NO_REPLY:
                        self._no_reply(req)
                        continue
                    await self._slots.acquire()
                    nursery.start_soon(self._answer, req)
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await self.listings.close_all()

    def _no_reply(self, req: p.Request) -> None:
        """FORGET, BATCH_FORGET (the VFS drops the kernel's references) and INTERRUPT (not
        acted on, as pyfuse3 does not: the request ends when its answer does)."""
        try:
            if req.opcode == p.FORGET:
                items = [(req.nodeid, p.FORGET_IN.unpack_from(req.body)[0])]
            elif req.opcode == p.BATCH_FORGET:
                count = p.BATCH_FORGET_IN.unpack_from(req.body)[0]
                off = p.BATCH_FORGET_IN.size
                items = [p.FORGET_ONE.unpack_from(req.body, off + k * p.FORGET_ONE.size)
                         for k in range(count)]
            else:
                return
            if self.forgotten is None:
                self.ops.vfs.forget(items)
            else:
                inos = [ino for ino, _ in items]
                self.forget_all(inos)
                self.forgotten(inos)
        except Exception:  # noqa: BLE001 - nothing a request carries may end the worker
            log.exception("%s of inode %d failed", req.name, req.nodeid)

    def forget_all(self, inos: list[int]) -> None:
        """The kernel evicted these inodes: drop every lookup this worker counted of them."""
        inodes = self.ops.vfs.inodes
        self.ops.vfs.forget([(ino, node.lookups) for ino in inos
                             if (node := inodes.get(ino)) is not None])

    async def _answer(self, req: p.Request) -> None:
        """Serve one request and write its answer; the engine's error boundary."""
        try:
            handler = self._handlers.get(req.opcode)
            if handler is None:
                err = errno.EROFS if req.opcode in p.CHANGES and self.ops.vfs.ro \
                    else errno.ENOSYS
                self._write(req.unique, [], err)
                return
            try:
                parts = await handler(req, Context(req.uid, req.gid, req.pid))
            except pyfuse3.FUSEError as e:
                self._write(req.unique, [], e.errno)
                return
            except OverflowError:
                self._write(req.unique, [], errno.ERANGE)
                return
            except Exception:  # noqa: BLE001 - the boundary: answered, logged, the worker goes on
                log.exception("%s of inode %d failed; answered EIO", req.name, req.nodeid)
                self._write(req.unique, [], errno.EIO)
                return
            self._write(req.unique, parts)
        finally:
            self._slots.release()

    def _write(self, unique: int, parts: list, err: int = 0) -> None:
        if self.before_reply is not None:
            self.before_reply()
        size = sum(len(x) for x in parts)
        try:
            os.writev(self.fd, [p.header(unique, size, err), *parts])
        except OSError as e:
            # ENOENT: the request was interrupted and the kernel forgot it; ENODEV: unmounted
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("answering request %d: %s", unique, e.strerror)

    # ------------------------------------------------------------------ handlers: return the body

    async def _lookup(self, req: p.Request, ctx: Context) -> list:
        e = await self.ops.lookup(req.nodeid, req.names()[0], ctx)
        return [p.entry_out(attributes(e))]

    async def _getattr(self, req: p.Request, ctx: Context) -> list:
        return [p.attr_out(attributes(await self.ops.getattr(req.nodeid, ctx)))]

    async def _readlink(self, req: p.Request, ctx: Context) -> list:
        return [await self.ops.readlink(req.nodeid, ctx)]

    async def _open(self, req: p.Request, ctx: Context) -> list:
        raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel opens files itself from now on

    async def _read(self, req: p.Request, ctx: Context) -> list:
        offset, size = p.READ_IN.unpack_from(req.body)[1:3]
        self.reads.pids[req.nodeid] = req.pid  # no OPEN: the READ names its inode
        data = await self.ops.read(req.nodeid, offset, size)
        return [data] if len(data) else []

    async def _flush(self, req: p.Request, ctx: Context) -> list:
        await self.ops.flush(p.RELEASE_IN.unpack_from(req.body)[0])
        return []

    async def _fsync(self, req: p.Request, ctx: Context) -> list:
        fh, flags = p.FSYNC_IN.unpack_from(req.body)[:2]
        await self.ops.fsync(fh, bool(flags & 1))
        return []

    async def _opendir(self, req: p.Request, ctx: Context) -> list:
        raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel opens directories itself

    async def _readdir(self, req: p.Request, ctx: Context) -> list:
        offset, size = p.READ_IN.unpack_from(req.body)[1:3]
        out = DirBuffer(size, req.opcode == p.READDIRPLUS)
        listing = await self.listings.get(req.nodeid, offset, ctx)  # no OPENDIR: our handle
        async with listing.lock:
            await self.ops.readdir(listing.fh, offset, out)
        return out.parts

    async def _statfs(self, req: p.Request, ctx: Context) -> list:
        s = await self.ops.statfs(ctx)
        return [p.statfs_out(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree,
                             s.f_bsize, s.f_namemax, s.f_frsize)]

    async def _getxattr(self, req: p.Request, ctx: Context) -> list:
        size = p.GETXATTR_IN.unpack_from(req.body)[0]
        name = req.names(p.GETXATTR_IN.size)[0]
        return [p.xattr_answer(await self.ops.getxattr(req.nodeid, name, ctx), size)]

    async def _listxattr(self, req: p.Request, ctx: Context) -> list:
        size = p.GETXATTR_IN.unpack_from(req.body)[0]
        names = await self.ops.listxattr(req.nodeid, ctx)
        return [p.xattr_answer(b"".join(n + b"\0" for n in names), size)]

    async def _nothing(self, req: p.Request, ctx: Context) -> list:
        """RELEASE and RELEASEDIR of what the kernel opened itself, FSYNCDIR of a read-only
        mount, DESTROY: nothing to do."""
        return []


__all__ = ["DirBuffer", "Engine", "EngineNotifier", "EngineReads", "Listings", "attributes"]
