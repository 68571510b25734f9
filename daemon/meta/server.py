"""``jpfs-meta``'s RPC server: one metadata shard's handler for every method.

The methods of ``jpfs.proto.meta``, each bound to its handler here (``MetaShard.handlers``).
Reads and single-shard changes run straight on the store; changes that may span shards (mkdir
placed elsewhere, link, unlink, rmdir, rename) are planned and run by ``crossshard.py``; the
daemon's command line and startup are ``main.py``.

A shard with several copies runs one daemon per copy (``--replica J``): only the leader
answers clients (the others say "not leader", naming it); see ``replica.py``. Namespace
changes that carry a request id run once (``once.py``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import trio

from jpfs.errors import JPFSError, error
from jpfs.placement import shard_of
from jpfs.proto import meta as P
from jpfs.proto.replica import ShardPool
from jpfs.rpc import Defer, Handler, Method, Pool
from jpfs.types import ROOT_INO

from . import copies as C
from . import layout as L
from . import maintenance as M
from . import namespace as ns
from . import once
from .coordinator import Coordinator
from .crossshard import CrossShard, mine, parent_of
from .keys import Inode
from .leases import LEASE_INODES, LEASE_MAX_NAMES
from .ops import apply_local
from .replica import Replication
from .store import Store
from .txn import Locked, Txn

log = logging.getLogger(__name__)


def init_shard(t: Txn, chunk_size: int) -> int:
    """First start: record the chunk size; shard 0 makes the root directory. Returns the
    chunk size this shard's files were written with."""
    stored = t.t.get(b"chunk_size", db=t.db["state"])
    if stored is None:
        t.t.put(b"chunk_size", str(chunk_size).encode(), db=t.db["state"])
        stored = str(chunk_size).encode()
    if t.store.shard == 0 and t.inode(ROOT_INO, lock=False) is None:
        ino = t.alloc_ino()
        assert ino == ROOT_INO
        t.put_inode(Inode(ino, stat.S_IFDIR | 0o755, 2, 0, 0, 0, t.now, t.now, t.now,
                          parent=ROOT_INO))
    return int(stored)


def _lead_init(t: Txn, chunk_size: int, term: int) -> int:
    """A new leader's first entry: ``init_shard`` plus its term, so a majority holds an
    entry of this term before the leader answers anyone (see ``Replication.became_ready``)."""
    t.t.put(b"leader_term", term.to_bytes(8, "big"), db=t.db["state"])
    return init_shard(t, chunk_size)


def stored_chunk_size(t: Txn) -> int | None:
    """The chunk size this shard's files were written with (None: a brand-new copy)."""
    stored = t.t.get(b"chunk_size", db=t.db["state"])
    return int(stored) if stored is not None else None


def _unlink_here(t: Txn, parent: int, name: bytes) -> list:
    """Unlink in one transaction when the file's inode lives on this shard (the usual case:
    files are made on their directory's shard); ``Defer`` to two-phase commit otherwise."""
    ino, kind, _ = ns.lookup(t, parent, name)
    if kind == stat.S_IFDIR:
        raise error(errno.EISDIR, f"{name.decode(errors='replace')!r} is a directory")
    if shard_of(ino) != t.store.shard:
        raise Defer
    apply_local(t, [["rmdent", parent, name, ino], ["nlink", ino, -1]])
    return t.need_inode(parent).attr().to_wire()  # the directory after: post-op attributes


def _alloc_range(t: Txn, n: int) -> int:
    return t.alloc_range(n)


