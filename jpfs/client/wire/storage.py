"""The storage client: put, get and delete blobs on the storage nodes, with replicas.

Every call is batched per node (one request carries many blobs, bounded in bytes) and all nodes
are asked in parallel. Reads verify every blob's xxh3-64 end to end and fail over to another
replica on a dead node, a missing blob or a checksum mismatch; only when no replica has good bytes
does a read fail, with an error naming the chunk, the nodes and why each failed. A node that
refuses the connection is not waited on (the next replica is asked at once); one that does not
answer gets the cluster's ``peer_timeout``. Nodes that just failed are remembered for a few
seconds, so reads go straight to a replica instead of waiting on a dead node each time.

Writes store each blob on R live nodes: the preferred nodes given by the caller
(``placement.chunk_nodes``), and where one of them is down, the next nodes round the ring. The
nodes actually used are returned: the caller records them, and they are the truth.

The client follows the cluster map (``follow``): new nodes join the address list, and node
states steer both sides. Writes go to *writable* (active) nodes only: a preferred node that is
draining or removed is replaced like a down one. Reads try active replicas first, then draining
ones, and a removed node's copy only when nothing else answered (its copies no longer count, but
a node drained to the end may still serve them). A read that fails its checksum tells that node
(``report_bad``), which re-verifies the blob and marks it for the healer to repair. A closing
client first waits (up to ``REPORT_GRACE``) for its reports to be answered: the node drops a
request whose connection closes, so a report still under way would otherwise be lost.
"""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import Sequence

import trio
import xxhash

from ...config import Cluster
from ...errors import ChecksumError, DeadlineError, JPFSError, Unavailable, error
from ...proto import storage as P
from ...rpc import Pool
from ...rpc.frame import receive_buffer
from ...types import Chunk
from .replicas import ReplicaView, batches
from .shortcircuit import LocalReads

log = logging.getLogger(__name__)

_HASH_INLINE = 1 << 20
"""Batches smaller than this are hashed on the trio thread; larger ones in a worker thread."""

_REPORTED_MAX = 4096
"""Bad copies remembered as reported (each is reported once per client, not on every read)."""

REPORT_GRACE = 10.0
"""Seconds a closing client waits at most for its reports of bad copies to be answered."""

_TRANSIENT = frozenset({errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.ENOSPC, errno.EIO,
                        errno.EROFS, errno.EDQUOT, errno.EAGAIN})
"""Put errors after which another node may do better (the rest are the caller's mistakes)."""


