"""``jpfs scrub``: the storage nodes' scrub progress, and the repair of the bad copies they found.

Each storage node scrubs itself (``jpfs_daemon.storage.scrub``) and keeps a list of its bad
blobs, which it no longer serves. A node knows blobs, not files, so the repair runs here, where
the metadata is: list every node's bad blobs, scan the chunk records of every shard for those
ids (each record names the nodes holding the blob's replicas), read each blob from another of
its replicas, check it against the checksum the bad node's index recorded (the good node's index
must agree, and so must the bytes), and ``put_blobs`` it back to the bad node, which writes a
fresh copy and clears the mark. A blob whose every copy is bad or whose chunk has one replica
cannot be repaired: it is reported with the path of its file. A bad blob no chunk record names is
garbage that ``jpfs gc`` deletes; it is reported, not repaired.

The same repair also runs without anyone asking: each metadata shard's leader heals the chunks
it owns (``jpfs_daemon.meta.heal``), and ``heal_status`` here gathers what the healers report.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import trio
import xxhash

from ...errors import JPFSError
from ...proto import storage as P
from ...proto.heal import HealStatus
from ...types import ROOT_INO
from ..client import AsyncClient

log = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20
"""Most blob bytes one repair round holds in memory (read from sources, then written back)."""
BATCH_BLOBS = 4096


@dataclass
class Job:
    """One bad copy to replace: the blob's id on ``node`` and where good copies may be."""

    node: int
    blob: bytes
    length: int
    xxh: int
    ino: int
    index: int
    sources: list[int]
    data: memoryview | None = None
    source: int | None = None
    failures: list[str] = field(default_factory=list)


@dataclass
class RepairReport:
    """What a repair found and did; ``problems`` are the copies left bad, with the reason."""

    bad: int = 0
    repaired: list[dict] = field(default_factory=list)
    unrepairable: list[dict] = field(default_factory=list)
    unreferenced: list[dict] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def clean(self) -> bool:
        """True when every bad copy that a file uses was (or, dry run, could be) repaired."""
        return not self.unrepairable and not self.errors

    def as_dict(self) -> dict:
        """The report for ``--json``."""
        return {"bad": self.bad, "repaired": self.repaired, "unrepairable": self.unrepairable,
                "unreferenced": self.unreferenced,
                "errors": {str(k): v for k, v in self.errors.items()}, "dry_run": self.dry_run}


async def node_status(client: AsyncClient, node: int) -> dict:
    """One storage node's scrub progress (``P.ScrubStatus.as_dict()``), or ``{"error":
    reason}``."""
    storage = client._data().storage
    try:
        return P.SCRUB_STATUS.decode(await storage.pool.call(
            node, P.SCRUB_STATUS, P.NoArgs(), retry_for=1.0, timeout=10.0)).as_dict()
    except JPFSError as e:  # down, or a daemon from before scrubbing (ENOSYS or the like)
        return {"error": e.strerror}


async def status(client: AsyncClient) -> list[dict]:
    """Every storage node's scrub progress (``P.ScrubStatus.as_dict()``), or ``{"error":
    reason}``."""
    storage = client._data().storage
    out: list[dict] = [{} for _ in range(storage.n_nodes)]

    async def one(node: int) -> None:
        if storage.state(node) == "removed":  # left the cluster: nothing of it counts
            out[node] = {"enabled": False, "state": "removed"}
            return
        out[node] = await node_status(client, node)

    async with trio.open_nursery() as nursery:
        for node in range(storage.n_nodes):
            nursery.start_soon(one, node)
    return out


async def start(client: AsyncClient, nodes: list[int] | None = None) -> list[dict]:
    """Start a scrub pass now on ``nodes`` (default all); each node's status or error."""
    storage = client._data().storage
    chosen = range(storage.n_nodes) if nodes is None else nodes
    out: dict[int, dict] = {}
    for node in chosen:
        try:
            out[node] = P.SCRUB_START.decode(await storage.pool.call(
                node, P.SCRUB_START, P.NoArgs(), retry_for=1.0, timeout=10.0)).as_dict()
        except JPFSError as e:
            out[node] = {"error": e.strerror}
    return [{"node": n, **s} for n, s in sorted(out.items())]


class NoAnswer(NamedTuple):
    """A shard whose healer did not answer (or predates healing), in ``heal_status``'s list:
    ``shard`` and ``error`` as a ``HealStatus`` has them."""

    shard: int
    error: str | None

    def as_dict(self) -> dict:
        """``{"shard": i, "error": reason}``, as JSON reports print it."""
        return self._asdict()


def answered(statuses: Sequence[HealStatus | NoAnswer]) -> list[HealStatus]:
    """The shards' statuses that came back (their last round may have failed: ``error``)."""
    return [s for s in statuses if isinstance(s, HealStatus)]