class MetaShard:
    """One shard's handlers for the methods of ``jpfs.proto.meta`` (see ``handlers``)."""

    def __init__(self, store: Store, peers: Pool | ShardPool, chunk_size: int,
                 repl: Replication | None = None):
        self.store = store
        self.shard = store.shard
        self.n_shards = store.n_shards
        self.peers = peers
        self.coord = Coordinator(store, peers)
        self.cross = CrossShard(store, peers, self.coord)
        """The changes that may span shards, and the rename lock."""
        self.chunk_size = chunk_size
        self.repl = repl
        """This copy's replication, the store's (None: the shard has one copy)."""
        self.leases = store.leases

    def _mine(self, ino: int) -> int:
        return mine(self.shard, ino)

    def _mine_all(self, inos: list) -> list:
        for ino in inos:
            self._mine(ino)
        return inos

    def _now(self, fn, *args):
        try:
            return self.store.read(fn, *args)
        except Locked:
            raise Defer from None

    def _read(self, fn, *extra, batch: bool = False) -> Handler:
        """A read of one shard: ``fn(txn, key, *args, *extra)`` where ``key`` (the first
        argument, an inode or a list of them) must belong to this shard. Answered inline; a
        read that meets a lock held by a cross-shard transaction waits in a task instead."""
        mine = self._mine_all if batch else self._mine
        store = self.store

        def now(key, *args):
            return self._now(fn, mine(key), *args, *extra)

        async def run(key, *args):
            return await store.view(fn, mine(key), *args, *extra)

        return Handler(run, now)

    def _write(self, method: Method, fn, *extra, run=None) -> Handler:
        """A single-shard change: ``fn(txn, key, *args, *extra)`` queued to the next group
        commit and answered once it is durable (``run`` takes over when ``fn`` defers). A
        request id (the record's last field) makes it run once (``once.once``)."""
        mine, write_later = self._mine, self.store.write_later
        fields = method._fields
        full = len(fields)
        defaults = getattr(method.request, "_field_defaults", {})

        def now(key, *args):
            if len(args) + 1 < full:  # optional fields left out: their defaults
                args = (*args, *(defaults[f] for f in fields[len(args) + 1:]))
            rid = args[-1]
            args = args[:-1]
            if rid is not None:
                return write_later(once.once, rid, fn, mine(key), *args, *extra)
            return write_later(fn, mine(key), *args, *extra)

        return Handler(run, now)

    async def lead(self, nursery: trio.Nursery) -> None:
        """This copy became the shard's leader: the first entry of its term, then what a
        shard does at start for 2PC (intents and prepared records replicated with the rest)."""
        assert self.repl is not None
        self.coord.reset()
        await self.store.write(_lead_init, self.chunk_size, self.store.term)
        await nursery.start(self.leases.start)
        self.repl.became_ready()
        await nursery.start(self.coord.resolver)
        nursery.start_soon(self.coord.orphan_checker)
        nursery.start_soon(self._prune_requests)

    async def _prune_requests(self) -> None:
        while True:
            await trio.sleep(10.0)
            try:
                await self.store.write(once.prune)
            except JPFSError as e:
                log.info("pruning request ids: %s", e.strerror)

    def handlers(self) -> dict:
        """Every method of ``jpfs.proto.meta`` bound to its handler."""
        return {**C.guarded(self._client_handlers(), self.repl), **C.replica_handlers(self)}

    def _client_handlers(self) -> dict:
        cs = self.chunk_size
        return {
            P.LOOKUP: self._read(ns.lookup),
            P.BATCH_LOOKUP: self._read(ns.batch_lookup),
            P.GETATTR: self._read(ns.getattr_),
            P.BATCH_GETATTR: self._read(ns.batch_getattr, batch=True),
            P.READDIR: self._read(ns.readdir),
            P.READLINK: self._read(ns.readlink),
            P.GETPARENT: Handler(self.getparent),
            P.STATFS: Handler(self.statfs),
            P.GETXATTR: Handler(self.getxattr),
            P.LISTXATTR: Handler(self.listxattr),
            P.CREATE: self._write(P.CREATE, ns.create),
            P.MKNOD: self._write(P.MKNOD, ns.mknod),
            P.MKDIR: Handler(self.cross.mkdir),
            P.SYMLINK: self._write(P.SYMLINK, ns.symlink),
            P.LINK: Handler(self.cross.link),
            P.UNLINK: self._write(P.UNLINK, _unlink_here, run=self.cross.unlink),
            P.RMDIR: Handler(self.cross.rmdir),
            P.RENAME: Handler(self.cross.rename),
            P.SETATTR: self._write(P.SETATTR, ns.setattr_, cs),
            P.SETXATTR: self._write(P.SETXATTR, ns.setxattr),
            P.REMOVEXATTR: self._write(P.REMOVEXATTR, ns.removexattr),
            P.GET_LAYOUT: self._read(L.get_layout, cs),
            P.BATCH_LAYOUT: self._read(L.batch_layout, cs, batch=True),
            P.LOOKUP_LAYOUTS: self._read(L.lookup_layouts, cs),
            P.WRITE_CHUNKS: self._write(P.WRITE_CHUNKS, L.write_chunks, cs),
            P.BULK_CREATE: self._write(P.BULK_CREATE, L.bulk_create, cs),
            P.TX_PREPARE: Handler(self.coord.tx_prepare),
            P.TX_COMMIT: Handler(self.coord.tx_commit),
            P.TX_ABORT: Handler(self.coord.tx_abort),
            P.TX_STATUS: Handler(self.coord.tx_status),
            P.RENAME_LOCK: Handler(self.cross.rename_lock),
            P.RENAME_UNLOCK: Handler(self.cross.rename_unlock),
            P.SCAN: Handler(self.scan),
            P.PENDING: Handler(self.pending),
            P.REPAIR: Handler(self.repair),
            P.SHARD_INFO: Handler(self.shard_info),
            P.SYNC: Handler(self.sync),
            P.LEASE: Handler(self.lease),
            P.LEASE_RETURN: Handler(self.lease_return),
            P.LEASE_WAIT: Handler(self.lease_wait),
            P.CREATE_BATCH: self._write(P.CREATE_BATCH, L.create_batch, cs),
            P.RESERVE: Handler(self.reserve),
            P.DIR_BATCH: Handler(self.cross.dir_batch),
        }

    # ---- directory write leases (leases.py)

    async def lease(self, parent: int, session: bytes) -> list:
        """Grant (or renew) ``session``'s lease on ``parent``, with the directory's names and
        a range of inode numbers; refused for directories with more than ``LEASE_MAX_NAMES``
        names, while a cross-shard change holds an entry, or while another session holds
        it."""
        self._mine(parent)
        if not self.store.leading and self.repl is not None:
            raise self.repl.not_leader()
        renew = self.leases.held.get(parent) == session
        known: tuple[list[bytes], list[int]] | None = ([], [])
        if not renew:  # a renewal needs no names
            try:
                known = self.store.read(ns.lease_grant, parent, LEASE_MAX_NAMES)
            except Locked:
                return [False, [], 0, 0, [], False]
        if known is None or not self.leases.grant(session, parent):
            return [False, [], 0, 0, [], False]
        try:
            first = await self.store.write(_alloc_range, LEASE_INODES)
        except BaseException:
            if not renew:
                self.leases.give_back(session, parent)
            raise
        return [True, known[0], first, LEASE_INODES, known[1], renew]

    async def reserve(self, n: int) -> int:
        """RESERVE: ``n`` inode numbers of this shard (at most a lease's), for the directories
        a lease holder places here (``dir_batch``); the first counter."""
        if type(n) is not int or not 0 < n <= LEASE_INODES:
            raise error(errno.EINVAL, f"reserve 1 to {LEASE_INODES} inode numbers")
        return await self.store.write(_alloc_range, n)

    async def lease_return(self, parent: int, session: bytes) -> bool:
        """LEASE_RETURN: the session gives the lease on ``parent`` back; False if it did not hold
        it."""
        return self.leases.give_back(session, self._mine(parent))

    async def lease_wait(self, session: bytes, held: list, seconds: float,
                         returned: list | None = None) -> list[int]:
        """LEASE_WAIT: the directories recalled from ``session`` (a long call, up to
        ``seconds``), once those it ``returned`` are given back."""
        for parent in returned or ():
            if type(parent) is not int:
                raise error(errno.EINVAL, "returned leases are directory inode numbers")
            self.leases.give_back(session, parent)
        return await self.leases.wait(session, held, seconds)

    # ---- reads that are not answered inline ------------------------------------------------------

    async def getattr(self, ino: int) -> list:
        """GETATTR: the inode's attributes; ENOENT, or EXDEV if the inode is another shard's."""
        return await self.store.view(ns.getattr_, self._mine(ino))

    async def lookup(self, parent: int, name: bytes) -> list:
        """LOOKUP: ``[ino, kind, attr or None]`` of ``name`` in ``parent``; ENOENT if absent."""
        return await self.store.view(ns.lookup, self._mine(parent), name)

    async def sync(self) -> int:
        """SYNC: returns once every change committed before it is durable; the groups synced."""
        return await self.store.sync()

    async def getparent(self, ino: int) -> int:
        """GETPARENT: the directory the inode was created in (for a directory: its ``..``)."""
        return await self.store.view(parent_of, self._mine(ino))

    async def statfs(self) -> P.Counts:
        """STATFS: this shard's record counts (the client sums them over shards)."""
        return await self.store.view(ns.statfs)

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        """GETXATTR: the attribute's value; ENODATA where it is not set."""
        return await self.store.view(ns.getxattr, self._mine(ino), name)

    async def listxattr(self, ino: int) -> list[bytes]:
        """LISTXATTR: the names of the inode's attributes."""
        return await self.store.view(ns.listxattr, self._mine(ino))

    # ---- changes that may span shards -----------------------------------------------------------

    # ---- maintenance ----------------------------------------------------------------------------

    async def scan(self, kind: str, after: bytes, limit: int) -> P.ScanPage:
        """SCAN (fsck, gc): a page of ``dentry``, ``inode`` or ``chunk`` records after ``after``,
        and the cursor to go on from."""
        return self.store.read(M.scan, kind, after, limit)

    async def pending(self) -> P.Pending:
        """PENDING (fsck): the cross-shard transactions in flight here, coordinated and prepared."""
        return self.store.read(M.pending)

    async def repair(self, kind: str, args: list) -> bool | int:
        """REPAIR (fsck): apply one fix of ``kind``; False when the state is no longer what fsck
        saw."""
        result = await self.store.write(M.repair, kind, args)
        if kind == "abort_tx" and result:
            self.store.tx_resolved(args[0])
        return result

    def info(self) -> P.ShardInfo:
        """The shard's counters, sizes and replication state (SHARD_INFO's record, also the
        daemon's metrics)."""
        counts = self.store.read(ns.statfs)
        line, st = C.replication_info(self.repl) if self.repl is not None else (None, None)
        return P.ShardInfo(
            shard=self.shard, shards=self.n_shards, chunk_size=self.chunk_size,
            commits=self.store.commits, ops=self.store.ops, syncs=self.store.syncs,
            syncs_inline=self.store.fsyncs.inline,
            transactions_committed=self.coord.committed,
            transactions_aborted=self.coord.aborted, inodes=counts.inodes,
            dentries=counts.dentries, chunks=counts.chunks,
            db_bytes=os.path.getsize(self.store.path / "data.mdb"), pid=os.getpid(),
            **self.leases.info(), replication=line, replication_status=st)

    async def shard_info(self) -> dict:
        """SHARD_INFO (``jpfs cluster status``): ``info()`` in wire form."""
        return self.info().to_wire()
