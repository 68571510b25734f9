"""The metadata service's maintenance answers: a shard's counts (STATFS), a page of a scan of
its records (SCAN), its pending cross-shard transactions (PENDING) and what it says of itself
(SHARD_INFO). Apart from ``meta.py``, which declares them in its method table and re-exports
them, because these are operators' views, not the namespace's wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .records import from_map
from .replica import ReplStatus


class Counts(NamedTuple):
    """``statfs``: one shard's record counts; the client sums them over shards (``total``).
    Wire: ``[inodes, dentries, chunks]``."""

    inodes: int
    dentries: int
    chunks: int

    @classmethod
    def from_wire(cls, w: list) -> Counts:
        """The counts from ``[inodes, dentries, chunks]``."""
        inodes, dentries, chunks = w
        return cls(inodes, dentries, chunks)

    @classmethod
    def total(cls, each: Sequence[Counts]) -> Counts:
        """The counts of several shards added up."""
        return cls(*(sum(c[i] for c in each) for i in range(len(cls._fields))))

    def as_dict(self) -> dict[str, int]:
        """``{"inodes", "dentries", "chunks"}`` (what ``Client.statfs`` answers)."""
        return self._asdict()


class ScanPage(NamedTuple):
    """``scan`` (fsck, gc): a page of one database's records and the cursor to go on from
    (None: the last page). Wire: ``[[item, ...], next or None]``; an item is ``[parent, name,
    ino, kind]`` (dentry), ``[ino, mode, nlink, parent, size]`` (inode) or ``[ino, index,
    blob, [node, ...]]`` (chunk)."""

    items: list[list]
    next: bytes | None

    @classmethod
    def from_wire(cls, w: list) -> ScanPage:
        """The page from ``[[item, ...], next or None]``."""
        items, nxt = w
        if type(items) is not list or (nxt is not None and type(nxt) is not bytes):
            raise TypeError("a scan page is [[item, ...], bytes or None]")
        return cls(items, nxt)


class Pending(NamedTuple):
    """``pending`` (fsck): the cross-shard transactions in flight on a shard: ``intents`` it
    coordinates, ``[txid, state]`` each, and ``prepared`` records, ``[txid, coordinator]``
    each. Wire: ``[intents, prepared]``."""

    intents: list[list]
    prepared: list[list]

    @classmethod
    def from_wire(cls, w: list) -> Pending:
        """The transactions from ``[intents, prepared]``."""
        intents, prepared = w
        return cls(intents, prepared)


class ShardInfo(NamedTuple):
    """``shard_info`` (``jpfs cluster status``, the daemon's metrics): one shard's counters,
    sizes and replication state. Wire: a map, one key per field, in this order; the last two
    only from a shard with several copies."""

    shard: int
    shards: int
    """Metadata shards in the cluster, as this one knows."""
    chunk_size: int
    commits: int
    """Group commits."""
    ops: int
    """Operations those committed."""
    syncs: int
    """fsyncs of the shard's environment."""
    syncs_inline: int
    """Of those, the ones run on the request loop (not in a worker thread)."""
    transactions_committed: int
    """Cross-shard transactions this shard coordinated to a commit."""
    transactions_aborted: int
    inodes: int
    dentries: int
    chunks: int
    db_bytes: int
    """Size of the LMDB data file."""
    pid: int
    leases: int
    """Directory write leases held."""
    lease_sessions: int
    """Sessions (mounts) holding them or waiting on recalls."""
    leases_granted: int
    leases_recalled: int
    leases_given_back: int
    leases_revoked: int
    replication: str | None = None
    """The copies in a line: who leads, and each other copy's position."""
    replication_status: ReplStatus | None = None
    """The leading copy's ``ReplStatus`` (None with one copy)."""

    @classmethod
    def from_wire(cls, w: dict) -> ShardInfo:
        """The figures from their map."""
        info = from_map(cls, w, _INFO_OPTIONAL)
        st = info.replication_status
        return info if st is None else info._replace(replication_status=ReplStatus.from_wire(st))

    def to_wire(self) -> dict:
        """The map the shard sends: without ``replication`` and ``replication_status`` when
        the shard has one copy."""
        d = self._asdict()
        st = d.pop("replication_status")
        if d["replication"] is None:
            del d["replication"]
        else:
            d["replication_status"] = st.to_wire() if st is not None else None
        return d

    def as_dict(self) -> dict:
        """The figures as JSON reports print them (the wire's map)."""
        return self.to_wire()


_INFO_OPTIONAL: dict[str, object] = {"replication": None, "replication_status": None}
