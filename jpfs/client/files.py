"""Open files on the native client: ``AsyncFile`` (trio) and ``RawFile`` (blocking, io-compatible).

A file reads through the client's ``Reader`` (the one chunk-assembly path, over the one blob
cache) and, when open for writing, changes through a ``FileWriter`` (dirty chunks committed on
``flush``/``close`` or past ``flush_bytes`` in one metadata transaction guarded by the version read
at open: another writer's change in between fails the commit with ESTALE instead of being lost).
Sequential reads of a large file are read ahead by the client's prefetcher, several chunks at
once over several nodes. Data becomes visible to other clients at flush or close
(close-to-open consistency).
"""

from __future__ import annotations

import errno
import io
import logging

from ..errors import error
from ..types import Layout
from .data.prefetch import Prefetcher
from .data.reader import Reader, chunk_map
from .data.store import DataPath
from .data.writer import FLUSH_BYTES, FileWriter
from .wire.storage import Moved

log = logging.getLogger(__name__)


def parse_mode(mode: str) -> tuple[bool, bool, str]:
    """(readable, writable, 'r'|'w'|'a'|'x') for a binary open mode; ValueError otherwise."""
    letters = set(mode)
    if "b" not in letters or not letters <= set("rwaxb+") or len(mode) != len(letters):
        raise ValueError(f"invalid mode {mode!r}: JPFS files are binary (wrap them in "
                         "io.TextIOWrapper for text)")
    kinds = letters & set("rwax")
    if len(kinds) != 1:
        raise ValueError(f"invalid mode {mode!r}: use exactly one of r, w, a, x")
    kind = kinds.pop()
    plus = "+" in letters
    return kind == "r" or plus, kind != "r" or plus, kind


