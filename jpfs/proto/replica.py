"""Metadata shard replication: the leader-to-follower methods, the "not leader" answer, and
``ShardPool``, which calls the leader of each replicated shard and follows it through a
failover.

Every copy of a shard (a *replica*) is its own daemon; one leads (it holds the shard's etcd
lease) and is the only one that answers clients. The others apply the leader's log entries
(``repl_append``) or install a snapshot of it (``repl_snapshot``), and answer any client call
with ``EREMOTE`` "not leader", naming the leader they know (``[leader J]``), so a client moves
there at once. Method ids 60-79.
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import trio

from ..errors import DeadlineError, JPFSError, Unavailable, error
from ..rpc import Method, Pool, method_table
from ..rpc.client import Refused
from .records import from_map

log = logging.getLogger(__name__)

NOT_LEADER = errno.EREMOTE
"""The errno of a "not leader" answer (``Object is remote``: the shard is served elsewhere)."""

_HINT = re.compile(r"\[leader (\d+)\]")

FAILOVER_FOR = 60.0
"""Seconds a call keeps looking for a shard's leader, and a change that met an election keeps
being retried, before it fails. A failover takes a lease TTL plus an election (seconds); this
rides out several in a row, and an etcd outage longer than a lease, the way a hard NFS mount
rides out a server restart, while a shard that is really gone still fails in bounded time."""

RETRIED_ANSWERS = frozenset({errno.EAGAIN, errno.EHOSTUNREACH, errno.ETIMEDOUT})
"""What a leader answers when a change met an election rather than failed: its own leadership
changed during a two-phase commit (EAGAIN), a participant shard had no leader (EHOSTUNREACH), or
no majority confirmed it in time (ETIMEDOUT). A change that carries a request id is sent again
on these: the first attempt either did nothing or recorded its result under the id, which the
retry then answers (``once``), so no change is made twice."""


def not_leader(shard: int, replica: int, leader: int | None, address: str | None) -> JPFSError:
    """The answer of a copy that does not lead: names the leader it knows, for the client."""
    where = (f"; the leader is replica {leader} ({address}) [leader {leader}]"
             if leader is not None else "; no leader is known yet (an election is under way)")
    return error(NOT_LEADER, f"metadata shard {shard} replica {replica} is not the "
                             f"leader{where}")


def leader_hint(e: OSError) -> int | None:
    """The leader a "not leader" answer names, if any."""
    m = _HINT.search(e.strerror or "")
    return int(m.group(1)) if m else None


# ---- request records ------------------------------------------------------------------------

class StatusReq(NamedTuple):
    """``repl_status``: this copy's position (also what a candidate asks in an election)."""

    shard: int


class AppendReq(NamedTuple):
    """``repl_append``: log entries from the leader of ``term`` (none: a heartbeat)."""

    shard: int
    term: int
    leader: int
    """The leader's replica index (followers name it in "not leader" answers)."""
    address: str
    prev_term: int
    prev_seq: int
    """The position the entries follow; the follower must be exactly there."""
    entries: list
    """``[term, seq, [[db, key, value or None], ...]]`` each, in order."""


class SnapshotReq(NamedTuple):
    """``repl_snapshot``: one step of a whole-shard copy from the leader."""

    shard: int
    term: int
    leader: int
    address: str
    step: str
    """``begin`` (drop everything), ``data`` (``db``'s ``items``), ``end`` (at ``pos``)."""
    db: str
    items: list
    """``[key, value]`` each."""
    pos: list[int]
    """``[term, seq]`` the snapshot is at (``end``)."""


class Appended(NamedTuple):
    """``repl_append``: whether the follower applied the entries (False: it is not at the
    position they follow) and where it is now. Wire: ``[ok, term, seq, resyncing]``."""

    ok: bool
    term: int
    seq: int
    resyncing: bool

    @classmethod
    def from_wire(cls, w: list) -> Appended:
        """The answer from ``[ok, term, seq, resyncing]``."""
        ok, term, seq, resyncing = w
        return cls(ok, term, seq, resyncing)


