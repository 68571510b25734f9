"""The replication log of one shard: what a group commit changed, as physical mutations.

A replicated shard's leader records every change its write transactions make (``Recorder``
wraps the LMDB transaction and its cursors: ``put``, ``delete``, ``replace``, ``pop`` and a
cursor's ``put``/``delete``), so a group commit becomes one log entry ``(term, seq,
[(db, key, value or None), ...])`` that followers apply byte for byte in one transaction. The
records of a nested operation count only if it commits (``Recorder.child``). Nothing here knows
about the network; ``replica.py`` ships entries and ``store.py`` commits them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lmdb
import xxhash

from jpfs.proto.replica import ReplDigest

REPL_KEY = b"repl"
"""``state`` key of the last applied ``(term, seq)`` (16 bytes, big-endian)."""
RESYNC_KEY = b"resyncing"
"""``state`` key present while a snapshot is being installed (the data is incomplete)."""

Mutation = tuple[str, bytes, bytes | None]


def pack_pos(term: int, seq: int) -> bytes:
    """A replication position as 16 bytes (term, seq; big-endian, so positions sort as keys)."""
    return term.to_bytes(8, "big") + seq.to_bytes(8, "big")


def unpack_pos(raw: bytes | memoryview | None) -> tuple[int, int]:
    """``(term, seq)`` from ``pack_pos`` bytes; ``(0, 0)`` for None (nothing replicated yet)."""
    if raw is None:
        return 0, 0
    raw = bytes(raw)
    return int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:16], "big")


_UNRECORDED = frozenset({"drop", "putmulti"})
"""Changes the recorder does not capture (nothing in a shard's operations uses them)."""


class _Cursor:
    """A cursor whose changes are recorded (reads pass straight through)."""

    __slots__ = ("_c", "_rec", "_db")

    def __init__(self, cur: lmdb.Cursor, rec: list[Mutation], db: str):
        self._c = cur
        self._rec = rec
        self._db = db

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._c.close()

    def __iter__(self) -> Iterator:
        return iter(self._c)

    def __getattr__(self, name: str) -> Any:
        if name in _UNRECORDED:
            raise NotImplementedError(f"cursor.{name} inside a replicated write is not "
                                      "recorded: use put/delete")
        return getattr(self._c, name)

    def delete(self, dupdata: bool = False) -> bool:
        key = bytes(self._c.key())
        done = self._c.delete(dupdata)
        if done:
            self._rec.append((self._db, key, None))
        return done

    def put(self, key: bytes, value: bytes, **kw: Any) -> bool:
        done = self._c.put(key, value, **kw)
        if done:
            self._rec.append((self._db, bytes(key), bytes(value)))
        return done

    def replace(self, key: bytes, value: bytes) -> Any:
        old = self._c.replace(key, value)
        self._rec.append((self._db, bytes(key), bytes(value)))
        return old

    def pop(self, key: bytes) -> Any:
        old = self._c.pop(key)
        if old is not None:
            self._rec.append((self._db, bytes(key), None))
        return old


class Recorder:
    """An ``lmdb.Transaction`` stand-in that records its changes into ``rec``.

    ``names`` maps each database handle to its name (what travels in an entry).
    """

    __slots__ = ("_t", "rec", "_names")

    def __init__(self, t: lmdb.Transaction, names: dict[Any, str]):
        self._t = t
        self.rec: list[Mutation] = []
        self._names = names

    def __getattr__(self, name: str) -> Any:
        if name in _UNRECORDED:
            raise NotImplementedError(f"{name} inside a replicated write is not recorded: "
                                      "use put/delete")
        return getattr(self._t, name)

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        """The value of ``key`` (reads are not recorded)."""
        return self._t.get(key, default, db=db)

    def put(self, key: bytes, value: bytes, *, db: Any = None, **kw: Any) -> bool:
        """Store ``value`` and record the change if it was made (as ``lmdb.Transaction.put``)."""
        done = self._t.put(key, value, db=db, **kw)
        if done:
            self.rec.append((self._names[db], bytes(key), bytes(value)))
        return done

    def replace(self, key: bytes, value: bytes, db: Any = None) -> Any:
        """Store ``value``, recorded; the old value (as ``lmdb.Transaction.replace``)."""
        old = self._t.replace(key, value, db=db)
        self.rec.append((self._names[db], bytes(key), bytes(value)))
        return old

    def pop(self, key: bytes, db: Any = None) -> Any:
        """Delete ``key``, recorded if it existed; the old value (as ``lmdb.Transaction.pop``)."""
        old = self._t.pop(key, db=db)
        if old is not None:
            self.rec.append((self._names[db], bytes(key), None))
        return old

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> bool:
        """Delete ``key``, recorded if it existed; whether it did (as
        ``lmdb.Transaction.delete``)."""
        done = self._t.delete(key, value, db=db)
        if done:
            self.rec.append((self._names[db], bytes(key), None))
        return done

    def cursor(self, db: Any = None) -> _Cursor:
        """A cursor over ``db`` whose changes are recorded too."""
        return _Cursor(self._t.cursor(db=db), self.rec, self._names[db])


def apply(t: lmdb.Transaction, dbs: dict[str, Any], mutations: list) -> None:
    """Apply an entry's mutations in ``t`` (a follower's commit)."""
    for db, key, value in mutations:
        handle = dbs[db]
        if value is None:
            t.delete(key, db=handle)
        else:
            t.put(key, value, db=handle)


@dataclass(frozen=True)
class Entry:
    """One group commit: its term, its position and what it changed."""

    term: int
    seq: int
    mutations: list
    size: int

    def to_wire(self) -> list:
        """The entry as ``repl_append`` sends it: ``[term, seq, mutations]``."""
        return [self.term, self.seq, self.mutations]  # msgpack sends tuples as arrays


def entry_size(mutations: list) -> int:
    """Bytes an entry of ``mutations`` counts for in the ring (keys, values, 16 each for
    overhead)."""
    return sum(len(k) + (len(v) if v is not None else 0) + 16 for _, k, v in mutations)


class Ring:
    """The leader's recent entries, bounded in count and bytes, with the position just before
    the oldest (``base``): a follower at any position in ``base`` or the ring can be caught up
    from memory; any other needs a snapshot."""

    def __init__(self, base: tuple[int, int], *, max_entries: int = 8192,
                 max_bytes: int = 64 << 20):
        self.base = base
        self.entries: deque[Entry] = deque()
        self.bytes = 0
        self.max_entries = max_entries
        self.max_bytes = max_bytes

    @property
    def last(self) -> tuple[int, int]:
        """The position of the newest entry (``base`` when the ring is empty)."""
        if self.entries:
            e = self.entries[-1]
            return e.term, e.seq
        return self.base

    def append(self, entry: Entry) -> None:
        """Add the newest entry, dropping the oldest (and moving ``base``) past either bound."""
        self.entries.append(entry)
        self.bytes += entry.size
        while self.entries and (len(self.entries) > self.max_entries
                                or self.bytes > self.max_bytes):
            old = self.entries.popleft()
            self.bytes -= old.size
            self.base = (old.term, old.seq)

    def holds(self, pos: tuple[int, int]) -> bool:
        """Whether ``pos`` is a position of this leader's history that the ring can continue."""
        if tuple(pos) == self.base:
            return True
        first = self.base[1] + 1
        i = pos[1] - first
        return 0 <= i < len(self.entries) and self.entries[i].term == pos[0]

    def after(self, seq: int, *, max_bytes: int = 4 << 20, max_entries: int = 512
              ) -> list[Entry]:
        """Entries after ``seq`` (which ``holds`` said is known), bounded per message."""
        first = self.base[1] + 1
        if seq + 1 < first:
            raise LookupError(f"seq {seq} is behind the ring")
        out: list[Entry] = []
        size = 0
        i = seq + 1 - first
        while i < len(self.entries) and len(out) < max_entries:
            e = self.entries[i]
            if out and size + e.size > max_bytes:
                break
            out.append(e)
            size += e.size
            i += 1
        return out


def digest(env: lmdb.Environment, dbs: dict[str, Any]) -> ReplDigest:
    """A hash of every record of one copy and the position it is at, from one read
    transaction (run it in a worker thread: it reads the whole shard). Copies at the same
    position must have the same digest (``jpfs fsck`` compares them); ``dbs`` holds each
    database's count and hash, so a report can name the database where copies part. A copy
    in the middle of a snapshot (``resyncing``) holds part of the shard: not comparable."""
    whole = xxhash.xxh3_128()
    records = 0
    per_db: dict[str, list] = {}
    with env.begin() as t:
        pos = unpack_pos(t.get(REPL_KEY, db=dbs["state"]))
        resyncing = t.get(RESYNC_KEY, db=dbs["state"]) is not None
        for name in sorted(dbs):
            h = xxhash.xxh3_128()
            n = 0
            for k, v in t.cursor(db=dbs[name]):
                h.update(b"%d:" % len(k))
                h.update(k)
                h.update(b"%d:" % len(v))
                h.update(v)
                n += 1
            per_db[name] = [n, h.hexdigest()]
            whole.update(b"%s:%s;" % (name.encode(), per_db[name][1].encode()))
            records += n
    return ReplDigest(term=pos[0], seq=pos[1], digest=whole.hexdigest(), records=records,
                      dbs=per_db, resyncing=resyncing)

