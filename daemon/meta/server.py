"""``jpfs-meta``: one metadata shard, an LMDB environment served over TCP.

The methods of ``jpfs.proto.meta``. Reads and single-shard changes run straight on the store;
changes that may span shards (mkdir placed elsewhere, link, unlink, rmdir, rename) are *planned*
here as ops (reads of the current state, possibly on other shards) and run by the Coordinator,
which applies them in one local transaction or by two-phase commit. A plan whose expectations
went stale by the time it runs is planned again.

A shard with several copies runs one daemon per copy (``--replica J``): only the leader
answers clients (the others say "not leader", naming it); see ``replica.py``. Namespace
changes that carry a request id run once (``once.py``).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import stat
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from jpfs import config
from jpfs.errors import JPFSError, error
from jpfs.placement import new_dir_shard, shard_of
from jpfs.proto import meta as P
from jpfs.proto.meta import RENAME_EXCHANGE, RENAME_NOREPLACE, check_name
from jpfs.proto.replica import ShardPool
from jpfs.rpc import Defer, Handler, Method, Pool, Service, serve
from jpfs.types import ROOT_INO, Attr

from . import copies as C
from . import heal, once
from . import layout as L
from . import maintenance as M
from . import namespace as ns
from .coordinator import Coordinator
from .keys import Inode
from .leases import LEASE_INODES, LEASE_MAX_NAMES, Leases
from .ops import NEW, apply_local
from .replica import RENEW, STALL, TTL, Replication
from .store import SYNC_DELAY, Store
from .txn import Locked, Txn

log = logging.getLogger(__name__)

REPLAN_ATTEMPTS = 50


def _init_shard(t: Txn, chunk_size: int) -> int:
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
    """A new leader's first entry: ``_init_shard`` plus its term, so a majority holds an
    entry of this term before the leader answers anyone (see ``Replication.became_ready``)."""
    t.t.put(b"leader_term", term.to_bytes(8, "big"), db=t.db["state"])
    return _init_shard(t, chunk_size)


def _stored_chunk_size(t: Txn) -> int | None:
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


def _getparent(t: Txn, ino: int) -> int:
    return t.need_inode(ino).parent


class MetaShard:
    """One shard's handlers for the methods of ``jpfs.proto.meta`` (see ``handlers``)."""

    def __init__(self, store: Store, peers: Pool | ShardPool, chunk_size: int):
        self.store = store
        self.shard = store.shard
        self.n_shards = store.n_shards
        self.peers = peers
        self.coord = Coordinator(store, peers)
        self.chunk_size = chunk_size
        self.repl: Replication | None = None
        """This copy's replication (None: the shard has one copy)."""
        self.leases = Leases(store)
        self._local: dict[Method, Callable[..., Awaitable[Any]]] = {
            P.LOOKUP: self.lookup, P.GETATTR: self.getattr, P.GETPARENT: self.getparent,
            P.RENAME_LOCK: self.rename_lock, P.RENAME_UNLOCK: self.rename_unlock}
        """Async handlers of the methods this shard calls on itself (``_call``)."""

    def _mine(self, ino: int) -> int:
        if shard_of(ino) != self.shard:
            raise error(errno.EXDEV, f"inode {ino:#x} belongs to shard {shard_of(ino)}, "
                                     f"not {self.shard} (misrouted request)")
        return ino

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
        full = len(method._fields)

        def now(key, *args):
            if len(args) + 1 == full:
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
            P.MKDIR: Handler(self.mkdir),
            P.SYMLINK: self._write(P.SYMLINK, ns.symlink),
            P.LINK: Handler(self.link),
            P.UNLINK: self._write(P.UNLINK, _unlink_here, run=self.unlink),
            P.RMDIR: Handler(self.rmdir),
            P.RENAME: Handler(self.rename),
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
            P.RENAME_LOCK: Handler(self.rename_lock),
            P.RENAME_UNLOCK: Handler(self.rename_unlock),
            P.SCAN: Handler(self.scan),
            P.PENDING: Handler(self.pending),
            P.REPAIR: Handler(self.repair),
            P.SHARD_INFO: Handler(self.shard_info),
            P.SYNC: Handler(self.sync),
            P.LEASE: Handler(self.lease),
            P.LEASE_RETURN: Handler(self.lease_return),
            P.LEASE_WAIT: Handler(self.lease_wait),
            P.CREATE_BATCH: self._write(P.CREATE_BATCH, L.create_batch, cs),
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
                return [False, [], 0, 0, []]
        if known is None or not self.leases.grant(session, parent):
            return [False, [], 0, 0, []]
        try:
            first = await self.store.write(_alloc_range, LEASE_INODES)
        except BaseException:
            if not renew:
                self.leases.give_back(session, parent)
            raise
        return [True, known[0], first, LEASE_INODES, known[1]]

    async def lease_return(self, parent: int, session: bytes) -> bool:
        """LEASE_RETURN: the session gives the lease on ``parent`` back; False if it did not hold
        it."""
        return self.leases.give_back(session, self._mine(parent))

    async def lease_wait(self, session: bytes, held: list, seconds: float) -> list:
        """LEASE_WAIT: the directories recalled from ``session`` (a long call, up to
        ``seconds``)."""
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
        return await self.store.view(_getparent, self._mine(ino))

    async def statfs(self) -> dict:
        """STATFS: this shard's record counts (the client sums them over shards)."""
        return await self.store.view(ns.statfs)

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        """GETXATTR: the attribute's value; ENODATA where it is not set."""
        return await self.store.view(ns.getxattr, self._mine(ino), name)

    async def listxattr(self, ino: int) -> list:
        """LISTXATTR: the names of the inode's attributes."""
        return await self.store.view(ns.listxattr, self._mine(ino))

    # ---- changes that may span shards -----------------------------------------------------------

    def _recorded(self, rid: bytes | None) -> object:
        return once.MISSING if rid is None else self.store.read(once.recorded, rid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    rid: bytes | None = None) -> list:
        """MKDIR: ``[attr, parent attr]`` of the new directory; one local transaction when its inode
        goes on this shard, a cross-shard transaction otherwise. A retried request id answers what
        the first attempt did."""
        self._mine(parent)
        check_name(name)
        got = self._recorded(rid)
        if isinstance(got, dict):
            return [await self._getattr(got["created"][0]), self.store.read(ns.getattr_, parent)]
        if got is not once.MISSING:
            return got  # type: ignore[return-value]
        if new_dir_shard(parent, name, self.n_shards) == self.shard:
            # Answered once committed, as a create is (durable within one fsync; fsyncdir waits)
            if rid is not None:
                return await self.store.write(once.once, rid, ns.mkdir_local, parent, name,
                                              mode, uid, gid, durable=False)
            return await self.store.write(ns.mkdir_local, parent, name, mode, uid, gid,
                                          durable=False)

        async def plan():
            await self.store.view(ns.lookup_absent, parent, name)
            target = new_dir_shard(parent, name, self.n_shards)
            return {
                target: [["mkinode", stat.S_IFDIR | (mode & 0o7777), uid, gid, parent, None]],
                self.shard: [["mkdent", parent, name, NEW, stat.S_IFDIR, None],
                             ["subdirs", parent, 1]],
            }

        made: dict[int, list] = {}
        created = await self._run(plan, rid, made)
        # made elsewhere: as its prepare answered (asking would wait for the commit there);
        # with the parent's attributes after it (here: a read, no call)
        return [made.get(created[0]) or await self._getattr(created[0]),
                self.store.read(ns.getattr_, parent)]

    async def link(self, ino: int, parent: int, name: bytes, rid: bytes | None = None) -> list:
        """LINK: a new name for ``ino`` in ``parent`` (the inode's shard counts the link); the
        inode's attributes. EPERM for a directory, EEXIST if the name is taken."""
        self._mine(parent)
        check_name(name)
        if self._recorded(rid) is not once.MISSING:
            return await self._getattr(ino)

        async def plan():
            attr = Attr.from_wire(await self._getattr(ino))
            # Linux's order: the new name's errors (ENOTDIR, EEXIST) before EPERM
            await self.store.view(ns.lookup_absent, parent, name)
            if attr.is_dir:
                raise error(errno.EPERM, "cannot hard-link a directory")
            return _merge(
                (self.shard, ["mkdent", parent, name, ino, stat.S_IFMT(attr.mode), None]),
                (shard_of(ino), ["nlink", ino, 1]),
            )

        await self._run(plan, rid)
        return await self._getattr(ino)

    async def unlink(self, parent: int, name: bytes, rid: bytes | None = None) -> list:
        """The general case (the inode on another shard): planned, and run by 2PC if needed."""
        self._mine(parent)
        if self._recorded(rid) is not once.MISSING:
            return self.store.read(ns.getattr_, parent)

        async def plan():
            ino, kind, _ = await self.store.view(ns.lookup, parent, name)
            if kind == stat.S_IFDIR:
                raise error(errno.EISDIR, f"{name.decode(errors='replace')!r} is a directory")
            return _merge((self.shard, ["rmdent", parent, name, ino]),
                          (shard_of(ino), ["nlink", ino, -1]))

        await self._run(plan, rid)
        return self.store.read(ns.getattr_, parent)

    async def rmdir(self, parent: int, name: bytes, rid: bytes | None = None) -> list:
        """RMDIR: remove the empty directory ``name``; the parent's attributes after. ENOTDIR,
        ENOTEMPTY as rmdir(2)."""
        self._mine(parent)
        if self._recorded(rid) is not once.MISSING:
            return self.store.read(ns.getattr_, parent)

        async def plan():
            ino, kind, _ = await self.store.view(ns.lookup, parent, name)
            if kind != stat.S_IFDIR:
                raise error(errno.ENOTDIR, f"{name.decode(errors='replace')!r} is not a directory")
            return _merge((self.shard, ["rmdent", parent, name, ino]),
                          (self.shard, ["subdirs", parent, -1]),
                          (shard_of(ino), ["rmdir", ino]))

        await self._run(plan, rid)
        return self.store.read(ns.getattr_, parent)

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int, rid: bytes | None = None, session: bytes | None = None
                     ) -> list:
        """``session``: the mount's lease session; a rename within a directory it holds the
        lease of goes ahead without recalling it."""
        self._mine(src_parent)
        check_name(src_name)
        check_name(dst_name)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
                RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise error(errno.EINVAL, "invalid rename flags")
        if session is not None and type(session) is not bytes:
            raise error(errno.EINVAL, "a lease session is bytes")
        owner = None
        try:
            if self._recorded(rid) is not once.MISSING:
                return [self.store.read(ns.getattr_, p) if shard_of(p) == self.shard else None
                        for p in (src_parent, dst_parent)]
            src_ino, src_kind, _ = await self.store.view(ns.lookup, src_parent, src_name)
            moves_dir = src_kind == stat.S_IFDIR or bool(flags & RENAME_EXCHANGE)
            if moves_dir and src_parent != dst_parent:
                owner = os.urandom(16)
                await self._rename_lock(owner)
            await self._run(lambda: self._plan_rename(src_parent, src_name, dst_parent, dst_name,
                                                      flags), rid, None, session)
        finally:
            if owner is not None:
                with trio.CancelScope(shield=True):
                    await self._call(0, P.RENAME_UNLOCK, [owner])
        # post-op attributes of the directories this shard holds (the other one: None)
        return [self.store.read(ns.getattr_, p) if shard_of(p) == self.shard else None
                for p in (src_parent, dst_parent)]

    async def _plan_rename(self, sp: int, sn: bytes, dp: int, dn: bytes, flags: int):
        src_ino, src_kind, _ = await self.store.view(ns.lookup, sp, sn)
        try:
            dst_ino, dst_kind, _ = await self._call(shard_of(dp), P.LOOKUP, [dp, dn])
        except JPFSError as e:
            if e.errno != errno.ENOENT:
                raise
            dst_ino = dst_kind = None
            await self._call(shard_of(dp), P.GETATTR, [dp])  # the target directory must exist
        if (sp, sn) == (dp, dn) or dst_ino == src_ino:
            return {}  # POSIX: renaming a file onto itself (or a link to it) does nothing
        exchange = bool(flags & RENAME_EXCHANGE)
        if flags & RENAME_NOREPLACE and dst_ino is not None:
            raise error(errno.EEXIST, f"{dn.decode(errors='replace')!r} exists")
        if exchange and dst_ino is None:
            raise error(errno.ENOENT, f"{dn.decode(errors='replace')!r} does not exist")
        src_dir, dst_dir = src_kind == stat.S_IFDIR, dst_kind == stat.S_IFDIR
        if dst_ino is not None and not exchange:
            if src_dir and not dst_dir:
                raise error(errno.ENOTDIR, "cannot replace a non-directory with a directory")
            if dst_dir and not src_dir:
                raise error(errno.EISDIR, "cannot replace a directory with a non-directory")
        if sp != dp:
            if src_dir:
                await self._check_not_within(dp, src_ino)
            if exchange and dst_dir:
                await self._check_not_within(sp, dst_ino)
        sh_sp, sh_dp = shard_of(sp), shard_of(dp)
        parts: list[tuple[int, list]] = []
        if exchange:
            parts.append((sh_sp, ["mkdent", sp, sn, dst_ino, dst_kind, src_ino]))
        else:
            parts.append((sh_sp, ["rmdent", sp, sn, src_ino]))
        parts.append((sh_dp, ["mkdent", dp, dn, src_ino, src_kind, dst_ino]))
        parts.append((shard_of(src_ino), ["ctime", src_ino]))  # as Linux: a rename is a change
        if exchange:
            parts.append((shard_of(dst_ino), ["ctime", dst_ino]))
        if sp != dp:
            if src_dir:
                parts += [(sh_sp, ["subdirs", sp, -1]), (sh_dp, ["subdirs", dp, 1]),
                          (shard_of(src_ino), ["setparent", src_ino, dp])]
            if exchange and dst_dir:
                parts += [(sh_dp, ["subdirs", dp, -1]), (sh_sp, ["subdirs", sp, 1]),
                          (shard_of(dst_ino), ["setparent", dst_ino, sp])]
        if dst_ino is not None and not exchange:
            if dst_dir:
                parts += [(shard_of(dst_ino), ["rmdir", dst_ino]), (sh_dp, ["subdirs", dp, -1])]
            else:
                parts.append((shard_of(dst_ino), ["nlink", dst_ino, -1]))
        return _merge(*parts)

    async def _check_not_within(self, target_parent: int, moved_dir: int) -> None:
        """EINVAL if ``target_parent`` is ``moved_dir`` or below it (a loop)."""
        cur, seen = target_parent, 0
        while True:
            if cur == moved_dir:
                raise error(errno.EINVAL, "cannot move a directory into itself")
            if cur == ROOT_INO:
                return
            cur = await self._call(shard_of(cur), P.GETPARENT, [cur])
            seen += 1
            if seen > 10_000:
                raise error(errno.ELOOP, "directory ancestry too deep (corrupt parent links?)")

    async def _rename_lock(self, owner: bytes) -> None:
        await self._call(0, P.RENAME_LOCK, [owner, 30.0])

    async def _run(self, planner, rid: bytes | None = None,
                   made: dict[int, list] | None = None, holder: bytes | None = None
                   ) -> list[int]:
        """Plan and run; plan again when the namespace changed under the plan. ``rid``: the
        request id recorded with the change (see ``once``); ``made``, ``holder``: see
        ``Coordinator.run``."""
        for attempt in range(REPLAN_ATTEMPTS):
            plan = await planner()
            if not plan:
                return []
            try:
                return await self.coord.run(plan, rid, made, holder)
            except JPFSError as e:
                if e.errno != errno.ESTALE:
                    raise
                log.debug("plan went stale (%s); planning again", e.strerror)
                await trio.sleep(random.uniform(0, 0.001 * attempt))  # apart, not in step
        raise error(errno.EAGAIN, "the namespace kept changing under this operation; try again")

    async def _getattr(self, ino: int) -> list:
        return await self._call(shard_of(ino), P.GETATTR, [ino])

    async def _call(self, shard: int, method: Method, args: list):
        """Call ``method`` on ``shard``, answered in its wire form: straight to this shard's
        async handler when it is this one."""
        if shard == self.shard:
            return await self._local[method](*args)
        return await self.peers.call(shard, method, args)

    # ---- cross-shard transactions ---------------------------------------------------------------

    async def rename_lock(self, owner: bytes, ttl: float) -> bool:
        """RENAME_LOCK: take the directory-move lock for ``owner`` for ``ttl`` seconds (waits while
        another holds it); EXDEV on any shard but 0."""
        if self.shard != 0:
            raise error(errno.EXDEV, "the rename lock lives on shard 0")
        return await self.coord.rename_lock(owner, ttl)

    async def rename_unlock(self, owner: bytes) -> bool:
        """RENAME_UNLOCK: free the directory-move lock if ``owner`` holds it; EXDEV on any shard but
        0."""
        if self.shard != 0:
            raise error(errno.EXDEV, "the rename lock lives on shard 0")
        return await self.coord.rename_unlock(owner)

    # ---- maintenance ----------------------------------------------------------------------------

    async def scan(self, kind: str, after: bytes, limit: int) -> list:
        """SCAN (fsck, gc): a page of ``dentry``, ``inode`` or ``chunk`` records after ``after``,
        and the cursor to go on from."""
        return self.store.read(M.scan, kind, after, limit)

    async def pending(self) -> dict:
        """PENDING (fsck): the cross-shard transactions in flight here, coordinated and prepared."""
        return self.store.read(M.pending)

    async def repair(self, kind: str, args: list) -> object:
        """REPAIR (fsck): apply one fix of ``kind``; False when the state is no longer what fsck
        saw."""
        result = await self.store.write(M.repair, kind, args)
        if kind == "abort_tx" and result:
            self.store.tx_resolved(args[0])
        return result

    async def shard_info(self) -> dict:
        """SHARD_INFO (``jpfs cluster status``): the shard's counters, sizes and replication
        state."""
        counts = self.store.read(ns.statfs)
        return {"shard": self.shard, "shards": self.n_shards, "chunk_size": self.chunk_size,
                "commits": self.store.commits, "ops": self.store.ops,
                "syncs": self.store.syncs,
                "syncs_inline": self.store.fsyncs.inline,
                "transactions_committed": self.coord.committed,
                "transactions_aborted": self.coord.aborted, **counts,
                "db_bytes": os.path.getsize(self.store.path / "data.mdb"), "pid": os.getpid(),
                **self.leases.info(),
                **(C.replication_info(self.repl) if self.repl is not None else {})}



