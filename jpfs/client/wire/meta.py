"""Inode-level metadata calls, routed to the right shard by ``jpfs.placement``.

Every call goes to exactly the shard that owns what it names (a directory's shard for entries, an
inode's shard for attributes), so no lookup service sits in the way. Batch calls are split by
shard and sent in parallel.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Sequence

import trio

from ...config import Cluster
from ...errors import ProtocolError, from_name
from ...placement import shard_of
from ...proto import meta as P
from ...proto.heal import HEAL_KICK, HEAL_STATUS, HealNoArgs, HealStatus
from ...proto.replica import REPL_STATUS, ReplStatus, ShardPool, StatusReq
from ...rpc import Method, Pool
from ...types import Attr, DirEntry, Layout


class MetaClient:
    """Async access to every metadata shard of a cluster.

    ``pool_options`` go to the ``Pool``; ``peer_timeout`` (how long a shard that does not answer
    is given) defaults to the cluster file's. A shard that refuses the connection fails the
    call at once, with an error naming the shard. A shard with several copies is called at
    its leader, through a failover (``ShardPool``).
    """

    def __init__(self, nursery: trio.Nursery, cluster: Cluster, **pool_options):
        self.cluster = cluster
        self.n_shards = cluster.n_shards
        pool_options.setdefault("peer_timeout", cluster.peer_timeout)
        self.pool: Pool | ShardPool
        self.replicated = any(len(r) > 1 for r in _replicas(cluster))
        """Whether any shard has several copies: calls then go to each shard's leader and
        namespace changes carry a request id (a retry after a failover is answered once)."""
        if self.replicated:
            self.pool = ShardPool(nursery, [[s.address for s in r] for r in _replicas(cluster)],
                                  cluster.secret, **pool_options)
        else:
            self.pool = Pool(nursery, [s.address for s in cluster.meta], cluster.secret,
                             role="meta", **pool_options)
        self._nursery = nursery
        self._pool_options = pool_options

    def follow(self, cluster: Cluster) -> None:
        """Follow a new cluster map (``MapFollower``): more shards, or copies elsewhere."""
        self.cluster = cluster
        self.n_shards = cluster.n_shards
        reps = [[s.address for s in r] for r in _replicas(cluster)]
        if isinstance(self.pool, ShardPool):
            self.pool.set_replicas(reps)
        elif all(len(r) == 1 for r in reps):
            self.pool.set_addresses([r[0] for r in reps])
        else:  # copies were added to a cluster that had none
            self.pool.close()
            self.pool = ShardPool(self._nursery, reps, cluster.secret, **self._pool_options)
            self.replicated = True

    def _rid(self) -> bytes | None:
        """A request id for a namespace change: the time (so shards prune the oldest first)
        and 8 random bytes; None where no shard is replicated."""
        if not self.replicated:
            return None
        return time.time_ns().to_bytes(8, "big") + os.urandom(8)


    async def call(self, shard: int, method: str, *args, **kw):
        """Call any method by name and get its answer in wire form (for tools: fsck, gc,
        status); the typed calls below decode answers with the method's response record."""
        return await self.pool.call(shard, P.METHODS[method], list(args), **kw)

    async def _ask(self, shard: int, method: Method, req: tuple):
        """Call ``method`` and decode its answer with its response record.

        The hottest calls (getattr, lookup and create) inline this: a coroutine frame is ~2%
        of a call.
        """
        return method.decode(await self.pool.call(shard, method, req))

    async def _grouped(self, method: Method, inos: Sequence[int]) -> list:
        """Call a batch ``method`` once per shard, in parallel; answers in ``inos`` order."""
        by_shard: dict[int, list[int]] = {}
        for i, ino in enumerate(inos):
            by_shard.setdefault(shard_of(ino), []).append(i)
        out: list = [None] * len(inos)

        async def one(shard: int, idx: list[int]) -> None:
            got = await self._ask(shard, method, P.InosReq([inos[i] for i in idx]))
            if len(got) != len(idx):
                raise ProtocolError(f"{method.name}: {len(got)} answers for {len(idx)} inodes")
            for i, v in zip(idx, got, strict=True):
                out[i] = v

        if len(by_shard) == 1:
            (shard, idx), = by_shard.items()
            await one(shard, idx)
        else:
            async with trio.open_nursery() as nursery:
                for shard, idx in by_shard.items():
                    nursery.start_soon(one, shard, idx)
        return out

    # ---- reads
    async def lookup(self, parent: int, name: bytes) -> Attr:
        """Attributes of ``name`` in directory ``parent`` (a second call when the inode lives on
        another shard); ENOENT if there is no such entry."""
        m = P.LOOKUP
        e = m.decode(await self.pool.call(shard_of(parent), m, P.NameReq(parent, name)))
        return e.attr if e.attr is not None else await self.getattr(e.ino)

    async def batch_lookup(self, parent: int, names: Sequence[bytes]) -> list[Attr | OSError]:
        """Attributes for each name in ``parent`` (an OSError in place of a missing one)."""
        got = await self._ask(shard_of(parent), P.BATCH_LOOKUP, P.NamesReq(parent, list(names)))
        remote = [r.ino for r in got if type(r) is P.Entry and r.attr is None]
        remote_attrs = dict(zip(remote, await self.batch_getattr(remote), strict=True)) \
            if remote else {}
        out: list[Attr | OSError] = []
        for r in got:
            if type(r) is not P.Entry:
                out.append(r)
            elif r.attr is not None:
                out.append(r.attr)
            else:
                a = remote_attrs.get(r.ino)
                out.append(a if a is not None else from_name("ENOENT"))
        return out

    async def getattr(self, ino: int) -> Attr:
        """Attributes of inode ``ino``; ENOENT if it does not exist."""
        m = P.GETATTR
        return m.decode(await self.pool.call(shard_of(ino), m, P.InoReq(ino)))

    async def batch_getattr(self, inos: Sequence[int]) -> list[Attr | None]:
        """Attributes of many inodes, one call per shard in parallel; None where one does not
        exist."""
        return await self._grouped(P.BATCH_GETATTR, inos)

    async def readdir(self, parent: int, *, plus: bool = True, page: int = 1000,
                      after: bytes = b"") -> AsyncGenerator[DirEntry, None]:
        """Entries of ``parent`` in name order, a page per call; with ``plus`` each carries its
        attributes (entries whose inode lives elsewhere are filled by one batch per page)."""
        shard = shard_of(parent)
        while True:
            batch, more = await self._ask(shard, P.READDIR,
                                          P.ReaddirReq(parent, after, page, plus))
            if plus:
                missing = [e.ino for e in batch if e.attr is None]
                if missing:
                    attrs = dict(zip(missing, await self.batch_getattr(missing), strict=True))
                    batch = [e if e.attr is not None else DirEntry(e.name, e.ino, e.kind,
                                                                     attrs.get(e.ino))
                             for e in batch]
            for e in batch:
                yield e
            if not more or not batch:
                return
            after = batch[-1].name

    async def readlink(self, ino: int) -> bytes:
        """The target of symlink ``ino``."""
        return await self._ask(shard_of(ino), P.READLINK, P.InoReq(ino))

    async def counts(self) -> P.Counts:
        """The record counts summed over every shard."""
        return P.Counts.total([await self._ask(shard, P.STATFS, P.NoArgs())
                               for shard in range(self.n_shards)])

    async def statfs(self) -> dict:
        """Filesystem counts summed over every shard (``Counts.as_dict()``: inodes, ...)."""
        return (await self.counts()).as_dict()

    async def sync(self, shards=None) -> None:
        """Return once every change these shards (all by default) answered is durable: what
        fsync(2) and unmount wait for (changes are answered once committed, durable within
        one fsync of the shard's)."""
        todo = range(self.n_shards) if shards is None else sorted(set(shards))

        async def one(shard: int) -> None:
            await self._ask(shard, P.SYNC, P.NoArgs())

        async with trio.open_nursery() as nursery:
            for shard in todo:
                nursery.start_soon(one, shard)

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        """The value of extended attribute ``name``; ENODATA where it is not set."""
        return await self._ask(shard_of(ino), P.GETXATTR, P.XattrReq(ino, name))

    async def listxattr(self, ino: int) -> list[bytes]:
        """The names of the inode's extended attributes."""
        return await self._ask(shard_of(ino), P.LISTXATTR, P.InoReq(ino))

    async def get_layout(self, ino: int) -> Layout:
        """The file's attributes and chunks; ENOENT if the inode does not exist."""
        return await self._ask(shard_of(ino), P.GET_LAYOUT, P.InoReq(ino))

    async def batch_layout(self, inos: Sequence[int]) -> list[Layout | None]:
        """Layouts of many inodes, one call per shard in parallel; None for a missing inode or a
        directory."""
        return await self._grouped(P.BATCH_LAYOUT, inos)

    async def lookup_layouts(self, parent: int, names: Sequence[bytes]
                             ) -> list[Layout | OSError | tuple[int, int]]:
        """Layouts of files in ``parent`` by name, in one call: a Layout, an OSError, or
        (ino, kind) where another call is needed (a symlink, an inode on another shard)."""
        return await self._ask(shard_of(parent), P.LOOKUP_LAYOUTS,
                               P.NamesReq(parent, list(names)))

    # ---- maintenance (fsck, gc, scrub)
    async def scan(self, shard: int, kind: str, after: bytes = b"", limit: int = 5000
                   ) -> P.ScanPage:
        """A page of ``shard``'s ``dentry``, ``inode`` or ``chunk`` records after ``after``."""
        return await self._ask(shard, P.SCAN, P.ScanReq(kind, after, limit))

    async def pending(self, shard: int) -> P.Pending:
        """The cross-shard transactions in flight on ``shard``."""
        return await self._ask(shard, P.PENDING, P.NoArgs())

    async def repair(self, shard: int, kind: str, args: list) -> bool | int:
        """Apply one fsck fix of ``kind`` on ``shard``; False when the state is no longer what
        fsck saw (``make_dir``: the directory's ino)."""
        return await self._ask(shard, P.REPAIR, P.RepairReq(kind, args))

    # ---- status (jpfs cluster status, node list, healing, tests)
    async def shard_info(self, shard: int, **kw) -> P.ShardInfo:
        """``shard``'s counters, sizes and replication state (its leader answers); ``kw``:
        the call's ``timeout``, ``retry_for``."""
        m = P.SHARD_INFO
        return m.decode(await self.pool.call(shard, m, P.NoArgs(), **kw))

    async def repl_status(self, shard: int, **kw) -> ReplStatus:
        """The replication state of the copy of ``shard`` that answers (its leader)."""
        m = REPL_STATUS
        return m.decode(await self.pool.call(shard, m, StatusReq(shard), **kw))

    async def heal_status(self, shard: int, **kw) -> HealStatus:
        """``shard``'s healer: its state and the counts of its last round."""
        m = HEAL_STATUS
        return m.decode(await self.pool.call(shard, m, HealNoArgs(), **kw))

    async def heal_kick(self, shard: int, **kw) -> HealStatus:
        """Ask ``shard``'s healer for a round now; its status."""
        m = HEAL_KICK
        return m.decode(await self.pool.call(shard, m, HealNoArgs(), **kw))

    # ---- changes
    async def create(self, parent: int, name: bytes, mode: int, uid: int | None = None,
                     gid: int | None = None, exclusive: bool = True) -> tuple[Attr, bool]:
        """Make (or, without ``exclusive``, open the existing) file ``name`` in ``parent``; its
        attributes and whether this call made it. EEXIST if it exists and ``exclusive``. Owner:
        ``uid``/``gid``, this process's by default."""
        m = P.CREATE
        c = m.decode(await self.pool.call(
            shard_of(parent), m, P.CreateReq(parent, name, mode, _uid(uid), _gid(gid), exclusive,
                                         self._rid())))
        return (c.attr if c.attr is not None else await self.getattr(c.ino)), c.created

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int = 0,
                    uid: int | None = None, gid: int | None = None) -> Attr:
        """A new node of any type but directory and symlink (EEXIST if the name is taken)."""
        c = await self._ask(shard_of(parent), P.MKNOD,
                            P.MknodReq(parent, name, mode, _uid(uid), _gid(gid), rdev, self._rid()))
        return c.attr if c.attr is not None else await self.getattr(c.ino)

    async def mkdir(self, parent: int, name: bytes, mode: int = 0o755, uid: int | None = None,
                    gid: int | None = None) -> P.Made:
        """Make directory ``name`` in ``parent``; its attributes and the parent's after (EEXIST if
        the name is taken)."""
        return await self._ask(shard_of(parent), P.MKDIR,
                               P.MkdirReq(parent, name, mode, _uid(uid), _gid(gid), self._rid()))

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int | None = None,
                      gid: int | None = None) -> Attr:
        """Make symlink ``name`` in ``parent`` pointing at ``target``; its attributes (EEXIST if the
        name is taken)."""
        return await self._ask(shard_of(parent), P.SYMLINK,
                               P.SymlinkReq(parent, name, target, _uid(uid), _gid(gid),
                                             self._rid()))

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        """Give inode ``ino`` the new name ``name`` in ``parent``; its attributes after (nlink
        up)."""
        return await self._ask(shard_of(parent), P.LINK, P.LinkReq(ino, parent, name, self._rid()))

    async def unlink(self, parent: int, name: bytes) -> Attr | None:
        """Remove a non-directory; returns the directory's attributes after it (None when the
        shard does not say)."""
        got = await self._ask(shard_of(parent), P.UNLINK, P.RemoveReq(parent, name, self._rid()))
        return got.parent

    async def rmdir(self, parent: int, name: bytes, session: bytes | None = None
                    ) -> Attr | None:
        """Remove an empty directory; returns the parent's attributes after it. ``session``: a
        mount's lease session (its leases do not stop the rmdir)."""
        got = await self._ask(shard_of(parent), P.RMDIR,
                              P.RmdirReq(parent, name, self._rid(), session))
        return got.parent

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int = 0, session: bytes | None = None
                     ) -> tuple[Attr | None, Attr | None]:
        """Rename as ``rename(2)``; returns both directories' attributes after it (None where
        unknown). ``session``: a mount's lease session (its leases do not stop the rename)."""
        got = await self._ask(shard_of(src_parent), P.RENAME,
                              P.RenameReq(src_parent, src_name, dst_parent, dst_name, flags,
                                           self._rid(), session))
        return got.src, got.dst

    async def setattr(self, ino: int, **fields: int) -> Attr:
        """Change some of ``mode``, ``uid``, ``gid``, ``size``, ``atime_ns``, ``mtime_ns``,
        ``ctime_ns``; the attributes after."""
        return await self._ask(shard_of(ino), P.SETATTR, P.SetattrReq(ino, fields, self._rid()))

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """Set extended attribute ``name`` (``flags``: XATTR_CREATE, XATTR_REPLACE, as
        setxattr(2))."""
        await self._ask(shard_of(ino), P.SETXATTR,
                        P.SetxattrReq(ino, name, value, flags, self._rid()))

    async def removexattr(self, ino: int, name: bytes) -> None:
        """Remove extended attribute ``name``; ENODATA where it is not set."""
        await self._ask(shard_of(ino), P.REMOVEXATTR, P.RemoveXattrReq(ino, name, self._rid()))

    async def write_chunks(self, ino: int, chunks: list, size: int,
                           expect_version: int | None = None) -> Attr:
        """Point file ``ino`` at stored chunks and set its size (a write's commit); the attributes
        after. ESTALE unless the file is still at ``expect_version`` (None: any version)."""
        return await self._ask(shard_of(ino), P.WRITE_CHUNKS, P.WriteChunksReq(
            ino, [c.to_wire() for c in chunks], size, expect_version, self._rid()))

    async def bulk_create(self, parent: int, entries: list, replace: bool = False) -> list:
        """Create files with content in one transaction: Attr or OSError per entry."""
        return await self._ask(shard_of(parent), P.BULK_CREATE,
                               P.BulkCreateReq(parent, entries, replace, self._rid()))

    # ---- directory write leases (jpfs/client/leases.py)

    async def lease(self, parent: int, session: bytes) -> P.Lease:
        """Ask for the write lease on directory ``parent`` for mount ``session`` (the answer says
        whether it was granted, with the names and inode numbers it comes with)."""
        return await self._ask(shard_of(parent), P.LEASE, P.LeaseReq(parent, session))

    async def lease_return(self, parent: int, session: bytes) -> bool:
        """Give the lease on ``parent`` back; False if ``session`` did not hold it."""
        return await self._ask(shard_of(parent), P.LEASE_RETURN, P.LeaseReq(parent, session))

    async def lease_wait(self, shard: int, session: bytes, held: list[int], seconds: float,
                         returned: list[int] | None = None) -> list[int]:
        """The directories of ``shard`` recalled from ``session``, or of ``held`` (those it
        believes it holds) that it does not (after at most ``seconds``), once the leases
        ``returned`` are given back."""
        m = P.LEASE_WAIT
        req = P.LeaseWaitReq(session, held, seconds, returned or [])
        return m.decode(await self.pool.call(shard, m, req, timeout=seconds + 10.0))

    async def create_batch(self, parent: int, session: bytes, entries: list,
                           time_ns: int = 0) -> list:
        """Files a lease holder answered: per entry its Attr or the OSError why not.
        ``time_ns``: the directory's mtime and ctime after them (0: the shard's clock)."""
        return await self._ask(shard_of(parent), P.CREATE_BATCH,
                               P.CreateBatchReq(parent, session, entries, time_ns, self._rid()))

    async def dir_batch(self, parent: int, session: bytes, entries: list,
                        time_ns: int = 0) -> list:
        """Directories a lease holder made or removed, placed on other shards than
        ``parent``'s: per entry its Attr (the parent's, for a removal) or the OSError why not.
        ``time_ns``: as ``create_batch``'s."""
        return await self._ask(shard_of(parent), P.DIR_BATCH,
                               P.CreateBatchReq(parent, session, entries, time_ns, self._rid()))

    async def reserve(self, shard: int, n: int) -> int:
        """``n`` inode numbers of ``shard`` for directories made under a lease elsewhere: the
        first counter."""
        return await self._ask(shard, P.RESERVE, P.ReserveReq(n))

    def close(self) -> None:
        """Close the connections to every shard."""
        self.pool.close()


def _replicas(cluster: Cluster) -> tuple:
    """Every copy of each shard."""
    return cluster.meta_replicas


def _uid(uid: int | None) -> int:
    return os.getuid() if uid is None else uid


def _gid(gid: int | None) -> int:
    return os.getgid() if gid is None else gid