class StorageClient:
    """Blob operations over all storage nodes of ``cluster``.

    Args:
        nursery: runs the connections' reader tasks; the client lives as long as it.
        cluster: the storage node addresses and the cluster secret.
        connections_per_node: TCP connections per node (each multiplexes many calls).
        batch_bytes: the most blob bytes one request carries (bigger batches cost less CPU
            per byte on both sides; smaller ones spread a node's share over its connections).
        batch_blobs: the most blobs one request carries.
        down_for: how long (seconds) a node that failed is tried last.
        read_retry_for: how long a read waits for an unreachable node when another replica
            could serve it instead.
        retry_for: how long a call waits for an unreachable node when nothing else can serve it
            (default: the cluster's ``peer_timeout``; a refused connection is never waited on).
        timeout: the deadline of one call, retries included.
        peer_timeout: how long a node that does not answer at all is given (default: the
            cluster file's ``cluster.peer_timeout``).
        first_copy: which of a chunk's live copies this client reads first, counted round the
            copies (default: chosen at random per client). Every client reading from the first
            copy would leave the others idle; a per-client choice spreads readers over all
            copies, and because the one-chunk files of a directory run share their nodes, a
            client's reads of them still go to one node in one batch.
        short_circuit: read the volume files of nodes on this host directly
            (``shortcircuit.py``); False reads everything over the sockets.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        cluster: Cluster,
        *,
        connections_per_node: int = 2,
        batch_bytes: int = 16 << 20,
        batch_blobs: int = 4096,
        down_for: float = 3.0,
        read_retry_for: float = 0.2,
        write_retry_for: float = 1.0,
        retry_for: float | None = None,
        timeout: float = 60.0,
        peer_timeout: float | None = None,
        first_copy: int | None = None,
        short_circuit: bool = True,
    ):
        self.cluster = cluster
        self.first_copy = random.randrange(1 << 16) if first_copy is None else first_copy
        self.nursery = nursery
        self.view = ReplicaView(cluster, self.first_copy)
        """The map's nodes as this client orders them (replaced by ``follow``)."""
        self._reported: set[tuple[int, bytes]] = set()
        self._reports_out = 0
        self._reports_answered = trio.Event()
        """Set while no report is in flight (``reports_answered`` waits on it)."""
        self._reports_answered.set()
        self.pool = Pool(
            nursery, [s.address for s in cluster.storage], cluster.secret, role="storage",
            connections_per_server=connections_per_node, retry_for=retry_for, timeout=timeout,
            peer_timeout=cluster.peer_timeout if peer_timeout is None else peer_timeout,
        )
        self.batch_bytes = max(1, batch_bytes)
        self.batch_blobs = max(1, min(batch_blobs, P.MAX_BATCH_BLOBS))
        self.down_for = down_for
        self.read_retry_for = read_retry_for
        self.write_retry_for = write_retry_for
        self.retry_for = self.pool.retry_for
        self._down_until: dict[int, float] = {}
        self.short_circuit = short_circuit
        self.local = LocalReads(nursery, self.pool, retry_for=self.retry_for,
                                read_retry_for=read_retry_for)
        """The nodes on this host and the reads of their volume files (``shortcircuit.py``)."""

    @property
    def n_nodes(self) -> int:
        """Storage nodes in the map (removed ones included: indices never change meaning)."""
        return self.view.n_nodes

    @property
    def states(self) -> tuple[str, ...]:
        """Each node's state in the map this client follows."""
        return self.view.states

    @property
    def writable(self) -> tuple[int, ...]:
        """Active nodes, where new blobs go (``placement.chunk_nodes`` takes this list)."""
        return self.view.writable

    @property
    def domains(self) -> tuple[str, ...]:
        """Each node's failure domain (copies of a chunk go to distinct ones)."""
        return self.view.domains

    @property
    def replicas(self) -> int:
        """Copies of each chunk, as the map says."""
        return self.view.replicas

    @property
    def counters(self) -> dict[str, int]:
        """Blobs and bytes read from local volume files, and blobs a local read left to the
        socket (not there, not readable, bytes that did not check)."""
        return self.local.counters

    def close(self) -> None:
        """Close the connections to the storage nodes, stop tending them and close the local
        volumes."""
        self.pool.close()
        self.local.close()

    def as_dict(self) -> dict:
        """Counters for the mount's stats."""
        return {"local_nodes": self.local.local_nodes(), **self.counters}

    def follow(self, cluster: Cluster) -> None:
        """Take a new cluster map: grown node list, moved addresses, node states, writable."""
        moved = [i for i, (a, s) in enumerate(zip(self.pool.addresses, cluster.storage,
                                                   strict=False)) if a != s.address]
        self.pool.set_addresses([s.address for s in cluster.storage])
        for i in moved:  # a node that moved may be elsewhere now: ask it again
            self.local.forget(i)
        self.cluster = cluster
        self.view = ReplicaView(cluster, self.first_copy)

    def state(self, node: int) -> str:
        """``node``'s state in the map this client follows."""
        return self.view.state(node)

    # ------------------------------------------------------------------ node health

    def is_down(self, node: int) -> bool:
        """Whether ``node`` failed recently and is skipped for ``down_for`` seconds (trio time)."""
        until = self._down_until.get(node)
        if until is None:
            return False
        if trio.current_time() >= until:
            del self._down_until[node]
            return False
        return True

    def _mark_down(self, node: int, why: JPFSError) -> None:
        if not self.is_down(node):
            log.warning("%s is down: %s", self.pool.name(node), why.strerror)
        self._down_until[node] = trio.current_time() + self.down_for

    def _down_now(self) -> frozenset[int]:
        return frozenset(n for n in list(self._down_until) if self.is_down(n))

    # ------------------------------------------------------------------ get

    async def get(
        self, chunks: Sequence[Chunk], into: Sequence[memoryview] | None = None
    ) -> list[memoryview]:
        """Read whole blobs, verified; one view of ``blob_len`` bytes per chunk, in order.

        ``into`` (one writable buffer per chunk, at least ``blob_len`` bytes) receives the blobs
        straight from the socket, and the views returned are views of those buffers. Without it
        each blob gets a fresh buffer of its own; callers that read a lot should pass reused
        buffers, since fresh memory costs page faults (see bench/storage_micro.py).
        """
        n = len(chunks)
        dest: list[memoryview] | None = None
        if into is not None:
            if len(into) != n:
                raise error(errno.EINVAL, f"get: {n} chunks but {len(into)} buffers")
            dest = []
            for c, buf in zip(chunks, into, strict=True):
                view = buf if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 \
                    and buf.contiguous else memoryview(buf).cast("B")
                if len(view) != c.blob_len:
                    if len(view) < c.blob_len:
                        raise error(errno.EINVAL, f"get: buffer of {len(view)} bytes for blob "
                                                  f"{P.blob_name(c.blob)} of {c.blob_len}")
                    view = view[:c.blob_len]
                dest.append(view)
        out: list[memoryview | None] = [None] * n
        down = self._down_now()
        order = self.view.order
        orders = [order(c.nodes, down) for c in chunks]
        tried = [0] * n
        failures: list[list[str]] = [[] for _ in range(n)]
        corrupt = [False] * n
        unreachable = [0] * n
        sizes = [c.blob_len for c in chunks]
        pending = list(range(n))
        while pending:
            groups: dict[int, list[int]] = {}
            for i in pending:
                if tried[i] >= len(orders[i]):
                    raise _read_error(chunks[i], failures[i], corrupt[i],
                                      unreachable[i] == len(orders[i]))
                groups.setdefault(orders[i][tried[i]], []).append(i)
            async with trio.open_nursery() as nursery:
                for node, items in groups.items():
                    for batch in batches(items, sizes, self.batch_bytes, self.batch_blobs):
                        last = any(tried[i] + 1 >= len(orders[i]) for i in batch)
                        nursery.start_soon(self._get_batch, node, batch, chunks, dest, out,
                                           failures, corrupt, unreachable, last)
            pending = [i for i in pending if out[i] is None]
            for i in pending:
                tried[i] += 1
        return out  # type: ignore[return-value]

    async def _get_batch(self, node, batch, chunks, dest, out, failures, corrupt, unreachable,
                         last) -> None:
        if dest is not None:
            into = [dest[i] for i in batch]
        else:
            # One buffer per blob, not one per batch: a caller that keeps a small blob (a cache)
            # must not keep the whole batch's memory alive with it.
            into = [memoryview(receive_buffer(chunks[i].blob_len)) for i in batch]
        local = None
        if self.short_circuit:
            reads = self.local
            local = reads.nodes[node] if node in reads.nodes else await reads.ask(node)
        if local is not None:
            try:
                left = await self.local.read(local, node, batch, chunks, into, out, last)
            except (Unavailable, DeadlineError) as e:  # as the socket read below would be
                self._mark_down(node, e)
                for i in batch:
                    failures[i].append(e.strerror)
                    unreachable[i] += 1
                return
            if not left:
                return
            into = [v for k, v in enumerate(into) if batch[k] in left]
            batch = [i for i in batch if i in left]
        ids = [chunks[i].blob for i in batch]
        try:
            statuses, payload = await self.pool.call_payload(
                node, P.GET_BLOBS, P.IdsReq(ids), into=into,
                retry_for=self.retry_for if last else self.read_retry_for)
        except (Unavailable, DeadlineError) as e:
            self._mark_down(node, e)
            for i in batch:
                failures[i].append(e.strerror)  # names the node
                unreachable[i] += 1
            return
        except JPFSError as e:
            for i in batch:
                failures[i].append(f"{self.pool.name(node)}: {e.strerror}")
            return
        try:
            statuses = P.GET_BLOBS.decode(statuses)
        except JPFSError:
            statuses = None
        if statuses is None or len(statuses) != len(batch):
            for i in batch:
                failures[i].append(f"{self.pool.name(node)}: malformed answer")
            return
        found = P.BlobStatuses.found
        views: list[memoryview | None] | None = None
        if isinstance(payload, list):
            # Scattered into our buffers: valid only if every blob came with the expected size.
            views = list(payload)
            for s, i in zip(statuses, batch, strict=True):
                if not found(s) or s[0] != chunks[i].blob_len:
                    payload = memoryview(b"".join(payload))
                    views = None
                    break
        if views is None:
            views = []
            pos = 0
            if payload is None:
                payload = memoryview(b"")
            assert not isinstance(payload, list)  # joined above
            size = len(payload)
            for s in statuses:
                length = s[0] if found(s) else -1  # [length, xxh]
                if 0 <= length <= size - pos:
                    views.append(payload[pos:pos + length])
                    pos += length
                else:
                    views.append(None)
        got = [v for v in views if v is not None]
        if sum(map(len, got)) >= _HASH_INLINE:
            sums = await trio.to_thread.run_sync(_hash_all, got)
        else:
            sums = _hash_all(got)
        k = 0
        for s, i, view in zip(statuses, batch, views, strict=True):
            c = chunks[i]
            if view is None:
                failures[i].append(f"{self.pool.name(node)}: "
                                   f"{s if isinstance(s, str) else 'bad status'}")
                continue
            xxh = sums[k]
            k += 1
            if len(view) != c.blob_len or xxh != c.xxh:
                corrupt[i] = True
                failures[i].append(f"{self.pool.name(node)}: checksum mismatch ({len(view)} bytes, "
                                   f"xxh {xxh:016x}, expected {c.blob_len} bytes, "
                                   f"xxh {c.xxh:016x})")
                log.error("blob %s on storage node %d fails its checksum; trying another "
                          "replica", P.blob_name(c.blob), node)
                self._report_bad(node, c.blob)
                continue
            if dest is not None and view is not dest[i]:
                dest[i][:] = view
                view = dest[i]
            elif dest is None and isinstance(payload, memoryview):
                view = memoryview(bytearray(view))  # own memory (see above), not a slice
            out[i] = view

    def _report_bad(self, node: int, blob: bytes) -> None:
        """Tell ``node`` its copy of ``blob`` read bad (once per client), in the background."""
        if (node, blob) in self._reported:
            return
        if len(self._reported) >= _REPORTED_MAX:
            self._reported.clear()
        self._reported.add((node, blob))
        if not self._reports_out:
            self._reports_answered = trio.Event()
        self._reports_out += 1
        self.nursery.start_soon(self._send_report, node, blob)

    async def reports_answered(self, timeout: float = REPORT_GRACE) -> bool:
        """Wait, shielded from cancellation, at most ``timeout`` seconds until every report of a
        bad copy in flight was answered (before closing: a node drops a request whose
        connection closed, report or not). False if some were not."""
        with trio.move_on_after(timeout, shield=True) as scope:
            await self._reports_answered.wait()
        if scope.cancelled_caught:
            log.warning("closing with %d reports of bad copies unanswered (the nodes' "
                        "scrubbers will find those copies)", self._reports_out)
        return not scope.cancelled_caught

    async def _send_report(self, node: int, blob: bytes) -> None:
        try:
            marked = await self.pool.call(node, P.REPORT_BAD, P.IdsReq([blob]), retry_for=1.0,
                                          timeout=30.0)
            log.info("reported blob %s to %s: %s", P.blob_name(blob), self.pool.name(node),
                     "marked bad for repair" if marked else "it verifies there")
        except JPFSError as e:  # an older node, or one gone meanwhile: the scrubber finds it
            log.warning("could not report bad blob %s to %s: %s", P.blob_name(blob),
                        self.pool.name(node), e.strerror)
        finally:
            self._reports_out -= 1
            if not self._reports_out:
                self._reports_answered.set()

    # ------------------------------------------------------------------ put

    async def put(
        self, blobs: Sequence[tuple[bytes, tuple[int, ...], bytes | memoryview]]
    ) -> list[tuple[tuple[int, ...], int]]:
        """Store each (blob id, preferred nodes, data) durably on as many live nodes.

        Returns (nodes used, xxh3-64) per blob. A preferred node that is down, draining or
        removed is replaced by the next writable node round the ring. Raises Unavailable (or
        the nodes' error) when a blob cannot get that many copies.
        """
        n = len(blobs)
        if not n:
            return []
        views = [memoryview(data).cast("B") for _, _, data in blobs]
        sizes = [len(v) for v in views]
        for bid, nodes, _ in blobs:
            P.check_id(bid)
            if not nodes or any(not 0 <= x < self.n_nodes for x in nodes):
                raise error(errno.EINVAL, f"put: bad nodes {nodes!r} for blob {P.blob_name(bid)}")
        if sum(sizes) >= _HASH_INLINE:
            xxhs = await trio.to_thread.run_sync(_hash_all, views)
        else:
            xxhs = _hash_all(views)
        room = len(self.writable)
        if not room:
            raise Unavailable("no writable storage node: every node is draining or removed "
                              "(add one with `jpfs node add`; see `jpfs node list`)")
        want = [min(len(set(nodes)), room) for _, nodes, _ in blobs]
        view = self.view
        cands = [view.ring(nodes) for _, nodes, _ in blobs]
        stored: list[list[int]] = [[] for _ in range(n)]
        tried: list[set[int]] = [set() for _ in range(n)]
        failures: list[list[str]] = [[] for _ in range(n)]
        fatal: list[JPFSError] = []
        while True:
            groups: dict[int, list[int]] = {}
            for i in range(n):
                need = want[i] - len(stored[i])
                if need <= 0:
                    continue
                fresh = [x for x in cands[i] if x not in tried[i]]
                if not fresh:
                    raise Unavailable(
                        f"cannot store {want[i]} copies of blob {P.blob_name(blobs[i][0])}: "
                        f"stored on {stored[i] or 'no node'}; " + "; ".join(failures[i]))
                picks = view.apart([x for x in fresh if not self.is_down(x)], need, stored[i])
                if len(picks) < need:
                    picks += [x for x in fresh if x not in picks][:need - len(picks)]
                for x in picks:
                    tried[i].add(x)
                    groups.setdefault(x, []).append(i)
            if not groups:
                break
            async with trio.open_nursery() as nursery:
                for node, items in groups.items():
                    for batch in batches(items, sizes, self.batch_bytes, self.batch_blobs):
                        nursery.start_soon(self._put_batch, node, batch, blobs, views, xxhs,
                                           stored, failures, fatal)
            if fatal:
                raise fatal[0]
        result = []
        for i in range(n):
            rank = {x: k for k, x in enumerate(cands[i])}
            result.append((tuple(sorted(stored[i], key=rank.__getitem__)), xxhs[i]))
        return result

    async def _put_batch(self, node, batch, blobs, views, xxhs, stored, failures, fatal) -> None:
        entries = [[blobs[i][0], len(views[i]), xxhs[i]] for i in batch]
        try:
            await self.pool.call(node, P.PUT_BLOBS, P.PutBlobsReq(entries),
                                 [views[i] for i in batch], retry_for=self.write_retry_for)
        except (Unavailable, DeadlineError) as e:
            self._mark_down(node, e)
            for i in batch:
                failures[i].append(e.strerror)  # names the node
            return
        except JPFSError as e:
            if e.errno not in _TRANSIENT:
                fatal.append(e)
                return
            log.warning("%s refused a put: %s", self.pool.name(node), e.strerror)
            for i in batch:
                failures[i].append(f"{self.pool.name(node)}: {e.strerror}")
            return
        for i in batch:
            stored[i].append(node)

    # ------------------------------------------------------------------ delete, maintenance

    async def delete(self, blobs: Sequence[tuple[bytes, tuple[int, ...]]]) -> None:
        """Delete blobs from every node that holds them (unknown blobs are ignored).

        Every reachable node is done; if some could not be reached, Unavailable names them
        afterwards (their copies stay until garbage collection finds them).
        """
        by_node: dict[int, list[bytes]] = {}
        for bid, nodes in blobs:
            P.check_id(bid)
            for x in dict.fromkeys(nodes):
                by_node.setdefault(x, []).append(bid)
        failed: dict[int, str] = {}

        async def one(node: int, ids: list[bytes]) -> None:
            try:
                await self.pool.call(node, P.DELETE_BLOBS, P.IdsReq(ids),
                                     retry_for=self.write_retry_for)
            except (Unavailable, DeadlineError) as e:
                self._mark_down(node, e)
                failed[node] = e.strerror or str(e)

        async with trio.open_nursery() as nursery:
            for node, ids in by_node.items():
                for k in range(0, len(ids), P.MAX_BATCH_BLOBS):
                    nursery.start_soon(one, node, ids[k:k + P.MAX_BATCH_BLOBS])
        if failed:
            raise Unavailable("delete: storage nodes unreachable: " + "; ".join(
                why for _, why in sorted(failed.items())))

    async def list_blobs(
        self, node: int, after: bytes = b"", limit: int = 10000
    ) -> list[tuple[bytes, float]]:
        """One page of the blob ids stored on ``node`` (greater than ``after``), with their
        creation times; an empty page at the end."""
        return P.LIST_BLOBS.decode(await self.pool.call(node, P.LIST_BLOBS,
                                                        P.ListBlobsReq(after, limit)))

    async def compact(self, node: int, min_dead_ratio: float = 0.3,
                      timeout: float = 3600.0) -> P.CompactSummary:
        """Rewrite ``node``'s volumes whose dead share is at least ``min_dead_ratio``; what was
        done."""
        return P.COMPACT.decode(await self.pool.call(
            node, P.COMPACT, P.CompactReq(float(min_dead_ratio)), timeout=timeout))

    async def stats(self, node: int) -> P.Stats:
        """``node``'s counters and space (``jpfs.proto.storage.Stats``)."""
        return P.STATS.decode(await self.pool.call(node, P.STATS, P.NoArgs()))


