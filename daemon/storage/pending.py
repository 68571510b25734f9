"""The pending overlay: index changes of appends that are durable but not yet in LMDB.

A put appended to the active volume is durable once its bytes and record are fdatasync-ed (the
record lets a restart index it again: ``recovery.py``), so its index entries may wait in memory
and reach LMDB with the next other commit, at ``PENDING_MAX`` entries, or after
``PENDING_AGE`` seconds: one sync per put instead of three (volume, LMDB pages, LMDB meta
page). Readers (lookups, listings, stats, scrubs) look here as well as in LMDB.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import Store

PENDING_MAX = 4096
"""Pending index entries (appends synced with their records) written to LMDB at once."""
PENDING_AGE = 1.0
"""Seconds after which pending index entries are written to LMDB (also by the server's writer
when idle)."""


@dataclass
class Pending:
    """Index changes not yet in LMDB: raw values by key, for the blobs, byvol and volumes
    databases. Only the writer adds to them (single dict operations, atomic for readers in
    other threads, which iterate over copies: ``list(d.items())``); once they are in LMDB the
    writer replaces the whole object, so a reader holding the old one still finds them."""

    blobs: dict[bytes, bytes] = field(default_factory=dict)
    byvol: dict[bytes, bytes] = field(default_factory=dict)
    vols: dict[bytes, bytes] = field(default_factory=dict)
    since: float = 0.0

    def absorb(self, view: PendingView) -> None:
        """Take what an append-only commit wrote to ``view``."""
        if not self.blobs:
            self.since = time.monotonic()
        self.byvol.update(view.byvol)
        self.vols.update(view.vols)
        self.blobs.update(view.blobs)  # last: a reader that finds a blob finds its volume

    def write_to(self, txn, store: Store) -> None:
        """Put every pending change into the write transaction ``txn`` of ``store``'s index."""
        for k, v in self.blobs.items():
            txn.put(k, v, db=store.blobs)
        for k, v in self.byvol.items():
            txn.put(k, v, db=store.byvol)
        for k, v in self.vols.items():
            txn.put(k, v, db=store.vols)

    def due(self) -> bool:
        """Whether the entries are due for LMDB (``PENDING_MAX`` of them, or older than
        ``PENDING_AGE`` seconds)."""
        return bool(self.blobs) and (len(self.blobs) >= PENDING_MAX
                                     or time.monotonic() - self.since >= PENDING_AGE)


class PendingView:
    """What a put sees as its transaction in an append-only commit: LMDB (a read transaction)
    under the pending entries; what it writes is collected here."""

    def __init__(self, store: Store, rtxn, pending: Pending):
        self.store = store
        self.rtxn = rtxn
        self.pending = pending
        self.blobs: dict[bytes, bytes] = {}
        self.byvol: dict[bytes, bytes] = {}
        self.vols: dict[bytes, bytes] = {}

    def _sets(self, db) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
        st, p = self.store, self.pending
        if db is st.blobs:
            return self.blobs, p.blobs
        if db is st.byvol:
            return self.byvol, p.byvol
        if db is st.vols:
            return self.vols, p.vols
        raise AssertionError("an append-only commit touches blobs, byvol and volumes only")

    def get(self, key: bytes, db=None):
        """The value as this commit sees it: written here, then pending, then in LMDB."""
        if db is self.store.bad_db:
            return self.rtxn.get(key, db=db)
        mine, pend = self._sets(db)
        v = mine.get(key)
        if v is None:
            v = pend.get(key)
        return v if v is not None else self.rtxn.get(key, db=db)

    def put(self, key: bytes, value: bytes, db=None) -> None:
        """Collect a change (it reaches ``Pending`` once the commit's data is synced)."""
        self._sets(db)[0][key] = value

    def delete(self, key: bytes, db=None) -> bool:
        """Never called: an append-only commit deletes nothing."""
        raise AssertionError("an append-only commit deletes nothing")
