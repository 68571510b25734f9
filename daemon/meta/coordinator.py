"""Running planned namespace changes: one local transaction, or two-phase commit across shards.

The shard that owns the directory being changed coordinates. For a cross-shard change it

1. writes an *intent* (state ``preparing``, the participant shards) durably;
2. asks every participant to *prepare*: check the ops, allocate new inodes, hold locks, record
   the ops durably (shards creating inodes go first, so others can name the new inode);
3. on success records the decision (state ``committing``) — the commit point — and tells every
   participant to *commit*; on failure tells the prepared ones to *abort*;
4. deletes the intent once every participant has answered.

Presumed abort: a participant with a prepared record whose coordinator has no intent aborts.
A ``kill -9`` anywhere is finished on restart: the coordinator replays its intents (``recover``)
and participants keep their locks (so readers wait rather than see half a change) until told.
"""

from __future__ import annotations

import errno
import logging
import os
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
from .store import Store, Txn

log = logging.getLogger(__name__)

FINISH_WAIT = 10.0
"""How long a caller waits for participants to apply a decided transaction before the rest is
left to the background resolver (the decision is durable either way)."""

RENAME_LEASE = 30.0

_TRANSIENT = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.EAGAIN})


def _put_intent(t: Txn, txid: bytes, state: str, shards: list[int]) -> None:
    t.t.put(txid, K.pack({"state": state, "shards": shards}), db=t.db["intent"])


def _decide(t: Txn, txid: bytes, shards: list[int], rid: bytes | None,
            created: list[int]) -> None:
    """The commit point, with the request id's outcome in the same transaction."""
    _put_intent(t, txid, "committing", shards)
    if rid is not None:
        once.record(t, rid, {"created": created})


