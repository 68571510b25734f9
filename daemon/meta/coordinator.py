"""Running planned namespace changes: one local transaction, or two-phase commit across shards.

The shard that owns the directory being changed coordinates. For a cross-shard change it

1. commits an *intent* (state ``preparing``, the participant shards) without waiting for its
   fsync (it only makes recovery prompt; presumed abort below does without it);
2. asks every *other* participant to *prepare*: check the ops, allocate new inodes, hold
   locks, record the ops durably (shards creating inodes go first, so others can name the new
   inode);
3. on success applies its own ops and records the decision (state ``committing``) in one
   transaction, durable before any participant commits: the commit point. Its own shard is
   the last agent and never holds prepared locks. On failure it tells the prepared ones to
   *abort*;
4. tells the participants to *commit* (a participant lets its readers in once committed and
   answers once that is durable) and then deletes the intent (not waited for on disk: a lost
   deletion replays a commit that does nothing). The intent outlives every participant's
   unsynced commit, so one that loses its commit in a power failure finds the decision again.
   When every remote op changes only inodes its prepare locked (``_LOCKED_ONLY``: a mkdir's new
   inode, an rmdir's, a link count, a ctime), whoever reads or writes those there waits for the
   commit: the caller is answered once the decision is committed, as a single-shard change is
   (a new inode's attributes come from its prepare), and the decision's fsync and step 4 run in
   the background (a nursery this object owns, at most ``BACKGROUND`` at once). A power
   failure before that fsync takes the decision and this shard's ops with it, and the
   participants' durable prepares are aborted (presumed abort): the change is lost whole,
   within the window README gives for any answered change. Otherwise (an entry, whose
   directory's times and link count change unlocked) the decision is durable and step 4 done
   before the answer, so the caller reads its own change.

Critical path: the remote prepares (their fsync), plus the decision's fsync and the commits
where 4 says so; before, the intent, every prepare, the decision, the commits and the intent's
deletion each waited for an fsync in turn.

Presumed abort: a participant with a prepared record whose coordinator neither has an intent
nor runs the transaction (``tx_status`` "unknown") aborts it. Participants ask at start and
then every ``ORPHAN_EVERY`` s about records older than ``ORPHAN_AGE`` s, so an intent lost to a
crash before it was committed (or to a power failure before its fsync) costs seconds, not locks
held for good. A ``kill -9`` anywhere is finished on restart: the coordinator replays its
intents (``resolver``) and participants keep their locks (so readers wait rather than see half
a change) until told.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from jpfs.errors import JPFSError, Unavailable, error
from jpfs.proto import meta as P
from jpfs.proto.replica import ShardPool
from jpfs.rpc import Method, Pool

from ..common import fault_point
from . import keys as K
from . import once, ops
from .store import Store
from .txn import Locked, Txn

log = logging.getLogger(__name__)

FINISH_WAIT = 10.0
"""How long a caller waits for participants to apply a decided transaction before the rest is
left to the background resolver (the decision is durable either way)."""

BACKGROUND = 256
"""Decided transactions finished (participants committed, intent dropped) in the background
at once; past that a caller finishes its own before it is answered."""

BUSY_BACKOFF = 0.005
"""Longest random pause (s) before a change that gave way to another plans again."""

ORPHAN_AGE = 5.0
"""A prepared record older than this (s) is checked against its coordinator."""
ORPHAN_EVERY = 2.0

RENAME_LEASE = 30.0

_TRANSIENT = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.EAGAIN})


class _Refused(JPFSError):
    """The coordinator's own ops failed their checks in the decision transaction, which rolled
    back: nothing was decided."""

    def __init__(self, cause: JPFSError):
        super().__init__(cause.errno or errno.EIO, cause.strerror)
        self.cause = cause


class _Busy(JPFSError):
    """One of the coordinator's own keys is held by another prepared transaction. Not waited for
    inside the decision: this transaction holds its remote locks meanwhile, and the holder may
    be waiting for one of them (a deadlock); it aborts, waits, and plans again instead."""

    def __init__(self, txid: bytes):
        super().__init__(errno.EAGAIN, f"held by transaction {txid.hex()}")
        self.txid = txid


_LOCKED_ONLY = frozenset({"mkinode", "nlink", "setparent", "rmdir", "ctime"})
"""Ops whose every effect is on an inode their prepare locked (``ops.lock_keys``)."""


def _creates(plan_ops: list[list]) -> bool:
    return any(op[0] == "mkinode" for op in plan_ops)


def _put_intent(t: Txn, txid: bytes, state: str, shards: list[int]) -> None:
    t.t.put(txid, K.pack({"state": state, "shards": shards}), db=t.db["intent"])


def _decide(t: Txn, coord: Coordinator, gen: int, txid: bytes, shards: list[int],
            rid: bytes | None, created: list[int], local_ops: list[list] | None,
            local_prepared: bool, holder: bytes | None = None) -> list[int]:
    """The commit point: this shard's own ops (checked and applied here, the last agent; or,
    prepared earlier, committed here) and the decision, with the request id's outcome, in one
    transaction. Returns every inode the transaction created.

    Refused when this copy stopped leading and led again since the transaction began
    (``gen``): the new leadership's resolver may have aborted it already."""
    if coord.gen != gen:
        raise _Refused(error(errno.EAGAIN, "this shard's leader changed during the change"))
    if local_ops is not None:
        try:
            created = created + ops.apply_local(t, local_ops, holder)
        except Locked as held:
            raise _Busy(held.txid) from None
        except JPFSError as e:
            raise _Refused(e) from None
    elif local_prepared:
        ops.commit(t, txid)
    _put_intent(t, txid, "committing", shards)
    if rid is not None:
        once.record(t, rid, {"created": created})
    return created


