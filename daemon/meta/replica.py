"""One copy of a replicated shard: leader election on an etcd lease, log shipping, fencing.

The leader holds ``LEADER_KEY(name, shard)`` with a lease it renews every ``renew`` seconds;
its term is the key's create revision (every election makes the key anew, so terms grow). It
records each group commit as a log entry (``replog``), ships entries to every follower (one
append in flight per follower, carrying everything since the last), and answers a client's
write once a majority (itself included) has committed it (``Store.replicated``). It stops
answering, reads included, once its lease may have lapsed (``serving``: the last renewal's send
time plus the TTL, less a margin), which is before etcd can give the key to anyone else.

A follower applies entries that continue exactly from its position, rejects any from a term
older than the newest it has seen, and answers clients "not leader" with the leader's name.
When the key is gone, a copy asks the others for their positions and campaigns only if a
majority answered (itself included) and none is ahead (ties: the lowest replica index): every
acknowledged write is on a majority, majorities intersect, so the winner holds them all. A
follower whose position is not in the leader's recent history (behind the ring, or holding an
entry nobody acknowledged) gets a snapshot.
"""

from __future__ import annotations

import errno
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from jpfs.coord.clustermap import LEADER_KEY
from jpfs.coord.etcd import Etcd
from jpfs.errors import JPFSError, error
from jpfs.proto import replica as R
from jpfs.rpc import Later, Pool

from . import replog
from .renewal import Renewals
from .store import Store

log = logging.getLogger(__name__)

TTL = 5.0
"""Seconds of the leader's etcd lease: how late renewals may be before it steps down, and how
long a shard waits for a new leader after its leader dies without revoking it (a clean stop or
a restart revokes or clears it at once). 2 s stepped leaders down spuriously on loaded hosts."""
RENEW = 1.0
"""Seconds between renewals (from a thread: ``renewal.py``): five chances per lease."""
POLL = 0.5
"""Seconds between a follower's looks at the leader key (a vacancy is noticed within this)."""
SNAPSHOT_BYTES = 1 << 20
PIPELINE = 4
"""Appends in flight per follower."""
STALL = 10.0
"""Seconds a write waits for a majority before it is answered with an error."""


