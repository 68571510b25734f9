"""The kernel hand-off: files a read-only mount's prefetch fetched ahead (a directory swept
whole for a shuffled epoch, the files a scan fetched ahead of an in-order reader) go on into the
kernel's page cache before anybody reads them (``notify_store``), so their readers make almost
no requests.

The prefetcher hands each fetched batch out as a value (``Prefetcher.handoffs``); ``run`` takes
them, ``hand`` gives them to the kernel, and the prefetcher is told what the kernel took
(``Prefetcher.handed``) and, as readers reach the held-back pages, how far behind they are
(``Prefetcher.reached``): prefetch never calls up into the VFS.
"""

from __future__ import annotations

import logging

import trio

from ...types import Attr, Layout
from ..data.prefetch import KernelBatch
from .inodes import Node
from .reads import Reads
from .shared import SharedState
from .types import Handed

log = logging.getLogger(__name__)

PAGE = 4096
"""The kernel's page size."""
HAND_SAMPLE = 8
"""A sweep gives the kernel one file in this many without its last page (``Handoff.hand``)."""
INTRODUCED_MAX = 4096
"""Directories remembered as listed through the mount for ``Handoff.hand``."""


class Handoff:
    """The directories introduced to the kernel and the files handed without their last page."""

    def __init__(self, shared: SharedState, reads: Reads):
        self.reads = reads
        self.inodes = shared.inodes
        self.cache = shared.cache
        self.prefetcher = shared.prefetcher
        self.notifier = shared.notifier
        self.stats = shared.stats
        self._introduced: dict[int, trio.Event] = {}
        """Directories whose entries this VFS made the kernel hold (``hand``)."""
        self._handed: dict[int, Handed] = {}
        """Inode -> a file given to the kernel but for its last page, until that is read."""
        self._hand_group = 0
        """Files handed whole since the last one handed without its last page."""
        self._hand_carry = 0
        """... and their bytes."""

    async def run(self) -> None:
        """Hand each batch the prefetcher fetched for the kernel (``Prefetcher.handoffs``), each
        in a task of its own, until cancelled (the mount's nursery runs it)."""
        async with trio.open_nursery() as nursery:
            async for batch in self.prefetcher.handoffs:
                nursery.start_soon(self._hand_batch, batch)

    async def _hand_batch(self, batch: KernelBatch) -> None:
        """``hand`` one batch, and tell the prefetcher what went to the kernel."""
        handed, failed = 0, False
        try:
            handed = await self.hand(batch.parent, batch.attrs)
        except Exception:
            failed = True  # prefetch is a hint: the files' READs fetch what this missed
            log.exception("a prefetch task failed")
        finally:
            self.prefetcher.handed(batch, handed, failed=failed)

    async def hand(self, parent: int, attrs: list[Attr]) -> int:
        """A read-only mount's directory sweep or scan fetched ``attrs`` (files of ``parent``):
        give them to the kernel's page cache now, before anybody reads them. Their readers then
        make no request at all (the kernel holds the entries, the pages and, with no OPEN, the
        open), where each cost a LOOKUP and a READ carrying the file, and the mount frees the
        blobs at once, so its memory is reused warm rather than grown into (page faults,
        docs/perf.md).

        The kernel says nothing when it serves a file, and prefetch must still know how far
        ahead of its readers it is (handed bytes count against ``kernel_ahead``). So one file
        in ``HAND_SAMPLE`` is handed without its last page and carries the bytes of the files
        handed whole before it: the READ of that page, answered from memory, releases them and
        counts as the file's open for prefetch. A shuffled reader reaches the sampled files at
        the pace it reaches the rest; a scan takes an in-order reader's jump past the files it
        handed as the reader's progress. Files whose opens co-access rules predict from (an
        episode's parquet, whose videos are fetched when it is opened) all keep their last page
        while the partners' directory is not swept, so those opens are still seen.

        The kernel must hold an inode to take pages for it: the first batch of a directory
        lists it through the mount (its entries then are lookups the kernel counts), and a
        batch that finds files the kernel let go of lists it again. A file open or being
        opened here is left to its READs, which find the blob in the cache. Returns the bytes
        given to the kernel (``Prefetcher.handed``)."""
        ready = self._introduced.get(parent)
        if ready is not None and ready.is_set() and any(
                self.inodes.get(a.ino) is None for a in attrs):
            ready = None
        if ready is None:
            while len(self._introduced) >= INTRODUCED_MAX:
                del self._introduced[next(iter(self._introduced))]
            ready = self._introduced[parent] = trio.Event()
            path = self.inodes.dir_path(parent)
            try:
                if path is not None:
                    await self.notifier.introduce(path)
            finally:
                ready.set()
        await ready.wait()
        files: list[tuple[int, memoryview]] = []
        picked: list[tuple[Node, Layout, memoryview]] = []
        for a in attrs:
            node = self.inodes.get(a.ino)
            if node is None or node.lookups <= 0 or node.opens or node.writer is not None \
                    or self.reads.is_opening(a.ino) or a.ino in self._handed \
                    or node.kernel_version == a.version:
                continue
            layout = node.layout or self.prefetcher.layout(a.ino)
            if layout is None or layout.attr.version != a.version or not layout.chunks:
                continue
            views = [self.cache.peek(c) for c in layout.chunks]
            if any(v is None for v in views):
                continue
            node.layout = layout
            data = views[0] if len(views) == 1 else \
                memoryview(b"".join(views))  # type: ignore[arg-type]
            assert data is not None
            files.append((a.ino, data))
            picked.append((node, layout, data))
        if not files:
            return 0
        samples: dict[int, int] = {}
        for k, ((ino, data), (node, _, _)) in enumerate(zip(files, picked, strict=True)):
            path = self.inodes.path(node)
            seen = path is not None and self.prefetcher.predicts_from(path)
            if (seen or self._hand_group + 1 >= HAND_SAMPLE) and len(data) > PAGE:
                samples[ino] = cut = (len(data) - 1) // PAGE * PAGE
                files[k] = (ino, data[:cut])
                self._hand_group = 0
            else:
                self._hand_group += 1
        stored = await self.notifier.store_many(files)
        handed = 0
        for (node, layout, data), ok in zip(picked, stored, strict=True):
            if ok and self.reads.unopened_handle(node.ino) is not None:
                self._stored_under_reader(node.ino, len(data))
            if not ok or self.inodes.get(node.ino) is not node or node.opens \
                    or node.kernel_version == layout.attr.version:
                continue  # gone, or read meanwhile: its READs opened it, the kernel has it
            node.kernel_version = layout.attr.version
            self.stats.handed_files += 1
            handed += len(data)
            self._hand_carry += len(data)
            held = samples.get(node.ino)
            if held is not None:
                self._handed[node.ino] = Handed(layout.attr.version, held, bytes(data[held:]),
                                                self._hand_carry)
                self._hand_carry = 0
            self.stats.notify_store_bytes += len(data) if held is None else held
            self.cache.delivered([c.blob for c in layout.chunks])
        return handed

    def _stored_under_reader(self, ino: int, nbytes: int) -> None:
        """A file was read (its first READ opened it) while its hand-off was being stored:
        the kernel now holds its first ``nbytes`` and will READ at most the rest (a sampled
        file's last page), so the handle counts them as served and closes once the file is
        covered, where it would have stayed open until the kernel forgot the inode."""
        h = self.reads.unopened_handle(ino)
        assert h is not None
        h.served = max(h.served, nbytes)
        if h.served >= h.node.attr.size:
            self.reads.close_unopened(ino)

    def unhand(self, ino: int) -> Handed | None:
        """A handed file's last page was asked for, or the kernel let go of it."""
        h = self._handed.pop(ino, None)
        if h is not None:
            self.prefetcher.reached(h.carries)
        return h

    def read_tail(self, ino: int, off: int, size: int, stream: int = 0) -> bytes | None:
        """A READ of a file the kernel opened without asking (``Reads.read_unopened``): the page
        held back of a handed file, answered from memory (it counts as the file's open for
        prefetch), or None for any other READ. Either way the file's hand-off has ended."""
        handed = self.unhand(ino)
        if handed is not None and off >= handed.cut:
            node = self.inodes.get(ino)
            if node is not None and node.attr.version == handed.version:
                self.stats.handed_reads += 1
                path = self.inodes.path(node) if node.parent else None
                if path is not None:
                    self.prefetcher.opened(stream, ino, node.parent, node.name, path,
                                           node.attr, True)
                self.stats.read_bytes += min(size, len(handed.tail))
                return handed.tail[off - handed.cut:off - handed.cut + size]
        return None


__all__ = ["HAND_SAMPLE", "Handoff"]
