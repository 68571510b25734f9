"""Shared fixtures and helpers for the tests of the VFS called directly (tests/test_vfs_*.py).

The VFS (``jpfs.client.vfs.VFS``) is built as ``jpfs.fuse.mount.serve`` builds it, over a real
local cluster (real daemons on loopback, real LMDB), and called as ``jpfs.fuse.operations`` calls
it: inode numbers, ``bytes`` names, open flags, the caller's uid and gid; errors come back as
``JPFSError`` with an errno. No kernel, no FUSE mount, nothing privileged.

What the kernel would do around a call (look a name up before it opens or removes it, ask for
the size before an O_APPEND write, apply the umask to a mode) the helpers here do the same way.
Only the VFS's public methods are used.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import pytest
import trio

from jpfs import config, localcluster
from jpfs.client.data.cache import BlobCache
from jpfs.client.vfs import VFS, VFSConfig
from jpfs.errors import JPFSError, errno_name
from jpfs.types import ROOT_INO, Attr

CHUNK = 64 << 10
"""The test cluster's chunk size: small, so that files of a few hundred KiB span chunks (and
the VFS's small-file limit, the chunk size as on a mount, is crossed cheaply)."""
UID, GID = os.geteuid(), os.getegid()
"""The caller, as the adapter passes ``ctx.uid``/``ctx.gid``."""
UMASK = 0o022
"""The kernel applies the caller's umask before the VFS sees a mode."""
RDONLY, WRONLY, RDWR = os.O_RDONLY, os.O_WRONLY, os.O_RDWR
CREAT = os.O_CREAT | os.O_WRONLY
LEASE_WARMUP = 3
"""Creates in a directory after which a read-write VFS holds its write lease
(``jpfs.client.vfs.leases.LEASE_AFTER``); the ``leased`` mode warms each test directory up."""

MODES: dict[str, dict] = {
    "plain": {"dir_leases": False},
    "leased": {},
    "write-behind": {"write_behind": True},
}
"""VFS configurations the tests run under: every change through the shard; creates, unlinks
and renames answered under a directory lease (the default of a read-write mount); and files
closed before their bytes are stored (``--write-behind``)."""


# ---- the cluster and the VFS --------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory):
    """One cluster of real daemons per test module: 2 metadata shards (so that directories
    spread over shards and cross-shard changes happen), 2 storage nodes, small chunks."""
    d = tmp_path_factory.mktemp("vfscluster")
    localcluster.up(d, meta_shards=2, storage_nodes=2, chunk_size=CHUNK, sync=False)
    yield d
    localcluster.down(d, timeout=5)


@pytest.fixture(scope="module")
def cluster(cluster_dir) -> config.Cluster:
    return config.load(localcluster.cluster_file(cluster_dir))


@asynccontextmanager
async def open_vfs(cluster: config.Cluster, **options) -> AsyncIterator[VFS]:
    """A VFS over ``cluster`` built as a mount builds it (``jpfs.fuse.mount.serve``): its own
    memory cache, ``small_file`` the chunk size, ``options`` as ``VFSConfig`` fields. At the end,
    as an unmount: every change committed, then the connections closed."""
    async with trio.open_nursery() as nursery:
        cache = BlobCache(64 << 20)
        vfs: VFS | None = None
        try:
            await cache.open(nursery)
            options.setdefault("small_file", cluster.chunk_size)
            vfs = await VFS.connect(nursery, cluster, cache, VFSConfig(**options))
            yield vfs
            await vfs.commit_all()
        finally:
            if vfs is not None:
                vfs.close()
            cache.close()
            nursery.cancel_scope.cancel()