async def heal_status(client: AsyncClient) -> list[HealStatus | NoAnswer]:
    """Every shard leader's healer progress (``jpfs.proto.heal.HealStatus``), or a
    ``NoAnswer`` for a shard that does not answer (or predates healing)."""
    out: list[HealStatus | NoAnswer] = [NoAnswer(shard, "") for shard in
                                        range(client.meta.n_shards)]

    async def one(shard: int) -> None:
        try:
            out[shard] = await client.meta.heal_status(shard, retry_for=1.0, timeout=10.0)
        except JPFSError as e:
            out[shard] = NoAnswer(shard, e.strerror)

    async with trio.open_nursery() as nursery:
        for shard in range(client.meta.n_shards):
            nursery.start_soon(one, shard)
    return out


async def heal_kick(client: AsyncClient) -> list[HealStatus | NoAnswer]:
    """Ask every shard's healer for a round now; their status or errors."""
    out: list[HealStatus | NoAnswer] = []
    for shard in range(client.meta.n_shards):
        try:
            out.append(await client.meta.heal_kick(shard, retry_for=1.0, timeout=10.0))
        except JPFSError as e:
            out.append(NoAnswer(shard, e.strerror))
    return out


async def bad_blobs(client: AsyncClient, node: int) -> list[tuple[bytes, int, int, float, str]]:
    """Every blob ``node`` has marked bad: (id, length, xxh, found, reason)."""
    storage = client._data().storage
    out: list = []
    after = b""
    while True:
        page = P.BAD_BLOBS.decode(await storage.pool.call(
            node, P.BAD_BLOBS, P.BadBlobsReq(after, P.MAX_LIST), retry_for=1.0))
        if not page:
            return out
        out.extend(page)
        after = page[-1][0]


async def _chunk_records(client: AsyncClient, wanted: set[bytes]) -> dict[bytes, tuple]:
    """Blob id -> (inode, chunk index, nodes) for the ids in ``wanted``, over every shard."""
    found: dict[bytes, tuple] = {}
    for shard in range(client.meta.n_shards):
        after = b""
        while True:
            page = await client.meta.scan(shard, "chunk", after)
            items, nxt = page.items, page.next
            for ino, index, blob, nodes in items:
                if blob in wanted:
                    found[blob] = (ino, index, tuple(nodes))
            if nxt is None:
                break
            after = nxt
    return found


async def paths_of(client: AsyncClient, inos: set[int]) -> dict[int, str]:
    """A path for each inode in ``inos`` (one of its names; ``#INO`` where none leads to the
    root). Scans every shard's entries: meant for the few files a report names."""
    if not inos:
        return {}
    up: dict[int, tuple[int, bytes]] = {}
    for shard in range(client.meta.n_shards):
        after = b""
        while True:
            page = await client.meta.scan(shard, "dentry", after)
            items, nxt = page.items, page.next
            for parent, name, ino, _kind in items:
                up.setdefault(ino, (parent, name))
            if nxt is None:
                break
            after = nxt
    out = {}
    for ino in inos:
        parts: list[str] = []
        cur, seen = ino, set()
        while cur != ROOT_INO and cur in up and cur not in seen:
            seen.add(cur)
            parent, name = up[cur]
            parts.append(name.decode(errors="surrogateescape"))
            cur = parent
        out[ino] = "/" + "/".join(reversed(parts)) if cur == ROOT_INO else f"#{ino:x}"
    return out


async def repair(client: AsyncClient, *, dry_run: bool = False) -> RepairReport:
    """Replace every bad copy the storage nodes know of from a good replica (see the module)."""
    storage = client._data().storage
    report = RepairReport(dry_run=dry_run)
    bad: dict[int, dict[bytes, tuple[int, int, str]]] = {}
    for node in range(storage.n_nodes):
        if storage.state(node) == "removed":
            continue
        try:
            bad[node] = {bid: (length, xxh, reason)
                         for bid, length, xxh, _found, reason in await bad_blobs(client, node)}
        except JPFSError as e:
            report.errors[node] = f"cannot list its bad blobs: {e.strerror}"
    report.bad = sum(map(len, bad.values()))
    if not report.bad:
        return report
    records = await _chunk_records(client, {b for blobs in bad.values() for b in blobs})
    jobs: list[Job] = []
    lost: list[dict] = []
    for node, blobs in sorted(bad.items()):
        for bid, (length, xxh, reason) in blobs.items():
            rec = records.get(bid)
            item = {"node": node, "blob": P.blob_name(bid), "reason": reason}
            if rec is None or node not in rec[2]:
                report.unreferenced.append(item)  # garbage: jpfs gc deletes it
                continue
            ino, index, nodes = rec
            sources = [x for x in dict.fromkeys(nodes) if x != node and bid not in
                       bad.get(x, {}) and x not in report.errors]
            if not sources:
                why = ("the chunk has no other replica" if len(set(nodes)) == 1
                       else "no other replica has a good copy")
                lost.append({**item, "ino": ino, "chunk": index, "why": why})
                continue
            jobs.append(Job(node, bid, length, xxh, ino, index, sources))
    k = 0
    while k < len(jobs):
        size, j = 0, k
        while j < len(jobs) and (j == k or (size + jobs[j].length <= BATCH_BYTES
                                            and j - k < BATCH_BLOBS)):
            size += jobs[j].length
            j += 1
        await _repair_round(storage, jobs[k:j], report, dry_run)
        k = j
    for job in jobs:
        if job.data is None:
            lost.append({"node": job.node, "blob": P.blob_name(job.blob), "ino": job.ino,
                         "chunk": job.index, "reason": bad[job.node][job.blob][2],
                         "why": "; ".join(job.failures) or "no replica could serve it"})
    if lost:
        paths = await paths_of(client, {x["ino"] for x in lost})
        for x in lost:
            x["path"] = paths[x["ino"]]
        report.unrepairable = lost
    return report


