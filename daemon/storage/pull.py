"""Copies between storage nodes, and clients' reports of bad reads: the healing side of a node.

``pull_blobs`` makes this node fetch blobs from another storage node itself (``get_blobs`` on
the source, over a connection authenticated with the cluster secret), check every one against
the length and xxh3 the caller gave (what the chunk record says), and store the ones that
verify through the writer like any put. The metadata shard's healer asks for it: the bytes go
node to node once, instead of source -> shard -> target, and the shard only sends ids.

``report_bad`` re-reads named blobs from this node's volumes at once and marks the ones whose
bytes fail their checksum, as the scrubber would have on its next pass: a client whose read hit
a mismatch says so, and the healer then repairs the copy.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import trio
import xxhash

from jpfs import config
from jpfs.errors import JPFSError, error
from jpfs.proto import storage as P
from jpfs.rpc import Pool

from .formats import BYVOL_KEY
from .ops import PutOp, ScrubOp
from .store import Store

log = logging.getLogger(__name__)

MAX_PULL_BYTES = 128 << 20
"""Most bytes one ``pull_blobs`` asks for (held in memory between the fetch and the put)."""
_HASH_INLINE = 256 << 10


class Puller:
    """Fetch blobs from other nodes for this one (see the module).

    Args:
        store: this node's volumes and index.
        submit: the writer's ``submit`` (the single owner of index writes).
        secret: the cluster secret (the source authenticates this node as any client).
        node: this node's index, for log lines and errors.
    """

    def __init__(self, store: Store, submit: Callable[..., Awaitable], secret: bytes,
                 node: int):
        self.store = store
        self.submit = submit
        self.secret = secret
        self.node = node
        self._pool: Pool | None = None
        self._index: dict[str, int] = {}
        self.counters = dict.fromkeys(("pulls", "blobs_pulled", "bytes_pulled", "reports_bad"),
                                      0)

    def start(self, nursery: trio.Nursery) -> None:
        """Connections to sources live in ``nursery`` (the server's)."""
        self._pool = Pool(nursery, [], self.secret, role="storage", retry_for=1.0,
                          timeout=120.0, peer_timeout=config.DEFAULT_PEER_TIMEOUT)

    def close(self) -> None:
        """Close the connections to the nodes pulled from."""
        if self._pool is not None:
            self._pool.close()

    def _source(self, address: str) -> int:
        try:
            config.parse_address(address)
        except ValueError as e:
            raise error(errno.EINVAL, f"pull_blobs: {e}") from None
        if self._pool is None:
            raise error(errno.EAGAIN, "pull_blobs: the node is still starting")
        idx = self._index.get(address)
        if idx is None:
            idx = self._index[address] = len(self._pool.addresses)
            self._pool.set_addresses([*self._pool.addresses, address])
        return idx

    async def pull(self, source: str, entries: list) -> list:
        """``pull_blobs``: ``[stored, already_present, [[id, reason], ...]]``."""
        want = _check_entries(entries)
        if not want:
            return [0, 0, []]
        pool = self._pool
        idx = self._source(source)
        assert pool is not None
        try:
            statuses, payload = await pool.call_payload(
                idx, P.GET_BLOBS, P.IdsReq([bid for bid, _, _ in want]), retry_for=1.0)
            statuses = P.GET_BLOBS.decode(statuses)
        except JPFSError as e:
            why = f"source {source}: {e.strerror}"
            log.warning("pull for storage node %d failed: %s", self.node, why)
            return [0, 0, [[bid, why] for bid, _, _ in want]]
        if isinstance(payload, list):
            payload = memoryview(b"".join(payload))
        view = payload if payload is not None else memoryview(b"")
        if len(statuses) != len(want):
            return [0, 0, [[bid, f"source {source}: malformed answer"] for bid, _, _ in want]]
        pieces: list[tuple[tuple[bytes, int, int], memoryview]] = []
        failures: list[list] = []
        pos = 0
        for (bid, length, xxh), s in zip(want, statuses, strict=True):
            if not P.BlobStatuses.found(s):
                failures.append([bid, f"source {source}: {s if isinstance(s, str) else '?'}"])
                continue
            got = view[pos:pos + s[0]]
            pos += s[0]
            pieces.append(((bid, length, xxh), got))
        views = [v for _, v in pieces]
        if sum(map(len, views)) >= _HASH_INLINE:
            sums = await trio.to_thread.run_sync(_hash_all, views)
        else:
            sums = _hash_all(views)
        good: list[tuple[bytes, int, int]] = []
        data: list[memoryview] = []
        for ((bid, length, xxh), v), got_xxh in zip(pieces, sums, strict=True):
            if len(v) != length or got_xxh != xxh:
                failures.append([bid, f"source {source}: its copy does not match the record "
                                      f"({len(v)} bytes, xxh {got_xxh:016x}; expected {length} "
                                      f"bytes, xxh {xxh:016x})"])
                continue
            good.append((bid, length, xxh))
            data.append(v)
        stored = present = 0
        if good:
            joined = memoryview(b"".join(data)) if len(data) > 1 else data[0]
            stored, present = await self.submit(PutOp(good, joined))
            c = self.counters
            c["pulls"] += 1
            c["blobs_pulled"] += stored
            c["bytes_pulled"] += len(joined)
        return [stored, present, failures]

    async def report_bad(self, ids: list) -> int:
        """``report_bad``: verify the named blobs now; mark and count those that fail."""
        P.check_ids(ids, "report_bad")
        self.counters["reports_bad"] += 1
        store = self.store
        found = store.lookup(ids)
        entries = [(BYVOL_KEY.pack(e.vol, e.offset, bid), e.vol, e.offset, e.length, e.xxh)
                   for bid, e in zip(ids, found, strict=True)
                   if e is not None and bid not in store.bad_ids]
        if not entries:
            return 0
        bad = await trio.to_thread.run_sync(store.verify, entries)
        if not bad:
            log.info("storage node %d: %d blobs a client reported bad verify here (the bytes "
                     "went bad on the way, or in the client)", self.node, len(entries))
            return 0
        marked = await self.submit(ScrubOp(bad))
        log.error("storage node %d: a client read %d bad blobs; %d marked for repair", self.node,
                  len(entries), marked)
        return marked


def _check_entries(entries: list) -> list[tuple[bytes, int, int]]:
    if len(entries) > P.MAX_BATCH_BLOBS:
        raise error(errno.E2BIG, f"pull_blobs: {len(entries)} blobs in one request "
                                 f"(at most {P.MAX_BATCH_BLOBS})")
    out = []
    total = 0
    for item in entries:
        if not (isinstance(item, list) and len(item) == 3):
            raise error(errno.EINVAL, "pull_blobs: each entry must be [id, length, xxh]")
        bid, length, xxh = item
        P.check_id(bid)
        if type(length) is not int or type(xxh) is not int or length < 0 or \
                not 0 <= xxh < (1 << 64):
            raise error(errno.EINVAL, f"pull_blobs: bad length or checksum for blob "
                                      f"{P.blob_name(bid)}")
        total += length
        out.append((bid, length, xxh))
    if total > MAX_PULL_BYTES:
        raise error(errno.E2BIG, f"pull_blobs: {total} bytes in one request (at most "
                                 f"{MAX_PULL_BYTES})")
    return out


def _hash_all(views: list[memoryview]) -> list[int]:
    h = xxhash.xxh3_64_intdigest
    return [h(v) for v in views]
