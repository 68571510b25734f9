"""The namespace changes that may span shards: mkdir placed on another shard, link, unlink of
a file whose inode lives elsewhere, rmdir, rename; and the directory-move lock of shard 0.

Each is *planned* here as ops (reads of the current state, possibly on other shards) and run by
the ``Coordinator``, which applies them in one local transaction or by two-phase commit; a plan
whose expectations went stale by the time it runs is planned again. Kept apart from
``server.py`` (which binds every method to its handler) so that each reads at once: this is the
part that talks to other shards.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from jpfs.errors import JPFSError, errno_name, error
from jpfs.placement import MAX_SHARDS, new_dir_shard, shard_of
from jpfs.proto import meta as P
from jpfs.proto.meta import RENAME_EXCHANGE, RENAME_NOREPLACE, check_name
from jpfs.proto.replica import ShardPool
from jpfs.rpc import Method, Pool
from jpfs.types import ROOT_INO, Attr

from . import namespace as ns
from . import once
from .coordinator import Coordinator
from .ops import NEW
from .store import Store
from .txn import Txn

log = logging.getLogger(__name__)

REPLAN_ATTEMPTS = 50
MAX_DIR_BATCH = 4096
"""Entries one ``dir_batch`` carries at most."""


def mine(shard: int, ino: int) -> int:
    """``ino``, checked to belong to ``shard``: EXDEV for a request sent to the wrong one."""
    if shard_of(ino) != shard:
        raise error(errno.EXDEV, f"inode {ino:#x} belongs to shard {shard_of(ino)}, "
                                 f"not {shard} (misrouted request)")
    return ino


def parent_of(t: Txn, ino: int) -> int:
    """GETPARENT's read: the directory the inode was created in (a directory's ``..``)."""
    return t.need_inode(ino).parent


class CrossShard:
    """One shard's handlers of the changes that may span shards (MKDIR, LINK, the general
    UNLINK, RMDIR, RENAME) and of the rename lock (RENAME_LOCK, RENAME_UNLOCK on shard 0)."""

    def __init__(self, store: Store, peers: Pool | ShardPool, coord: Coordinator):
        self.store = store
        self.shard = store.shard
        self.peers = peers
        self.coord = coord
        self._local: dict[Method, Callable[..., Awaitable[Any]]] = {
            P.LOOKUP: self._lookup, P.GETATTR: self._getattr_here,
            P.GETPARENT: self._getparent, P.RENAME_LOCK: self.rename_lock,
            P.RENAME_UNLOCK: self.rename_unlock}
        """Async handlers of the methods this shard calls on itself (``_call``)."""

    async def _lookup(self, parent: int, name: bytes) -> list:
        return await self.store.view(ns.lookup, parent, name)

    async def _getattr_here(self, ino: int) -> list:
        return await self.store.view(ns.getattr_, ino)

    async def _getparent(self, ino: int) -> int:
        return await self.store.view(parent_of, ino)

    def _recorded(self, rid: bytes | None) -> object:
        return once.MISSING if rid is None else self.store.read(once.recorded, rid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    rid: bytes | None = None) -> list:
        """MKDIR: ``[attr, parent attr]`` of the new directory; one local transaction when its inode
        goes on this shard, a cross-shard transaction otherwise. A retried request id answers what
        the first attempt did."""
        mine(self.shard, parent)
        check_name(name)
        got = self._recorded(rid)
        if isinstance(got, dict):
            return [await self._getattr(got["created"][0]), self.store.read(ns.getattr_, parent)]
        if got is not once.MISSING:
            return got  # type: ignore[return-value]
        if new_dir_shard(parent, name, self.store.n_shards) == self.shard:
            # Answered once committed, as a create is (durable within one fsync; fsyncdir waits)
            if rid is not None:
                return await self.store.write(once.once, rid, ns.mkdir_local, parent, name,
                                              mode, uid, gid, durable=False)
            return await self.store.write(ns.mkdir_local, parent, name, mode, uid, gid,
                                          durable=False)

        async def plan():
            await self.store.view(ns.lookup_absent, parent, name)
            target = new_dir_shard(parent, name, self.store.n_shards)
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

    async def dir_batch(self, parent: int, session: bytes, entries: list, time_ns: int = 0,
                        rid: bytes | None = None) -> list:
        """DIR_BATCH: directory changes a mount holding ``parent``'s lease already answered,
        of directories placed on other shards, in one cross-shard transaction: new ones
        (``[name, ino, mode, uid, gid, time_ns]``, ``ino`` reserved there by ``reserve``: their
        inodes there, their entries and the parent's link count here) and removed ones
        (``[name, ino]``, empty, their leases the mount's: their inodes there, their entries
        here). Per entry a new directory's attributes, for a removed one the parent's after,
        or an errno name (EEXIST: the name was taken while the lease was lost). A retry finds
        what an earlier attempt did and answers the same; a directory found not empty fails
        the batch whole, as does an inode number never reserved, and nothing of it is done.
        The parent's mtime and ctime become ``time_ns`` (0: the decision's time)."""
        mine(self.shard, parent)
        if not isinstance(entries, list) or len(entries) > MAX_DIR_BATCH:
            raise error(errno.E2BIG, f"at most {MAX_DIR_BATCH} entries per dir_batch")
        results: list = [None] * len(entries)

        def checked(t: Txn) -> dict[int, list[list]]:
            t.need_dir(parent)
            t.check_lease(parent, session)
            plan: dict[int, list[list]] = {}
            here: list[list] = []
            subdirs = 0
            seen: set[bytes] = set()
            for i, e in enumerate(entries):
                try:
                    name, ino, mode, uid, gid = _dir_entry(e, self.shard)
                    if name in seen:
                        raise error(errno.EINVAL, "one change per name in a batch")
                except OSError as err:
                    results[i] = errno_name(err.errno)
                    continue
                seen.add(name)
                d = t.dentry(parent, name)
                if mode is None:  # a removed directory
                    results[i] = _REMOVED
                    if d is None:
                        continue  # removed by an earlier attempt
                    if d[0] != ino or d[1] != stat.S_IFDIR:
                        results[i] = "ENOENT" if d[0] != ino else "ENOTDIR"
                        continue
                    plan.setdefault(shard_of(ino), []).append(["rmdir", ino])
                    here.append(["rmdent", parent, name, ino])
                    subdirs -= 1
                    continue
                if d is not None:  # made by an earlier attempt, or taken
                    results[i] = ino if d[0] == ino else "EEXIST"
                    continue
                plan.setdefault(shard_of(ino), []).append(
                    ["mkinode", mode, uid, gid, parent, None, ino])
                here.append(["mkdent", parent, name, ino, stat.S_IFDIR, None])
                subdirs += 1
                results[i] = ino
            if here:
                plan[self.shard] = [*here, ["subdirs", parent, subdirs]]
                if time_ns > 0:
                    plan[self.shard].append(["times", parent, time_ns])
            return plan

        async def planner():
            return await self.store.view(checked)

        made: dict[int, list] = {}
        await self._run(planner, None, made, session)  # a failure fails them all
        after = self.store.read(ns.getattr_, parent)
        return [after if r is _REMOVED else await self._made_dir(made, r) if type(r) is int
                else r for r in results]

    async def _made_dir(self, made: dict[int, list], ino: int) -> list | str:
        try:
            return made.get(ino) or await self._getattr(ino)
        except JPFSError as e:
            return errno_name(e.errno)

    async def link(self, ino: int, parent: int, name: bytes, rid: bytes | None = None) -> list:
        """LINK: a new name for ``ino`` in ``parent`` (the inode's shard counts the link); the
        inode's attributes. EPERM for a directory, EEXIST if the name is taken."""
        mine(self.shard, parent)
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
        mine(self.shard, parent)
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

    async def rmdir(self, parent: int, name: bytes, rid: bytes | None = None,
                    session: bytes | None = None) -> list:
        """RMDIR: remove the empty directory ``name``; the parent's attributes after. ENOTDIR,
        ENOTEMPTY as rmdir(2). ``session``: the mount's lease session (its leases do not stop
        it)."""
        mine(self.shard, parent)
        if session is not None and type(session) is not bytes:
            raise error(errno.EINVAL, "a lease session is bytes")
        if self._recorded(rid) is not once.MISSING:
            return self.store.read(ns.getattr_, parent)

        async def plan():
            ino, kind, _ = await self.store.view(ns.lookup, parent, name)
            if kind != stat.S_IFDIR:
                raise error(errno.ENOTDIR, f"{name.decode(errors='replace')!r} is not a directory")
            return _merge((self.shard, ["rmdent", parent, name, ino]),
                          (self.shard, ["subdirs", parent, -1]),
                          (shard_of(ino), ["rmdir", ino]))

        await self._run(plan, rid, None, session)
        return self.store.read(ns.getattr_, parent)

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int, rid: bytes | None = None, session: bytes | None = None
                     ) -> list:
        """``session``: the mount's lease session; a rename within a directory it holds the
        lease of goes ahead without recalling it."""
        mine(self.shard, src_parent)
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