def _merge(*parts: tuple[int, list]) -> dict[int, list[list]]:
    plan: dict[int, list[list]] = {}
    for shard, op in parts:
        plan.setdefault(shard, []).append(op)
    return plan


COUNTERS = frozenset({"commits", "ops", "transactions_committed", "transactions_aborted",
                      "leases_granted", "leases_recalled", "leases_given_back", "leases_revoked"})
"""shard_info keys that only grow (Prometheus counters); the rest are gauges."""


async def run_shard(cluster: config.Cluster, index: int, data, host: str, port: int, *,
                    replica: int = 0, sync: bool = True, ack_after_sync: bool = False,
                    sync_delay: float = SYNC_DELAY, metrics: str | None = None,
                    heal_options: dict | None = None,
                    ttl: float = TTL, renew: float = RENEW, stall: float = STALL,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Open shard ``index`` (copy ``replica``) and serve it until cancelled;
    ``task_status.started(port)``. ``metrics``: HOST:PORT for Prometheus. A shard with
    several copies elects a leader on etcd (lease ``ttl``, renewed every ``renew`` s)."""
    copies = cluster.meta_replicas[index]
    replicated = len(copies) > 1
    etcd = tuple(cluster.etcd)
    if replicated and not etcd:
        raise SystemExit(f"metadata shard {index} has {len(copies)} copies but the cluster "
                         "names no etcd (replication elects its leader there): add "
                         '[cluster] etcd = ["http://HOST:PORT"]')
    store = Store(data, index, cluster.n_shards, sync=sync, ack_after_sync=ack_after_sync,
                  sync_delay=sync_delay)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.committer)
            peers = C.shard_peers(nursery, cluster)
            if not replicated:
                chunk_size = await store.write(_init_shard, cluster.chunk_size)
                shard = MetaShard(store, peers, chunk_size)
                await nursery.start(shard.coord.resolver)
                nursery.start_soon(shard.coord.orphan_checker)
                await nursery.start(shard.leases.start)
            else:
                if store.created and replica != 0:
                    store.mark_new_copy()
                stored = store.read(_stored_chunk_size)
                shard = MetaShard(store, peers, stored or cluster.chunk_size)
                shard.repl = Replication(
                    store, replica, [s.address for s in copies], cluster.secret, etcd,
                    cluster.name, nursery, on_lead=shard.lead, ttl=ttl, renew=renew, stall=stall,
                    peer_timeout=min(cluster.peer_timeout, ttl / 2))
            healer = heal.Healer(store, cluster, **(heal_options or {}))  # leads only: heal.py
            await nursery.start(healer.run)
            service = Service("meta", P.METHODS, {**shard.handlers(), **healer.handlers()})
            bound = await nursery.start(serve, service, host, port, cluster.secret)
            if shard.repl is not None:
                await nursery.start(shard.repl.run)
            if etcd:
                nursery.start_soon(C.follow_map, cluster, shard)
            if metrics:
                from ..metrics import serve_metrics

                serve_metrics(metrics, "meta", index, service,
                              healer.with_metrics(shard.shard_info), COUNTERS | heal.COUNTERS)
            log.info("meta shard %d of %d (copy %d of %d) serving %s on port %d", index,
                     cluster.n_shards, replica, len(copies), data, bound)
            task_status.started(bound)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> None:
    """``jpfs-meta``: serve one metadata shard (or one copy of it) until SIGTERM or SIGINT."""
    from .. import common

    p = common.parser("meta", "Serve one metadata shard of a JPFS cluster (LMDB over TCP).")
    p.add_argument("--no-sync", action="store_true",
                   help="do not fsync commits (faster; loses recent changes on power failure)")
    p.add_argument("--ack-after-sync", action="store_true",
                   help="answer single-shard changes only once they are fsynced (default: once "
                   "committed, durable within one fsync; clients call sync for fsync(2))")
    p.add_argument("--sync-delay", type=float, default=SYNC_DELAY, metavar="SECONDS",
                   help="how long an fsync that no client waits for may wait for more changes "
                   "to cover (default %(default)s; a power failure can lose this much more of "
                   "the changes already answered; 0: fsync after every commit)")
    p.add_argument("--replica", type=int, default=0,
                   help="which copy of the shard this is (0-based; shards with several copies "
                   "elect a leader on etcd)")
    p.add_argument("--lease-ttl", type=float, default=TTL,
                   help="seconds of the leader's etcd lease (default %(default)s)")
    p.add_argument("--lease-renew", type=float, default=RENEW,
                   help="seconds between lease renewals (default %(default)s)")
    p.add_argument("--stall-timeout", type=float, default=STALL,
                   help="seconds a write waits for a majority of the copies before it is "
                   "answered with an error (default %(default)s)")
    heal.add_arguments(p)
    args = p.parse_args(argv)
    common.setup_logging(args.log_level, args.log_file)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per etcd request otherwise
    cluster, data, host, port = common.resolve(args, "meta")
    copies = cluster.meta_replicas[args.index]
    if not 0 <= args.replica < len(copies):
        raise SystemExit(f"jpfs-meta: --replica {args.replica} but shard {args.index} has "
                         f"{len(copies)} copies")
    if args.replica and not args.listen:
        host, port = config.parse_address(copies[args.replica].address)
    if args.replica and not args.data:
        data = cluster.data_dir("meta", args.index, args.replica)

    async def serve_shard() -> None:
        await run_shard(cluster, args.index, data, host, port, replica=args.replica,
                        sync=not args.no_sync, ack_after_sync=args.ack_after_sync,
                        sync_delay=args.sync_delay,
                        metrics=common.metrics_address(args, cluster, "meta"),
                        heal_options=heal.options(args), ttl=args.lease_ttl,
                        renew=args.lease_renew, stall=args.stall_timeout)

    common.run(args, serve_shard)


if __name__ == "__main__":
    main(sys.argv[1:])
