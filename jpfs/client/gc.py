"""``jpfs gc``: reclaim the space of blobs no file points at, then compact volumes.

Mark and sweep: the live set is every blob named by a chunk record on any shard; every blob a
storage node holds that is not live and older than ``grace`` seconds is deleted, and volumes with
enough dead bytes are rewritten (``compact``, which never loses a live blob even if killed). The
grace period protects writes in flight: their blobs are stored before the metadata that names
them commits. Blobs freed by a delete or overwrite during the scan are found by the next gc.
"""

from __future__ import annotations

import logging
import time

from ..errors import JPFSError
from .client import AsyncClient

log = logging.getLogger(__name__)

DEFAULT_GRACE = 600.0
DELETE_BATCH = 10_000


async def live_blobs(client: AsyncClient) -> set[bytes]:
    live: set[bytes] = set()
    for shard in range(client.meta.n_shards):
        after = b""
        while True:
            items, nxt = await client.meta.call(shard, "scan", "chunk", after, 5000)
            live.update(rec[2] for rec in items)
            if nxt is None:
                break
            after = nxt
    return live


async def collect(client: AsyncClient, *, grace: float = DEFAULT_GRACE,
                  min_dead_ratio: float = 0.3, compact: bool = True,
                  dry_run: bool = False) -> dict:
    storage = client._data().storage
    live = await live_blobs(client)
    cutoff = time.time() - grace
    report: dict = {"live_blobs": len(live), "nodes": {}}
    for node in range(storage.n_nodes):
        r = report["nodes"][node] = {"scanned": 0, "deleted": 0}
        try:
            after = b""
            dead: list[bytes] = []
            while True:
                page = await storage.list_blobs(node, after, 10_000)
                if not page:
                    break
                r["scanned"] += len(page)
                dead += [bid for bid, created in page if bid not in live and created < cutoff]
                after = page[-1][0]
            if not dry_run:
                for k in range(0, len(dead), DELETE_BATCH):
                    await storage.delete([(bid, (node,)) for bid in dead[k:k + DELETE_BATCH]])
            r["deleted"] = len(dead)
            if compact and not dry_run:
                r["compact"] = await storage.compact(node, min_dead_ratio)
        except JPFSError as e:
            log.warning("gc: storage node %d skipped: %s", node, e.strerror)
            r["error"] = e.strerror
    return report