def _nothing(t: Txn) -> None:
    pass


def _apply_recorded(t: Txn, plan_ops: list[list], holder: bytes | None = None) -> dict:
    return {"created": ops.apply_local(t, plan_ops, holder)}


def _drop_intent(t: Txn, txid: bytes) -> None:
    t.t.delete(txid, db=t.db["intent"])


def _intents(t: Txn) -> list[tuple[bytes, dict]]:
    with t.t.cursor(db=t.db["intent"]) as cur:
        return [(bytes(k), K.unpack(v)) for k, v in cur]


def _prepared(t: Txn) -> list[tuple[bytes, dict]]:
    with t.t.cursor(db=t.db["prepared"]) as cur:
        return [(bytes(k), K.unpack(v)) for k, v in cur]


class Coordinator:
    """Applies op plans for one shard and serves the participant side of 2PC."""

    def __init__(self, store: Store, peers: Pool | ShardPool):
        self.store = store
        self.shard = store.shard
        self.peers = peers
        self._unfinished = trio.Event()
        self._active: set[bytes] = set()
        """Transactions a task of this copy is running (decided or not): ``tx_status`` says
        "active" rather than "unknown" for them, and the resolver leaves them alone."""
        self._left: set[bytes] = set()
        self._bg: trio.Nursery | None = None  # the resolver's: background finishes
        self.gen = 0
        """Bumped by ``reset``: a transaction begun before may not decide after."""
        self._in_bg = 0
        self._rename_owner: bytes | None = None
        self._rename_expiry = 0.0
        self._rename_freed = trio.Event()
        self.committed = 0
        self.aborted = 0

    # ---- running a plan -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget in-memory state: this copy just became its shard's leader (what it knew of
        transactions when it last led is stale; the resolver reads the records)."""
        self.gen += 1
        self._unfinished = trio.Event()
        self._active = set()
        self._left = set()
        self._rename_owner = None
        self._rename_expiry = 0.0

    async def run(self, plan: dict[int, list[list]], rid: bytes | None = None,
                  made: dict[int, list] | None = None, holder: bytes | None = None
                  ) -> list[int]:
        """Apply ``plan`` (ops per shard) atomically; returns the inodes it created.

        ``rid``: a request id recorded with the outcome, in the local transaction or in the
        commit decision (so a retry after a failover finds it; see ``once``). ``made``: filled
        with the attributes (wire form) of the inodes created on other shards, as they will
        be once committed, so the caller need not ask those shards (and wait for the commit).
        ``holder``: the lease session asking, exempt from its own leases (in a two-phase
        plan, on every shard: its prepares carry it, and this shard's ops are the last
        agent's, applied in the decision).
        Raises ``ops.Stale`` (ESTALE) when an expectation failed: the caller plans again.
        """
        if list(plan) == [self.shard]:
            # one transaction, answered once committed like any single-shard change (durable
            # within one fsync; fsync(2) and fsyncdir wait for it)
            if rid is not None:
                got = await self.store.write(once.once, rid, _apply_recorded, plan[self.shard],
                                             holder, durable=False)
                return got["created"]
            return await self.store.write(ops.apply_local, plan[self.shard], holder,
                                          durable=False)
        txid = os.urandom(16)
        self._active.add(txid)
        handed_off = False
        try:
            created, handed_off = await self._two_phase(txid, plan, rid, made, holder)
            return created
        finally:
            if not handed_off:
                self._done(txid)

    def _done(self, txid: bytes) -> None:
        self._active.discard(txid)
        if txid in self._left:
            self._left.discard(txid)
            self._unfinished.set()

    async def _two_phase(self, txid: bytes, plan: dict[int, list[list]],
                         rid: bytes | None = None, made: dict[int, list] | None = None,
                         holder: bytes | None = None) -> tuple[list[int], bool]:
        """Returns the created inodes, and whether a background task finishes the rest."""
        gen = self.gen
        shards = sorted(plan)
        local = plan.get(self.shard)
        order = sorted((s for s in plan if s != self.shard),
                       key=lambda s: (not _creates(plan[s]), s))
        # The last agent's ops run in the decision, after every prepare, so they cannot make
        # an inode the others name; then this shard prepares in turn like the others.
        last_agent = local is not None and not (
            _creates(local) and any(ops.NEW in op for s in order for op in plan[s]))
        if local is not None and not last_agent:
            order = sorted(plan, key=lambda s: (not _creates(plan[s]), s))
        # A decided transaction must be finished even if our caller goes away.
        with trio.CancelScope(shield=True):
            await self.store.write(_put_intent, txid, "preparing", shards, durable=False)
            fault_point("coordinator.intent")
            created: list[int] = []
            attrs: dict[int, list] = {}
            try:
                for s in order:
                    new = created[0] if created else None
                    for a in await self._participant(s, "prepare", txid,
                                                     ops.substitute(plan[s], new), holder):
                        created.append(a[0])
                        attrs[a[0]] = a
                    fault_point("coordinator.prepared_one")
            except JPFSError:
                # Abort everywhere: a prepare whose answer was lost may still have happened.
                await self._abort(txid, order)
                raise
            local_ops = None
            if last_agent:
                assert local is not None
                local_ops = ops.substitute(local, created[0] if created else None)
            remote = [s for s in shards if s != self.shard]
            # Answered once decided if no reader can see the remote ops undone: each changes
            # only inodes its prepare locked (a reader or writer there waits for the commit).
            # The decision need not be durable before that answer: the participants commit
            # only once it is, and a power failure before then takes it and this shard's ops
            # together, and presumed abort rolls the durable prepares back. Others (an entry's
            # directory's times, subdirs) are answered after the commits, so the caller reads
            # its own change.
            later = (self._bg is not None and self._in_bg < BACKGROUND
                     and all(op[0] in _LOCKED_ONLY for s in remote for op in plan[s]))
            try:
                created = await self.store.write(_decide, self, gen, txid, shards, rid, created,
                                                 local_ops, local is not None and not last_agent,
                                                 holder, durable=not later)
            except _Busy as busy:
                await self._abort(txid, order)
                await self.store.wait_resolved(busy.txid)
                # Two changes that hold each other's keys both give way; a random pause keeps
                # them from meeting again at once, round after round.
                await trio.sleep(random.uniform(0, BUSY_BACKOFF))
                raise ops.Stale(f"held by transaction {busy.txid.hex()}; planning again") \
                    from None
            except _Refused as refused:
                await self._abort(txid, order)
                raise refused.cause from None
            except BaseException:
                # committed or not (a write that failed after its commit: the fsync, the
                # majority, the leadership): the resolver reads the intent and finishes it
                self._left.add(txid)
                raise
            self.store.tx_resolved(txid)  # this shard's own prepared ops, if it had any
            fault_point("coordinator.decided")
            self.committed += 1
            if made is not None:
                made.update(attrs)
            if later and self._bg is not None:
                self._in_bg += 1  # (transactions deciding meanwhile may pass the bound a little)
                self._bg.start_soon(self._finish_later, txid, remote)
                return created, True
            if later:  # the resolver stopped meanwhile: finish here, once decided durably
                await self.store.sync()
            await self._finish(txid, remote)
        return created, False

    async def _participant(self, shard: int, step: str, txid: bytes, plan_ops=None,
                           holder: bytes | None = None):
        steps: dict[str, tuple[Method, Callable[..., Awaitable[Any]]]] = {
            "prepare": (P.TX_PREPARE, self.tx_prepare),
            "commit": (P.TX_COMMIT, self.tx_commit),
            "commit unhurried": (P.TX_COMMIT, self.tx_commit),
            "abort": (P.TX_ABORT, self.tx_abort)}
        method, local = steps[step]
        args = [txid, self.shard, plan_ops, holder] if step == "prepare" else \
            [txid, False] if step == "commit unhurried" else [txid]
        if shard == self.shard:
            return await local(*args)
        return await self.peers.call(shard, method, args, timeout=60.0)

    async def _tell_all(self, txid: bytes, shards: list[int], step: str) -> bool:
        """``step`` on every shard at once, retried; False if some did not answer in time."""
        with trio.move_on_after(FINISH_WAIT) as scope:
            async with trio.open_nursery() as nursery:
                for s in shards:
                    nursery.start_soon(self._tell, s, step, txid)
        if scope.cancelled_caught:
            log.warning("transaction %s: participants unreachable; finishing in the background",
                        txid.hex())
            return False
        return True

    async def _abort(self, txid: bytes, shards: list[int]) -> None:
        self.aborted += 1
        if await self._tell_all(txid, shards, "abort"):
            await self.store.write(_drop_intent, txid, durable=False)
        else:
            self._left.add(txid)

    async def _finish(self, txid: bytes, shards: list[int], step: str = "commit") -> None:
        """Commit a decided transaction everywhere; the intent goes once every commit is
        durable (each participant answers only then). Until then a participant that lost its
        commit to a power failure still finds the decision (its prepared record was durable)."""
        if await self._tell_all(txid, shards, step):
            fault_point("coordinator.committed")
            await self.store.write(_drop_intent, txid, durable=False)
            fault_point("coordinator.finished")
        else:
            self._left.add(txid)  # the resolver finishes it

    async def _finish_later(self, txid: bytes, shards: list[int]) -> None:
        """``_finish`` of a transaction answered once decided: the participants commit once
        the decision is durable (at once: readers wait for those commits), and answer once
        their next fsync covers it (nobody waits for that but the intent's deletion)."""
        try:
            await self.store.sync()
            await self._finish(txid, shards, "commit unhurried")
        except Exception as e:  # noqa: BLE001 - the resolver is the backstop; the nursery lives
            log.warning("transaction %s: finishing failed (%s); left to the resolver",
                        txid.hex(), e)
            self._left.add(txid)
        finally:
            self._in_bg -= 1
            self._done(txid)

    async def _tell(self, shard: int, step: str, txid: bytes) -> None:
        delay = 0.05
        while True:
            try:
                await self._participant(shard, step, txid)
                return
            except JPFSError as e:
                if not isinstance(e, Unavailable) and e.errno not in _TRANSIENT:
                    raise
                log.info("transaction %s: %s on shard %d failed (%s); retrying", txid.hex(),
                         step, shard, e.strerror)
            await trio.sleep(delay)
            delay = min(delay * 2, 2.0)

    # ---- recovery -------------------------------------------------------------------------------

    async def resolver(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Finish this shard's undecided and unfinished transactions: at start, and whenever a
        decision could not be delivered in time. Its nursery runs the background finishes."""
        async with trio.open_nursery() as bg:
            self._bg, self._in_bg = bg, 0
            try:
                task_status.started()
                for txid, _ in self.store.read(_prepared):
                    self.store.tx_begun(txid)  # readers of its locked keys wait for it
                while True:
                    if self.store.repl is not None:
                        # act only on what a majority holds: one empty write, answered once a
                        # majority holds it and so everything before it
                        await self.store.write(_nothing, durable=False)
                    # a decision committed just before a kill -9 may not be on the disk yet:
                    # participants commit only on a durable one
                    await self.store.sync()
                    for txid, intent in self.store.read(_intents):
                        if txid in self._active:
                            continue
                        commit = intent["state"] == "committing"
                        log.info("recovering transaction %s: %s", txid.hex(),
                                 "commit" if commit else "abort")
                        async with trio.open_nursery() as nursery:
                            for s in intent["shards"]:
                                nursery.start_soon(self._tell, s,
                                                   "commit" if commit else "abort", txid)
                        await self.store.write(_drop_intent, txid, durable=False)
                    await self._unfinished.wait()
                    self._unfinished = trio.Event()
            finally:
                if self._bg is bg:
                    self._bg = None

    async def orphan_checker(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Ask coordinators about transactions this shard prepared: all of them at start, then
        periodically those older than ``ORPHAN_AGE``. One its coordinator neither records nor
        runs ("unknown") was never decided, so it is aborted."""
        task_status.started()
        first = True
        while True:
            now = time.time_ns()
            for txid, rec in self.store.read(_prepared):
                if not first and now - rec.get("at", 0) < ORPHAN_AGE * 1e9:
                    continue
                coord = rec["coordinator"]
                state: object
                if coord == self.shard:
                    state = await self.tx_status(txid)  # no await between the reads: exact
                else:
                    delay = 0.1
                    while True:
                        try:
                            state = await self.peers.call(coord, P.TX_STATUS, [txid])
                            break
                        except JPFSError:
                            await trio.sleep(delay)
                            delay = min(delay * 2, 5.0)
                if state == "unknown":
                    log.info("transaction %s: coordinator %d has no record; aborting",
                             txid.hex(), coord)
                    await self.tx_abort(txid)
            first = False
            await trio.sleep(ORPHAN_EVERY)

    # ---- participant side ----------------------------------------------------------------------

    async def tx_prepare(self, txid: bytes, coordinator: int, plan_ops: list,
                         holder: bytes | None = None) -> list[list]:
        """Prepare: answers the attributes of the inodes the commit will make. ``holder``: the
        lease session the change is made for."""
        if len(txid) != 16:
            raise error(errno.EINVAL, "transaction ids are 16 bytes")
        if holder is not None and type(holder) is not bytes:
            raise error(errno.EINVAL, "a lease session is bytes")
        ops.check_shapes(plan_ops)
        created = await self.store.write(ops.prepare, txid, coordinator, plan_ops, holder)
        self.store.tx_begun(txid)
        if coordinator != self.shard:
            fault_point("participant.prepared")
        return created

    async def tx_commit(self, txid: bytes, hurry: bool = True) -> bool:
        """Readers and writers waiting for the transaction's locks go on once it is committed
        (replicated: on a majority); the coordinator is answered once it is durable, since it
        forgets the decision then (``hurry=False``: by the next fsync as it comes, for a
        commit its caller was answered without)."""
        applied = await self.store.write(ops.commit, txid, durable=False)
        self.store.tx_resolved(txid)
        fault_point("participant.committed")
        await self.store.sync(hurry)
        return applied

    async def tx_abort(self, txid: bytes) -> bool:
        """Answered once committed: an abort lost to a power failure is presumed again."""
        dropped = await self.store.write(ops.abort, txid, durable=False)
        self.store.tx_resolved(txid)
        return dropped

    async def tx_status(self, txid: bytes) -> str:
        """TX_STATUS: the state of transaction ``txid`` as this coordinator recorded it; ``active``
        while it is still being decided, ``unknown`` if it has no record (forgotten, or never
        begun)."""
        raw = self.store.read(lambda t: t.t.get(txid, db=t.db["intent"]))
        if raw is not None:
            return K.unpack(raw)["state"]
        return "active" if txid in self._active else "unknown"

    # ---- the directory-move lock (held on shard 0) ----------------------------------------------

    async def rename_lock(self, owner: bytes, ttl: float) -> bool:
        """Serialise directory moves between parents, so the loop check sees a stable tree
        (as Linux's per-filesystem rename mutex does). A lease: a dead holder expires."""
        ttl = min(max(ttl, 1.0), RENAME_LEASE)
        while True:
            now = trio.current_time()
            if self._rename_owner in (None, owner) or now >= self._rename_expiry:
                self._rename_owner, self._rename_expiry = owner, now + ttl
                return True
            with trio.move_on_at(self._rename_expiry):
                await self._rename_freed.wait()

    async def rename_unlock(self, owner: bytes) -> bool:
        """RENAME_UNLOCK: free the directory-move lock if ``owner`` holds it; whether it did."""
        if self._rename_owner == owner:
            self._rename_owner = None
            self._rename_freed.set()
            self._rename_freed = trio.Event()
            return True
        return False