class ReplStatus(NamedTuple):
    """``repl_status``: one copy's replication state (``jpfs cluster status``, elections, the
    tests). Wire: a map, one key per field, in this order (operators read it as JSON)."""

    shard: int
    replica: int
    """This copy's index among the shard's copies."""
    term: int
    seq: int
    """The position of the last entry this copy holds."""
    known_term: int
    """The newest term this copy has heard of (a leader's etcd key revision)."""
    role: str
    """``"leader"``, ``"follower"``, or ``"single"`` for a shard of one copy."""
    leader: int | None
    """The copy it knows leads, or None (an election is under way)."""
    leader_address: str | None
    resyncing: bool
    """Installing a snapshot: it holds part of the shard and cannot lead."""
    floor: list | None
    """``[term, seq]`` it held before the snapshot began (what it acknowledged still counts in
    an election), while ``resyncing``; None otherwise."""
    elections: int
    """Elections this copy won since it started."""
    snapshots_sent: int
    """Snapshots it sent to followers (as leader)."""
    followers: dict[int, int]
    """``{copy: seq}`` of each follower in contact, when it leads; empty otherwise."""

    @classmethod
    def single(cls, shard: int, term: int, seq: int) -> ReplStatus:
        """The status of a shard with one copy: it alone holds the shard and answers."""
        return cls(shard, 0, term, seq, term, "single", 0, None, False, None, 0, 0, {})

    @classmethod
    def from_wire(cls, w: dict) -> ReplStatus:
        """The status from its map (a single copy's lacks the election figures)."""
        if type(w) is dict and "known_term" not in w:
            w = {**w, "known_term": w.get("term", 0)}
        return from_map(cls, w, _STATUS_OPTIONAL)

    def to_wire(self) -> dict:
        """The map a copy sends; a shard of one copy (``"single"``) sends only its position
        and role, having no elections or followers to tell of."""
        d = self._asdict()
        if self.role == "single":
            return {k: d[k] for k in _SINGLE_KEYS}
        return d

    def as_dict(self) -> dict:
        """The status as JSON reports print it (the wire's map)."""
        return self.to_wire()


_SINGLE_KEYS = ("shard", "replica", "term", "seq", "role", "leader", "resyncing")
_STATUS_OPTIONAL: dict[str, object] = {"leader_address": None, "floor": None, "elections": 0,
                    "snapshots_sent": 0, "followers": {}}


class ReplDigest(NamedTuple):
    """``repl_digest`` (fsck): a hash of every record of one copy and the position it is at,
    from one read transaction. Copies at the same position must have the same digest. Wire: a
    map, one key per field, in this order."""

    term: int
    seq: int
    digest: str
    """xxh3-128 (hex) over every database's hash, in name order."""
    records: int
    dbs: dict[str, list] | None
    """``{database: [records, hash]}``, so a report names the database where copies part;
    None from a daemon that predates them."""
    resyncing: bool
    """In the middle of a snapshot: it holds part of the shard, not comparable."""

    @classmethod
    def from_wire(cls, w: dict) -> ReplDigest:
        """The digest from its map."""
        return from_map(cls, w, _DIGEST_OPTIONAL)

    def to_wire(self) -> dict:
        """The map a copy sends."""
        return self._asdict()

    def as_dict(self) -> dict:
        """The digest as JSON reports print it (the wire's map)."""
        return self._asdict()


_DIGEST_OPTIONAL: dict[str, object] = {"dbs": None, "resyncing": False}


REPL_STATUS = Method(60, "repl_status", StatusReq, ReplStatus, idempotent=True)
REPL_APPEND = Method(61, "repl_append", AppendReq, Appended, inline=True)
REPL_SNAPSHOT = Method(62, "repl_snapshot", SnapshotReq, bool)
REPL_DIGEST = Method(63, "repl_digest", StatusReq, ReplDigest, idempotent=True)

METHODS = method_table(REPL_STATUS, REPL_APPEND, REPL_SNAPSHOT, REPL_DIGEST)


# ---- calling the leader ---------------------------------------------------------------------

