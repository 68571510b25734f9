"""``jpfs gc``: reclaim the space of blobs no file points at, then compact volumes.

Mark and sweep: the live set is every (blob, node) pair named by a chunk record on any shard;
every blob a storage node holds that no record names *on that node* and that is older than
``grace`` seconds is deleted, and volumes with enough dead bytes are rewritten (``compact``,
which never loses a live blob even if killed). Per node, not per blob: a copy the healer moved
away (rebalance, drain), or one it copied whose record changed meanwhile, is garbage on that
node even though the blob lives on elsewhere. The grace period protects writes in flight and
the healer's copies: their blobs are stored before the metadata that names them commits. Blobs
freed by a delete or overwrite during the scan are found by the next gc. Removed nodes are
left alone (nothing of theirs counts any more).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ...errors import JPFSError
from ..client import AsyncClient

log = logging.getLogger(__name__)

DEFAULT_GRACE = 600.0
DELETE_BATCH = 10_000


async def live_copies(client: AsyncClient) -> dict[bytes, frozenset[int]]:
    """Mark: every blob a chunk record points at, with the nodes the records name for it."""
    live: dict[bytes, frozenset[int]] = {}
    for shard in range(client.meta.n_shards):
        after = b""
        while True:
            page = await client.meta.scan(shard, "chunk", after)
            items, nxt = page.items, page.next
            for rec in items:
                have = live.get(rec[2])
                nodes = frozenset(rec[3])
                live[rec[2]] = nodes if have is None else have | nodes
            if nxt is None:
                break
            after = nxt
    return live


async def live_blobs(client: AsyncClient) -> set[bytes]:
    """Mark: the id of every blob a chunk record points at, over every shard."""
    return set(await live_copies(client))


async def collect(client: AsyncClient, *, grace: float = DEFAULT_GRACE,
                  min_dead_ratio: float = 0.3, compact: bool = True,
                  dry_run: bool = False) -> dict:
    """One mark and sweep; the report says per storage node what was scanned, deleted (or
    would be, ``dry_run``) and kept by the grace period, what compaction did, and the node's
    live and dead bytes afterwards, so a caller can say why nothing was reclaimed without a
    second scan.

    ``{"live_blobs": N, "nodes": {node: {"scanned", "deleted", "kept_by_grace", "compact",
    "live_bytes", "dead_bytes", "dead_share"} or {..., "error": reason}}}``; ``compact`` only
    when compaction ran. ``dead_share`` is the node's dead bytes over its live plus dead ones:
    the storage daemon reports volumes' bytes summed per node, not per volume.
    """
    storage = client._data().storage
    live = await live_copies(client)
    cutoff = time.time() - grace
    report: dict = {"live_blobs": len(live), "nodes": {}}
    for node in range(storage.n_nodes):
        if storage.state(node) == "removed":
            continue
        r: dict[str, Any] = {"scanned": 0, "deleted": 0, "kept_by_grace": 0}
        report["nodes"][node] = r
        try:
            after = b""
            dead: list[bytes] = []
            young = 0
            while True:
                page = await storage.list_blobs(node, after, 10_000)
                if not page:
                    break
                r["scanned"] += len(page)
                for bid, created in page:
                    if node not in live.get(bid, ()):
                        if created < cutoff:
                            dead.append(bid)
                        else:
                            young += 1  # a write in flight may be about to name it
                after = page[-1][0]
            r["kept_by_grace"] = young
            if not dry_run:
                for k in range(0, len(dead), DELETE_BATCH):
                    await storage.delete([(bid, (node,)) for bid in dead[k:k + DELETE_BATCH]])
            r["deleted"] = len(dead)
            if compact and not dry_run:
                r["compact"] = (await storage.compact(node, min_dead_ratio)).as_dict()
            st = await storage.stats(node)
            live_b, dead_b = st.live_bytes, st.dead_bytes
            r.update(live_bytes=live_b, dead_bytes=dead_b,
                     dead_share=dead_b / (live_b + dead_b) if live_b + dead_b else 0.0)
        except JPFSError as e:
            log.warning("gc: storage node %d skipped: %s", node, e.strerror)
            r["error"] = e.strerror
    return report