_REMOVED = object()
"""A ``dir_batch`` result: the parent's attributes after the batch."""


def _dir_entry(e: object, shard: int) -> tuple[bytes, int, int | None, int, int]:
    """(name, ino, mode, uid, gid) of a ``dir_batch`` entry (mode None: a removal); EINVAL
    unless it is well formed and names a directory placed on another shard than ``shard``."""
    if isinstance(e, list) and len(e) == 2 and type(e[1]) is int:
        name, ino = e
        check_name(name)
        if not 0 <= shard_of(ino) < MAX_SHARDS or shard_of(ino) == shard:
            raise error(errno.EINVAL, f"inode {ino:#x} is not another shard's")
        return name, ino, None, 0, 0
    if not isinstance(e, list) or len(e) != 6 or not all(
            type(v) is int for v in e[1:]):
        raise error(errno.EINVAL, "malformed entry")
    name, ino, mode, uid, gid, _time_ns = e
    check_name(name)
    if stat.S_IFMT(mode) != stat.S_IFDIR or mode & ~(stat.S_IFDIR | 0o7777) or not (
            0 <= uid < 1 << 32 and 0 <= gid < 1 << 32):
        raise error(errno.EINVAL, "a batched mkdir makes a directory")
    if not 0 <= shard_of(ino) < MAX_SHARDS or shard_of(ino) == shard:
        raise error(errno.EINVAL, f"inode {ino:#x} is not another shard's")
    return name, ino, mode, uid, gid


def _merge(*parts: tuple[int, list]) -> dict[int, list[list]]:
    plan: dict[int, list[list]] = {}
    for shard, op in parts:
        plan.setdefault(shard, []).append(op)
    return plan
