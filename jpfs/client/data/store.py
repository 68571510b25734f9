"""Storing file bytes: blobs on R storage nodes first, then the metadata that points at them.

A crash between the two leaves unreferenced blobs for ``jpfs gc``, never a file that points at
missing bytes. Reading is ``reader.Reader``'s; buffered writes to open files are
``writer.FileWriter``'s, which store through here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ...config import Cluster
from ...placement import chunk_nodes, n_chunks
from ...types import Attr, Chunk
from ..wire.meta import MetaClient
from ..wire.storage import StorageClient


def new_blob_id() -> bytes:
    """A fresh random 128-bit blob id (blobs are immutable: a change is a new id)."""
    return os.urandom(16)


class DataPath:
    """Store file contents given inodes (the path-level client and the writers sit on top)."""

    def __init__(self, meta: MetaClient, storage: StorageClient, cluster: Cluster):
        self.meta = meta
        self.storage = storage
        self.cluster = cluster
        self.chunk_size = cluster.chunk_size

    # ---- writes
    def placement(self, ino: int, parent: int, index: int, total: int,
                  group: int = 0) -> tuple[int, ...]:
        """The preferred nodes of a chunk: over the writable nodes of the map the storage
        client follows (a drained or removed node takes no new bytes; a new one at once), the
        copies on distinct failure domains where there are enough."""
        return chunk_nodes(ino, parent, index, total, self.storage.writable,
                           self.storage.replicas, group, self.storage.domains)

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
