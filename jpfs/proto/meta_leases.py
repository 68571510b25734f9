"""The records of directory write leases (``daemon/meta/leases.py``,
``jpfs/client/vfs/leases.py``): a lease asked for and granted, the long call that hears
recalls, the batches a holder commits behind (files and directories) and the inode numbers it
reserves on other shards. Apart from ``meta.py``, which declares their methods and re-exports
them, so each reads at once.
"""

from __future__ import annotations

from typing import NamedTuple


class LeaseReq(NamedTuple):
    """``lease``/``lease_return``: a mount's (``session``) write lease on a directory."""

    parent: int
    session: bytes


class Lease(NamedTuple):
    """``lease``: whether it was granted and, if so, the directory's names then with their
    inodes (a renewal: none) and a range of inode numbers reserved for the holder
    (``n_inodes`` counters from ``first``), and whether it was a renewal of the session's lease
    (else granted afresh: one the session believed it held had ended meanwhile). Wire:
    ``[granted, names, first, n_inodes, inos, renewed]``."""

    granted: bool
    names: list[bytes]
    first: int
    n_inodes: int
    inos: list[int]
    renewed: bool = False

    @classmethod
    def from_wire(cls, w: list) -> Lease:
        """The answer from ``[granted, names, first, n_inodes, inos, renewed]``."""
        granted, names, first, n_inodes, inos, renewed = w
        return cls(granted, names, first, n_inodes, inos, renewed)


class LeaseWaitReq(NamedTuple):
    """``lease_wait``: a session's long call, answered with the directories recalled from it
    and those of ``held`` it does not hold (a restarted shard's, or taken back)."""

    session: bytes
    held: list[int]
    seconds: float
    returned: list[int] = []
    """Leases the session gives back (idle ones: nobody waits for them, so they ride on the
    next call instead of a ``lease_return`` each)."""


class CreateBatchReq(NamedTuple):
    """``create_batch``: files a lease holder already answered, committed behind."""

    parent: int
    session: bytes
    entries: list
    """In order: creates, ``[name, ino, mode, uid, gid, time_ns]`` (the inode number from the
    lease), with ``ctime_ns`` after it for a file renamed before it was sent, or with ``size,
    [Chunk.to_wire(), ...]`` after it for a file whose first commit goes with it; removes,
    ``[name, ino]``; renames within the directory, ``[old, new, ino, replaced or 0]``."""
    time_ns: int = 0
    """The directory's mtime and ctime after the batch, as the holder answered its changes (0:
    the shard's clock at the commit)."""
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class ReserveReq(NamedTuple):
    """``reserve``: ``n`` inode numbers of this shard for a mount's lease holder (its mkdirs
    answered from a lease on another shard's directory, placed here)."""

    n: int