class ShardPool:
    """Calls to the leader of each shard, any of whose copies may lead.

    ``replicas[i]`` lists the addresses of shard ``i``'s copies. A call goes to the copy last
    seen leading; on "not leader" it moves to the named leader (or the next copy), on a
    refused, closed or silent connection to the next copy, and retries within
    ``failover_for`` seconds. Calls that change the namespace carry a request id
    (``MetaClient``), so a retry after a failover answers what the first attempt did; such a
    call is also sent again, within the same bound, when the leader answers that the change met
    an election (``RETRIED_ANSWERS``). A shard whose every copy refuses the connection fails at
    once. Unreplicated shards (one copy) go straight to their ``Pool``, as before.
    """

    def __init__(self, nursery: trio.Nursery, replicas: Sequence[Sequence[str]],
                 secret: bytes, *, role: str = "meta", failover_for: float = FAILOVER_FOR,
                 attempt_timeout: float | None = None, **pool_options: Any):
        self.nursery = nursery
        self.secret = secret
        self.role = role
        self.failover_for = failover_for
        self.attempt_timeout = attempt_timeout
        """Seconds one copy is given to answer before the call moves to the next (None: the
        call's whole timeout); bounds a leader that is cut off with the connection up."""
        pool_options.setdefault("retry_for", 0.0)  # another copy is tried instead
        self.options = pool_options
        self.pools: list[Pool] = []
        self.leader: list[int] = []
        self.set_replicas(replicas)

    def __len__(self) -> int:
        return len(self.pools)

    def set_replicas(self, replicas: Sequence[Sequence[str]]) -> None:
        """Follow a new map: more shards, or copies at new addresses."""
        for i, addrs in enumerate(replicas):
            addrs = list(addrs)
            if i < len(self.pools):
                if self.pools[i].addresses != addrs:
                    self.pools[i].close()
                    self.pools[i] = Pool(self.nursery, addrs, self.secret, role=self.role,
                                         **self.options)
                    self.leader[i] = 0
            else:
                self.pools.append(Pool(self.nursery, addrs, self.secret, role=self.role,
                                       **self.options))
                self.leader.append(0)

    @property
    def addresses(self) -> list[str]:
        """The address of the copy believed to lead, per shard."""
        return [p.addresses[j] for p, j in zip(self.pools, self.leader, strict=True)]

    async def call(self, shard: int, method: Method, args: Sequence[Any], payload=(),
                   **kw: Any) -> object:
        """Call ``method`` on the leader of ``shard`` and return its answer, failing over as the
        class says. Raises EINVAL for a shard that does not exist; Refused when every copy
        refuses the connection; Unavailable when no copy answers as leader within
        ``failover_for`` seconds; an answer in ``RETRIED_ANSWERS`` to a change with a request
        id once ``failover_for`` has passed, naming the shard; any other error the leader
        answers, as it is."""
        if not 0 <= shard < len(self.pools):
            raise error(errno.EINVAL, f"no metadata shard number {shard}")
        pool = self.pools[shard]
        n = len(pool)
        if n == 1:
            return await pool.call(0, method, args, payload, **kw)
        give_up = trio.current_time() + self.failover_for
        retried = getattr(args, "rid", None) is not None
        j = self.leader[shard]
        refused: set[int] = set()
        delay = 0.02
        hops = 0
        if self.attempt_timeout is not None:
            kw["timeout"] = min(kw.get("timeout") or pool.timeout, self.attempt_timeout)
        while True:
            try:
                pool = self.pools[shard]  # a new map may have replaced it meanwhile
                n = len(pool)
                j %= n
                result = await pool.call(j, method, args, payload, **kw)
            except JPFSError as e:
                hint = None
                if isinstance(e, DeadlineError) and self.attempt_timeout is not None:
                    pass  # a leader cut off with the connection up: try another copy
                elif e.errno == NOT_LEADER:
                    hint = leader_hint(e)
                    refused.discard(j)
                elif isinstance(e, Unavailable):
                    if isinstance(e, Refused):
                        refused.add(j)
                    if len(refused) == n:
                        raise Refused(f"metadata shard {shard}: every copy refused the "
                                      f"connection (not running?): {e.strerror}") from None
                elif retried and e.errno in RETRIED_ANSWERS:
                    if trio.current_time() + delay >= give_up:
                        raise error(e.errno, f"metadata shard {shard}: {e.strerror} (still so "
                                    f"after {self.failover_for:.3g} s of retries); run `jpfs "
                                    "cluster status`") from None
                    log.debug("shard %d: %s; sending the change again", shard, e.strerror)
                    await trio.sleep(delay)
                    delay = min(delay * 2, 0.25)
                    continue  # the same copy: it answered as leader
                else:
                    raise
                if trio.current_time() + delay >= give_up:
                    raise Unavailable(f"metadata shard {shard}: no copy answered as leader "
                                      f"within {self.failover_for:.3g} s (last: "
                                      f"{e.strerror}); run `jpfs cluster status`") from None
                log.debug("shard %d copy %d: %s; trying another", shard, j, e.strerror)
                if hint is not None and hint != j and hops < n:
                    j, hops = hint, hops + 1
                    continue
                j, hops = (j + 1) % n, 0
                await trio.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
            self.leader[shard] = j
            return result

    def close(self) -> None:
        """Close every shard's pool (each copy's connections)."""
        for p in self.pools:
            p.close()