async def _repair_round(storage, jobs: list[Job], report: RepairReport, dry_run: bool) -> None:
    """Fetch a good copy of each job's blob (trying its sources in turn), then put them back."""
    pending = list(jobs)
    tried = 0
    while pending:
        groups: dict[int, list[Job]] = {}
        for job in pending:
            if tried < len(job.sources):
                groups.setdefault(job.sources[tried], []).append(job)
        if not groups:
            break
        async with trio.open_nursery() as nursery:
            for src, items in groups.items():
                nursery.start_soon(_fetch, storage, src, items)
        pending = [j for j in pending if j.data is None]
        tried += 1
    by_node: dict[int, list[Job]] = {}
    for job in jobs:
        if job.data is not None:
            by_node.setdefault(job.node, []).append(job)
    async with trio.open_nursery() as nursery:
        for node, items in by_node.items():
            nursery.start_soon(_put_back, storage, node, items, report, dry_run)


async def _fetch(storage, src: int, jobs: list[Job]) -> None:
    try:
        statuses, payload = await storage.pool.call_payload(
            src, P.GET_BLOBS, P.IdsReq([j.blob for j in jobs]), retry_for=1.0)
        statuses = P.GET_BLOBS.decode(statuses)
    except JPFSError as e:
        for j in jobs:
            j.failures.append(f"node {src}: {e.strerror}")
        return
    if isinstance(payload, list):
        payload = memoryview(b"".join(payload))
    payload = payload if payload is not None else memoryview(b"")
    if len(statuses) != len(jobs):
        for j in jobs:
            j.failures.append(f"node {src}: malformed answer")
        return
    pos = 0
    for j, s in zip(jobs, statuses, strict=True):
        if not P.BlobStatuses.found(s):
            j.failures.append(f"node {src}: {s if isinstance(s, str) else 'bad status'}")
            continue
        length, xxh = s
        view = payload[pos:pos + length]
        pos += length
        if (length, xxh) != (j.length, j.xxh):
            j.failures.append(f"node {src}: its index says {length} bytes, xxh {xxh:016x}; "
                              f"node {j.node}'s says {j.length} bytes, xxh {j.xxh:016x}")
        elif len(view) != length or xxhash.xxh3_64_intdigest(view) != xxh:
            j.failures.append(f"node {src}: its copy fails the checksum too")
        else:
            j.data = memoryview(bytes(view))
            j.source = src


async def _put_back(storage, node: int, jobs: list[Job], report: RepairReport,
                    dry_run: bool) -> None:
    if dry_run:
        for j in jobs:
            report.repaired.append(_done(j, "would repair"))
        return
    try:
        stored, present = P.PUT_BLOBS.decode(await storage.pool.call(
            node, P.PUT_BLOBS, P.PutBlobsReq([[j.blob, j.length, j.xxh] for j in jobs]),
            [j.data for j in jobs], retry_for=1.0))
    except JPFSError as e:
        for j in jobs:
            j.failures.append(f"writing it to node {node}: {e.strerror}")
            j.data = None
        return
    if present:
        log.info("repair: %d of %d blobs on node %d were no longer bad", present, len(jobs),
                 node)
    for j in jobs:
        report.repaired.append(_done(j, "repaired"))
    log.info("repair: %d bad copies on storage node %d replaced", stored, node)


def _done(j: Job, what: str) -> dict:
    return {"node": j.node, "blob": P.blob_name(j.blob), "ino": j.ino, "chunk": j.index,
            "from": j.source, "result": what}
