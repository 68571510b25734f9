"""The filesystem's totals (``statfs``): JPFS's stored bytes and its storage disks' free space.

``df`` and every tool that checks for room ask often; the answer asks every storage node, so it
is kept for a second.
"""

from __future__ import annotations

import time

import trio

from ...errors import JPFSError
from ...types import StatFS
from .shared import SharedState


class Capacity:
    """``statfs``, with its last answer."""

    def __init__(self, shared: SharedState):
        self.meta = shared.meta
        self.client = shared.client
        self._statfs: tuple[float, StatFS | None] = (0.0, None)

    async def statfs(self) -> StatFS:
        """Capacity as JPFS sees it: its own stored bytes (over the replicas) as used, and the
        free space of each distinct storage disk (over the replicas) as what may still be
        written; storage nodes that share a disk count it once."""
        at, cached = self._statfs
        if cached is not None and time.monotonic() - at < 1.0:
            return cached
        counts = await self.meta.counts()
        storage = self.client.storage
        assert storage is not None
        nodes: list = []  # each answering node's jpfs.proto.storage.Stats

        async def one(i: int) -> None:
            try:
                nodes.append(await storage.stats(i))
            except JPFSError:
                pass

        async with trio.open_nursery() as nursery:
            for i in range(storage.n_nodes):
                nursery.start_soon(one, i)
        r = max(1, self.client.cluster.replicas)
        disks: dict[object, int] = {}
        for n in nodes:
            key = n.disk_id or ("node", n.node)
            disks[key] = n.disk_free
        bs = 4096
        used = sum(n.bytes_used for n in nodes) // r
        free = sum(disks.values()) // r
        free_inodes = 1 << 40
        s = StatFS(block_size=bs, blocks=(used + free) // bs, blocks_free=free // bs,
                   files=counts.inodes + free_inodes, files_free=free_inodes)
        self._statfs = (time.monotonic(), s)
        return s


__all__ = ["Capacity"]
