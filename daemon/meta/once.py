"""Request ids: a namespace change retried after a failover answers what it did the first time.

A client of a replicated shard sends a 16-byte id with every namespace change: its clock in ns
(8 bytes, big-endian) then 8 random bytes. The change records ``id -> result`` in the
``request`` database *in its own transaction* (a cross-shard change: in the coordinator's
commit decision), so the record replicates with the change: a retry that reaches the next
leader finds it and answers the recorded result instead of applying the change twice. Ids
begin with a time so the leader prunes the oldest with one cursor walk from the start.
"""

from __future__ import annotations

from collections.abc import Callable

from jpfs.rpc.service import Defer

from . import keys as K
from .txn import Txn

KEEP_NS = 120 * 10**9
"""How long a request id is remembered (a retry comes within a failover: seconds)."""
MISSING = object()


def recorded(t: Txn, rid: bytes) -> object:
    """The recorded result of request ``rid``, or ``MISSING``."""
    raw = t.t.get(rid, db=t.db["request"])
    return K.unpack(raw) if raw is not None else MISSING


def record(t: Txn, rid: bytes, result: object) -> None:
    """Record ``result`` as the answer to request ``rid``, in the change's own transaction ``t``."""
    t.t.put(rid, K.pack(result), db=t.db["request"])


def once(t: Txn, rid: bytes, fn: Callable, *args: object) -> object:
    """``fn(t, *args)`` unless request ``rid`` ran already (then its recorded result)."""
    got = recorded(t, rid)
    if got is not MISSING:
        if isinstance(got, dict) and "created" in got:
            # recorded by the planned path (``fn`` deferred to it the first time): that
            # handler rebuilds its answer from the record; the raw record is no answer
            raise Defer
        return got
    result = fn(t, *args)
    record(t, rid, result)
    return result


def prune(t: Txn, limit: int = 20_000) -> int:
    """Delete up to ``limit`` ids older than ``KEEP_NS``; the number deleted."""
    cutoff = (t.now - KEEP_NS).to_bytes(8, "big")
    old: list[bytes] = []
    with t.t.cursor(db=t.db["request"]) as cur:
        ok = cur.first()
        while ok and len(old) < limit and bytes(cur.key()[:8]) < cutoff:
            old.append(bytes(cur.key()))
            ok = cur.next()
    for k in old:
        t.t.delete(k, db=t.db["request"])
    return len(old)
