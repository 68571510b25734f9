"""One shard's LMDB environment: read views, group-committed writes, and transaction locks.

Writes are functions ``fn(txn, *args)`` queued to a single committer task. The committer takes
everything queued and runs it inside *one* LMDB write transaction (each operation in its own
nested transaction, so one failing operation rolls back alone), on the event loop: an operation
takes microseconds, less than a hop to a worker thread. Nothing awaits while a transaction is
open. The environment never fsyncs by itself: a syncer task makes everything committed so far
durable with one ``env.sync()``, so one fsync covers many groups (durable metadata writes are
fsync-bound, and sharing the fsync is the 10x lever: docs/perf.md). When somebody waits for
durability (a ``write``, ``sync``) it syncs at once; when nobody does, it lets commits gather
for up to ``sync_delay`` (5 ms) after its previous fsync, so two clients creating files one at a
time cost a few hundred fsyncs a second, not one per change. The fsync itself runs on the event
loop while fsyncs take less than a thread hop would (``BlockingCalls``), in a worker thread
otherwise.

Who waits for the fsync: ``write`` (a 2PC vote and decision, repairs: what another shard or a
restart relies on) is answered once its group is durable; ``write(durable=False)`` (planned
single-shard changes, 2PC commits whose coordinator waits for a ``sync`` before it forgets the
decision) once committed. ``write_later`` (the single-shard changes a
client makes: create, setattr, write_chunks, ...) is answered once its group is committed, as a
local filesystem answers before its journal commit: the change is visible to every client at
once and durable within ``sync_delay`` and one fsync (milliseconds); a client that needs to
know it is durable calls ``sync`` (what fsync(2) and unmount do), which returns once everything
committed before it is. A killed shard process loses nothing committed (the pages are in the
kernel); only a power failure in that window could. With ``ack_after_sync`` every write waits
(the old, slower policy, for comparison).

A replicated shard (``repl``, built by the store's constructor from the ``replication``
factory it is given; see ``replica.py``) records each group's changes as a log
entry while it commits (``replog.Recorder``), writes its position in the same transaction, and
answers the group's writes once a majority of the copies holds it (``replicated``); on a
follower ``write``/``write_later`` raise "not leader" and the leader's entries are applied
with ``apply_entries`` or a snapshot. With one copy none of this runs.

Keys held by a prepared cross-shard transaction are recorded in the ``lock`` database. An
operation that touches one raises ``Locked``; the caller waits for that transaction to resolve and
runs again, so readers never see half of a cross-shard change.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lmdb
import trio

from jpfs.errors import JPFSError, error
from jpfs.rpc.service import Defer, Later

from ..common import BlockingCalls, stall_point
from . import keys as K
from . import replog
from .leases import Leases
from .txn import Locked, Txn

log = logging.getLogger(__name__)

SYNC_DELAY = 0.005
"""Seconds an fsync nobody waits for may wait for more commits to cover (``Store``)."""

MAX_BATCH = 512
LOCK_WAIT = 30.0


class Replicator(Protocol):
    """What the store asks of its shard's replication (``replica.Replication``)."""

    def not_leader(self) -> JPFSError:
        """The error a write on a copy that does not lead is answered with."""
        ...

    def append(self, entry: replog.Entry) -> None:
        """A group commit of this leader, recorded as a log entry to ship."""
        ...

    def committed(self, seq: int) -> None:
        """The leader's own group ``seq`` is committed: it counts towards the majority."""
        ...


@dataclass
class _Slot:
    fn: Callable
    args: tuple
    done: trio.Event | None = None  # set when durable (write) ...
    later: Later | None = None  # ... or settled (write_later)
    result: object = None
    exc: BaseException | None = None
    read: bool = False  # an answer held until a majority holds what it saw (``hold``)
    soon: bool = False  # a ``write(durable=False)``: answered once committed, as write_later


