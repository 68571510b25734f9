"""How the VFS reaches the kernel's caches on a FUSE mount: pyfuse3's notify calls.

The VFS decides when the kernel must learn something (a file's bytes to cache, attributes gone
stale); this object only carries it, so the VFS never imports pyfuse3. A failed notification is
never an error for the request that caused it: the kernel then asks again on its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import pyfuse3
import trio

log = logging.getLogger(__name__)

T = TypeVar("T")


class KernelNotifier:
    """The ``jpfs.client.vfs.core.Notifier`` of a live pyfuse3 mount at ``mountpoint``."""

    def __init__(self, mountpoint: str = ""):
        self.mountpoint = mountpoint
        self.closed = False
        self._busy = 0
        self._idle = trio.Event()
        self._idle.set()

    def store(self, ino: int, data: memoryview) -> bool:
        """Put ``data`` (a whole file) into the kernel's page cache for ``ino``."""
        try:
            # pyfuse3 takes any contiguous buffer (PyObject_GetBuffer); its stub says bytes, and
            # a copy of a whole file is what this avoids.
            pyfuse3.notify_store(ino, 0, data)  # type: ignore[arg-type]
        except OSError as e:
            log.debug("notify_store of inode %d failed: %s", ino, e)
            return False
        return True

    async def store_many(self, files: list[tuple[int, memoryview]]) -> list[bool]:
        """``store`` for each file, from a worker thread: a READ of one of them may hold its
        pages locked, and only this loop, which must stay free for it, can answer that READ.
        pyfuse3 lets go of the GIL while the kernel copies."""
        return await self._in_thread(
            lambda: [not self.closed and self.store(i, d) for i, d in files],
            [False] * len(files))

    async def introduce(self, path: str) -> bool:
        """Let the kernel know every entry of the directory at ``path`` (from the mount's
        root): a worker thread lists it through the mount, and the READDIRPLUS answers (this
        loop's own) hand the kernel an inode per entry, which ``store`` needs."""
        if not self.mountpoint:
            return False

        def scan() -> bool:
            with os.scandir(self.mountpoint + path) as it:
                for _ in it:
                    pass
            return True

        try:
            return await self._in_thread(scan, False)
        except OSError as e:
            log.debug("listing %s through the mount failed: %s", path, e)
            return False

    async def _in_thread(self, fn: Callable[[], T], closed: T) -> T:
        """``fn()`` in a worker thread, unless the mount is closing (then ``closed``)."""
        if self.closed:
            return closed
        if not self._busy:
            self._idle = trio.Event()
        self._busy += 1
        try:
            return await trio.to_thread.run_sync(fn)
        finally:
            self._busy -= 1
            if not self._busy:
                self._idle.set()

    async def close(self) -> None:
        """No more notifications; wait for those in worker threads to end. Call it while
        the mount still answers requests (a store may wait for a READ's pages) and before
        the session is closed (a thread must not use it after)."""
        self.closed = True
        await self._idle.wait()

    def invalidate_attr(self, ino: int) -> None:
        """Drop the kernel's cached attributes of ``ino`` (not its pages), so the next stat asks the
        mount; a failure (the kernel no longer knows the inode) is only logged."""
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as e:
            log.debug("invalidate_inode %d failed: %s", ino, e)


__all__ = ["KernelNotifier"]