def unique(prefix: str = "t") -> bytes:
    """A name no other test of the module uses (tests share their module's cluster)."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}".encode()


async def fresh_dir(vfs: VFS, *, warm: bool = False, parent: int = ROOT_INO) -> int:
    """A new empty directory; with ``warm``, one whose write lease ``vfs`` holds (files made
    and removed there until it is granted)."""
    d = (await vfs.mkdir(parent, unique("d"), 0o755 & ~UMASK, UID, GID)).ino
    if warm:
        for i in range(LEASE_WARMUP + 1):
            f, _ = await vfs.create(d, b"warm%d" % i, stat.S_IFREG | 0o644, CREAT, UID, GID)
            await vfs.release(f.fh)
        for i in range(LEASE_WARMUP + 1):
            await vfs.lookup(d, b"warm%d" % i)
            await vfs.unlink(d, b"warm%d" % i)
        leases = vfs.snapshot()["leases"]
        assert leases.get("held", 0) >= 1 and leases.get("answered", 0) >= 1, leases
    return d


@dataclass
class Fs:
    """A VFS and a fresh directory of one test's own, with what the kernel does around the
    calls under test (lookups before opens, the open/write/close of a whole file)."""

    vfs: VFS
    d: int
    mode: str = "plain"

    async def create(self, name: bytes, perm: int = 0o644, flags: int = CREAT,
                     parent: int | None = None) -> tuple[int, Attr]:
        """open(O_CREAT) of a missing name: (handle, attributes)."""
        f, attr = await self.vfs.create(self.d if parent is None else parent, name,
                                        stat.S_IFREG | (perm & ~UMASK), flags, UID, GID)
        return f.fh, attr

    async def write(self, name: bytes, data: bytes = b"", parent: int | None = None,
                    perm: int = 0o644) -> Attr:
        """Make file ``name`` holding ``data`` as a process does (creat, write, close); its
        attributes after."""
        fh, attr = await self.create(name, perm, parent=parent)
        await write_all(self.vfs, fh, 0, data)
        await self.vfs.flush(fh)
        await self.vfs.release(fh)
        return await self.vfs.getattr(attr.ino)

    async def lookup(self, name: bytes, parent: int | None = None) -> Attr:
        return await self.vfs.lookup(self.d if parent is None else parent, name)

    async def read(self, ino: int) -> bytes:
        return await read_file(self.vfs, ino)

    async def mkdir(self, name: bytes, parent: int | None = None, perm: int = 0o755) -> Attr:
        return await self.vfs.mkdir(self.d if parent is None else parent, name, perm & ~UMASK,
                                    UID, GID)

    async def names(self, parent: int | None = None) -> list[bytes]:
        return await names(self.vfs, self.d if parent is None else parent)


async def write_all(vfs: VFS, fh: int, off: int, data: bytes, piece: int = 128 << 10) -> None:
    """Write ``data`` at ``off`` in the kernel's pieces (it splits writes at max_write)."""
    for i in range(0, len(data), piece):
        n = await vfs.write(fh, off + i, data[i:i + piece])
        assert n == len(data[i:i + piece])


async def read_at(vfs: VFS, fh: int, off: int, size: int, piece: int = 128 << 10) -> bytes:
    """``size`` bytes at ``off`` (fewer at the end of the file), read in the kernel's pieces."""
    out = bytearray()
    while len(out) < size:
        got = bytes(await vfs.read(fh, off + len(out), min(piece, size - len(out))))
        out += got
        if not got:
            break
    return bytes(out)


async def read_file(vfs: VFS, ino: int) -> bytes:
    """open, read to the end, close."""
    f = await vfs.open(ino, RDONLY)
    try:
        size = (await vfs.getattr(ino)).size
        return await read_at(vfs, f.fh, 0, size + 1)  # one byte more: the end is the end
    finally:
        await vfs.release(f.fh)


async def entries(vfs: VFS, ino: int, start: int = 0) -> list[tuple[bytes, Attr, int]]:
    """opendir, readdir from ``start`` to the end, releasedir: (name, attributes, next)."""
    fh = vfs.opendir(ino)
    try:
        async with aclosing(vfs.readdir(fh, start)) as it:
            return [e async for e in it]
    finally:
        vfs.releasedir(fh)


async def names(vfs: VFS, ino: int) -> list[bytes]:
    """The directory's names, sorted, without "." and ".."."""
    return sorted(n for n, _, _ in await entries(vfs, ino) if n not in (b".", b".."))


async def errno_of(aw: Awaitable) -> int | None:
    """The errno ``aw`` fails with, or None if it succeeds."""
    try:
        await aw
    except JPFSError as e:
        return e.errno
    return None


async def expect(err: int, aw: Awaitable) -> None:
    """``aw`` fails with ``err``."""
    got = await errno_of(aw)
    assert got == err, f"expected {errno_name(err)}, got {errno_name(got) if got else 'success'}"


async def eventually(check: Callable[[], Awaitable[bool]], what: str,
                     timeout: float = 10.0) -> None:
    """Wait until ``check()`` holds (what another VFS shows within its timeouts)."""
    with trio.move_on_after(timeout):
        while True:
            if await check():
                return
            await trio.sleep(0.01)
    raise AssertionError(f"not within {timeout} s: {what}")


async def exists(vfs: VFS, parent: int, name: bytes) -> bool:
    """Whether a lookup finds ``name`` (ENOENT: no)."""
    got = await errno_of(vfs.lookup(parent, name))
    if got not in (None, errno.ENOENT):
        raise AssertionError(f"lookup of {name!r}: {errno_name(got)}")
    return got is None


@asynccontextmanager
async def open_fs(cluster: config.Cluster, mode: str = "plain", **options) -> AsyncIterator[Fs]:
    """A VFS in ``mode`` (``MODES``) and a fresh directory in it (leased, unless "plain")."""
    async with open_vfs(cluster, **{**MODES[mode], **options}) as vfs:
        yield Fs(vfs, await fresh_dir(vfs, warm=mode != "plain"), mode)


__all__ = ["CHUNK", "CREAT", "GID", "LEASE_WARMUP", "MODES", "RDONLY", "RDWR", "UID", "UMASK",
           "WRONLY", "Fs", "cluster", "cluster_dir", "entries", "errno_of", "eventually", "exists",
           "expect", "fresh_dir", "names", "open_fs", "open_vfs", "read_at", "read_file", "unique",
           "write_all"]

