"""Buffered writes to one file: dirty chunks in memory, committed in one metadata transaction.

Every writer of JPFS (the mount's VFS, the native client's file objects) keeps its changes here.
A write copies the chunks it touches into memory (``dirty``); a commit stores them as new blobs on
R storage nodes and then points the file at them with one ``write_chunks`` transaction guarded by
the version the writer started from: another writer's commit in between fails this one with
ESTALE instead of being silently lost, and readers elsewhere see the old bytes or the new, never a
mix. Commits happen on ``commit()`` (close, flush, fsync) and whenever ``flush_bytes`` of chunks
are dirty.

All handles that write one file on a mount share one FileWriter, as a local filesystem shares its
page cache: a second writer sees the first one's bytes, and one commit publishes both. ``lock``
serialises them.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio

from ...errors import error
from ...placement import chunk_span, n_chunks
from ...types import Attr, Layout
from .reader import Reader, chunk_map
from .store import DataPath

log = logging.getLogger(__name__)


async def _nothing(ino: int) -> None:
    return None


async def _not_attached(ino: int, chunks: list, size: int) -> Attr | None:
    return None

FLUSH_BYTES = 64 << 20
"""Dirty chunk bytes after which a writer commits on its own (bounds a writer's memory)."""


class FileWriter:
    """One file's uncommitted changes (see the module docstring)."""

    def __init__(self, data: DataPath, reader: Reader, layout: Layout, parent: int, name: str,
                 *, flush_bytes: int = FLUSH_BYTES):
        self.data = data
        self.reader = reader
        self.name = name
        """For error messages: the path, or what is known of it."""
        self.ino = layout.attr.ino
        self.parent = parent
        self.cs = layout.chunk_size
        self.size = layout.attr.size
        self.version = layout.attr.version
        self.flush_bytes = flush_bytes
        self.chunks = chunk_map(layout.chunks)
        self.dirty_chunks: dict[int, bytearray] = {}
        self._dirty_bytes = 0
        self._size_dirty = False
        self.lock = trio.Lock()
        self.refs = 0
        """Handles sharing this writer (the mount's count; the native client keeps one)."""
        self.discarded = False
        """The file was removed while open: its unwritten bytes go with it, as in POSIX."""
        self.commits = 0
        self.settle: Callable[[int], Awaitable[None]] = _nothing
        """Awaited before the shard is asked about the file (a mount's lease settle)."""
        self.attach: Callable[[int, list, int], Awaitable[Attr | None]] = _not_attached
        """The first commit of a file a lease made and has not sent: sent with it (its
        attributes after), or None."""

    @property
    def dirty(self) -> bool:
        """Whether there is anything to commit (written chunks, or a size change)."""
        return bool(self.dirty_chunks or self._size_dirty)

    @property
    def dirty_bytes(self) -> int:
        """The bytes the dirty chunks hold."""
        return sum(len(b) for b in self.dirty_chunks.values())

    # ---- reading what the writer sees
    async def read(self, off: int, n: int) -> memoryview | bytearray:
        """Bytes ``[off, off + n)`` as this writer has them (dirty chunks over stored ones)."""
        return await self.reader.read(self.chunks, self.size, self.cs, off, n,
                                      self.dirty_chunks)

    async def _load(self, index: int) -> bytearray:
        """Chunk ``index`` as a writable buffer, as long as the file has bytes in it."""
        buf = self.dirty_chunks.get(index)
        if buf is not None:
            return buf
        end_here = min(self.cs, max(0, self.size - index * self.cs))
        c = self.chunks.get(index)
        if c is not None and end_here:
            (blob,) = await self.reader.blobs([c])
            buf = bytearray(blob[:min(c.length, end_here)])
        else:
            buf = bytearray()
        if len(buf) < end_here:  # bytes the file has past the stored length read as zeros
            buf.extend(bytes(end_here - len(buf)))
        self.dirty_chunks[index] = buf
        self._dirty_bytes += self.cs
        return buf

    # ---- changes
    def _spans(self, off: int, n: int):
        """(chunk index, start in it, bytes) of each chunk that ``[off, off + n)`` touches."""
        cs = self.cs
        done = 0
        for i in chunk_span(off, n, cs):
            start = max(off, i * cs) - i * cs
            take = min(cs - start, n - done)
            yield i, start, take
            done += take

    def _needs_read(self, index: int, start: int, take: int) -> bool:
        """Whether writing part of chunk ``index`` must first read its stored bytes."""
        if index in self.dirty_chunks or (start == 0 and take == self.cs):
            return False
        return self.chunks.get(index) is not None and self.size > index * self.cs

    def _put(self, off: int, src: memoryview) -> int:
        """Copy ``src`` to ``off`` in the dirty chunks; no await. Every chunk whose stored bytes
        are needed (``_needs_read``) is dirty already."""
        done = 0
        for i, start, take in self._spans(off, len(src)):
            buf = self.dirty_chunks.get(i)
            if buf is None:  # overwritten whole, or nothing stored: zeros where the file has bytes
                end_here = min(self.cs, max(0, self.size - i * self.cs))
                buf = self.dirty_chunks[i] = bytearray(self.cs if take == self.cs else end_here)
                self._dirty_bytes += self.cs
            if len(buf) < start:
                buf.extend(bytes(start - len(buf)))
            buf[start:start + take] = src[done:done + take]
            done += take
        if off + len(src) > self.size:
            self.size = off + len(src)
            self._size_dirty = True
        return len(src)

    def write_now(self, off: int, data) -> int | None:
        """``write`` when it needs no await: no chunk it touches needs its stored bytes read
        first, and the dirty bound is not reached (no commit). The bytes written, or None when
        ``write`` must do it. As it never yields, a caller that finds ``lock`` free may call it
        without taking the lock."""
        src = memoryview(data).cast("B")
        if not src:
            return 0
        added = 0
        for i, start, take in self._spans(off, len(src)):
            if self._needs_read(i, start, take):
                return None
            if i not in self.dirty_chunks:
                added += self.cs
        if self._dirty_bytes + added >= self.flush_bytes:
            return None
        return self._put(off, src)

    async def write(self, off: int, data) -> int:
        """Write ``data`` at ``off`` (the file grows as needed); returns the bytes written."""
        now = self.write_now(off, data)
        if now is not None:
            return now
        src = memoryview(data).cast("B")
        for i, start, take in self._spans(off, len(src)):
            if self._needs_read(i, start, take):
                await self._load(i)
        n = self._put(off, src)
        if self._dirty_bytes >= self.flush_bytes:
            await self.commit()
        return n

    async def allocate(self, off: int, length: int, keep_size: bool) -> None:
        """``fallocate``: the file reads as before, and grows to ``off + length`` unless
        ``keep_size`` (JPFS stores no blocks ahead of writes: holes read as zeros already)."""
        if off < 0 or length <= 0:
            raise error(errno.EINVAL, "fallocate needs offset >= 0 and length > 0", self.name)
        if not keep_size and off + length > self.size:
            self.size = off + length
        self._size_dirty = True  # the commit marks the file modified, as fallocate(2) does

    async def truncate(self, size: int) -> Attr:
        """Make the file ``size`` bytes long (committing what is dirty first)."""
        if size < 0:
            raise error(errno.EINVAL, "negative size", self.name)
        await self.commit()
        await self.settle(self.ino)
        attr = await self.data.meta.setattr(self.ino, size=size)
        layout = await self.data.meta.get_layout(self.ino)
        self.size, self.version = attr.size, attr.version
        self.chunks = chunk_map(layout.chunks)
        self.commits += 1
        return attr

    async def commit(self) -> Attr | None:
        """Store the dirty chunks and publish them (version-guarded); None if nothing was dirty.
        A file removed while open loses its unwritten bytes (``discarded``), as in POSIX."""
        if not self.dirty or self.discarded:
            return None
        pieces = [(i, memoryview(b)) for i, b in sorted(self.dirty_chunks.items())]
        total = n_chunks(self.size, self.cs)
        stored = await self.data.store(self.ino, self.parent, pieces, total)
        try:
            attr = await self.attach(self.ino, stored, self.size)  # with a lease's create
            if attr is None:
                await self.settle(self.ino)  # a file made under a lease is known first
                attr = await self.data.meta.write_chunks(self.ino, stored, self.size,
                                                         expect_version=self.version)
        except OSError as e:
            if e.errno == errno.ESTALE:
                raise error(errno.ESTALE, "the file was changed by another writer since it was "
                            "opened; reopen it and write again", self.name) from None
            if e.errno == errno.ENOENT:
                self.discarded = True
                log.debug("%s was removed while open; its unwritten bytes are dropped",
                          self.name)
                return None
            raise
        self.version = attr.version
        for c in stored:
            self.chunks[c.index] = c
        self.dirty_chunks.clear()
        self._dirty_bytes = 0
        self._size_dirty = False
        self.commits += 1
        return attr


__all__ = ["FLUSH_BYTES", "FileWriter"]
