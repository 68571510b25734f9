"""The healer: each shard's leader keeps R live copies of the chunks whose records it owns.

Why here: a storage node knows blobs, not files; the chunk records (which nodes hold a blob)
live on the metadata shard of the file's inode, and only that shard may rewrite them. So each
shard's leader scans its own ``chunk`` records, round after round, and for every chunk:

- counts its *live* copies: on an active node, not marked bad by that node's scrubber; a copy on
  a draining node counts for reading but must move; one on a removed node does not count;
- repairs a bad copy on an active node in place (the node pulls a good copy and its store
  replaces the bad one), and adds copies on writable nodes chosen by ``placement.spread`` until
  the chunk has R live ones (a draining or removed node's copy then leaves the record);
- when usage is uneven (a node was added), moves copies from the fullest active node to the
  emptiest, a bounded share per round (see ``_rebalance_plan``), deleting the old copy a little
  later (readers that hold the old record fail over meanwhile). Only in a cluster with a map:
  a static cluster file never grows, and moving its chunks would only fight placement's
  packing of a directory's files.

Copies go node to node (``pull_blobs``: the target fetches from the source and verifies the
record's xxh3), so no bytes pass through the shard. Each copy is paced by a per-shard rate
(``--heal-rate``) with ``CONCURRENCY`` pulls in flight. The record is then rewritten only if it
still names the same blob and nodes it was read with (compare-and-set in one group commit): a
write that replaced the chunk meanwhile wins, and the orphan copy is gc's. Nothing is kept
between rounds but counters: a restarted or new leader simply rescans.

Shard 0's healer also finishes drains: a draining node that two consecutive rounds of every
shard found no chunk naming becomes ``removed`` in the cluster map. Followers do not heal (their
store refuses writes); they skip rounds and say so in ``heal_status``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from jpfs import config
from jpfs.config import Cluster
from jpfs.errors import JPFSError
from jpfs.proto import heal as H
from jpfs.proto import storage as S
from jpfs.rpc import Handler, Pool

from . import heal_plan as P
from .heal_plan import ACTIVE, DRAINING, REMOVED
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_RATE = 64 << 20
DEFAULT_INTERVAL = 30.0
"""Seconds between rounds that found nothing to do (a map change starts one at once)."""
BUSY_PAUSE = 1.0
IDLE_SHARE = 0.1
"""An idle shard spends at most this share of its time scanning: the pause after a round that
found nothing is at least (1 / IDLE_SHARE - 1) times the round's length (a scan costs about
9 us per chunk record here: 90 s for 10M records)."""
"""Seconds between rounds that did work (so a failing copy does not spin)."""
PAGE = 2000
"""Chunk records read per step of a scan (one short read transaction each)."""
CONCURRENCY = 2
DELETE_AFTER = 5.0
"""Seconds a rebalanced-away copy is kept, for readers holding the old record."""
TOLERANCE = 0.1
"""Usage counts as even when max - min <= max(TOLERANCE * mean, 2 chunks)."""
CLEAN_ROUNDS = 2
"""Consecutive rounds of every shard finding no chunk on a draining node before it is removed."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The healer's daemon options (``jpfs-meta``)."""
    p.add_argument("--heal-rate", default=f"{DEFAULT_RATE >> 20}MiB",
                   help="bytes per second this shard's healer copies at most (default "
                        f"{config.format_size(DEFAULT_RATE)}; 0 turns healing off)")
    p.add_argument("--heal-interval", type=float, default=DEFAULT_INTERVAL,
                   help="seconds between healing rounds that found nothing to do (default "
                        f"{DEFAULT_INTERVAL:.0f}; a cluster map change starts one at once)")


def options(args: argparse.Namespace) -> dict:
    """``Healer`` keyword arguments from the parsed options."""
    return {"rate": config.parse_size(args.heal_rate), "interval": args.heal_interval}


def states_of(cluster: Cluster) -> tuple[str, ...]:
    """The storage nodes' states (``active``, ``draining``, ``removed``), by node index."""
    return tuple(s.state for s in cluster.storage)