class AsyncFile:
    """A binary file open on JPFS. Not safe for concurrent use by several tasks."""

    def __init__(self, reader: Reader, data: DataPath, prefetcher: Prefetcher | None, path: str,
                 mode: str, layout: Layout, parent: int, *, flush_bytes: int = FLUSH_BYTES):
        self.reader = reader
        self.prefetcher = prefetcher
        self.name = path
        self.mode = mode
        self.readable, self.writable, kind = parse_mode(mode)
        self.append = kind == "a"
        self.ino = layout.attr.ino
        self.cs = layout.chunk_size
        self._layout = layout
        self._data = data
        self._chunks = chunk_map(layout.chunks)
        self._size = layout.attr.size
        self.writer = FileWriter(data, reader, layout, parent, path, flush_bytes=flush_bytes) \
            if self.writable else None
        self.pos = self._size if self.append else 0
        self.closed = False

    @property
    def size(self) -> int:
        """The file's size in bytes, writes not yet flushed included."""
        return self.writer.size if self.writer is not None else self._size

    @property
    def version(self) -> int:
        """The file's version (``Attr.version``): as opened, or as this handle's last commit left
        it."""
        return self.writer.version if self.writer is not None else self._layout.attr.version

    # ---- reading
    async def readinto(self, buf) -> int:
        """Read into ``buf`` from the position on; the bytes read (0 at end of file)."""
        self._check(self.readable, "not open for reading")
        dest = memoryview(buf).cast("B")
        got = await self._read(len(dest))
        dest[:len(got)] = got
        return len(got)

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes from the position on (all the rest when ``n`` is negative or None)."""
        self._check(self.readable, "not open for reading")
        if n is None or n < 0:
            n = max(0, self.size - self.pos)
        return bytes(await self._read(n))

    async def _read(self, n: int):
        off = self.pos
        if self.writer is not None:
            out = await self.writer.read(off, n)
        else:
            if self.prefetcher is not None and self._size > self.cs:
                self.prefetcher.read(self, self._layout, off, n)
            try:
                out = await self.reader.read(self._chunks, self._size, self.cs, off, n)
            except Moved:
                # the healer moved a chunk's every copy since open: the same bytes elsewhere
                fresh = await self._data.meta.get_layout(self.ino)
                if fresh.attr.version != self._layout.attr.version:
                    raise
                self._layout, self._chunks = fresh, chunk_map(fresh.chunks)
                out = await self.reader.read(self._chunks, self._size, self.cs, off, n)
        self.pos += len(out)
        return out

    # ---- position
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move the position as ``io`` does; the new position. EINVAL before the start; ValueError
        for a bad ``whence``."""
        self._check(True, "")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise error(errno.EINVAL, "negative seek position", self.name)
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        """The position, in bytes from the start."""
        return self.pos

    # ---- writing
    async def write(self, data) -> int:
        """Write ``data`` at the position (at the end in append mode); the bytes taken, all of them.
        Others see them after ``flush`` or ``close``."""
        self._check(self.writable, "not open for writing")
        assert self.writer is not None
        if self.append:
            self.pos = self.writer.size
        n = await self.writer.write(self.pos, data)
        self.pos += n
        return n

    async def truncate(self, size: int | None = None) -> int:
        """Cut or extend the file to ``size`` bytes (default: the position); the new size."""
        self._check(self.writable, "not open for writing")
        assert self.writer is not None
        size = self.pos if size is None else size
        await self.writer.truncate(size)
        return size

    async def flush(self) -> None:
        """Commit the writes so far (one metadata transaction); ESTALE if another writer changed the
        file since it was opened."""
        if not self.closed and self.writer is not None:
            await self.writer.commit()

    async def close(self) -> None:
        """Flush, then close (idempotent); a failed flush still closes and raises."""
        if self.closed:
            return
        try:
            await self.flush()
        finally:
            self.closed = True
            if self.prefetcher is not None:
                self.prefetcher.closed(self)

    def _check(self, allowed: bool, why: str) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if not allowed:
            raise io.UnsupportedOperation(why)

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class RawFile(io.RawIOBase):
    """A blocking, ``io``-compatible view of an AsyncFile, run on the client's trio loop."""

    def __init__(self, afile: AsyncFile, call):
        self._f = afile
        self._call = call  # runs an async function on the client's loop
        self.name = afile.name
        self.mode = afile.mode

    def readable(self) -> bool:
        """Whether the file was opened for reading."""
        return self._f.readable

    def writable(self) -> bool:
        """Whether the file was opened for writing."""
        return self._f.writable

    def seekable(self) -> bool:
        """Always True: every JPFS file can seek."""
        return True

    def readinto(self, b) -> int:
        """Read into ``b`` at the position; the bytes read (0 at end of file)."""
        return self._call(self._f.readinto, b)

    def readall(self) -> bytes:
        """Everything from the position to the end of the file."""
        return self._call(self._f.read, -1)

    def write(self, b) -> int:
        """Write ``b`` at the position (see ``AsyncFile.write``); the bytes taken."""
        return self._call(self._f.write, b)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move the position as ``io`` does; the new position."""
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        """The position, in bytes from the start."""
        return self._f.tell()

    def truncate(self, size: int | None = None) -> int:
        """Cut or extend the file to ``size`` bytes (default: the position); the new size."""
        return self._call(self._f.truncate, size)

    def flush(self) -> None:
        """Commit the writes so far (see ``AsyncFile.flush``)."""
        if not self.closed:
            self._call(self._f.flush)

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if not self.closed:
            try:
                self._call(self._f.close)
            finally:
                super().close()

    @property
    def size(self) -> int:
        """The file's size in bytes, writes not yet flushed included."""
        return self._f.size


class BufferedWriter(io.BufferedWriter):
    """``flush()`` commits: buffered bytes go to the file *and* to JPFS (visible to others)."""

    def flush(self) -> None:
        """Write out the buffer, then commit the file (``RawFile.flush``)."""
        super().flush()
        self.raw.flush()


class BufferedRandom(io.BufferedRandom):
    """``flush()`` commits: buffered bytes go to the file *and* to JPFS (visible to others)."""

    def flush(self) -> None:
        """Write out the buffer, then commit the file (``RawFile.flush``)."""
        super().flush()
        self.raw.flush()
