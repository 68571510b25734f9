"""Inode-level metadata calls, routed to the right shard by ``jpfs.placement``.

Every call goes to exactly the shard that owns what it names (a directory's shard for entries, an
inode's shard for attributes), so no lookup service sits in the way. Batch calls are split by
shard and sent in parallel.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence

import trio

from ..config import Cluster
from ..errors import from_name
from ..placement import shard_of
from ..proto.meta import METHODS
from ..rpc import Pool
from ..types import Attr, DirEntry, Layout


def _attr(w) -> Attr | None:
    return Attr.from_wire(w) if w is not None else None


class MetaClient:
    """Async access to every metadata shard of a cluster."""

    def __init__(self, nursery: trio.Nursery, cluster: Cluster, **pool_options):
        self.cluster = cluster
        self.n_shards = cluster.n_shards
        self.pool = Pool(nursery, [s.address for s in cluster.meta], cluster.secret, role="meta",
                         **pool_options)

    async def call(self, shard: int, method: str, *args, **kw):
        return await self.pool.call(shard, METHODS[method], list(args), **kw)

    async def _grouped(self, method: str, inos: Sequence[int], *extra) -> list:
        """Call a batch ``method`` once per shard, in parallel; answers in ``inos`` order."""
        by_shard: dict[int, list[int]] = {}
        for i, ino in enumerate(inos):
            by_shard.setdefault(shard_of(ino), []).append(i)
        out: list = [None] * len(inos)

        async def one(shard: int, idx: list[int]) -> None:
            got = await self.call(shard, method, [inos[i] for i in idx], *extra)
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
        ino, _, attr = await self.call(shard_of(parent), "lookup", parent, name)
        return Attr.from_wire(attr) if attr is not None else await self.getattr(ino)

    async def batch_lookup(self, parent: int, names: Sequence[bytes]) -> list[Attr | OSError]:
        """Attributes for each name in ``parent`` (an OSError in place of a missing one)."""
        got = await self.call(shard_of(parent), "batch_lookup", parent, list(names))
        remote = [r[0] for r in got if not isinstance(r, str) and r[2] is None]
        remote_attrs = dict(zip(remote, await self.batch_getattr(remote), strict=True)) \
            if remote else {}
        out: list[Attr | OSError] = []
        for r in got:
            if isinstance(r, str):
                out.append(from_name(r))
            elif r[2] is not None:
                out.append(Attr.from_wire(r[2]))
            else:
                a = remote_attrs.get(r[0])
                out.append(a if a is not None else from_name("ENOENT"))
        return out

    async def getattr(self, ino: int) -> Attr:
        return Attr.from_wire(await self.call(shard_of(ino), "getattr", ino))

    async def batch_getattr(self, inos: Sequence[int]) -> list[Attr | None]:
        return [_attr(w) for w in await self._grouped("batch_getattr", inos)]

    async def readdir(self, parent: int, *, plus: bool = True, page: int = 1000,
                      after: bytes = b"") -> AsyncIterator[DirEntry]:
        """Entries of ``parent`` in name order, a page per call; with ``plus`` each carries its
        attributes (entries whose inode lives elsewhere are filled by one batch per page)."""
        shard = shard_of(parent)
        while True:
            entries, more = await self.call(shard, "readdir", parent, after, page, plus)
            batch = [DirEntry.from_wire(e) for e in entries]
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
        return await self.call(shard_of(ino), "readlink", ino)

    async def statfs(self) -> dict:
        totals: dict[str, int] = {}
        for shard in range(self.n_shards):
            for k, v in (await self.call(shard, "statfs")).items():
                totals[k] = totals.get(k, 0) + v
        return totals

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.call(shard_of(ino), "getxattr", ino, name)

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.call(shard_of(ino), "listxattr", ino)

    async def get_layout(self, ino: int) -> Layout:
        return Layout.from_wire(await self.call(shard_of(ino), "get_layout", ino))

    async def batch_layout(self, inos: Sequence[int]) -> list[Layout | None]:
        got = await self._grouped("batch_layout", inos)
        return [Layout.from_wire(w) if w is not None else None for w in got]

    async def lookup_layouts(self, parent: int, names: Sequence[bytes]
                             ) -> list[Layout | OSError | tuple[int, int]]:
        """Layouts of files in ``parent`` by name, in one call: a Layout, an OSError, or
        (ino, kind) where another call is needed (a symlink, an inode on another shard)."""
        got = await self.call(shard_of(parent), "lookup_layouts", parent, list(names))
        out: list = []
        for r in got:
            if isinstance(r, str):
                out.append(from_name(r))
            elif len(r) == 2:
                out.append((r[0], r[1]))
            else:
                out.append(Layout.from_wire(r))
        return out

    # ---- changes
    async def create(self, parent: int, name: bytes, mode: int, uid: int | None = None,
                     gid: int | None = None, exclusive: bool = True) -> tuple[Attr, bool]:
        ino, _, attr, created = await self.call(
            shard_of(parent), "create", parent, name, mode, _uid(uid), _gid(gid), exclusive)
        return (Attr.from_wire(attr) if attr is not None else await self.getattr(ino)), created

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int = 0,
                    uid: int | None = None, gid: int | None = None) -> Attr:
        """A new node of any type but directory and symlink (EEXIST if the name is taken)."""
        ino, _, attr, _ = await self.call(shard_of(parent), "mknod", parent, name, mode,
                                          _uid(uid), _gid(gid), rdev)
        return Attr.from_wire(attr) if attr is not None else await self.getattr(ino)

    async def mkdir(self, parent: int, name: bytes, mode: int = 0o755, uid: int | None = None,
                    gid: int | None = None) -> Attr:
        return Attr.from_wire(await self.call(shard_of(parent), "mkdir", parent, name, mode,
                                              _uid(uid), _gid(gid)))

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int | None = None,
                      gid: int | None = None) -> Attr:
        return Attr.from_wire(await self.call(shard_of(parent), "symlink", parent, name, target,
                                              _uid(uid), _gid(gid)))

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        return Attr.from_wire(await self.call(shard_of(parent), "link", ino, parent, name))

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.call(shard_of(parent), "unlink", parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.call(shard_of(parent), "rmdir", parent, name)

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int = 0) -> None:
        await self.call(shard_of(src_parent), "rename", src_parent, src_name, dst_parent,
                        dst_name, flags)

    async def setattr(self, ino: int, **fields: int) -> Attr:
        return Attr.from_wire(await self.call(shard_of(ino), "setattr", ino, fields))

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        await self.call(shard_of(ino), "setxattr", ino, name, value, flags)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.call(shard_of(ino), "removexattr", ino, name)

    async def write_chunks(self, ino: int, chunks: list, size: int,
                           expect_version: int | None = None) -> Attr:
        return Attr.from_wire(await self.call(shard_of(ino), "write_chunks", ino,
                                              [c.to_wire() for c in chunks], size,
                                              expect_version))

    async def bulk_create(self, parent: int, entries: list, replace: bool = False) -> list:
        """Create files with content in one transaction: Attr or OSError per entry."""
        got = await self.call(shard_of(parent), "bulk_create", parent, entries, replace)
        return [from_name(r) if isinstance(r, str) else Attr.from_wire(r) for r in got]

    def close(self) -> None:
        self.pool.close()


def _uid(uid: int | None) -> int:
    return os.getuid() if uid is None else uid


def _gid(gid: int | None) -> int:
    return os.getgid() if gid is None else gid
