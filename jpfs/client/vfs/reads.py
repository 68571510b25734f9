"""Opens for reading and reads: what an open fetches, what it lets the kernel keep, and the
handles of files the kernel opened without asking.

Answers come from memory where that is safe (docs/design-notes.md: the cost of a mount is
requests per file):

- an open of a file whose bytes the kernel caches (same version) keeps the kernel's pages;
- a small file is fetched whole at open (usually prefetched already) and pushed into the kernel's
  page cache, so its reads never reach us.

A read-only mount answers OPEN with ENOSYS, so the kernel opens files itself; their first READ
opens them here (``read_unopened``), and those "unopened" handles are kept, within bounds, until
the reads cover the file.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import OrderedDict

import trio

from ...errors import JPFSError, error
from ...types import Layout
from ..data.reader import chunk_map
from ..wire.storage import Moved
from .handles import FileHandle
from .inodes import Node
from .leasing import Leasing
from .shared import SharedState
from .types import OpenFile, outcome_of

log = logging.getLogger(__name__)

UNOPENED_MAX = 1024
"""Handles the VFS keeps for files the kernel opened without asking and has not read whole (the
oldest is closed first; a later READ opens it again)."""
UNOPENED_BYTES = 256 << 20
"""... and the bytes of whole small files those handles may hold (views that keep blobs alive
after the memory cache let them go)."""


class Reads:
    """Reading opens and reads, and the handles the VFS keeps for the kernel's own opens."""

    def __init__(self, shared: SharedState, leasing: Leasing):
        self.shared = shared
        self.leasing = leasing
        self.meta = shared.meta
        self.reader = shared.reader
        self.cache = shared.cache
        self.prefetcher = shared.prefetcher
        self.inodes = shared.inodes
        self.handles = shared.handles
        self.stats = shared.stats
        self.config = shared.config
        self.notifier = shared.notifier
        self.ro = shared.ro
        self._unopened: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Inode -> (the handle its first READ opened, the bytes it holds), where the kernel
        sends no OPEN."""
        self._unopened_bytes = 0
        self._opening: dict[int, trio.Event] = {}

    async def open(self, ino: int, stream: int = 0) -> OpenFile:
        """Open a file for reading; ``stream`` identifies the reader (a thread or process) for
        prefetch."""
        await self.leasing.settle(ino)
        node = self.inodes.get(ino) or await self.shared.node(ino)
        if node.writer is not None:  # being written here: reads go through the writer
            node.opens += 1
            self.stats.opens["memory"] += 1
            return OpenFile(self.handles.add(FileHandle(node, writer=None)), True)
        if self.ro and node.kernel_version == node.attr.version and node.layout is not None:
            node.opens += 1  # the kernel holds these bytes: nothing to fetch, nothing to check
            self.stats.opens["kernel"] += 1
            return OpenFile(self.handles.add(FileHandle(node, node.layout)), True)
        return await self.open_read(node, stream)

    async def open_read(self, node: Node, stream: int, *, by_kernel: bool = False
                         ) -> OpenFile:
        """Open for reading; ``by_kernel``: the kernel opened the file without asking and is
        reading it now (its pages are missing, and the READ answers with the bytes)."""
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
        if node.writer is not None:  # a writer opened it while we fetched
            node.opens += 1
            self.stats.opens["memory"] += 1
            return OpenFile(self.handles.add(FileHandle(node)), True)
        node.layout = layout
        attr = layout.attr
        version = attr.version
        stale = node.kernel_version is not None and node.kernel_version != version
        keep = not by_kernel and node.kernel_version == version
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
                sources: set[str] = set()
                try:
                    (h.data,) = await self.reader.whole([layout], sources)
                except JPFSError as e:
                    log.warning("cannot read %s: %s", self.shared.name_of(node), e.strerror)
                    raise
                outcome = outcome_of(sources)
                # Only when no other handle is open: then no READ of this inode can hold page
                # locks that the store would wait for while we cannot answer.
                if not stale and not by_kernel and node.opens == 1 and cfg.notify_store \
                        and self.notifier.store(ino, h.data):
                    keep = True
                    self.stats.notify_store_bytes += len(h.data)
                    self.cache.delivered([c.blob for c in layout.chunks])
            else:
                outcome = "deferred"
        except BaseException:
            self.handles.pop(fh)
            node.opens -= 1
            raise
        if stale and (by_kernel or not self.ro):
            # the kernel's size may be stale too; where it keeps pages across opens, its next
            # look at the attributes drops the old version's pages (mtime and size changed)
            self.notifier.invalidate_attr(ino)
        node.kernel_version = version
        self.stats.opens[outcome] += 1
        return OpenFile(fh, keep)

    async def read_unopened(self, ino: int, off: int, size: int, stream: int = 0
                            ) -> memoryview | bytearray | bytes:
        """A READ of a file the kernel opened without asking (a read-only mount that answers
        OPEN with ENOSYS): the first READ opens it here (what prefetch learns from an open, a
        small file fetched whole), and that handle is closed once the reads have covered the
        file (the kernel's pages hold it), when the kernel forgets the inode, or when it is the
        oldest past ``UNOPENED_MAX`` handles or ``UNOPENED_BYTES``; the page a hand-off held
        back is answered before this, by ``Handoff.read_tail``."""
        held = self._unopened.get(ino)
        if held is None:
            fh = await self._open_unopened(ino, stream)
        else:
            fh = held[0]
            self._unopened.move_to_end(ino)
        h = self.shared.file_handle(fh)
        out = await self.read(fh, off, size)
        h.served += len(out)
        held = self._unopened.get(ino)
        if h.served >= h.node.attr.size and held is not None and held[0] == fh:
            if h.data is not None and h.layout is not None and self.config.notify_store:
                self.cache.delivered([c.blob for c in h.layout.chunks])
            self.close_unopened(ino)
        return out

    def opened_elsewhere(self, ino: int, stream: int) -> None:
        """Another process serving this mount opened ``ino`` for ``stream`` with its first READ
        (``VFS.peer_read``): its READs fill the kernel's pages of this version, which hand-offs
        and prefetch then skip, and prefetch learns from the open, where the name is known."""
        node = self.inodes.get(ino)
        if node is None:
            return
        node.kernel_version = node.attr.version
        if not node.parent or not self.prefetcher.enabled:
            return
        path = self.inodes.path(node)
        if path is not None:
            self.prefetcher.opened(stream, ino, node.parent, node.name, path, node.attr)

    def is_opening(self, ino: int) -> bool:
        """Whether a READ of ``ino`` is opening it here now."""
        return ino in self._opening

    def unopened_handle(self, ino: int) -> FileHandle | None:
        """The handle held for ``ino``, which the kernel opened without asking, if one is."""
        held = self._unopened.get(ino)
        return self.shared.file_handle(held[0]) if held is not None else None

    def forgotten(self, ino: int) -> None:
        """The kernel forgot ``ino``: the handle held for it, if any, is closed."""
        if ino in self._unopened:
            self.close_unopened(ino)

    async def _open_unopened(self, ino: int, stream: int) -> int:
        while (busy := self._opening.get(ino)) is not None:  # another READ is opening it
            await busy.wait()
            held = self._unopened.get(ino)
            if held is not None:
                return held[0]
        done = self._opening[ino] = trio.Event()
        try:
            node = self.inodes.get(ino) or await self.shared.node(ino)
            if not node.attr.is_reg:
                raise error(errno.EINVAL, "JPFS stores bytes for regular files only")
            fh = (await self.open_read(node, stream, by_kernel=True)).fh
            h = self.shared.file_handle(fh)
            nbytes = len(h.data) if h.data is not None else 0
            self._unopened[ino] = (fh, nbytes)
            self._unopened_bytes += nbytes
            while len(self._unopened) > UNOPENED_MAX or (
                    self._unopened_bytes > UNOPENED_BYTES and len(self._unopened) > 1):
                self.close_unopened(next(iter(self._unopened)))
            return fh
        finally:
            del self._opening[ino]
            done.set()

    def close_unopened(self, ino: int) -> None:
        """Close the handle held for ``ino``, which the kernel opened without asking."""
        fh, nbytes = self._unopened.pop(ino)
        self._unopened_bytes -= nbytes
        self.close_reader(fh)

    async def read(self, fh: int, off: int, size: int) -> memoryview | bytearray | bytes:
        """Up to ``size`` bytes at ``off`` through handle ``fh`` (fewer at end of file): from the
        bytes fetched at open, the handle's writer, or the file's chunks."""
        h = self.shared.file_handle(fh)
        out: memoryview | bytearray | bytes
        if h.data is not None:
            out = h.data[off:off + size]
        elif h.node.writer is not None:
            w = h.node.writer
            async with w.lock:
                out = await w.read(off, size)
        else:
            out = await self._read_layout(h, off, size)
        self.stats.read_bytes += len(out)
        return out

    async def _read_layout(self, h: FileHandle, off: int, size: int):
        try:
            return await self._read_from_layout(h, off, size)
        except Moved:
            # the healer moved every copy of a chunk since this layout was read (a drain, a
            # rebalance): the record names the new nodes, and the bytes are the same
            stale = h.layout
            fresh = await self.meta.get_layout(h.node.ino)
            if stale is not None and fresh.attr.version != stale.attr.version:
                raise  # rewritten meanwhile: not the bytes this open saw
            h.layout, h.chunks, h.node.layout = fresh, None, fresh
            self.stats.layouts_refreshed += 1
            return await self._read_from_layout(h, off, size)

    async def _read_from_layout(self, h: FileHandle, off: int, size: int):
        layout = h.layout
        if layout is None:
            layout = h.layout = h.node.layout or await self.meta.get_layout(h.node.ino)
        fsize = layout.attr.size
        if off >= fsize or size <= 0:
            return b""
        if fsize <= self.config.small_file:
            (h.data,) = await self.reader.whole([layout])
            return h.data[off:off + size]
        chunks = h.chunks
        if chunks is None:
            chunks = h.chunks = chunk_map(layout.chunks)
        self.prefetcher.read(h, layout, off, min(size, fsize - off))
        return await self.reader.read(chunks, fsize, layout.chunk_size, off, size)

    def close_reader(self, fh: int) -> None:
        """Release reading handle ``fh``: the node may go, and its read-ahead stops."""
        h = self.handles.pop(fh)
        if type(h) is not FileHandle:
            return
        node = h.node
        node.opens -= 1
        if h.chunks is not None:
            self.prefetcher.closed(h)
        if node.lookups <= 0:
            self.inodes.drop_if_unused(node)


__all__ = ["Reads", "UNOPENED_BYTES", "UNOPENED_MAX"]