class Healer:
    """One shard's healer (see the module). Start ``run`` in the shard's nursery.

    Args:
        store: the shard's store (its chunk records; ``leading`` says whether it leads).
        cluster: the map at start; followed from etcd when the cluster has one.
        rate: bytes/s copied at most; 0 turns healing off (status still answers).
        interval: seconds between rounds that found nothing to do.
    """

    def __init__(self, store: Store, cluster: Cluster, *, rate: float = DEFAULT_RATE,
                 interval: float = DEFAULT_INTERVAL):
        self.store = store
        self.shard = store.shard
        self.cluster = cluster
        self.rate = max(0.0, float(rate))
        self.interval = max(0.05, float(interval))
        self._kick = trio.Event()
        self._limiter = trio.CapacityLimiter(CONCURRENCY)
        self._due = 0.0
        self._batch_limit = int(min(P.BATCH_BYTES, max(1 << 20, self.rate / 4)))
        """Bytes per pull: a quarter second's worth at the rate, so a burst stays short."""
        self._deletes: list[tuple[float, int, bytes]] = []
        self._drain_seen: dict[int, int] = {}  # draining node -> clean rounds in a row
        self._storage: Pool | None = None
        self._shards: Pool | None = None
        self._etcd: Any = None
        self.state = "idle" if self.rate > 0 else "off"
        self.scanned = 0
        self._current: P.Round | None = None
        """The round under way: its running counts show while it is."""
        self.pending = 0
        self.error: str | None = None
        self.last: dict[str, Any] = {}
        self.totals = dict.fromkeys(("rounds", "repaired_chunks", "repaired_bytes",
                                     "moved_chunks", "moved_bytes", "copy_failures"), 0)
        self.bytes_per_s = 0.0
        self.rebalance: dict[str, Any] = {}
        self.round_started: float | None = None

    # ---- the RPC side

    def handlers(self) -> dict:
        """The methods of ``jpfs.proto.heal`` bound to this healer."""
        return {H.HEAL_STATUS: Handler(self.heal_status), H.HEAL_KICK: Handler(self.heal_kick)}

    @property
    def leading(self) -> bool:
        """Whether this copy leads its shard (only the leader heals)."""
        return self.store.leading

    def status(self) -> H.HealStatus:
        """The healer's state and the counts of its last round (those of the round under way
        where it has found more): HEAL_STATUS's record."""
        last = self.last
        under, under_bytes = last.get("under", 0), last.get("under_bytes", 0)
        cur = self._current
        if cur is not None and cur.under > 0:  # found so far in this round, less those fixed
            under, under_bytes = max(0, cur.under), max(0, cur.under_bytes)
        totals = self.totals
        return H.HealStatus(
            shard=self.shard, leader=self.leading, enabled=self.rate > 0,
            state=self.state if self.leading or self.rate <= 0 else "follower",
            rounds=totals["rounds"], round_started=self.round_started,
            round_epoch=last.get("epoch", -1), last_round=last.get("finished"),
            scanned=self.scanned, chunks=last.get("chunks", 0), bytes=last.get("bytes", 0),
            under_replicated=under, under_bytes=under_bytes,
            unrepairable=last.get("unrepairable", 0), bad_copies=last.get("bad_copies", 0),
            node_chunks=dict(last.get("node_chunks", {})),
            to_move=dict(last.get("to_move", {})), clean_rounds=dict(self._drain_seen),
            repaired_chunks=totals["repaired_chunks"], repaired_bytes=totals["repaired_bytes"],
            moved_chunks=totals["moved_chunks"], moved_bytes=totals["moved_bytes"],
            copy_failures=totals["copy_failures"], pending=self.pending,
            rate_limit=self.rate, bytes_per_s=self.bytes_per_s, rebalance=self.rebalance,
            error=self.error)

    async def heal_status(self) -> dict:
        """HEAL_STATUS: :meth:`status` in wire form."""
        return self.status().to_wire()

    def with_metrics(self, snapshot: Callable[[], Awaitable[dict]]
                     ) -> Callable[[], Awaitable[dict]]:
        """``snapshot`` (the shard's ``shard_info``) plus the healer's figures as ``heal_*``
        keys, for the Prometheus export (``COUNTERS`` are the ones that only grow)."""
        async def both() -> dict:
            s = heal_status_numbers(self.status())
            return {**await snapshot(), **s}

        return both

    async def heal_kick(self) -> dict:
        """HEAL_KICK: start a round now instead of after the pause; the status as
        ``heal_status``."""
        self._kick.set()
        return self.status().to_wire()

    # ---- following the map

    def follow(self, cluster: Cluster) -> None:
        """A newer map: new addresses and node states; start a round now."""
        if cluster.epoch < self.cluster.epoch:
            return
        self.cluster = cluster
        if self._storage is not None:
            self._storage.set_addresses([s.address for s in cluster.storage])
        if self._shards is not None:
            self._shards.set_addresses(_meta_addresses(cluster))
        self._kick.set()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Round after round until cancelled; a failed round is logged and retried later."""
        async with trio.open_nursery() as nursery:
            c = self.cluster
            self._storage = Pool(nursery, [s.address for s in c.storage], c.secret,
                                 role="storage", retry_for=0.5, timeout=120.0,
                                 peer_timeout=c.peer_timeout)
            self._shards = Pool(nursery, _meta_addresses(c), c.secret, role="meta",
                                retry_for=0.5, timeout=10.0, peer_timeout=c.peer_timeout)
            if c.etcd:
                from jpfs.coord.clustermap import follow_map
                from jpfs.coord.etcd import Etcd

                self._etcd = Etcd(c.etcd, timeout=max(2.0, c.peer_timeout))
                nursery.start_soon(follow_map, self._etcd, c, self.follow)
            task_status.started()
            try:
                await self._loop()
            finally:
                self._storage.close()
                self._shards.close()
                if self._etcd is not None:
                    with trio.CancelScope(shield=True):
                        await self._etcd.aclose()

    async def _loop(self) -> None:
        pause = self.interval  # a map change or heal_kick starts one sooner
        while True:
            with trio.move_on_after(pause):
                await self._kick.wait()
            self._kick = trio.Event()
            if self.rate <= 0:
                pause = self.interval
                continue
            if not self.leading:  # looked at again soon: a follower may be elected
                self.state = "follower"
                pause = min(self.interval, 2.0)
                continue
            try:
                worked = await self._round()
                self.error = None
            except JPFSError as e:
                if not self.leading:  # lost the lead mid-round: the new leader rescans
                    self.state = "follower"
                    pause = min(self.interval, 2.0)
                    continue
                log.warning("shard %d: healing round failed: %s", self.shard, e.strerror)
                self.error, worked = e.strerror, True
            except Exception as e:  # noqa: BLE001 - a shard never dies of its healer
                log.exception("shard %d: healing round failed", self.shard)
                self.error, worked = f"{type(e).__name__}: {e}", True
            self.state = "idle"
            self._current = None
            took = time.time() - (self.round_started or time.time())
            pause = BUSY_PAUSE if worked or self._deletes else \
                max(self.interval, took * (1 / IDLE_SHARE - 1))

    # ---- one round

    async def _round(self) -> bool:
        await self._flush_deletes()
        cluster = self.cluster
        self.round_started = time.time()
        self.state = "scanning"
        self.scanned = 0
        states = states_of(cluster)
        writable = [i for i, s in enumerate(states) if s == ACTIVE]
        up, used, bad = await self._nodes(cluster)
        r = self._current = P.Round(
            cluster.epoch, self.round_started, states,
            min(cluster.replicas, max(1, len(writable))), up, bad, cluster.replicas,
            domains=cluster.node_domains)
        if not cluster.etcd:
            self.rebalance = {"off": "a static cluster file never grows"}
        elif not self._deletes:
            r.moves = self._rebalance_plan(cluster, writable, up, used)
        else:  # the figures still count copies moved away but not yet deleted
            self.rebalance = {"waiting": len(self._deletes)}
        writable_up = [n for n in writable if n in up]
        after = b""
        while True:
            items, nxt = self.store.read(P.scan_page, after, PAGE)
            jobs = []
            for ino, c in items:
                r.chunks += 1
                r.nbytes += c.blob_len
                job = P.plan_chunk(ino, c, r, writable_up)
                if job is None:
                    P.count(r.node_chunks, c.nodes)
                else:
                    jobs.append(job)
            self.scanned += len(items)
            if jobs:
                r.worked = True
                await self._do(jobs, r)
            if nxt is None:
                break
            after = nxt
            await trio.sleep(0)  # a big shard's scan must not hold the event loop
        self._finish(r)
        self._current = None
        if self.shard == 0 and self._etcd is not None:
            try:
                if await self.finish_drains():
                    r.worked = True
            except (JPFSError, OSError, ValueError) as e:
                log.warning("shard 0: cannot finish drains yet: %s", e)
        return r.worked

    async def _do(self, jobs: list[P.Job], r: P.Round) -> None:
        """Copy what the jobs need, then compare-and-set their records in one commit."""
        copies = [cp for j in jobs for cp in j.copies]
        if copies:
            self.state = "copying"
            self.pending = len(copies)
            t0 = trio.current_time()
            await self._copy(copies)
            r.copy_time += trio.current_time() - t0
            r.copied += sum(cp.length for cp in copies if cp.ok)
            self.pending = 0
            self.state = "scanning"
        changes, changed = [], []
        for j in jobs:
            nodes = P.new_nodes(j, r)
            if nodes != tuple(j.chunk.nodes):
                changes.append((j.ino, j.chunk.index, j.chunk.blob, tuple(j.chunk.nodes), nodes))
                changed.append(j)
        done = await self.store.write(P.swap_nodes, changes) if changes else []
        swapped = {id(j): ch[4] for j, ch, ok in zip(changed, changes, done, strict=True) if ok}
        now = trio.current_time()
        t = self.totals
        for j in jobs:
            ok_copies = [cp for cp in j.copies if cp.ok]
            t["copy_failures"] += len(j.copies) - len(ok_copies)
            in_place = j.kind == "repair" and ok_copies and id(j) not in swapped and \
                all(cp.target in j.chunk.nodes for cp in ok_copies)
            if id(j) in swapped or in_place:
                nodes = swapped.get(id(j), j.chunk.nodes)
                P.count(r.node_chunks, nodes)
                if j.kind == "move":
                    t["moved_chunks"] += 1
                    t["moved_bytes"] += j.chunk.blob_len
                    assert j.replace is not None
                    self._deletes.append((now + DELETE_AFTER, j.replace[0], j.chunk.blob))
                elif j.kind == "repair":
                    t["repaired_chunks"] += 1
                    t["repaired_bytes"] += sum(cp.length for cp in ok_copies)
                    want = max(r.replicas, r.wanted)
                    if P.live_after(j, nodes, r) >= want > P.live_before(j, r):
                        r.under -= 1
                        r.under_bytes -= j.chunk.blob_len
            else:
                P.count(r.node_chunks, j.chunk.nodes)

    async def _copy(self, copies: list[P.Copy]) -> None:
        """Each copy from its sources in turn, batched per (target, source), paced."""
        pending = copies
        while pending:
            groups: dict[tuple[int, int], list[P.Copy]] = {}
            for cp in pending:
                if cp.tried < len(cp.sources):
                    groups.setdefault((cp.target, cp.sources[cp.tried]), []).append(cp)
                    cp.tried += 1
            if not groups:
                return
            async with trio.open_nursery() as nursery:
                for (target, source), items in groups.items():
                    for batch in P.batches(items, self._batch_limit):
                        nursery.start_soon(self._pull, target, source, batch)
            pending = [cp for cp in pending if not cp.ok]

    async def _pull(self, target: int, source: int, batch: list[P.Copy]) -> None:
        pool = self._storage
        assert pool is not None
        async with self._limiter:
            await self._pace(sum(cp.length for cp in batch))
            try:
                got = S.PULL_BLOBS.decode(await pool.call(
                    target, S.PULL_BLOBS, S.PullBlobsReq(
                        pool.addresses[source], [[cp.blob, cp.length, cp.xxh] for cp in batch]),
                    retry_for=0.5))
            except JPFSError as e:
                log.warning("shard %d: copying %d blobs from storage node %d to %d failed: %s",
                            self.shard, len(batch), source, target, e.strerror)
                return
        failed = {bid for bid, _ in got.failures}
        for bid, why in got.failures[:3]:
            log.warning("shard %d: blob %s not copied from storage node %d to %d: %s",
                        self.shard, S.blob_name(bid), source, target, why)
        for cp in batch:
            cp.ok = cp.blob not in failed

    async def _pace(self, nbytes: int) -> None:
        """Wait for this copy's turn at the rate: a token bucket of one batch."""
        now = trio.current_time()
        start = max(self._due, now)
        self._due = start + nbytes / self.rate
        await trio.sleep_until(start)

    def _finish(self, r: P.Round) -> None:
        to_move = {n: r.node_chunks.get(n, 0) for n, s in enumerate(r.states) if s == DRAINING}
        for n in list(self._drain_seen):
            if n not in to_move:
                del self._drain_seen[n]
        for n, count in to_move.items():
            self._drain_seen[n] = self._drain_seen.get(n, 0) + 1 if count == 0 else 0
        if r.copy_time > 0 and r.copied:
            self.bytes_per_s = r.copied / r.copy_time
        self.last = {"epoch": r.epoch, "finished": time.time(), "chunks": r.chunks,
                     "bytes": r.nbytes, "under": max(0, r.under),
                     "under_bytes": max(0, r.under_bytes), "unrepairable": r.unrepairable,
                     "bad_copies": r.bad_copies, "node_chunks": dict(r.node_chunks),
                     "to_move": to_move}
        self.totals["rounds"] += 1
        if r.worked or r.under or r.unrepairable:
            log.info("shard %d: healing round %d: %d chunks, %d under-replicated, %d "
                     "unrepairable, %d bytes copied", self.shard, self.totals["rounds"],
                     r.chunks, r.under, r.unrepairable, r.copied)

    # ---- what the storage nodes say

    async def _nodes(self, cluster: Cluster) -> tuple[set[int], dict[int, int], dict[int, set]]:
        """Nodes that answer, their live bytes, and the blobs each has marked bad."""
        up: set[int] = set()
        used: dict[int, int] = {}
        bad: dict[int, set[bytes]] = {}
        pool = self._storage
        assert pool is not None

        async def one(n: int) -> None:
            try:
                stats = await pool.call(n, S.STATS, S.NoArgs(), retry_for=0.5, timeout=10.0)
                assert isinstance(stats, dict)
                ids: set[bytes] = set()
                if stats.get("bad_blobs"):
                    after = b""
                    while True:
                        page = S.BAD_BLOBS.decode(await pool.call(
                            n, S.BAD_BLOBS, S.BadBlobsReq(after, S.MAX_LIST), retry_for=0.5,
                            timeout=30.0))
                        if not page:
                            break
                        ids.update(p[0] for p in page)
                        after = page[-1][0]
            except JPFSError as e:
                log.debug("shard %d: storage node %d: %s", self.shard, n, e.strerror)
                return
            up.add(n)
            used[n] = int(stats.get("live_bytes", 0))
            bad[n] = ids

        async with trio.open_nursery() as nursery:
            for n in range(cluster.n_nodes):
                nursery.start_soon(one, n)
        return up, used, bad

    def _rebalance_plan(self, cluster: Cluster, writable: list[int], up: set[int],
                        used: dict[int, int]) -> list[list]:
        """Moves [from, to, bytes] that bring the active nodes' live bytes towards their mean.

        Even means max - min <= max(TOLERANCE * mean, 2 chunks). Every shard's healer plans
        from the same node figures, so each moves its share (1 / shards) of half the gap per
        round, and the next round plans again from fresh figures: no shard overshoots the
        others' moves, and the gap closes geometrically."""
        live: dict[int, float] = {n: used[n] for n in writable if n in used}
        self.rebalance = {}
        if len(live) < 2 or len(live) != len(writable):
            return []  # a writable node that does not answer: its usage is unknown
        mean = sum(live.values()) / len(live)
        gap = max(live.values()) - min(live.values())
        allowed = max(TOLERANCE * mean, 2 * cluster.chunk_size)
        self.rebalance = {"mean": mean, "spread": gap, "allowed": allowed, "moves": []}
        if gap <= allowed:
            return []
        share = 2 * max(1, cluster.n_shards)
        over = sorted((n for n in live if live[n] > mean), key=lambda n: -live[n])
        under = sorted((n for n in live if live[n] < mean), key=lambda n: live[n])
        moves: list[list] = []
        for src in over:
            extra = live[src] - mean
            for dst in under:
                room = mean - live[dst]
                amount = min(extra, room)
                if amount <= 0 or src not in up or dst not in up:
                    continue
                moves.append([src, dst, max(amount / share, 1)])
                live[dst] += amount
                extra -= amount
        self.rebalance["moves"] = [[a, b, int(c)] for a, b, c in moves]
        return moves

    async def _flush_deletes(self) -> None:
        """Delete copies moved away at least DELETE_AFTER seconds ago (gc finds the rest)."""
        now = trio.current_time()
        due = [(n, b) for t, n, b in self._deletes if t <= now]
        if not due:
            return
        self._deletes = [d for d in self._deletes if d[0] > now]
        pool = self._storage
        assert pool is not None
        by_node: dict[int, list[bytes]] = {}
        for n, b in due:
            by_node.setdefault(n, []).append(b)
        for n, ids in by_node.items():
            try:
                await pool.call(n, S.DELETE_BLOBS, S.IdsReq(ids), retry_for=0.5)
            except JPFSError as e:
                log.info("shard %d: %d moved-away copies on storage node %d stay for gc: %s",
                         self.shard, len(ids), n, e.strerror)

    # ---- finishing drains (shard 0)

    async def finish_drains(self) -> list[int]:
        """Shard 0: mark removed the draining nodes every shard's leader found no chunk on
        in CLEAN_ROUNDS rounds in a row; returns them."""
        cluster = self.cluster
        draining = [n for n, s in enumerate(states_of(cluster)) if s == DRAINING]
        if self.shard != 0 or not draining or self._etcd is None:
            return []
        statuses = [self.status()] + [await self._leader_status(cluster, i)
                                      for i in range(1, cluster.n_shards)]
        done = [n for n in draining if all(
            s is not None and s.clean_rounds.get(n, 0) >= CLEAN_ROUNDS for s in statuses)]
        if not done:
            return []
        from jpfs.coord.clustermap import update_map

        def change(current: Cluster) -> Cluster:
            nodes = list(current.storage)
            for n in done:
                if n < len(nodes) and nodes[n].state == DRAINING:
                    nodes[n] = dataclasses.replace(nodes[n], state=REMOVED)
            return dataclasses.replace(current, storage=tuple(nodes))

        new = await update_map(self._etcd, cluster, change)
        log.info("storage nodes %s drained: no chunk names them; removed (map epoch %d)",
                 done, new.epoch)
        self.follow(new)
        return done

    async def _leader_status(self, cluster: Cluster, shard: int) -> H.HealStatus | None:
        """Shard ``shard``'s leader's heal_status, asking each of its copies; None if none
        answers as the leader."""
        pool = self._shards
        assert pool is not None
        base = sum(len(_replicas(cluster, i)) for i in range(shard))
        for j in range(len(_replicas(cluster, shard))):
            try:
                s = H.HEAL_STATUS.decode(await pool.call(base + j, H.HEAL_STATUS,
                                                         H.HealNoArgs(), retry_for=0.5))
            except JPFSError:
                continue
            if s.leader:
                return s
        return None


COUNTERS = frozenset({"heal_rounds", "heal_repaired_chunks", "heal_repaired_bytes",
                      "heal_moved_chunks", "heal_moved_bytes", "heal_copy_failures"})
"""Prometheus counters among the ``heal_*`` figures (the rest are gauges)."""


def heal_status_numbers(status: H.HealStatus) -> dict:
    """The numeric figures of a ``heal_status`` answer, as ``heal_<key>``."""
    out = {f"heal_{k}": v for k, v in status.to_wire().items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "shard"}
    out["heal_leader"] = int(bool(status.leader))
    return out


def _replicas(cluster: Cluster, shard: int) -> tuple:
    copies = cluster.meta_replicas
    return copies[shard] if shard < len(copies) and copies[shard] else (cluster.meta[shard],)


def _meta_addresses(cluster: Cluster) -> list[str]:
    """Every copy of every shard, shard by shard (a pool index per copy)."""
    return [s.address for i in range(cluster.n_shards) for s in _replicas(cluster, i)]


