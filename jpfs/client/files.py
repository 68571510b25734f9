"""Open files on the native client: ``AsyncFile`` (trio) and ``RawFile`` (blocking, io-compatible).

A file holds its layout (chunk records) from open time. Reads fetch whole chunks, a few ahead at
once (``readahead`` chunks, striped over the nodes, so one sequential reader uses every node);
a sequential reader also has the *next* window in flight while it consumes this one.
Writes collect modified chunks in memory and, on ``flush``/``close`` (or past ``flush_bytes``),
store them as new blobs and commit them in one metadata transaction guarded by the version read
at open: another writer's change in between fails the commit with ESTALE instead of being lost.
Data becomes visible to other clients at flush or close (close-to-open consistency).
"""

from __future__ import annotations

import errno
import io
import logging
from collections import OrderedDict

import trio

from ..errors import error
from ..placement import n_chunks
from ..types import Attr, Chunk, Layout
from .data import DataPath, zeros

log = logging.getLogger(__name__)

READAHEAD_CHUNKS = 4
FLUSH_BYTES = 64 << 20


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

    def __init__(self, data: DataPath, path: str, mode: str, layout: Layout, parent: int, *,
                 readahead: int = READAHEAD_CHUNKS, flush_bytes: int = FLUSH_BYTES,
                 nursery: trio.Nursery | None = None):
        self.data = data
        self.nursery = nursery
        self.name = path
        self.mode = mode
        self.readable, self.writable, kind = parse_mode(mode)
        self.append = kind == "a"
        self.ino = layout.attr.ino
        self.parent = parent
        self.size = layout.attr.size
        self.version = layout.attr.version
        self.cs = layout.chunk_size
        self.pos = self.size if self.append else 0
        self.readahead = max(1, readahead)
        self.flush_bytes = flush_bytes
        self.closed = False
        self._chunks: dict[int, Chunk] = {c.index: c for c in layout.chunks}
        self._blobs: OrderedDict[int, memoryview] = OrderedDict()
        self._dirty: dict[int, bytearray] = {}
        self._dirty_bytes = 0
        self._size_dirty = False
        self._coming: dict[int, trio.Event] = {}  # chunks being fetched ahead
        self._last = -2  # the chunk read last (sequential detection)

    # ---- reading
    async def _chunk(self, index: int) -> memoryview | None:
        """Chunk ``index``'s bytes as the file has them now (None for a hole)."""
        if index in self._dirty:
            return memoryview(self._dirty[index])
        sequential = index in (self._last, self._last + 1)
        self._last = index
        blob = self._blobs.get(index)
        if blob is None and index in self._coming:
            await self._coming[index].wait()
            blob = self._blobs.get(index)
        if blob is None:
            if index not in self._chunks:
                return None
            want = self._window(index)
            for c, b in zip(want, await self.data.read_chunks(want), strict=True):
                self._blobs[c.index] = b[:c.length]
            blob = self._blobs[index]
        self._blobs.move_to_end(index)
        if sequential:
            self._fetch_ahead(index)
        while len(self._blobs) > self.readahead * 3:
            self._blobs.popitem(last=False)
        return blob

    def _window(self, index: int) -> list[Chunk]:
        """Stored chunks from ``index`` on, up to ``readahead``, not held or coming already."""
        return [self._chunks[j] for j in range(index, index + self.readahead)
                if j in self._chunks and j not in self._blobs and j not in self._dirty
                and j not in self._coming]

    def _fetch_ahead(self, index: int) -> None:
        """Start fetching the window after the one holding ``index`` unless it is on its way."""
        nxt = (index // self.readahead + 1) * self.readahead
        want = self._window(nxt)
        if not want or self.nursery is None:
            return
        done = trio.Event()
        for c in want:
            self._coming[c.index] = done
        self.nursery.start_soon(self._fetch_window, want, done)

    async def _fetch_window(self, want: list[Chunk], done: trio.Event) -> None:
        try:
            got = await self.data.read_chunks(want)
            if not self.closed:
                for c, b in zip(want, got, strict=True):
                    if c.index not in self._dirty and self._chunks.get(c.index) is c:
                        self._blobs[c.index] = b[:c.length]
        except OSError as e:  # the reader fetches it again itself, and sees the error then
            log.debug("read-ahead of %s failed: %s", self.name, e)
        finally:
            for c in want:
                self._coming.pop(c.index, None)
            done.set()

    async def readinto(self, buf) -> int:
        self._check(self.readable, "not open for reading")
        dest = memoryview(buf).cast("B")
        n = max(0, min(len(dest), self.size - self.pos))
        done = 0
        while done < n:
            index, off = divmod(self.pos + done, self.cs)
            take = min(n - done, self.cs - off)
            chunk = await self._chunk(index)
            have = 0 if chunk is None else max(0, min(take, len(chunk) - off))
            if have:
                dest[done:done + have] = chunk[off:off + have]
            if have < take:
                dest[done + have:done + take] = zeros(take - have)
            done += take
        self.pos += n
        return n

    async def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = max(0, self.size - self.pos)
        buf = bytearray(min(n, max(0, self.size - self.pos)))
        got = await self.readinto(buf)
        del buf[got:]
        return bytes(buf)

    # ---- position
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check(True, "")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise error(errno.EINVAL, "negative seek position", self.name)
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    # ---- writing
    async def write(self, data) -> int:
        self._check(self.writable, "not open for writing")
        src = memoryview(data).cast("B")
        if self.append:
            self.pos = self.size
        done = 0
        while done < len(src):
            index, off = divmod(self.pos + done, self.cs)
            take = min(len(src) - done, self.cs - off)
            buf = self._dirty.get(index)
            if buf is None:
                old = await self._chunk(index)
                buf = bytearray(old) if old is not None else bytearray()
                # bytes the file has past this chunk's stored length read as zeros
                end_here = min(self.cs, max(0, self.size - index * self.cs))
                if len(buf) < end_here:
                    buf.extend(bytes(end_here - len(buf)))
                self._dirty[index] = buf
                self._blobs.pop(index, None)
                self._dirty_bytes += self.cs
            if len(buf) < off:
                buf.extend(bytes(off - len(buf)))
            buf[off:off + take] = src[done:done + take]
            done += take
        self.pos += len(src)
        if self.pos > self.size:
            self.size = self.pos
            self._size_dirty = True
        if self._dirty_bytes >= self.flush_bytes:
            await self.flush()
        return len(src)

    async def truncate(self, size: int | None = None) -> int:
        self._check(self.writable, "not open for writing")
        size = self.pos if size is None else size
        if size < 0:
            raise error(errno.EINVAL, "negative size", self.name)
        await self.flush()
        attr = await self.data.meta.setattr(self.ino, size=size)
        self._reload(attr, await self.data.meta.get_layout(self.ino))
        return size

    async def flush(self) -> None:
        if self.closed or not (self._dirty or self._size_dirty):
            return
        pieces = [(i, memoryview(b)) for i, b in sorted(self._dirty.items())]
        total = n_chunks(self.size, self.cs)
        chunks = await self.data.store(self.ino, self.parent, pieces, total)
        try:
            attr = await self.data.meta.write_chunks(self.ino, chunks, self.size,
                                                     expect_version=self.version)
        except OSError as e:
            if e.errno == errno.ESTALE:
                raise error(errno.ESTALE, "the file was changed by another writer since it was "
                            "opened; reopen it and write again", self.name) from None
            raise
        self.version = attr.version
        for c, (_, view) in zip(chunks, pieces, strict=True):
            self._chunks[c.index] = c
            self._blobs[c.index] = view
        self._dirty.clear()
        self._dirty_bytes = 0
        self._size_dirty = False

    def _reload(self, attr: Attr, layout: Layout) -> None:
        self.size, self.version = attr.size, attr.version
        self._chunks = {c.index: c for c in layout.chunks}
        self._blobs.clear()
        self.pos = min(self.pos, self.size) if not self.writable else self.pos

    async def close(self) -> None:
        if self.closed:
            return
        try:
            await self.flush()
        finally:
            self.closed = True
            self._blobs.clear()

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
        return self._f.readable

    def writable(self) -> bool:
        return self._f.writable

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._call(self._f.readinto, b)

    def readall(self) -> bytes:
        return self._call(self._f.read, -1)

    def write(self, b) -> int:
        return self._call(self._f.write, b)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def truncate(self, size: int | None = None) -> int:
        return self._call(self._f.truncate, size)

    def flush(self) -> None:
        if not self.closed:
            self._call(self._f.flush)

    def close(self) -> None:
        if not self.closed:
            try:
                self._call(self._f.close)
            finally:
                super().close()

    @property
    def size(self) -> int:
        return self._f.size


class BufferedWriter(io.BufferedWriter):
    """``flush()`` commits: buffered bytes go to the file *and* to JPFS (visible to others)."""

    def flush(self) -> None:
        super().flush()
        self.raw.flush()


class BufferedRandom(io.BufferedRandom):
    """``flush()`` commits: buffered bytes go to the file *and* to JPFS (visible to others)."""

    def flush(self) -> None:
        super().flush()
        self.raw.flush()
