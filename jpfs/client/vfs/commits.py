"""Commits of what the VFS's writers hold, and the write-behind of files made under a lease.

Write semantics: writes are buffered per file (one ``FileWriter`` shared by the handles writing
it) and committed on flush (close), fsync, release and every 64 MiB, each commit one metadata
transaction guarded by the version the writer started from, so other nodes see the old bytes or
the new, never a mix. Another node sees the new bytes when it next opens the file (an open
revalidates the layout unless ``read_only``). With ``write_behind``, a file made under a lease
and not sent yet is committed behind its close (``BEHIND_FILES``): its create waits in the
lease's queue for its bytes, so the shard, and every other node, learns of it with them;
whatever asks about it first (an open, a getattr, fsync, another node) waits for both, as it
waits for a create. Without it a close returns once the file is committed: a killed mount loses
no closed file.
"""

from __future__ import annotations

import errno
import logging
import time

import trio

from ...errors import JPFSError, error
from ..data.writer import FileWriter
from .handles import FileHandle
from .inodes import Node
from .leasing import Leasing
from .shared import SharedState

log = logging.getLogger(__name__)

BEHIND_FILES = 64
"""Files made under a lease whose close is answered before their bytes are stored, at most at
once; a close past this (or past ``BEHIND_BYTES``) stores them before it is answered."""
BEHIND_BYTES = 64 << 20
"""... and their bytes."""


class Commits:
    """When a writer's bytes are committed, and the files committed behind their close."""

    def __init__(self, shared: SharedState, leasing: Leasing):
        self.shared = shared
        self.leases = leasing.leases
        self.meta = shared.meta
        self.inodes = shared.inodes
        self.handles = shared.handles
        self.stats = shared.stats
        self.prefetcher = shared.prefetcher
        self.config = shared.config
        self.ro = shared.ro
        self._behind: dict[int, int] = {}
        """Inode -> its bytes, for files whose close was answered before they were stored."""
        self._behind_bytes = 0
        self._behind_done = trio.Event()
        self._behind_done.set()
        self._behind_lost: dict[int, int] = {}
        """Inode -> directory, for files whose bytes a store behind their close lost (until an
        fsync reports it, or a later commit stores them)."""

    async def commit(self, node: Node, w: FileWriter) -> None:
        """Commit what ``w`` holds of the file (waiting for a commit in progress)."""
        if not w.lock.locked() and (not w.dirty or w.discarded):
            return  # nothing to commit and none in progress (the close of a clean handle)
        async with w.lock:
            if not w.dirty or w.discarded:
                return
            await w.commit()
        if not w.discarded:
            self.committed(node, w)

    def committed(self, node: Node, w: FileWriter) -> None:
        """``w`` committed: the node holds the new version, its exact times are the shard's."""
        now = time.time_ns()
        node.attr = node.attr.with_(size=w.size, version=w.version, mtime_ns=now, ctime_ns=now)
        node.fetched = float("-inf")  # the service has the exact times
        node.layout = None
        node.kernel_version = w.version  # the kernel's pages were written through it
        self.stats.commits += 1
        self._behind_lost.pop(node.ino, None)  # stored after all
        if node.parent:
            self.prefetcher.forget_dir(node.parent)

    async def drop_writer(self, node: Node, w: FileWriter) -> None:
        """A handle writing through ``w`` closed: the last one commits and lets the writer go."""
        w.refs -= 1
        if w.refs > 0:
            return
        try:
            await self.commit(node, w)
        finally:
            if w.refs == 0 and node.writer is w:
                node.writer = None
                if self.leases is not None:
                    self.leases.book.closed(node.ino)
                if node.lookups <= 0:
                    self.inodes.drop_if_unused(node)

    def close_behind(self, node: Node, w: FileWriter) -> bool:
        """Start committing ``w`` behind its close, if its file was made under a lease and is
        not sent yet, nothing else commits it, and the bound allows: True if started."""
        leases = self.leases
        if leases is None or not self.config.write_behind:
            return False
        if w.lock.locked() or not w.dirty or w.discarded or w.ino in self._behind or \
                len(self._behind) >= BEHIND_FILES:
            return False
        n = w.dirty_bytes
        if self._behind_bytes + n > BEHIND_BYTES:
            return False
        stored = leases.book.store_behind(w.ino)
        if stored is None:
            return False
        self._behind[w.ino] = n
        self._behind_bytes += n
        if self._behind_done.is_set():  # (a new event only when none was in flight: a waiter
            self._behind_done = trio.Event()  # on the current one must see it set)
        self.shared.client.nursery.start_soon(self._commit_behind, node, w, stored)
        return True

    async def _commit_behind(self, node: Node, w: FileWriter, stored: trio.Event) -> None:
        try:
            await self.commit(node, w)
            self.stats.closes_behind += 1
        except Exception as e:  # noqa: BLE001 - a task of the mount's own: log, never crash it
            self.stats.closes_behind_failed += 1
            self._behind_lost[w.ino] = node.parent
            if len(self._behind_lost) > 65536:  # nobody asks: keep the newest
                del self._behind_lost[next(iter(self._behind_lost))]
            why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            log.error("could not store %s after it was closed (%s); its release tries again, "
                      "and its create is committed without its bytes", self.shared.name_of(node),
                      why)
        finally:
            stored.set()
            self._behind_bytes -= self._behind.pop(w.ino)
            if not self._behind:
                self._behind_done.set()

    def report_lost(self, ino: int | None, parent: int | None) -> None:
        """EIO, once, for the file ``ino`` or the files in ``parent`` whose bytes could not be
        stored behind their close (as a local filesystem's fsync reports a writeback error)."""
        lost = [i for i, p in self._behind_lost.items() if i == ino or p == parent]
        for i in lost:
            del self._behind_lost[i]
        if lost:
            raise error(errno.EIO, f"the bytes of {len(lost)} file(s) closed here could not be "
                        "stored after their close (see the mount's log)")

    async def behind_settled(self) -> None:
        """Return once no file is being committed behind its close (each has stored its bytes,
        or logged that it could not)."""
        await self._behind_done.wait()

    async def commit_all(self) -> None:
        """Commit every file with buffered writes and make every change durable (before an
        unmount); errors are logged."""
        await self._behind_done.wait()
        for h in self.handles.values():
            if type(h) is FileHandle and h.writer is not None:
                try:
                    await self.commit(h.node, h.writer)
                except JPFSError as e:
                    log.error("could not commit %s before unmounting: %s",
                              self.shared.name_of(h.node), e.strerror)
        if self.leases is not None:
            await self.leases.close()
        if not self.ro:
            try:
                await self.meta.sync()
            except JPFSError as e:
                log.error("could not make the metadata durable before unmounting: %s",
                          e.strerror)


__all__ = ["BEHIND_BYTES", "BEHIND_FILES", "Commits"]