def _hash_all(views: Sequence[memoryview]) -> list[int]:
    h = xxhash.xxh3_64_intdigest
    return [h(v) for v in views]


class Moved(JPFSError):
    """Every node a chunk record named answered that it has no such blob: the healer moved the
    copies after the caller read the layout. Reading the layout again finds them."""


def _read_error(chunk: Chunk, failures: list[str], corrupt: bool, all_down: bool) -> JPFSError:
    """Why chunk ``chunk`` could not be read, naming each replica's node and its answer (the
    path is added by the layers that know it)."""
    why = "; ".join(failures)
    blob = f"(blob {P.blob_name(chunk.blob)})"
    if corrupt:
        return ChecksumError(f"chunk {chunk.index}: no replica has good bytes: {why} {blob}")
    if all_down:
        if len(set(chunk.nodes)) == 1:
            return Unavailable(f"chunk {chunk.index}: {why}, and no other replica holds it "
                               f"{blob}")
        return Unavailable(f"chunk {chunk.index}: no replica reachable: {why} {blob}")
    if failures and all(f.endswith(": ENOENT") for f in failures):
        # every recorded node answered that it has no such blob: the healer moved the copies
        # since this layout was read (or gc took a blob a crashed write left unnamed)
        return Moved(errno.EIO, f"chunk {chunk.index}: no recorded node holds it any more "
                                f"({why}): the copies moved since the file's layout was read; "
                                f"open the file again {blob}")
    return error(errno.EIO, f"chunk {chunk.index}: no replica could serve it: {why} {blob}")