class Store:
    """The LMDB environment of shard ``shard`` of ``n_shards``, with its directory leases
    (``leases``) and, for a shard with several copies, its replication: ``replication(store)``
    builds it once the store is open (None: a single copy)."""

    def __init__(self, path: str | os.PathLike, shard: int, n_shards: int, *,
                 sync: bool = True, map_size: int = 1 << 40, ack_after_sync: bool = False,
                 sync_delay: float = SYNC_DELAY,
                 replication: Callable[[Store], Replicator] | None = None):
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self.shard = shard
        self.n_shards = n_shards
        # Commits never fsync by themselves: the committer runs transactions on the event loop
        # and the syncer makes groups durable with one env.sync() for all of them.
        self.durable = sync
        self.ack_after_sync = ack_after_sync
        self.sync_delay = sync_delay
        """How long an fsync that nobody waits for may wait for more commits."""
        self.fsyncs = BlockingCalls()
        self._committed = 0  # groups committed so far
        self._synced = 0  # of those, durable
        self._dirty = trio.Event()  # set when a group was committed and not yet synced
        self._pending: list[tuple[int, _Slot | trio.Event]] = []  # waiting for a sync
        self._waited = trio.Event()  # set when something waits in _pending: sync now
        self.syncs = 0
        self.env = lmdb.open(str(path), max_dbs=len(K.DBS) + 2, map_size=map_size, sync=False,
                             metasync=False, max_readers=1024, readahead=False)
        self.dbs = {name: self.env.open_db(name.encode()) for name in K.DBS}
        self._check_identity()
        self._send, self._recv = trio.open_memory_channel(math.inf)
        self._tx_done: dict[bytes, trio.Event] = {}
        self.leases = Leases(self.tx_begun, self.tx_resolved)
        """The shard's directory leases (``Txn.check_lease`` asks them inside operations)."""
        self.commits = 0
        self.ops = 0
        self.leading = replication is None
        """False on a follower: writes raise "not leader" (``repl.not_leader()``); a copy of
        a replicated shard starts as one."""
        self.pos = self.read(lambda t: replog.unpack_pos(
            t.t.get(replog.REPL_KEY, db=t.db["state"])))
        """(term, seq) of the last group this copy committed or applied."""
        self.term = self.pos[0]
        """The term this copy writes entries in while it leads."""
        self._names = {h: name for name, h in self.dbs.items()}
        self._repl_wait: deque[tuple[int, int, _Slot]] = deque()  # (seq, group, slot)
        self._acked = 0  # a majority holds every group up to this seq (while leading)
        self.repl: Replicator | None = replication(self) if replication is not None else None
        """This copy's replication (None: a single copy, exactly the old path): replica.py."""

    def _check_identity(self) -> None:
        """Refuse to serve another shard's data (a wrong --index would corrupt placement)."""
        with self.env.begin(write=True) as t:
            stored = t.get(b"shard", db=self.dbs["state"])
            self.created = stored is None
            """Whether this environment was made just now (a brand-new copy)."""
            if stored is None:
                t.put(b"shard", str(self.shard).encode(), db=self.dbs["state"])
                t.put(b"next", (1).to_bytes(8, "big"), db=self.dbs["state"])
            elif int(stored) != self.shard:
                raise SystemExit(f"{self.path} holds shard {int(stored)}, not shard {self.shard}")

    def close(self) -> None:
        """Close the LMDB environment."""
        self.env.close()

    # ---- reads (in the trio thread: LMDB reads take microseconds, a thread hop costs more)
    def read(self, fn: Callable, *args):
        """``fn(txn, *args)`` in a read transaction (a consistent view; blocks the calling thread
        only for LMDB's reads)."""
        with self.env.begin() as t:
            return fn(Txn(t, self, time.time_ns()), *args)

    async def view(self, fn: Callable, *args):
        """Run a read function, waiting out cross-shard transactions holding what it reads."""
        while True:
            try:
                return self.read(fn, *args)
            except Locked as held:
                await self.wait_resolved(held.txid)

    # ---- writes
    def _not_leader(self) -> JPFSError:
        assert self.repl is not None  # only a replicated copy ever stops leading
        return self.repl.not_leader()

    def _check_leading(self) -> None:
        if not self.leading:
            raise self._not_leader()

    async def write(self, fn: Callable, *args, durable: bool = True):
        """Run ``fn(txn, *args)`` in the next group commit; returns its result once durable
        (and, replicated, once a majority of the copies holds it). ``durable=False``: once
        committed (durable within one fsync, as ``write_later``; ``sync`` waits for it)."""
        while True:
            self._check_leading()
            done = trio.Event()
            slot = _Slot(fn, args, done=done, soon=not durable)
            self._send.send_nowait(slot)
            await done.wait()
            if isinstance(slot.exc, Locked):
                await self.wait_resolved(slot.exc.txid)
                continue
            if slot.exc is not None:
                raise slot.exc
            return slot.result

    def write_later(self, fn: Callable, *args) -> Later:
        """``write`` for a server's inline handler: queue ``fn(txn, *args)`` for the next group
        commit and return a ``Later`` settled with its result once durable (no task waits)."""
        self._check_leading()
        later = Later()
        self._send.send_nowait(_Slot(fn, args, later=later))
        return later

    async def committer(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The single writer: drains the queue into group commits until cancelled (and runs
        the syncer beside it)."""
        async with trio.open_nursery() as waiters:  # write_later slots waiting out a lock
            if self.durable:
                waiters.start_soon(self._syncer)
            task_status.started()
            while True:
                batch = [await self._recv.receive()]
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(self._recv.receive_nowait())
                    except trio.WouldBlock:
                        break
                if not self.leading:  # queued before this copy stepped down
                    self._fail_all(batch, self._not_leader())
                    for slot in batch:
                        self._answer(slot)
                    continue
                self._commit(batch)  # microseconds per operation: cheaper than a thread hop
                self._committed += 1
                if self.durable:
                    self._dirty.set()
                repl = self.repl
                for slot in batch:
                    if slot.later is not None and isinstance(slot.exc, Locked):
                        waiters.start_soon(self._requeue_when_resolved, slot, slot.later,
                                           slot.exc)
                    elif repl is not None:  # answered once a majority holds the group
                        self._repl_wait.append((self.pos[1], self._committed, slot))
                    else:
                        self._settle(self._committed, slot)
                if repl is not None:
                    repl.committed(self.pos[1])

    async def _syncer(self) -> None:
        """Make committed groups durable, one fsync for all committed since the last one: at
        once when somebody waits for it, else up to ``sync_delay`` after the previous one."""
        last = -math.inf
        while True:
            await self._dirty.wait()
            if not self._waited.is_set():  # nobody in a hurry
                with trio.move_on_at(last + self.sync_delay):
                    await self._waited.wait()
            self._dirty = trio.Event()
            self._waited = trio.Event()
            upto = self._committed
            failure = None
            try:
                stall_point("meta.fsync")
                await self.fsyncs.run(self.env.sync, True)
                last = trio.current_time()
                self.syncs += 1
            except lmdb.Error as e:
                log.exception("metadata fsync failed")
                failure = error(errno.EIO, f"metadata fsync failed: {e}")
            self._synced = upto
            ready = [w for gen, w in self._pending if gen <= upto]
            self._pending = [(gen, w) for gen, w in self._pending if gen > upto]
            for w in ready:
                if isinstance(w, trio.Event):
                    w.set()
                    continue
                if failure is not None and w.exc is None:
                    w.exc = failure
                self._answer(w)

    def _wait_synced(self, group: int, waiter: _Slot | trio.Event, hurry: bool = True) -> None:
        """Answer ``waiter`` (set it, for an event) once ``group`` is durable; the syncer
        syncs at once rather than waiting for more commits, unless not in a ``hurry``."""
        self._pending.append((group, waiter))
        self._dirty.set()
        if hurry:
            self._waited.set()

    def _settle(self, group: int, slot: _Slot) -> None:
        """Answer a committed slot now, or once its group is fsynced where that is asked."""
        if slot.read:
            self._answer(slot)
        elif self.durable and ((slot.later is None and not slot.soon) or self.ack_after_sync):
            if self._synced >= group:
                self._answer(slot)
            else:
                self._wait_synced(group, slot)
        else:
            self._answer(slot)

    def hold(self, result: object, exc: BaseException | None = None) -> object:
        """A replicated leader's answer (a read's, or an error it met), given only once a
        majority holds every group it could have seen: a reader never sees a change that a
        failover could still drop. At once when nothing is waiting for a majority."""
        if self.repl is None or self._acked >= self.pos[1]:
            if exc is not None:
                raise exc
            return result
        if not self.leading:  # stepped down meanwhile: nobody will confirm it here
            raise self._not_leader()
        later = Later()
        self._repl_wait.append((self.pos[1], self._committed, _Slot(
            self.hold, (), later=later, result=result, exc=exc, read=True)))
        return later

    def replicated(self, seq: int) -> None:
        """A majority of the copies holds every group up to ``seq``: answer their writes."""
        if seq > self._acked:
            self._acked = seq
        wait = self._repl_wait
        while wait and wait[0][0] <= seq:
            _, group, slot = wait.popleft()
            self._settle(group, slot)

    def waiting_since_seq(self) -> int | None:
        """The oldest group a write waits to see on a majority (None: nothing waits)."""
        return self._repl_wait[0][0] if self._repl_wait else None

    def fail_waiting(self, exc: JPFSError) -> None:
        """Answer every write waiting for a majority with ``exc`` (they stay committed here
        and replicate once the copies are back: ``exc`` says they may still apply)."""
        wait, self._repl_wait = self._repl_wait, deque()
        for _, _, slot in wait:
            slot.result, slot.exc = None, exc
            self._answer(slot)

    def step_down(self, exc: JPFSError) -> None:
        """This copy stopped leading: fail what waits for replication, and wake the waiters of
        cross-shard transactions (the next leader finishes those)."""
        self.leading = False
        self._acked = 0
        self.leases.clear()
        self.fail_waiting(exc)
        done, self._tx_done = self._tx_done, {}
        for ev in done.values():
            ev.set()

    def _answer(self, slot: _Slot) -> None:
        if slot.later is None:
            if slot.done is not None:  # a slot has one of the two (write, write_later)
                slot.done.set()
            return
        try:
            slot.later.settle(slot.result, slot.exc)
        except Exception:  # an answer that fails to send must not stop commits
            log.exception("answering %s failed", slot.fn.__name__)

    async def sync(self, hurry: bool = True) -> int:
        """Return once everything committed before the call is durable; the groups synced.
        ``hurry=False``: by the syncer's next fsync as it comes (within the sync delay), not
        one started for this call (for an answer nobody waits on)."""
        if self.durable and self._synced < self._committed:
            ev = trio.Event()
            self._wait_synced(self._committed, ev, hurry)
            await ev.wait()
        return self._synced

    async def _requeue_when_resolved(self, slot: _Slot, later: Later, held: Locked) -> None:
        """Run a ``write_later`` operation (``slot``, answered by ``later``) again once the
        transaction that held it (``held``, its error) resolves."""
        try:
            await self.wait_resolved(held.txid)
        except Exception as e:  # noqa: BLE001 - the caller is told; the committer lives on
            later.settle(None, e)
            return
        slot.result = slot.exc = None
        self._send.send_nowait(slot)

    def _commit(self, batch: list[_Slot]) -> None:
        now = time.time_ns()
        repl = self.repl
        record = repl is not None
        group: list[replog.Mutation] = []
        try:
            with self.env.begin(write=True) as parent:
                for slot in batch:
                    child = self.env.begin(write=True, parent=parent)
                    t = replog.Recorder(child, self._names) if record else child
                    try:
                        slot.result = slot.fn(Txn(t, self, now), *slot.args)
                    except BaseException as e:  # noqa: BLE001 - every failure goes to its caller
                        child.abort()
                        slot.exc = e
                        if not isinstance(e, (JPFSError, Locked, Defer)):
                            log.exception("metadata operation %s failed", slot.fn.__name__)
                    else:
                        child.commit()
                        if record:
                            group.extend(t.rec)  # type: ignore[union-attr]
                if group:
                    pos = (self.term, self.pos[1] + 1)
                    parent.put(replog.REPL_KEY, replog.pack_pos(*pos), db=self.dbs["state"])
            if group and repl is not None:
                self.pos = pos
                repl.append(replog.Entry(pos[0], pos[1], group, replog.entry_size(group)))
            self.commits += 1
            self.ops += len(batch)
        except lmdb.MapFullError:
            self._fail_all(batch, error(errno.ENOSPC, "metadata shard is full (LMDB map size)"))
        except lmdb.Error as e:
            log.exception("metadata commit failed")
            self._fail_all(batch, error(errno.EIO, f"metadata commit failed: {e}"))

    @staticmethod
    def _fail_all(batch: list[_Slot], exc: JPFSError) -> None:
        for slot in batch:
            if slot.exc is None:
                slot.exc = exc

    # ---- a follower's side of replication (see replica.py)
    def apply_entries(self, entries: list) -> tuple[int, int]:
        """Apply a leader's entries (wire form, in order) in one transaction, with their
        position; durable within one fsync, as a commit is. Returns the new position."""
        state = self.dbs["state"]
        with self.env.begin(write=True) as t:
            for term, seq, mutations in entries:
                replog.apply(t, self.dbs, mutations)
                pos = (term, seq)
            t.put(replog.REPL_KEY, replog.pack_pos(*pos), db=state)
        self.pos = pos
        self._mark_committed()
        return pos

    def settle_when_synced(self, later: Later, result: object) -> None:
        """Settle ``later`` with ``result`` once everything applied so far is fsynced (a
        follower's acknowledgement under ``ack_after_sync``)."""
        slot = _Slot(self.settle_when_synced, (), later=later, result=result)
        if not self.durable or self._synced >= self._committed:
            self._answer(slot)
            return
        self._wait_synced(self._committed, slot)

    def _mark_committed(self) -> None:
        self._committed += 1
        self.commits += 1
        if self.durable:
            self._dirty.set()

    def snapshot_begin(self) -> None:
        """Drop everything before a snapshot is installed; the copy is marked incomplete
        (``resyncing``) until ``snapshot_end``, so it never campaigns with half a shard. The
        mark keeps the position the copy had (its *floor*): what it acknowledged before is
        gone from it until the snapshot ends, so an election must not pick a copy behind it."""
        floor = self.resync_floor or self.pos
        with self.env.begin(write=True) as t:
            for handle in self.dbs.values():
                t.drop(handle, delete=False)
            t.put(replog.RESYNC_KEY, replog.pack_pos(*floor), db=self.dbs["state"])
            t.put(b"shard", str(self.shard).encode(), db=self.dbs["state"])
        self.pos = (0, 0)
        self._mark_committed()

    def snapshot_data(self, db: str, items: list) -> None:
        """Records of the leader's snapshot; its position is not one of them: the copy is at
        no position until ``snapshot_end`` (a digest mid-snapshot must not claim one)."""
        handle = self.dbs[db]
        with self.env.begin(write=True) as t:
            for key, value in items:
                if db == "state" and key in (replog.REPL_KEY, replog.RESYNC_KEY):
                    continue
                t.put(key, value, db=handle)
        self._mark_committed()

    def snapshot_end(self, pos: tuple[int, int]) -> None:
        """The leader's snapshot is all here: this copy is at ``pos`` and no longer resyncing."""
        with self.env.begin(write=True) as t:
            t.put(replog.REPL_KEY, replog.pack_pos(*pos), db=self.dbs["state"])
            t.delete(replog.RESYNC_KEY, db=self.dbs["state"])
        self.pos = pos
        self._mark_committed()

    @property
    def resyncing(self) -> bool:
        """Whether a snapshot from the leader is unfinished (the copy must not lead meanwhile)."""
        return self.resync_floor is not None

    @property
    def resync_floor(self) -> tuple[int, int] | None:
        """The position this copy had before an unfinished snapshot (None: not resyncing)."""
        raw = self.read(lambda t: t.t.get(replog.RESYNC_KEY, db=t.db["state"]))
        return replog.unpack_pos(raw) if raw is not None else None

    def mark_new_copy(self) -> None:
        """A brand-new copy (not copy 0) must be filled by a leader before it may lead: were
        it elected, an existing shard's data would be replaced by its empty one."""
        with self.env.begin(write=True) as t:
            t.put(replog.RESYNC_KEY, replog.pack_pos(0, 0), db=self.dbs["state"])

    # ---- cross-shard transaction resolution
    def tx_begun(self, txid: bytes) -> None:
        """A cross-shard transaction was prepared here: ``wait_resolved`` may wait for it."""
        self._tx_done.setdefault(txid, trio.Event())

    def tx_resolved(self, txid: bytes) -> None:
        """Transaction ``txid`` committed or aborted here: wake whatever waits on its locks."""
        ev = self._tx_done.pop(txid, None)
        if ev is not None:
            ev.set()

    async def wait_resolved(self, txid: bytes) -> None:
        """Wait until prepared transaction ``txid`` is resolved; EAGAIN after ``LOCK_WAIT`` seconds
        (the coordinator may be gone: the client retries)."""
        ev = self._tx_done.get(txid)
        if ev is None:
            # Resolved between the read and now, or held since before a restart.
            if self.read(lambda t: t.t.get(txid, db=t.db["prepared"])) is None:
                return
            ev = self._tx_done.setdefault(txid, trio.Event())
        with trio.move_on_after(LOCK_WAIT):
            await ev.wait()
            return
        raise error(errno.EAGAIN, "held by a cross-shard operation that has not resolved yet "
                                  f"(transaction {txid.hex()})")
