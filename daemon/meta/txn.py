"""What a shard's operations see of a transaction: record helpers, lock and lease checks.

Every operation (``namespace.py``, ``layout.py``, ``ops.py``, ...) is a function
``fn(txn, *args)`` run by the store (``store.py``) in a read view or a group commit; the
``Txn`` it gets reads and writes the shard's records (inodes, directory entries, counters) and
raises ``Locked`` where a prepared cross-shard transaction holds what it touches, so readers
never see half of a cross-shard change.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

import lmdb

from jpfs.errors import error
from jpfs.placement import COUNTER_MASK, make_ino

from . import keys as K
from . import replog
from .keys import Inode

if TYPE_CHECKING:
    from .store import Store


class Locked(Exception):
    """Raised inside an operation that touched a key held by transaction ``txid``."""

    def __init__(self, txid: bytes):
        super().__init__(txid.hex())
        self.txid = txid


class Txn:
    """An LMDB transaction with the shard's record helpers. Operations take one of these."""

    __slots__ = ("t", "store", "now", "db", "holder")

    def __init__(self, t: lmdb.Transaction | replog.Recorder, store: Store, now: int):
        self.t: Any = t
        self.store = store
        self.now = now
        self.db = store.dbs
        self.holder: bytes | None = None
        """The lease session making this change (its own leases do not stop it)."""

    # ---- locks
    def check_lock(self, key: bytes) -> None:
        """Raise ``Locked`` if a prepared cross-shard transaction holds lock ``key`` (the caller
        waits for it to resolve and tries again)."""
        txid = self.t.get(key, db=self.db["lock"])
        if txid is not None:
            raise Locked(bytes(txid))

    def check_lease(self, parent: int, holder: bytes | None = None) -> None:
        """Raise ``Leased`` (and recall the lease) if a change of ``parent``'s names must wait
        for a mount's lease on it (``leases.py``); ``holder``: the session making it."""
        leases = self.store.leases
        if leases.held:
            leases.check(parent, holder if holder is not None else self.holder)

    def lease_new_dir(self, ino: int, holder: bytes) -> None:
        """Lease directory ``ino``, made by this transaction for a lease holder, to it from
        birth (in memory, as every lease: if the transaction does not commit, a lease on a
        directory nobody can name is left until the session ends, harmless)."""
        self.store.leases.grant(holder, ino)

    def end_lease(self, ino: int, holder: bytes) -> None:
        """Directory ``ino``, removed by this transaction for ``holder``, is no longer leased to
        it (in memory: if the transaction does not commit, the directory is left unleased,
        and the holder's batch reports its removal failed)."""
        self.store.leases.give_back(holder, ino)

    def check_dir_lock(self, parent: int) -> None:
        """Wait-worthy if any entry of ``parent`` is held (readdir)."""
        prefix = K.lock_dir(parent)
        with self.t.cursor(db=self.db["lock"]) as cur:
            if cur.set_range(prefix) and bytes(cur.key()).startswith(prefix):
                raise Locked(bytes(cur.value()))

    # ---- inodes
    def inode(self, ino: int, *, lock: bool = True) -> Inode | None:
        """The record of ``ino``, or None; ``Locked`` while a prepared transaction holds the inode
        (unless ``lock`` is off)."""
        if lock:
            self.check_lock(K.lock_inode(ino))
        data = self.t.get(K.ino_key(ino), db=self.db["inode"])
        return Inode.decode(ino, data) if data is not None else None

    def need_inode(self, ino: int, what: str = "inode") -> Inode:
        """The record of ``ino``; ENOENT (naming ``what``) if there is none."""
        node = self.inode(ino)
        if node is None:
            raise error(errno.ENOENT, f"no such {what} {ino:#x}")
        return node

    def need_dir(self, ino: int) -> Inode:
        """The record of directory ``ino``; ENOENT if there is none, ENOTDIR if it is no
        directory."""
        node = self.need_inode(ino, "directory")
        if not node.mode & 0o170000 == 0o040000:
            raise error(errno.ENOTDIR, f"inode {ino:#x} is not a directory")
        return node

    def put_inode(self, node: Inode) -> None:
        """Write the inode's record."""
        self.t.put(K.ino_key(node.ino), node.encode(), db=self.db["inode"])

    def delete_inode(self, ino: int) -> None:
        """Remove an inode with its chunks and xattrs (the blobs are reclaimed by gc)."""
        self.t.delete(K.ino_key(ino), db=self.db["inode"])
        prefix = K.ino_key(ino)
        for dbname in ("chunk", "xattr"):
            with self.t.cursor(db=self.db[dbname]) as cur:
                if cur.set_range(prefix):
                    while bytes(cur.key()).startswith(prefix):
                        if not cur.delete():
                            break

    def alloc_ino(self) -> int:
        """A new inode id on this shard (the shard's counter, bumped in this transaction); ENOSPC
        once the counter is used up."""
        counter = int.from_bytes(self.t.get(b"next", b"\0" * 8, db=self.db["state"]), "big")
        if counter >= COUNTER_MASK:
            raise error(errno.ENOSPC, "this shard has used all its inode numbers")
        self.t.put(b"next", (counter + 1).to_bytes(8, "big"), db=self.db["state"])
        return make_ino(self.store.shard, counter)

    def alloc_range(self, n: int) -> int:
        """Reserve ``n`` inode numbers (a lease's, made later by ``create_batch``): the first
        counter of the range."""
        counter = self.next_counter()
        if counter + n > COUNTER_MASK:
            raise error(errno.ENOSPC, "this shard has used all its inode numbers")
        self.t.put(b"next", (counter + n).to_bytes(8, "big"), db=self.db["state"])
        return counter

    def next_counter(self) -> int:
        """The counter the next inode number allocated here will take."""
        return int.from_bytes(self.t.get(b"next", b"\0" * 8, db=self.db["state"]), "big")

    # ---- directory entries
    def dentry(self, parent: int, name: bytes, *, lock: bool = True) -> tuple[int, int] | None:
        """``(ino, kind)`` of entry ``name`` in ``parent``, or None; ``Locked`` while a prepared
        transaction holds the entry (unless ``lock`` is off)."""
        if lock:
            self.check_lock(K.lock_dentry(parent, name))
        v = self.t.get(K.dentry_key(parent, name), db=self.db["dentry"])
        return K.split_dentry_value(v) if v is not None else None

    def put_dentry(self, parent: int, name: bytes, ino: int, kind: int) -> None:
        """Write entry ``name`` in ``parent`` pointing at ``ino`` (``kind``: its file type bits)."""
        self.t.put(K.dentry_key(parent, name), K.dentry_value(ino, kind), db=self.db["dentry"])

    def delete_dentry(self, parent: int, name: bytes) -> None:
        """Delete entry ``name`` from ``parent`` (nothing happens if it is absent)."""
        self.t.delete(K.dentry_key(parent, name), db=self.db["dentry"])

    def dir_is_empty(self, ino: int) -> bool:
        """Whether directory ``ino`` has no entries."""
        prefix = K.dentry_prefix(ino)
        with self.t.cursor(db=self.db["dentry"]) as cur:
            return not (cur.set_range(prefix) and bytes(cur.key()).startswith(prefix))