def _apply_recorded(t: Txn, plan_ops: list[list]) -> dict:
    return {"created": ops.apply_local(t, plan_ops)}


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
        self._left: set[bytes] = set()
        self._rename_owner: bytes | None = None
        self._rename_expiry = 0.0
        self._rename_freed = trio.Event()
        self.committed = 0
        self.aborted = 0

    # ---- running a plan -------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget in-memory state: this copy just became its shard's leader (what it knew of
        transactions when it last led is stale; the resolver reads the records)."""
        self._unfinished = trio.Event()
        self._active = set()
        self._left = set()
        self._rename_owner = None
        self._rename_expiry = 0.0

    async def run(self, plan: dict[int, list[list]], rid: bytes | None = None) -> list[int]:
        """Apply ``plan`` (ops per shard) atomically; returns the inodes it created.

        ``rid``: a request id recorded with the outcome, in the local transaction or in the
        commit decision (so a retry after a failover finds it; see ``once``). Raises
        ``ops.Stale`` (ESTALE) when an expectation failed: the caller plans again.
        """
        if list(plan) == [self.shard]:
            if rid is not None:
                got = await self.store.write(once.once, rid, _apply_recorded, plan[self.shard])
                return got["created"]
            return await self.store.write(ops.apply_local, plan[self.shard])
        shards = sorted(plan, key=lambda s: (not any(op[0] == "mkinode" for op in plan[s]), s))
        txid = os.urandom(16)
        self._active.add(txid)
        try:
            return await self._two_phase(txid, plan, shards, rid)
        finally:
            self._active.discard(txid)
            if txid in self._left:
                self._left.discard(txid)
                self._unfinished.set()

    async def _two_phase(self, txid: bytes, plan: dict[int, list[list]], shards: list[int],
                         rid: bytes | None = None):
        # A decided transaction must be finished even if our caller goes away.
        with trio.CancelScope(shield=True):
            await self.store.write(_put_intent, txid, "preparing", shards)
            fault_point("coordinator.intent")
            created: list[int] = []
            try:
                for s in shards:
                    new = created[0] if created else None
                    created.extend(await self._participant(s, "prepare", txid,
                                                           ops.substitute(plan[s], new)))
                    fault_point("coordinator.prepared_one")
            except JPFSError:
                # Abort everywhere: a prepare whose answer was lost may still have happened.
                self.aborted += 1
                await self._finish(txid, shards, commit=False)
                raise
            await self.store.write(_decide, txid, shards, rid, created)
            fault_point("coordinator.decided")
            self.committed += 1
            await self._finish(txid, shards, commit=True)
            fault_point("coordinator.finished")
        return created

    async def _participant(self, shard: int, step: str, txid: bytes, plan_ops=None):
        steps: dict[str, tuple[Method, Callable[..., Awaitable[Any]]]] = {
            "prepare": (P.TX_PREPARE, self.tx_prepare),
            "commit": (P.TX_COMMIT, self.tx_commit),
            "abort": (P.TX_ABORT, self.tx_abort)}
        method, local = steps[step]
        args = [txid, self.shard, plan_ops] if step == "prepare" else [txid]
        if shard == self.shard:
            return await local(*args)
        return await self.peers.call(shard, method, args, timeout=60.0)

    async def _finish(self, txid: bytes, shards: list[int], commit: bool) -> None:
        """Tell participants the decision; leave what does not answer in time to the resolver."""
        step = "commit" if commit else "abort"
        with trio.move_on_after(FINISH_WAIT) as scope:
            async with trio.open_nursery() as nursery:
                for s in shards:
                    nursery.start_soon(self._tell, s, step, txid)
        if scope.cancelled_caught:
            log.warning("transaction %s: participants unreachable; finishing in the background",
                        txid.hex())
            self._left.add(txid)
        else:
            await self.store.write(_drop_intent, txid)

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
        decision could not be delivered in time."""
        task_status.started()
        for txid, _ in self.store.read(_prepared):
            self.store.tx_begun(txid)  # readers of its locked keys wait for it
        while True:
            for txid, intent in self.store.read(_intents):
                if txid in self._active:
                    continue
                commit = intent["state"] == "committing"
                log.info("recovering transaction %s: %s", txid.hex(),
                         "commit" if commit else "abort")
                async with trio.open_nursery() as nursery:
                    for s in intent["shards"]:
                        nursery.start_soon(self._tell, s, "commit" if commit else "abort", txid)
                await self.store.write(_drop_intent, txid)
            await self._unfinished.wait()
            self._unfinished = trio.Event()

    async def orphan_checker(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Ask coordinators about transactions this shard prepared before a restart: one whose
        coordinator forgot it (no intent) was never decided, so it is aborted."""
        task_status.started()
        for txid, rec in self.store.read(_prepared):
            coord = rec["coordinator"]
            if coord == self.shard:
                continue  # our own resolver handles it
            delay = 0.1
            while True:
                try:
                    state = await self.peers.call(coord, P.TX_STATUS, [txid])
                    break
                except JPFSError:
                    await trio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            if state == "unknown":
                log.info("transaction %s: coordinator %d has no record; aborting", txid.hex(),
                         coord)
                await self.tx_abort(txid)

    # ---- participant side ----------------------------------------------------------------------

    async def tx_prepare(self, txid: bytes, coordinator: int, plan_ops: list) -> list[int]:
        if len(txid) != 16:
            raise error(errno.EINVAL, "transaction ids are 16 bytes")
        ops.check_shapes(plan_ops)
        created = await self.store.write(ops.prepare, txid, coordinator, plan_ops)
        self.store.tx_begun(txid)
        if coordinator != self.shard:
            fault_point("participant.prepared")
        return created

    async def tx_commit(self, txid: bytes) -> bool:
        applied = await self.store.write(ops.commit, txid)
        self.store.tx_resolved(txid)
        fault_point("participant.committed")
        return applied

    async def tx_abort(self, txid: bytes) -> bool:
        dropped = await self.store.write(ops.abort, txid)
        self.store.tx_resolved(txid)
        return dropped

    async def tx_status(self, txid: bytes) -> str:
        raw = self.store.read(lambda t: t.t.get(txid, db=t.db["intent"]))
        return K.unpack(raw)["state"] if raw is not None else "unknown"

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
        if self._rename_owner == owner:
            self._rename_owner = None
            self._rename_freed.set()
            self._rename_freed = trio.Event()
            return True
        return False
