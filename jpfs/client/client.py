"""The path-level async client: what ``jpfs.aconnect()`` yields.

Paths are POSIX paths inside JPFS (``/a/b``; ``jpfs:/a/b`` and ``jpfs://a/b`` are accepted too),
resolved by ``paths.Resolver`` (one ``lookup`` per component, recent directories remembered for
``dir_cache_ttl`` seconds).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat as _stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from .. import config
from ..coord.clustermap import MapFollower
from ..errors import JPFSError, error
from ..types import Attr, Layout
from .data.cache import BlobCache
from .data.prefetch import PrefetchConfig, Prefetcher
from .data.reader import Reader
from .data.store import DataPath
from .files import AsyncFile, parse_mode
from .paths import Resolver, at_path, jpfs_path, naming
from .wire.meta import MetaClient
from .wire.storage import StorageClient

log = logging.getLogger(__name__)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@dataclass(frozen=True, slots=True)
class Entry:
    """A directory entry from ``scandir``: name, full path and attributes."""

    name: str
    path: str
    attr: Attr

    def is_dir(self) -> bool:
        """Whether the entry is a directory (not following a symlink)."""
        return self.attr.is_dir

    def is_file(self) -> bool:
        """Whether the entry is a regular file (not following a symlink)."""
        return self.attr.is_reg

    def is_symlink(self) -> bool:
        """Whether the entry is a symbolic link."""
        return self.attr.is_link


MEMORY_CACHE = 256 << 20
"""The native client's blob cache: read-ahead windows and prefetch hints wait here (it only
grows as they use it; whole-file reads hand their blobs to the caller instead)."""


class AsyncClient:
    """Namespace operations by path, over a MetaClient, and file bytes through one Reader, one
    BlobCache and one Prefetcher (the same parts the mount's VFS reads through).

    Args:
        nursery: runs connections and prefetch tasks; the client lives as long as it.
        cluster: where the shards and storage nodes are.
        dir_cache_ttl: how long resolved directories are trusted (seconds).
        cache: the blob cache to read through (an opened one, possibly with a disk part; the
            mount passes its own). Default: memory only, ``MEMORY_CACHE`` bytes at most.
        keep_whole: whether whole-file reads leave their blobs in the cache (the mount's case).
        prefetch: prefetch limits and switches.
        own_prefetcher: False for a caller that builds its own prefetcher over these parts
            (the mount's VFS: its prefetcher knows what the kernel holds); ``prefetcher`` is
            then None.
        first_copy: which live copy of a chunk this client reads first (``StorageClient``;
            default: chosen at random, so readers spread over the copies).
        short_circuit: read the volume files of storage nodes on this host directly
            (``StorageClient``).

    Attributes ``meta`` (a ``MetaClient``) and ``storage`` (a ``StorageClient``, None without
    storage nodes) are the wire clients beneath, public for tools and benchmarks that measure
    the services themselves; ``paths`` (a ``paths.Resolver``) resolves paths to inodes and keeps
    the directory cache.
    """

    def __init__(self, nursery: trio.Nursery, cluster: config.Cluster, *,
                 dir_cache_ttl: float = 1.0, cache: BlobCache | None = None,
                 keep_whole: bool = False, prefetch: PrefetchConfig | None = None,
                 own_prefetcher: bool = True, first_copy: int | None = None,
                 short_circuit: bool = True):
        self.cluster = cluster
        self.nursery = nursery
        self.meta = MetaClient(nursery, cluster)
        self.storage = StorageClient(nursery, cluster, first_copy=first_copy,
                                     short_circuit=short_circuit) \
            if cluster.n_nodes else None
        self.data = DataPath(self.meta, self.storage, cluster) if self.storage else None
        self.cache = cache if cache is not None else BlobCache(MEMORY_CACHE)
        self.reader = Reader(self.cache, self.storage.get, keep_whole=keep_whole) \
            if self.storage else None
        self.prefetcher = Prefetcher(self.meta, self.storage.get, self.cache,
                                     prefetch or PrefetchConfig(small_file=cluster.chunk_size)
                                     ) if self.storage and own_prefetcher else None
        if self.prefetcher is not None:
            nursery.start_soon(self.prefetcher.run)
        self.paths = Resolver(self.meta, dir_cache_ttl)
        self.umask = _umask()
        self.follower = MapFollower(cluster)
        self.follower.subscribe(self._follow)
        self.follower.start_soon(nursery)

    def _follow(self, cluster: config.Cluster) -> None:
        """A newer cluster map: shards and nodes added, nodes draining or removed, addresses
        moved. Inode ids and chunk records name shards and nodes by index, which never change
        meaning, so nothing cached goes stale."""
        self.cluster = cluster
        self.meta.follow(cluster)
        if self.storage is not None:
            self.storage.follow(cluster)
        if self.data is not None:
            self.data.cluster = cluster

    def close(self) -> None:
        """Close the connections and the cache (the nursery's tasks end with it)."""
        self.meta.close()
        if self.storage:
            self.storage.close()
        self.cache.close()

    def _data(self) -> DataPath:
        if self.data is None:
            raise error(errno.ENODEV, "this cluster has no storage nodes: file contents cannot "
                        "be stored or read")
        return self.data

    def _reader(self) -> Reader:
        self._data()
        assert self.reader is not None
        return self.reader

    # ---- reads ----------------------------------------------------------------------------------

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> Attr:
        """Attributes of ``path`` (following a final symlink unless told not to)."""
        attr, _ = await self.paths.walk(jpfs_path(path), follow_symlinks)
        return attr

    async def lstat(self, path: str) -> Attr:
        """Attributes of ``path`` itself (a final symlink is not followed)."""
        return await self.stat(path, follow_symlinks=False)

    async def exists(self, path: str) -> bool:
        """Whether ``path`` names something (a dangling symlink does not)."""
        try:
            await self.stat(path)
            return True
        except FileNotFoundError:
            return False
        except JPFSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise

    async def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (or a symlink to one)."""
        try:
            return (await self.stat(path)).is_dir
        except JPFSError:
            return False

    async def isfile(self, path: str) -> bool:
        """Whether ``path`` is a regular file (or a symlink to one)."""
        try:
            return (await self.stat(path)).is_reg
        except JPFSError:
            return False

    async def stat_many(self, paths: list[str]) -> list[Attr | OSError]:
        """Attributes of many paths, one batched lookup per directory (final symlinks are not
        followed)."""
        return await self.paths.by_directory(paths, self.meta.batch_lookup)

    async def scandir(self, path: str = "/") -> list[Entry]:
        """Entries of a directory with their attributes (readdirplus), in name order."""
        attr, real = await self.paths.directory(path)
        base = real.rstrip("/")
        with naming(jpfs_path(path)):
            return [Entry(os.fsdecode(e.name), f"{base}/{os.fsdecode(e.name)}", e.attr)
                    async for e in self.meta.readdir(attr.ino, plus=True) if e.attr is not None]

    async def iterdir(self, path: str = "/", page: int = 1000) -> AsyncIterator[Entry]:
        """Like scandir, a page at a time: a million entries never sit in memory together."""
        attr, real = await self.paths.directory(path)
        base = real.rstrip("/")
        with naming(jpfs_path(path)):
            async for e in self.meta.readdir(attr.ino, plus=True, page=page):
                if e.attr is not None:
                    yield Entry(os.fsdecode(e.name), f"{base}/{os.fsdecode(e.name)}", e.attr)

    async def listdir(self, path: str = "/") -> list[str]:
        """Names in a directory, in name order."""
        attr, _ = await self.paths.directory(path)
        with naming(jpfs_path(path)):
            return [os.fsdecode(e.name) async for e in self.meta.readdir(attr.ino, plus=False)]

    async def walk(self, top: str = "/") -> AsyncIterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk`` (top-down, symlinks to directories not followed)."""
        stack = [jpfs_path(top)]
        while stack:
            d = stack.pop()
            try:
                entries = await self.scandir(d)
            except FileNotFoundError:
                continue
            dirs = [e.name for e in entries if e.is_dir()]
            files = [e.name for e in entries if not e.is_dir()]
            yield d, dirs, files
            stack.extend(reversed([f"{d.rstrip('/')}/{n}" for n in dirs]))

    async def readlink(self, path: str) -> str:
        """The target of a symbolic link (EINVAL for anything else)."""
        attr = await self.lstat(path)
        if not attr.is_link:
            raise error(errno.EINVAL, "not a symbolic link", path)
        return os.fsdecode(await self.meta.readlink(attr.ino))

    async def statfs(self) -> dict:
        """Totals over the metadata shards (``inodes``, ``dentries``, ``chunks``)."""
        return await self.meta.statfs()

    async def sync(self) -> None:
        """Return once every change answered so far is durable (changes are visible when
        answered and durable within one fsync of their shard; this waits for that)."""
        await self.meta.sync()

    async def getxattr(self, path: str, name: str) -> bytes:
        """An extended attribute's value (ENODATA if it is not set)."""
        return await self.meta.getxattr((await self.stat(path)).ino, os.fsencode(name))

    async def listxattr(self, path: str) -> list[str]:
        """Names of the extended attributes set on ``path``."""
        return [os.fsdecode(n) for n in await self.meta.listxattr((await self.stat(path)).ino)]

    # ---- changes --------------------------------------------------------------------------------

    async def mkdir(self, path: str, mode: int = 0o777) -> Attr:
        """Make a directory (``mode`` less the umask); EEXIST if the name is taken."""
        parent, name, p = await self.paths.parent(path)
        with naming(p, change=True):
            return (await self.meta.mkdir(parent, name, mode & ~self.umask)).attr

    async def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = True) -> None:
        """Make a directory and any missing parents, as ``os.makedirs``."""
        p = jpfs_path(path)
        try:
            attr = await self.stat(p)
        except JPFSError as e:
            if e.errno != errno.ENOENT:
                raise
        else:
            if not attr.is_dir:
                raise error(errno.EEXIST, "exists and is not a directory", p)
            if not exist_ok:
                raise error(errno.EEXIST, "exists", p)
            return
        head = p.rsplit("/", 1)[0] or "/"
        if head != "/":
            await self.makedirs(head, mode, exist_ok=True)
        try:
            await self.mkdir(p, mode)
        except FileExistsError:
            if not exist_ok or not await self.isdir(p):
                raise

    async def remove(self, path: str) -> None:
        """Remove a file, symlink or other non-directory."""
        parent, name, p = await self.paths.parent(path)
        with naming(p, change=True):
            await self.meta.unlink(parent, name)

    unlink = remove

    async def rmdir(self, path: str) -> None:
        """Remove an empty directory."""
        parent, name, p = await self.paths.parent(path)
        with naming(p, change=True):
            await self.meta.rmdir(parent, name)
        self.paths.forget(p)

    async def rmtree(self, path: str) -> int:
        """Remove a tree; returns the number of entries removed."""
        p = jpfs_path(path)
        attr = await self.lstat(p)
        if not attr.is_dir:
            await self.remove(p)
            return 1
        n = 0
        while True:
            entries = [e async for e in self.iterdir(p, page=1000)]
            if not entries:
                break
            for e in entries:
                if e.is_dir():
                    n += await self.rmtree(e.path)
                else:
                    await self.remove(e.path)
                    n += 1
        await self.rmdir(p)
        return n + 1

    async def rename(self, src: str, dst: str, *, flags: int = 0) -> None:
        """Move ``src`` to ``dst``, replacing it as POSIX ``rename(2)`` does."""
        sp, sn, s = await self.paths.parent(src)
        dp, dn, d = await self.paths.parent(dst)
        with naming(s, change=True):
            await self.meta.rename(sp, sn, dp, dn, flags)
        self.paths.forget(s)
        self.paths.forget(d)

    replace = rename

    async def symlink(self, target: str, path: str) -> Attr:
        """Make ``path`` a symbolic link to ``target``."""
        parent, name, p = await self.paths.parent(path)
        with naming(p, change=True):
            return await self.meta.symlink(parent, name, os.fsencode(target))

    async def link(self, src: str, dst: str) -> Attr:
        """Make ``dst`` a hard link to the file ``src``."""
        attr = await self.lstat(src)
        parent, name, p = await self.paths.parent(dst)
        with naming(p, change=True):
            return await self.meta.link(attr.ino, parent, name)

    async def chmod(self, path: str, mode: int) -> Attr:
        """Set the permission bits (``mode & 0o7777``)."""
        return await self.meta.setattr((await self.stat(path)).ino, mode=mode & 0o7777)

    async def chown(self, path: str, uid: int, gid: int) -> Attr:
        """Set the owner and group (-1 or None leaves one as it is)."""
        fields = {k: v for k, v in (("uid", uid), ("gid", gid)) if v is not None and v >= 0}
        return await self.meta.setattr((await self.stat(path)).ino, **fields)

    async def utime(self, path: str, ns: tuple[int, int] | None = None) -> Attr:
        """Set (atime, mtime) in nanoseconds; now for both when ``ns`` is None."""
        now = time.time_ns()
        atime, mtime = ns if ns is not None else (now, now)
        return await self.meta.setattr((await self.stat(path)).ino, atime_ns=atime,
                                       mtime_ns=mtime)

    async def truncate(self, path: str, size: int) -> Attr:
        """Cut or extend a file to ``size`` bytes (new bytes read as zeros)."""
        return await self.meta.setattr((await self.stat(path)).ino, size=size)

    async def setxattr(self, path: str, name: str, value: bytes, flags: int = 0) -> None:
        """Set an extended attribute (``flags``: XATTR_CREATE / XATTR_REPLACE)."""
        await self.meta.setxattr((await self.stat(path)).ino, os.fsencode(name), value, flags)

    async def removexattr(self, path: str, name: str) -> None:
        """Remove an extended attribute (ENODATA if it is not set)."""
        await self.meta.removexattr((await self.stat(path)).ino, os.fsencode(name))

    async def create(self, path: str, mode: int = 0o666, *, exclusive: bool = True) -> Attr:
        """Create an empty regular file (EEXIST if it exists and ``exclusive``)."""
        parent, name, p = await self.paths.parent(path)
        with naming(p, change=True):
            attr, _ = await self.meta.create(parent, name, _stat.S_IFREG | (mode & ~self.umask),
                                             exclusive=exclusive)
        return attr

    # ---- file contents ---------------------------------------------------------------------

    async def open(self, path: str, mode: str = "rb", *, perm: int = 0o666) -> AsyncFile:
        """Open a file (binary modes: r, w, a, x, with + and b)."""
        readable, writable, kind = parse_mode(mode)
        data = self._data()
        reader = self._reader()
        if kind == "r":
            attr = await self.stat(path)
            parent = 0
            if writable:
                parent, _, _ = await self.paths.parent(path)
        else:
            parent, name, p = await self.paths.parent(path)
            with naming(p, change=True):
                attr, created = await self.meta.create(parent, name, _stat.S_IFREG |
                                                       (perm & ~self.umask),
                                                       exclusive=kind == "x")
            if attr.is_link:  # open() follows a final symlink
                attr = await self.stat(path)
            if kind == "w" and attr.size:
                attr = await self.meta.setattr(attr.ino, size=0)
        if attr.is_dir:
            raise error(errno.EISDIR, "is a directory", path)
        with naming(jpfs_path(path)):
            layout = await self.meta.get_layout(attr.ino)
        return AsyncFile(reader, data, self.prefetcher, jpfs_path(path), mode, layout, parent)

    async def layout(self, path: str) -> Layout:
        """The file's attributes and chunk records (where its bytes are stored)."""
        ino = (await self.stat(path)).ino
        with naming(jpfs_path(path)):
            return await self.meta.get_layout(ino)

    async def read_bytes(self, path: str) -> bytes:
        """The whole content of a file."""
        reader = self._reader()
        layout = await self.layout(path)
        if layout.attr.is_dir:
            raise error(errno.EISDIR, "is a directory", path)
        with naming(jpfs_path(path)):
            (view,) = await reader.whole([layout])
        return bytes(view)

    async def read_many(self, paths: list[str]) -> list[memoryview]:
        """The contents of many files in as few round trips as possible: per directory one call
        that looks the names up and returns their layouts (directories in parallel), then one
        batched blob read per storage node. Returns read-only views (bytes-like)."""
        reader = self._reader()
        layouts = await self.paths.layouts(paths)
        for p, lay in zip(paths, layouts, strict=True):
            if isinstance(lay, OSError):
                raise at_path(lay, jpfs_path(p))
        try:
            return await reader.whole(layouts)
        except JPFSError as e:
            if len(paths) == 1:
                raise at_path(e, jpfs_path(paths[0])) from None
            raise

    async def prefetch(self, paths: list[str]) -> int:
        """Hint: these files will be read soon. Their bytes are fetched in the background (one
        batched call per directory and per storage node) into this client's blob cache
        (``cache``, bounded in bytes), so later ``read_many``, ``read_bytes`` and ``open`` reads
        of them are served locally. Returns the number of files queued; paths that cannot be
        read are skipped (a hint never fails a reader)."""
        reader = self._reader()

        async def fetch() -> None:
            try:
                got = await self.paths.by_directory(paths, self.meta.lookup_layouts)
                chunks = [c for lay in got if isinstance(lay, Layout) for c in lay.chunks]
                await self.cache.prefetch(chunks, reader.fetch)
            except JPFSError as e:
                log.debug("prefetch hint failed: %s", e.strerror)

        self.nursery.start_soon(fetch)
        return len(paths)

    async def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[memoryview]:
        """Byte ranges ``[start, end)`` of files, in one batched read: each needed chunk is
        fetched once however many ranges touch it. Negative offsets count from the end."""
        reader = self._reader()
        paths = list(dict.fromkeys(p for p, _, _ in ranges))
        found = await self.stat_many(paths)
        attrs: list[Attr] = []
        for p, a in zip(paths, found, strict=True):
            if isinstance(a, OSError):
                raise error(a.errno, a.strerror, p)
            attrs.append(await self.stat(p) if a.is_link else a)
        layouts = dict(zip(paths, await self.meta.batch_layout([a.ino for a in attrs]),
                           strict=True))
        spans = []
        for p, start, end in ranges:
            lay = layouts[p]
            if lay is None:
                raise error(errno.EISDIR if await self.isdir(p) else errno.ENOENT,
                            "cannot read a range of it", p)
            size = lay.attr.size
            s = max(0, size + start if start < 0 else min(start, size))
            e = max(s, size + end if end < 0 else min(end, size))
            spans.append((lay, s, e))
        return await reader.ranges(spans)

    async def write_bytes(self, path: str, content, *, perm: int = 0o666) -> Attr:
        """Make ``content`` the whole content of ``path`` (created if missing). Atomic for
        readers: they see the old content or the new, never an empty or partial file."""
        data = self._data()
        parent, name, p = await self.paths.parent(path)
        with naming(p, change=True):
            try:
                attr = await self.meta.lookup(parent, name)
            except FileNotFoundError:
                # new file: bytes first, then the entry with its content in one transaction
                (made,) = await self.meta.bulk_create(parent, [await data.new_entry(
                    name, parent, content, _stat.S_IFREG | (perm & ~self.umask))])
                if not isinstance(made, OSError):
                    return made
                if made.errno != errno.EEXIST:
                    raise made from None
                attr = await self.meta.lookup(parent, name)
            if attr.is_link:
                attr = await self.stat(p)
            if attr.is_dir:
                raise error(errno.EISDIR, "is a directory", p)
            return await data.write_whole(attr, parent, content)

    async def put(self, local: str | os.PathLike, remote: str, *, window: int = 4) -> Attr:
        """Copy a local file into JPFS, streaming ``window`` chunks at a time; the new content
        appears at once when every chunk is stored. Keeps the local mtime and permissions."""
        data = self._data()
        st = os.stat(local)
        parent, name, p = await self.paths.parent(remote)
        attr, _ = await self.meta.create(parent, name, _stat.S_IFREG | (st.st_mode & 0o7777),
                                         exclusive=False)
        cs = data.chunk_size
        total = -(-st.st_size // cs)
        chunks: list = []
        with open(local, "rb") as f:
            for first in range(0, total, window):
                pieces = []
                for i in range(first, min(first + window, total)):
                    buf = await trio.to_thread.run_sync(f.read, cs)
                    pieces.append((i, memoryview(buf)))
                chunks += await data.store(attr.ino, parent, pieces, total)
        await self.meta.write_chunks(attr.ino, chunks, st.st_size)
        return await self.meta.setattr(attr.ino, mtime_ns=st.st_mtime_ns,
                                       mode=st.st_mode & 0o7777)

    async def get(self, remote: str, local: str | os.PathLike) -> int:
        """Copy a JPFS file to a local path (written to a temporary name, then renamed); the
        chunks ahead are fetched (read-ahead) while the current ones are written."""
        f = await self.open(remote, "rb")
        attr = await self.meta.getattr(f.ino)
        tmp = f"{os.fspath(local)}.jpfs-part"
        buf = memoryview(bytearray(f.cs))
        try:
            with open(tmp, "wb") as out:
                while n := await f.readinto(buf):
                    await trio.to_thread.run_sync(out.write, buf[:n])
        except JPFSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise at_path(e, jpfs_path(remote)) from None
        finally:
            await f.close()
        os.utime(tmp, ns=(attr.atime_ns, attr.mtime_ns))
        os.chmod(tmp, attr.mode & 0o7777)
        os.replace(tmp, local)
        return f.size


@asynccontextmanager
async def aconnect(cluster: str | os.PathLike | config.Cluster | None = None, **options):
    """``async with jpfs.aconnect() as client:`` — an AsyncClient for the duration."""
    c = cluster if isinstance(cluster, config.Cluster) else config.load(cluster)
    async with trio.open_nursery() as nursery:
        client = AsyncClient(nursery, c, **options)
        try:
            yield client
        finally:
            if client.storage is not None:  # before the connections close
                await client.storage.reports_answered()
            client.close()
            nursery.cancel_scope.cancel()