class Replication:
    """Replica ``replica`` of ``store``'s shard; ``addresses`` lists every copy's address.

    Built by the store's constructor (``Store(replication=...)``), which starts it as a
    follower; ``run(on_lead)`` follows or leads.
    """

    def __init__(self, store: Store, replica: int, addresses: list[str], secret: bytes,
                 etcd_endpoints: tuple[str, ...], cluster_name: str, nursery: trio.Nursery, *,
                 ttl: float = TTL, renew: float = RENEW, peer_timeout: float = 1.0,
                 stall: float = STALL):
        self.store = store
        self.shard = store.shard
        self.replica = replica
        self.addresses = list(addresses)
        self.n = len(addresses)
        self.majority = self.n // 2 + 1
        self.endpoints = etcd_endpoints
        self.cluster_name = cluster_name
        self.ttl = ttl
        self.renew = renew
        self.stall = stall
        self.peers = Pool(nursery, self.addresses, secret, role="meta", retry_for=0.0,
                          peer_timeout=peer_timeout, timeout=10.0)
        self.role = "follower"
        self.ready = False
        self.known_term = store.pos[0]
        self.leader: int | None = None
        self.leader_address: str | None = None
        self.valid_until = -math.inf
        self.log = replog.Ring(store.pos)
        """Recent entries, kept by followers too (what they applied), so a new leader can
        catch up a follower a few entries behind from memory instead of a snapshot."""
        self.ring: replog.Ring | None = None
        """``log`` while leading (shippers read it), else None."""
        self.match: dict[int, int] = {}
        self._wake = trio.Event()
        self._lead_scope: trio.CancelScope | None = None
        self._vacant_since: float | None = None
        self.elections = 0
        self.snapshots_sent = 0

    # ---- what the store and the handlers ask -------------------------------------------------

    def serving(self) -> bool:
        """Whether this copy may answer clients now: it leads, a majority holds an entry of
        its own term (``ready``), and its lease cannot have lapsed."""
        return self.ready and self.role == "leader" and trio.current_time() < self.valid_until

    def may_ack(self) -> bool:
        """Whether this copy may still acknowledge a change: it leads and its lease cannot
        have lapsed (``ready`` not needed: the acknowledgement is what makes it ready)."""
        return self.role == "leader" and trio.current_time() < self.valid_until

    def became_ready(self) -> None:
        """The first entry of this term is on a majority: start answering clients. Counting
        copies for entries of older terms alone could acknowledge one that a later election
        drops, as in Raft's figure 8: an entry of the new term on a majority rules that out."""
        self.ready = True

    def check(self) -> None:
        """Raise the not-leader error (EREMOTE, naming the leader) unless this copy serves."""
        if not self.serving():
            raise self.not_leader()

    def not_leader(self) -> JPFSError:
        """The error a client gets from a copy that does not serve: the leader it knows, if
        any, and its address, so the client goes there next."""
        leader = self.leader if self.leader != self.replica else None
        return R.not_leader(self.shard, self.replica, leader, self.leader_address
                            if leader is not None else None)

    def append(self, entry: replog.Entry) -> None:
        """A group commit of this leader (``Store._commit``): keep it and wake the shippers."""
        self.log.append(entry)
        self._wake.set()
        self._wake = trio.Event()

    def committed(self, seq: int) -> None:
        """The leader's own group commit ``seq`` is durable: it counts towards the majority."""
        self._advance()

    def _advance(self) -> None:
        if self.role != "leader":
            return
        marks = sorted([self.store.pos[1], *self.match.values()], reverse=True)
        if len(marks) >= self.majority and self.may_ack():
            self.store.replicated(marks[self.majority - 1])

    def status(self) -> R.ReplStatus:
        """This copy's replication state, for ``jpfs cluster status`` and the tests: position,
        role, the leader it knows, elections, and each follower's position when it leads."""
        term, seq = self.store.pos
        floor = self.store.resync_floor
        return R.ReplStatus(
            shard=self.shard, replica=self.replica, term=term, seq=seq,
            known_term=self.known_term, role=self.role, leader=self.leader,
            leader_address=self.leader_address, resyncing=floor is not None,
            floor=list(floor) if floor is not None else None, elections=self.elections,
            snapshots_sent=self.snapshots_sent,
            followers=dict(self.match) if self.role == "leader" else {})

    # ---- election -------------------------------------------------------------------------------

    def _key(self) -> str:
        return LEADER_KEY(self.cluster_name, self.shard)

    async def run(self, on_lead: Callable[[trio.Nursery], Awaitable[None]],
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Follow or lead until cancelled. ``on_lead(nursery)`` is awaited each time this copy
        becomes leader (the shard's 2PC recovery runs there); the nursery is cancelled when it
        stops leading."""
        etcd = Etcd(self.endpoints, timeout=max(1.0, self.ttl / 2))
        task_status.started()
        try:
            while True:
                try:
                    await self._round(etcd, on_lead)
                except JPFSError as e:
                    log.warning("shard %d replica %d: etcd: %s", self.shard, self.replica,
                                e.strerror)
                    await trio.sleep(self.renew)
                except Exception:  # a daemon lives on: logged, and the next round tries again
                    log.exception("shard %d replica %d: election round failed", self.shard,
                                  self.replica)
                    await trio.sleep(self.renew)
        finally:
            with trio.CancelScope(shield=True):
                await etcd.aclose()

    async def _round(self, etcd: Etcd, on_lead: Callable[[trio.Nursery], Awaitable[None]]
                     ) -> None:
        key = self._key()
        kv = await etcd.get(key)
        if kv is not None:
            info = json.loads(kv.value)
            if info.get("replica") == self.replica:
                # our own key from before a restart: its lease is not ours to renew
                log.info("shard %d replica %d: clearing the leader key of a previous run",
                         self.shard, self.replica)
                await etcd.delete_if(key, mod_revision=kv.mod_revision)
                return
            self._vacant_since = None
            if kv.create_revision > self.known_term:
                self.known_term = kv.create_revision
            self.leader, self.leader_address = info.get("replica"), info.get("address")
            await trio.sleep(POLL)
            return
        self.leader = self.leader_address = None
        if self._vacant_since is None:
            self._vacant_since = trio.current_time()
        if not await self._may_campaign():
            await trio.sleep(self.renew / 2)
            return
        t0 = trio.current_time()
        lease = await etcd.grant(self.ttl)
        value = json.dumps({"replica": self.replica, "address": self.addresses[self.replica],
                            "seq": self.store.pos[1]}).encode()
        if not await etcd.put_if(key, value, mod_revision=0, lease=lease):
            await etcd.revoke(lease)
            return
        kv = await etcd.get(key)
        if kv is None or kv.value != value:
            return
        term = kv.create_revision
        named = json.dumps({"replica": self.replica, "address": self.addresses[self.replica],
                            "term": term}).encode()  # what tools read: the term too
        if not await etcd.put_if(key, named, mod_revision=kv.mod_revision, lease=lease):
            return
        self.valid_until = t0 + self.ttl * 0.75
        await self._lead(etcd, lease, term, t0, on_lead)

    async def _may_campaign(self) -> bool:
        """Ask every other copy where it is: campaign only with a majority and nobody ahead."""
        mine = self.store.pos
        if self.store.resyncing:
            return False
        answers: list[R.ReplStatus] = []

        async def ask(j: int) -> None:
            try:
                answers.append(R.REPL_STATUS.decode(await self.peers.call(
                    j, R.REPL_STATUS, [self.shard], timeout=self.ttl / 2)))
            except JPFSError:
                pass

        async with trio.open_nursery() as nursery:
            for j in range(self.n):
                if j != self.replica:
                    nursery.start_soon(ask, j)
        if 1 + len(answers) < self.majority:
            return False
        # a tie goes to the lowest index, unless the seat stayed empty for long (that copy
        # may be unable to reach etcd)
        ties_count = trio.current_time() - (self._vacant_since or 0.0) < 3 * self.ttl
        for a in answers:
            if a.resyncing:  # it cannot lead, but what it held still counts
                floor = tuple(a.floor or (0, 0))
                if floor > mine:
                    return False
                continue
            theirs = (a.term, a.seq)
            if theirs > mine or (ties_count and theirs == mine and a.replica < self.replica):
                return False
        return True

    # ---- leading --------------------------------------------------------------------------------

    async def _lead(self, etcd: Etcd, lease: int, term: int, granted: float,
                    on_lead: Callable[[trio.Nursery], Awaitable[None]]) -> None:
        self.elections += 1
        self._vacant_since = None
        log.info("shard %d replica %d leads (term %d, at seq %d)", self.shard, self.replica,
                 term, self.store.pos[1])
        self.role, self.known_term, self.leader = "leader", term, self.replica
        self.leader_address = self.addresses[self.replica]
        self.store.term = term
        if self.log.last != self.store.pos:  # (cannot happen: every change passes here)
            self.log = replog.Ring(self.store.pos)
        self.ring = self.log
        self.match = {}
        self.store.leading = True
        try:
            async with trio.open_nursery() as nursery:
                self._lead_scope = nursery.cancel_scope
                nursery.start_soon(self._guard, self._keepalive, lease, granted)
                nursery.start_soon(self._guard, self._stalls)
                for j in range(self.n):
                    if j != self.replica:
                        nursery.start_soon(self._guard, self._ship, j)
                nursery.start_soon(self._guard, on_lead, nursery)
        finally:
            self._stop_leading()
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await etcd.revoke(lease)
                except JPFSError:
                    pass

    def _stop_leading(self) -> None:
        if self.role == "leader":
            log.info("shard %d replica %d stops leading (term %d)", self.shard, self.replica,
                     self.store.term)
        self.role = "follower"
        self.ready = False
        if self.leader == self.replica:
            self.leader = self.leader_address = None
        self.ring = None
        self.match = {}
        self.store.step_down(self.not_leader())
        if self._lead_scope is not None:
            self._lead_scope.cancel()

    async def _guard(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """A leader task: any failure ends the leadership (logged), never the daemon."""
        try:
            await fn(*args)
        except Exception:
            log.exception("shard %d replica %d: leader task %s failed; stepping down",
                          self.shard, self.replica, fn.__name__)
            self._stop_leading()

    async def _stalls(self) -> None:
        """Answer writes that a majority has not confirmed within ``stall`` seconds with an
        error that says so (rather than leave clients to their 60 s deadline): the copies
        are down or cut off while this leader still holds its lease."""
        seen: tuple[int, float] | None = None  # the oldest waiting group, first seen when
        while True:
            await trio.sleep(1.0)
            seq, now = self.store.waiting_since_seq(), trio.current_time()
            if seq is None or seen is None or seen[0] != seq:
                seen = (seq, now) if seq is not None else None
                continue
            if now - seen[1] < self.stall:
                continue
            seen = None
            reachable = 1 + len(self.match)
            self.store.fail_waiting(error(errno.ETIMEDOUT, (
                f"metadata shard {self.shard}: a majority of its {self.n} copies did not "
                f"confirm the change within {self.stall:.3g} s ({reachable} reachable); it may "
                "still apply once they are back: run `jpfs cluster status`")))

    async def _keepalive(self, lease: int, granted: float) -> None:
        """Renew the lease every ``renew`` seconds from a thread of its own (``Renewals``: the
        loop's request work never delays a renewal), counted from the last renewal's send
        (from ``granted``, when the grant was asked for, at first), so neither a slow election
        nor a slow answer pushes the next renewal towards the end of the lease.

        A late answer is waited for until the lease may have lapsed in etcd (the TTL from the
        send of the last renewal it confirmed); meanwhile this copy stops answering clients
        (``serving``), and a renewal that comes back resumes it: a loaded host then pauses the
        shard for a moment instead of starting an election. It steps down when etcd says the
        lease is gone, or when no renewal came back within the TTL."""
        def renewed(sent: float, left: float) -> None:
            self.valid_until = sent + min(left, self.ttl) * 0.75
            self._advance()

        renewals = Renewals(self.endpoints, lease, ttl=self.ttl, renew=self.renew,
                            granted=granted, where=f"shard {self.shard} replica {self.replica}")
        why = await renewals.run(renewed)
        log.warning("shard %d replica %d: lease %s; stepping down", self.shard, self.replica,
                    why)
        self._stop_leading()

    async def _append_call(self, j: int, prev: tuple[int, int], entries: list
                           ) -> R.Appended:
        return R.REPL_APPEND.decode(await self.peers.call(j, R.REPL_APPEND, [
            self.shard, self.store.term, self.replica, self.addresses[self.replica],
            prev[0], prev[1], [e.to_wire() for e in entries]]))

    async def _ship(self, j: int) -> None:
        """Keep follower ``j`` up to date: find where it is (an empty append from the ring's
        end), then stream entries from the ring, or send a snapshot first."""
        delay = 0.05
        while True:
            ring = self.ring
            if ring is None:
                return
            try:
                ans = await self._append_call(j, ring.last, [])
                known = (ans.term, ans.seq)
                if ans.resyncing or not ring.holds(known):
                    await self._snapshot(j)
                    continue  # where is it now? (the ring moved on meanwhile)
                self.match[j] = known[1]
                self._advance()
                await self._stream(j, known)
                delay = 0.05
            except JPFSError as e:
                if e.errno == errno.ESTALE:
                    log.warning("shard %d replica %d: %s; stepping down", self.shard,
                                self.replica, e.strerror)
                    self._stop_leading()
                    return
                log.debug("shard %d: replica %d unreachable: %s", self.shard, j, e.strerror)
                self.match.pop(j, None)
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _stream(self, j: int, start: tuple[int, int]) -> None:
        """Send follower ``j`` (at ``start``) every new entry, up to ``PIPELINE`` appends in
        flight (a follower applies them in the order they arrive, on its request loop; each
        names the position it follows, so one that does not fit is refused, never misapplied).
        An empty append every ``renew`` seconds when idle tells it the leader lives. Returns
        when the follower refuses one (the caller finds out where it is); raises what a call
        raised."""
        window = trio.Semaphore(PIPELINE)
        failure: list[JPFSError] = []
        sent = start
        async with trio.open_nursery() as nursery:

            async def one(prev: tuple[int, int], entries: list) -> None:
                try:
                    ans = await self._append_call(j, prev, entries)
                except JPFSError as e:
                    failure.append(e)
                    nursery.cancel_scope.cancel()
                    return
                finally:
                    window.release()
                if ans.ok:
                    self.match[j] = max(self.match.get(j, 0), ans.seq)
                    self._advance()
                else:
                    nursery.cancel_scope.cancel()

            while True:
                ring = self.ring
                if ring is None or not ring.holds(sent):
                    break  # the ring moved past it: the caller sends a snapshot
                entries = ring.after(sent[1])
                if not entries:
                    wake = self._wake
                    with trio.move_on_after(self.renew):
                        await wake.wait()
                    if not ring.holds(sent):
                        break
                    entries = ring.after(sent[1])
                await window.acquire()
                nursery.start_soon(one, sent, entries)
                if entries:
                    sent = (entries[-1].term, entries[-1].seq)
            nursery.cancel_scope.cancel()
        if failure:
            raise failure[0]

    async def _snapshot(self, j: int) -> tuple[int, int]:
        """Copy the whole shard to follower ``j`` from one read transaction (a consistent view
        at one position; a read transaction may stay open across awaits, writes go on)."""
        store = self.store
        head = [self.shard, store.term, self.replica, self.addresses[self.replica]]
        log.info("shard %d: sending replica %d a snapshot", self.shard, j)

        async def call(args: list) -> None:
            await self.peers.call(j, R.REPL_SNAPSHOT, args, timeout=60.0)

        with store.env.begin() as t:
            pos = replog.unpack_pos(t.get(replog.REPL_KEY, db=store.dbs["state"]))
            await call([*head, "begin", "", [], [0, 0]])
            for name, handle in store.dbs.items():
                items: list = []
                size = 0
                with t.cursor(db=handle) as cur:
                    for k, v in cur:
                        items.append([bytes(k), bytes(v)])
                        size += len(k) + len(v)
                        if size >= SNAPSHOT_BYTES:
                            await call([*head, "data", name, items, [0, 0]])
                            items, size = [], 0
                if items:
                    await call([*head, "data", name, items, [0, 0]])
            await call([*head, "end", "", [], list(pos)])
        self.snapshots_sent += 1
        return pos

    # ---- the follower's handlers ---------------------------------------------------------------

    def _hear(self, shard: int, term: int, leader: int, address: str) -> None:
        if shard != self.shard:
            raise error(errno.EXDEV, f"replication for shard {shard} sent to shard "
                                     f"{self.shard} (misrouted)")
        if term < self.known_term:
            raise error(errno.ESTALE, f"shard {self.shard} replica {self.replica}: term {term} "
                                      f"is older than term {self.known_term}")
        if self.role == "leader" and (term > self.store.term or leader != self.replica):
            self._stop_leading()
        self.known_term = term
        self.leader, self.leader_address = leader, address

    async def repl_status(self, shard: int) -> dict:
        """REPL_STATUS: this copy's :meth:`status` (``ReplStatus.to_wire()``)."""
        return self.status().to_wire()

    def _append(self, shard: int, term: int, leader: int, address: str, prev_term: int,
                prev_seq: int, entries: list) -> R.Appended:
        self._hear(shard, term, leader, address)
        store = self.store
        if self.role == "leader":
            raise error(errno.EBUSY, f"shard {self.shard} replica {self.replica} leads")
        resyncing = store.resyncing
        ok = not resyncing and store.pos == (prev_term, prev_seq)
        if ok and entries:
            store.apply_entries(entries)
            for term, seq, mutations in entries:
                self.log.append(replog.Entry(term, seq, mutations,
                                             replog.entry_size(mutations)))
        term_now, seq_now = store.pos
        return R.Appended(ok, term_now, seq_now, resyncing)

    def repl_append(self, *args: Any) -> R.Appended | Later:
        """Appends are applied on the request loop, in the order they arrive (no task per
        append); under ``--ack-after-sync`` the answer waits for the follower's fsync."""
        answer = self._append(*args)
        if self.store.ack_after_sync and args[-1]:
            later = Later()
            self.store.settle_when_synced(later, answer)
            return later
        return answer

    async def repl_snapshot(self, shard: int, term: int, leader: int, address: str, step: str,
                            db: str, items: list, pos: list[int]) -> bool:
        """REPL_SNAPSHOT from the leader, in steps: ``begin`` empties this copy, ``data``
        loads ``items`` into database ``db``, ``end`` sets the position ``pos`` and syncs."""
        self._hear(shard, term, leader, address)
        store = self.store
        if step == "begin":
            store.snapshot_begin()
            self.log = replog.Ring(store.pos)
        elif step == "data":
            if db not in store.dbs:
                raise error(errno.EINVAL, f"no database {db!r}")
            store.snapshot_data(db, items)
        elif step == "end":
            store.snapshot_end((pos[0], pos[1]))
            self.log = replog.Ring(store.pos)
            await store.sync()
            log.info("shard %d replica %d installed a snapshot at seq %d", self.shard,
                     self.replica, pos[1])
        else:
            raise error(errno.EINVAL, f"unknown snapshot step {step!r}")
        return True
