"""File bytes: layouts from the metadata service, blobs from the storage nodes.

Reads fetch whole blobs (a chunk is one blob, at most ``chunk_size``), verified end to end by the
storage client, and assemble files from them; a one-chunk file is handed out as a view of its
blob, without a copy. Writes store blobs first (on R nodes) and only then point the file at them
in one metadata transaction: a crash in between leaves unreferenced blobs for ``jpfs gc``, never a
file that points at missing bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ..config import Cluster
from ..placement import chunk_nodes, n_chunks
from ..types import Attr, Chunk, Layout
from .cache import BlobCache
from .meta import MetaClient
from .storage import StorageClient

_ZEROS = memoryview(bytes(1 << 20))


def new_blob_id() -> bytes:
    return os.urandom(16)


def assemble(layout: Layout, blobs: Sequence[memoryview]) -> memoryview:
    """A file's bytes from its chunks' blobs: holes and the tail past the last chunk read as 0."""
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


class DataPath:
    """Read and write file contents given inodes (the path-level client sits on top)."""

    def __init__(self, meta: MetaClient, storage: StorageClient, cluster: Cluster,
                 cache: BlobCache | None = None):
        self.meta = meta
        self.storage = storage
        self.cluster = cluster
        self.chunk_size = cluster.chunk_size
        self.cache = cache
        """Reads go through this blob cache when set (the FUSE mount sets its own)."""

    async def _blobs(self, chunks: Sequence[Chunk]) -> list[memoryview]:
        if self.cache is not None:
            return await self.cache.get(chunks, self.storage.get)
        return await self.storage.get(chunks)

    # ---- reads
    async def read_layouts(self, layouts: Sequence[Layout]) -> list[memoryview]:
        """The whole contents of each file, fetched in one batched storage call."""
        chunks = [c for lay in layouts for c in lay.chunks]
        blobs = await self._blobs(chunks) if chunks else []
        out, k = [], 0
        for lay in layouts:
            n = len(lay.chunks)
            out.append(assemble(lay, blobs[k:k + n]))
            k += n
        return out

    async def read_chunks(self, chunks: Sequence[Chunk]) -> list[memoryview]:
        return await self._blobs(chunks) if chunks else []

    # ---- writes
    def placement(self, ino: int, parent: int, index: int, total: int) -> tuple[int, ...]:
        return chunk_nodes(ino, parent, index, total, self.cluster.n_nodes,
                           self.cluster.replicas)

    async def store(self, ino: int, parent: int, pieces: Sequence[tuple[int, memoryview]],
                    total_chunks: int) -> list[Chunk]:
        """Store ``(chunk index, bytes)`` pieces as new blobs; returns their Chunk records."""
        if not pieces:
            return []
        items = [(new_blob_id(), self.placement(ino, parent, i, total_chunks), data)
                 for i, data in pieces]
        stored = await self.storage.put(items)
        return [Chunk(i, bid, nodes, len(data), len(data), xxh)
                for (i, data), (bid, _, _), (nodes, xxh) in zip(pieces, items, stored,
                                                                  strict=True)]

    async def new_entry(self, name: bytes, parent: int, data, mode: int) -> list:
        """A ``bulk_create`` entry for a new file holding ``data`` (its blobs stored first).
        Chunks of a large file stripe from a random start, as its inode is not known yet."""
        view = memoryview(data).cast("B")
        cs = self.chunk_size
        total = n_chunks(len(view), cs)
        key = int.from_bytes(os.urandom(8), "little")
        chunks = await self.store(key, parent, [(i, view[i * cs:(i + 1) * cs])
                                                for i in range(total)], total)
        return [name, mode & 0o7777, os.getuid(), os.getgid(), len(view), time.time_ns(),
                [c.to_wire() for c in chunks]]

    async def write_whole(self, attr: Attr, parent: int, data) -> Attr:
        """Make ``data`` the whole content of regular file ``attr.ino``."""
        view = memoryview(data).cast("B")
        cs = self.chunk_size
        total = n_chunks(len(view), cs)
        pieces = [(i, view[i * cs:(i + 1) * cs]) for i in range(total)]
        chunks = await self.store(attr.ino, parent, pieces, total)
        return await self.meta.write_chunks(attr.ino, chunks, len(view))


def zeros(n: int) -> memoryview:
    return _ZEROS[:n] if n <= len(_ZEROS) else memoryview(bytes(n))
