"""The VFS: JPFS as an inode-level filesystem, what the FUSE mount (or any other front end) asks.

The front end translates its requests into these calls and their ``JPFSError`` into its own error
form at one place; everything a filesystem decides lives here: which inodes are held and what is
known of them, open handles, the one reader and the writers, prefetch signals, and what the
kernel's caches must be told (through the ``Notifier`` the front end passes in).

The cost of a mount is requests per file (docs/design-notes.md), so answers come from memory where
that is safe; each part's docstring says where. ``VFS`` is the one object the front end holds: it
builds the parts, lowest first, each whole with the parts it uses, and hands every request to the
part that answers it:

- ``SharedState`` (shared.py): the client's parts, nodes, handles, counters, config;
- ``Leasing`` (leasing.py): the directory write leases (``leases.py``, ``lease_book.py``) and
  what the other parts ask of them (settle, give back);
- ``Xattrs`` (xattrs.py): extended attributes;
- ``Commits`` (commits.py): commits of the writers and write-behind (the write semantics);
- ``Reads`` (reads.py): opens for reading, reads, the handles of the kernel's own opens;
- ``Handoff`` (handoff.py): files prefetch fetched, given to the kernel before they are read;
- ``Names`` (names.py): lookup, forget, getattr, setattr, readlink;
- ``Namespace`` (namespace.py): mknod, mkdir, symlink, link, unlink, rmdir, rename;
- ``Writes`` (writes.py): opens for writing, create, write, fallocate, flush, fsync, release;
- ``Directories`` (directories.py) and ``Capacity`` (statfs.py): listings and statfs.

The mount's prefetcher is built here too (``connect``), after the node table it asks what the
kernel holds, and joined to the VFS one way: the VFS tells it what it sees, and takes from it
the batches fetched for the kernel (``Prefetcher.handoffs``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncGenerator

import trio

from ...config import Cluster
from ...errors import error
from ...types import ROOT_INO, Attr, StatFS
from ..client import AsyncClient
from ..data.cache import BlobCache
from ..data.prefetch import PrefetchConfig, Prefetcher
from .commits import Commits
from .directories import Directories
from .handoff import Handoff
from .inodes import Inodes, Node
from .leasing import Leasing
from .names import Names
from .namespace import Namespace
from .reads import Reads
from .shared import SharedState
from .statfs import Capacity
from .types import (
    OPEN_OUTCOMES,
    Notifier,
    NullNotifier,
    OpenFile,
    PrefetchOwner,
    VFSConfig,
    VFSStats,
)
from .writes import FALLOC_FL_KEEP_SIZE, Writes
from .xattrs import Xattrs


class VFS:
    """JPFS by inode (see the module docstring). Build it with ``await VFS.connect(...)``.

    Args:
        client: the client whose parts the VFS reads and writes through.
        inodes: the node table, holding the root.
        prefetcher: the prefetcher to tell what the VFS sees (default: the client's).
    """

    def __init__(self, client: AsyncClient, inodes: Inodes, config: VFSConfig,
                 notifier: Notifier, *, prefetcher: Prefetcher | None = None):
        prefetcher = prefetcher or client.prefetcher
        if client.data is None or client.reader is None or prefetcher is None:
            raise error(errno.ENODEV, "this cluster has no storage nodes: nothing to mount")
        self.shared = shared = SharedState(client, prefetcher, inodes, config, notifier)
        self.client = client
        self.meta = client.meta
        self.data = client.data
        self.reader = client.reader
        self.cache = client.cache
        self.prefetcher = prefetcher
        self.inodes = inodes
        self.config = config
        self.notifier = notifier
        self.ro = config.read_only
        self.handles = shared.handles
        self.stats = shared.stats
        self.known = shared.known
        """Names of directories being written (None on read-only mounts: listings do it)."""
        self.leasing = Leasing(shared)
        self.leases = self.leasing.leases
        """Directories whose creates and unlinks this VFS answers from memory (``leases.py``)."""
        self.xattrs = Xattrs(self.meta, inodes, self.stats, shared.attr_age, shared.writable,
                             settle=self.leasing.settle)
        self.commits = Commits(shared, self.leasing)
        self.reads = Reads(shared, self.leasing)
        self.handoff = Handoff(shared, self.reads)
        self.names = Names(shared, self.leasing, self.commits, self.reads, self.handoff)
        self.namespace = Namespace(shared, self.leasing)
        self.writes = Writes(shared, self.leasing, self.xattrs, self.commits, self.reads,
                             self.names, self.namespace)
        self.directories = Directories(shared, self.leasing)
        self.capacity = Capacity(shared)
        self.owner: PrefetchOwner | None = None
        """Where prefetch runs, when another process does it (``attach_owner``)."""
        if prefetcher.config.handoff:  # a read-only mount's kernel takes files ahead
            client.nursery.start_soon(self.handoff.run)

    @classmethod
    async def connect(cls, nursery: trio.Nursery, cluster: Cluster, cache: BlobCache,
                      config: VFSConfig, notifier: Notifier | None = None, *,
                      prefetch: bool = True, ahead: bool = True) -> VFS:
        """Connect to ``cluster`` and build the VFS over ``cache`` (an opened BlobCache);
        ``prefetch`` and ``ahead``: ``PrefetchConfig.enabled`` and ``ahead``."""
        if not cluster.n_nodes:
            raise error(errno.ENODEV, "this cluster has no storage nodes: nothing to mount")
        client = AsyncClient(nursery, cluster, dir_cache_ttl=config.entry_timeout, cache=cache,
                             keep_whole=True, own_prefetcher=False,
                             short_circuit=config.short_circuit)
        try:
            inodes = Inodes(await client.meta.getattr(ROOT_INO))
        except BaseException:
            client.close()
            raise
        assert client.storage is not None
        # the mount's prefetcher skips what the kernel holds, and on a read-only mount hands
        # what sweeps and scans fetch on to it (``Handoff``)
        prefetcher = Prefetcher(client.meta, client.storage.get, cache, PrefetchConfig(
            enabled=prefetch, ahead=ahead, small_file=config.small_file,
            layouts=config.read_only,
            kernel_ahead=config.kernel_ahead,
            handoff=config.read_only and config.notify_store), inodes.kernel_has)
        nursery.start_soon(prefetcher.run)
        return cls(client, inodes, config, notifier or NullNotifier(), prefetcher=prefetcher)

    def close(self) -> None:
        """Close the client under the VFS (its connections); a mount calls it last, as it ends."""
        self.client.close()

    def attr_of(self, node: Node) -> Attr:
        """What a reader of the node sees now (a writer's size counts before its commit)."""
        return self.shared.attr_of(node)

    def name_of(self, node: Node) -> str:
        """The node's path from the mount's root for log lines, or ``inode N`` where it is
        unknown."""
        return self.shared.name_of(node)

    def snapshot(self) -> dict:
        """The VFS's counts (inodes, handles, counters, names, leases), as one JSON-able object."""
        return {"inodes": len(self.inodes), "handles": len(self.handles),
                **self.stats.as_dict(),
                "names": self.known.as_dict() if self.known is not None else {},
                "leases": self.leases.as_dict() if self.leases is not None else {}}

    # ------------------------------------------------------------------ names

    async def lookup(self, parent: int, name: bytes) -> Attr:
        """The entry ``name`` in ``parent`` (the kernel counts one more lookup of it)."""
        return await self.names.lookup(parent, name)

    def fresh_for(self, ino: int) -> float:
        """How much longer the attributes this VFS holds of ``ino`` may be trusted (the
        attribute timeout less their age): what the kernel may cache them for."""
        return self.names.fresh_for(ino)

    def forget(self, items) -> None:
        """FORGET: the kernel dropped these ``(inode, nlookup)`` references; a node no longer looked
        up loses its kernel-held state and goes once nothing uses it."""
        self.names.forget(items)

    async def getattr(self, ino: int) -> Attr:
        """The inode's attributes: from memory within the attribute timeout (unless this VFS changed
        it), else from its shard. A file removed while still open answers nlink 0, not ENOENT."""
        return await self.names.getattr(ino)

    async def setattr(self, ino: int, changes: dict[str, int], size: int | None = None) -> Attr:
        """Change ``mode``/``uid``/``gid``/``atime_ns``/``mtime_ns``/``ctime_ns`` and the size."""
        return await self.names.setattr(ino, changes, size)

    async def readlink(self, ino: int) -> bytes:
        """The target of symlink ``ino``."""
        return await self.names.readlink(ino)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        """A regular file, FIFO, socket or block/character device (metadata only: type, mode
        and device number; the kernel does their I/O)."""
        return await self.namespace.mknod(parent, name, mode, rdev, uid, gid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """Make directory ``name`` in ``parent`` owned by ``uid``/``gid`` (a setgid parent gives its
        group and bit); its attributes. EEXIST if the name is taken, EROFS on a read-only mount."""
        return await self.namespace.mkdir(parent, name, mode, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int
                      ) -> Attr:
        """Make symlink ``name`` in ``parent`` pointing at ``target``; its attributes. EEXIST if the
        name is taken, EROFS on a read-only mount."""
        return await self.namespace.symlink(parent, name, target, uid, gid)

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        """Give inode ``ino`` the new name ``name`` in ``parent``; its attributes after. EEXIST if
        the name is taken, EROFS on a read-only mount."""
        return await self.namespace.link(ino, parent, name)

    async def unlink(self, parent: int, name: bytes) -> None:
        """Remove the non-directory ``name`` from ``parent`` (answered at once from the directory's
        lease where this VFS holds it); ENOENT, EISDIR or EROFS as unlink(2)."""
        await self.namespace.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        """Remove the empty directory ``name`` from ``parent``; ENOTEMPTY, ENOTDIR or EROFS as
        rmdir(2)."""
        await self.namespace.rmdir(parent, name)

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int) -> None:
        """Rename as ``rename(2)``, with RENAME_NOREPLACE (1) and RENAME_EXCHANGE (2). A plain
        rename of a file within a directory this mount holds the lease of keeps the lease: it
        is answered from the lease and committed behind when the lease's names vouch for both
        names (``LeaseBook.movable``); else what the lease answered there is committed first,
        and the shard lets the holder's rename pass (the lease's names follow it)."""
        await self.namespace.rename(parent_old, name_old, parent_new, name_new, flags)

    # ------------------------------------------------------------------ files

    async def open(self, ino: int, flags: int, stream: int = 0) -> OpenFile:
        """Open a file; ``stream`` identifies the reader (a thread or process) for prefetch."""
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            return await self.writes.open(ino, flags)
        return await self.reads.open(ino, stream)

    async def read_unopened(self, ino: int, off: int, size: int, stream: int = 0
                            ) -> memoryview | bytearray | bytes:
        """A READ of a file the kernel opened without asking (a read-only mount that answers
        OPEN with ENOSYS): the first READ opens it here (what prefetch learns from an open, a
        small file fetched whole), and that handle is closed once the reads have covered the
        file (the kernel's pages hold it), when the kernel forgets the inode, or when it is the
        oldest past ``UNOPENED_MAX`` handles or ``UNOPENED_BYTES``. Where another process
        prefetches (``attach_owner``), a file's first READ here is told to it, and one past the
        first page waits for its answer: the page its hand-off held back, perhaps."""
        tail = self.handoff.read_tail(ino, off, size, stream)  # a page held back
        if tail is not None:
            return tail
        owner = self.owner
        if owner is not None and self.reads.unopened_handle(ino) is None \
                and not self.reads.is_opening(ino):
            tail = await owner.first_read(ino, off, size, stream)  # its hand-off's page
            if tail is not None:
                return tail  # (counted by the owner, as its hand-off's)
        return await self.reads.read_unopened(ino, off, size, stream)

    def attach_owner(self, owner: PrefetchOwner) -> None:
        """Prefetch runs in another process that serves this mount (``PrefetchOwner``): tell it
        each entry handed to the kernel and each file a READ opens here, and answer the page its
        hand-off held back from what it says. This VFS's own prefetcher fetches nothing ahead
        (``PrefetchConfig.ahead``)."""
        self.owner = owner
        self.inodes.named = owner.named

    def peer_read(self, ino: int, off: int, size: int, stream: int) -> bytes | None:
        """Another process serving this mount had the first READ of ``ino``
        (``PrefetchOwner.first_read``): the page this VFS's hand-off held back, if it is that
        page; else the read counts as the file's open for prefetch here, and None."""
        tail = self.handoff.read_tail(ino, off, size, stream)
        if tail is None:
            self.reads.opened_elsewhere(ino, stream)
        return tail

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[OpenFile, Attr]:
        """open(O_CREAT): the file (made if missing; EEXIST with O_EXCL), opened."""
        return await self.writes.create(parent, name, mode, flags, uid, gid)

    async def read(self, fh: int, off: int, size: int) -> memoryview | bytearray | bytes:
        """Up to ``size`` bytes at ``off`` through handle ``fh`` (fewer at end of file): from the
        bytes fetched at open, the handle's writer, or the file's chunks."""
        return await self.reads.read(fh, off, size)

    async def write(self, fh: int, off: int, buf) -> int:
        """Write ``buf`` at ``off`` through handle ``fh`` (buffered in the file's writer, committed
        past the dirty bound); the bytes taken. EBADF if the handle is not open for writing."""
        return await self.writes.write(fh, off, buf)

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """Allocate as ``fallocate(2)``: modes 0 and FALLOC_FL_KEEP_SIZE (others:
        EOPNOTSUPP)."""
        await self.writes.fallocate(fh, mode, off, length)

    async def flush(self, fh: int) -> None:
        """Commit what the handle wrote (close-to-open: the next open elsewhere sees it); on a
        write-behind mount a file made under a lease is committed behind the close (the module
        docstring)."""
        await self.writes.flush(fh)

    async def fsync(self, fh: int) -> None:
        """Commit, and return once the file's bytes and metadata are durable (its blobs are
        fsynced by the storage nodes before any commit; the shard's sync covers the rest)."""
        await self.writes.fsync(fh)

    async def fsyncdir(self, ino: int) -> None:
        """Return once the directory's entries are durable."""
        await self.writes.fsyncdir(ino)

    async def release(self, fh: int) -> None:
        """RELEASE of handle ``fh``: the last handle writing a file commits what is left."""
        await self.writes.release(fh)

    async def commit_all(self) -> None:
        """Commit every file with buffered writes and make every change durable (before an
        unmount); errors are logged."""
        await self.commits.commit_all()

    # ------------------------------------------------------------------ directories

    def opendir(self, ino: int) -> int:
        """A directory handle on ``ino`` (``readdir`` reads through it)."""
        return self.directories.opendir(ino)

    def readdir(self, fh: int, start: int
                      ) -> AsyncGenerator[tuple[bytes, Attr, int], None]:
        """Entries from position ``start`` on: (name, attributes, position after it), with
        "." and ".." first. Use with ``contextlib.aclosing``."""
        return self.directories.readdir(fh, start)

    def releasedir(self, fh: int) -> None:
        """Free directory handle ``fh``."""
        self.directories.releasedir(fh)

    # ------------------------------------------------------------------ filesystem

    async def statfs(self) -> StatFS:
        """Capacity as JPFS sees it: its own stored bytes (over the replicas) as used, and the
        free space of each distinct storage disk (over the replicas) as what may still be
        written; storage nodes that share a disk count it once."""
        return await self.capacity.statfs()

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        """The value of attribute ``name`` (``Xattrs.get``); ENODATA where it is not set."""
        return await self.xattrs.get(ino, name)

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """Set attribute ``name`` (``Xattrs.set``); EROFS on a read-only mount."""
        await self.xattrs.set(ino, name, value, flags)

    async def listxattr(self, ino: int) -> list[bytes]:
        """The names of the inode's extended attributes."""
        return await self.xattrs.list(ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        """Remove attribute ``name`` (``Xattrs.remove``); ENODATA where it is not set."""
        await self.xattrs.remove(ino, name)


__all__ = ["FALLOC_FL_KEEP_SIZE", "OPEN_OUTCOMES", "VFS", "Notifier", "NullNotifier",
           "OpenFile", "VFSConfig", "VFSStats"]
