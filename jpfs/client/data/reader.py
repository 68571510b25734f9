"""File bytes from chunks: the only code that assembles what a reader sees.

A file is a list of chunks (``chunk_size`` bytes of the file each, one immutable blob per chunk);
holes and the bytes past a chunk's stored length read as zeros. Every reader of JPFS (the mount's
VFS, the native client's file objects, ``read_many`` and ``read_ranges``) goes through ``Reader``,
and every blob it needs comes through the one ``BlobCache``, so prefetched and read-ahead blobs
are found whoever asked for them.

A read that covers part of one stored chunk is handed out as a view of the cached blob, without a
copy; anything else is assembled into one new buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...placement import chunk_span
from ...types import Chunk, Layout
from .cache import BlobCache, Fetch

_ZEROS = memoryview(bytes(1 << 20))


def zeros(n: int) -> memoryview:
    """``n`` zero bytes (a view of a shared buffer when small)."""
    return _ZEROS[:n] if n <= len(_ZEROS) else memoryview(bytes(n))


def chunk_map(chunks: Sequence[Chunk]) -> dict[int, Chunk]:
    """Chunks by index (holes are absent)."""
    return {c.index: c for c in chunks}


def assemble(layout: Layout, blobs: Sequence[memoryview]) -> memoryview:
    """A whole file from its chunks' blobs (``blobs[i]`` is ``layout.chunks[i]``'s)."""
    size = layout.attr.size
    chunks = layout.chunks
    if len(chunks) == 1 and chunks[0].index == 0 and chunks[0].length >= size:
        return blobs[0][:size]
    out = bytearray(size)
    cs = layout.chunk_size
    for c, blob in zip(chunks, blobs, strict=True):
        start = c.index * cs
        if start >= size:
            continue
        n = min(c.length, size - start)
        out[start:start + n] = blob[:n]
    return memoryview(out)


def _fill(dest: memoryview, src: memoryview | bytearray | None, stored: int, start: int) -> None:
    """``dest`` from ``src[start:]`` where ``src`` holds ``stored`` bytes; zeros past them."""
    n = len(dest)
    have = 0 if src is None else max(0, min(n, stored - start))
    if src is not None and have:
        dest[:have] = src[start:start + have]
    if have < n:
        dest[have:] = zeros(n - have)


def piece(chunks: Mapping[int, Chunk], blobs: Mapping[int, memoryview], size: int, cs: int,
          off: int, n: int, dirty: Mapping[int, bytearray] | None = None
          ) -> memoryview | bytearray:
    """Bytes ``[off, off + n)`` of a file (``n`` already clipped to ``size``) from its chunks'
    blobs by index and its ``dirty`` (unwritten) chunks, which take precedence."""
    span = chunk_span(off, n, cs)
    if len(span) == 1:
        i = span[0]
        start = off - i * cs
        src: memoryview | bytearray | None = dirty.get(i) if dirty else None
        if src is None:
            c = chunks.get(i)
            view = blobs.get(i) if c is not None else None
            if c is not None and view is not None and start + n <= c.length:
                return view[start:start + n]
            stored = c.length if c is not None else 0
            src = view
        else:
            stored = len(src)
        out = bytearray(n)
        _fill(memoryview(out), src, stored, start)
        return out
    out = bytearray(n)
    dest = memoryview(out)
    pos = 0
    for i in span:
        start = max(off, i * cs) - i * cs
        take = min(cs - start, n - pos)
        src = dirty.get(i) if dirty else None
        if src is not None:
            _fill(dest[pos:pos + take], src, len(src), start)
        else:
            c = chunks.get(i)
            _fill(dest[pos:pos + take], blobs.get(i), c.length if c is not None else 0, start)
        pos += take
    return out


class Reader:
    """Reads file bytes through the blob cache.

    Args:
        cache: where blobs are looked for first, and where partly read blobs wait for the rest
            of their reads.
        fetch: the verified storage read (``StorageClient.get``).
        keep_whole: whether whole-file reads leave their blobs in the memory cache (the mount:
            other handles may open the file next) or hand them to the caller only (the native
            client: the caller holds them).
    """

    def __init__(self, cache: BlobCache, fetch: Fetch, *, keep_whole: bool):
        self.cache = cache
        self.fetch = fetch
        self.keep_whole = keep_whole

    async def blobs(self, chunks: Sequence[Chunk], sources: set[str] | None = None, *,
                    keep: bool = True) -> list[memoryview]:
        """Whole blobs of ``chunks``, in order (one storage call for all that are not cached)."""
        if not chunks:
            return []
        return await self.cache.get(chunks, self.fetch, sources, keep=keep)

    async def whole(self, layouts: Sequence[Layout], sources: set[str] | None = None
                    ) -> list[memoryview]:
        """The whole contents of each file, fetched in one batched call."""
        chunks = [c for lay in layouts for c in lay.chunks]
        blobs = await self.blobs(chunks, sources, keep=self.keep_whole)
        out, k = [], 0
        for lay in layouts:
            n = len(lay.chunks)
            out.append(assemble(lay, blobs[k:k + n]))
            k += n
        return out

    async def read(self, chunks: Mapping[int, Chunk], size: int, cs: int, off: int, n: int,
                   dirty: Mapping[int, bytearray] | None = None) -> memoryview | bytearray:
        """Bytes ``[off, off + n)`` of a file of ``size`` bytes (short at its end). A chunk read
        to its end is released from the memory cache: its reader has it now."""
        if off >= size or n <= 0:
            return bytearray()
        n = min(n, size - off)
        span = chunk_span(off, n, cs)
        need = [c for i in span if (c := chunks.get(i)) is not None
                and not (dirty and i in dirty)]
        blobs: dict[int, memoryview] = {}
        if need:
            got = await self.cache.get(need, self.fetch)
            blobs = {c.index: v for c, v in zip(need, got, strict=True)}
        out = piece(chunks, blobs, size, cs, off, n, dirty)
        end = off + n
        if end % cs == 0 or end == size:
            done = chunks.get(span[-1])
            if done is not None:
                self.cache.delivered([done.blob])
        return out

    async def ranges(self, spans: Sequence[tuple[Layout, int, int]]) -> list[memoryview]:
        """Byte ranges ``[start, end)`` (already clipped) of files, in one batched read: each
        chunk is fetched once however many ranges touch it."""
        wanted: dict[bytes, Chunk] = {}
        maps = [chunk_map(lay.chunks) for lay, _, _ in spans]
        for (lay, s, e), chunks in zip(spans, maps, strict=True):
            for i in chunk_span(s, e - s, lay.chunk_size):
                c = chunks.get(i)
                if c is not None:
                    wanted.setdefault(c.blob, c)
        got = await self.blobs(list(wanted.values()), keep=False)
        by_blob = dict(zip(wanted, got, strict=True))
        out = []
        for (lay, s, e), chunks in zip(spans, maps, strict=True):
            blobs = {c.index: by_blob[c.blob] for c in chunks.values() if c.blob in by_blob}
            out.append(memoryview(piece(chunks, blobs, lay.attr.size, lay.chunk_size, s,
                                        e - s)) if e > s else memoryview(b""))
        return out


__all__ = ["Reader", "assemble", "chunk_map", "piece", "zeros"]
