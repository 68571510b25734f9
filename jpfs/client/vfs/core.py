"""The VFS: JPFS as an inode-level filesystem, what the FUSE mount (or any other front end) asks.

The front end translates its requests into these calls and their ``JPFSError`` into its own error
form at one place; everything a filesystem decides lives here: which inodes are held and what is
known of them, open handles, the one reader and the writers, prefetch signals, and what the
kernel's caches must be told (through the ``Notifier`` the front end passes in).

The cost of a mount is requests per file (docs/design-notes.md), so answers come from memory where
that is safe:

- attributes of a node are trusted for ``attr_timeout`` (forever with ``read_only``) unless this
  VFS changed the inode, its parent or its names since: then the next ``getattr`` asks the
  metadata service, so a process always sees its own changes (nlink, size, mode, times);
- lookups in directories being read are answered from the prefetcher's listings, and lookups
  that find nothing in directories being written from their names as this VFS knows them
  (``listings.KnownDirs``; within the entry timeout, as the kernel's caches);
- an open of a file whose bytes the kernel caches (same version) keeps the kernel's pages;
- a small file is fetched whole at open (usually prefetched already) and pushed into the kernel's
  page cache, so its reads never reach us;
- creates and unlinks in a directory this VFS holds the write lease of are answered at once and
  committed behind in batches (``leases.py``).

Write semantics: writes are buffered per file (one ``FileWriter`` shared by the handles writing
it) and committed on flush (close), fsync, release and every 64 MiB, each commit one metadata
transaction guarded by the version the writer started from, so other nodes see the old bytes or
the new, never a mix. Another node sees the new bytes when it next opens the file (an open
revalidates the layout unless ``read_only``). With ``write_behind``, a file made under a lease
and not sent yet is committed behind its close (``BEHIND_FILES``): its create waits in the
lease's queue for its bytes, so the shard, and every other node, learns of it with them;
whatever asks about it first (an open, a getattr, fsync, another node) waits for both, as it
waits for a create. Without it a close returns once the file is committed: a killed mount loses
no closed file.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager

import trio

from ...config import Cluster
from ...errors import JPFSError, error
from ...placement import shard_of
from ...proto.meta import check_name
from ...types import ROOT_INO, Attr, Layout, StatFS
from ..client import AsyncClient
from ..data.cache import BlobCache
from ..data.listings import KnownDirs
from ..data.prefetch import KernelBatch, PrefetchConfig, Prefetcher
from ..data.reader import chunk_map
from ..data.writer import FileWriter
from ..wire.storage import Moved
from .handles import DirHandle, FileHandle, Handles
from .inodes import Inodes, Node
from .leases import DirLeases, GiveBack, LeasedDir
from .types import (
    OPEN_OUTCOMES,
    Handed,
    Notifier,
    NullNotifier,
    OpenFile,
    VFSConfig,
    VFSStats,
    outcome_of,
)
from .xattrs import Xattrs

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
_DEVICES = (stat.S_IFBLK, stat.S_IFCHR)
PAGE = 4096
"""The kernel's page size."""
HAND_SAMPLE = 8
"""A sweep gives the kernel one file in this many without its last page (``_hand_to_kernel``)."""
INTRODUCED_MAX = 4096
"""Directories remembered as listed through the mount for ``_hand_to_kernel``."""
UNOPENED_MAX = 1024
"""Handles the VFS keeps for files the kernel opened without asking and has not read whole (the
oldest is closed first; a later READ opens it again)."""
UNOPENED_BYTES = 256 << 20
"""... and the bytes of whole small files those handles may hold (views that keep blobs alive
after the memory cache let them go)."""
BEHIND_FILES = 64
"""Files made under a lease whose close is answered before their bytes are stored, at most at
once; a close past this (or past ``BEHIND_BYTES``) stores them before it is answered."""
BEHIND_BYTES = 64 << 20
"""... and their bytes."""


class VFS:
    """JPFS by inode (see the module docstring). Build it with ``await VFS.connect(...)``."""

    def __init__(self, client: AsyncClient, inodes: Inodes, config: VFSConfig,
                 notifier: Notifier, *, prefetcher: Prefetcher | None = None):
        prefetcher = prefetcher or client.prefetcher
        if client.data is None or client.reader is None or prefetcher is None:
            raise error(errno.ENODEV, "this cluster has no storage nodes: nothing to mount")
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
        self.handles = Handles()
        self.stats = VFSStats()
        self._listing_age = float("inf") if self.ro else config.entry_timeout
        self._attr_age = float("inf") if self.ro else config.attr_timeout
        self._statfs: tuple[float, StatFS | None] = (0.0, None)
        self.known: KnownDirs | None = None if self.ro or config.entry_timeout <= 0 else \
            KnownDirs(self.meta, config.entry_timeout)
        """Names of directories being written (None on read-only mounts: listings do it)."""
        self.leases: DirLeases | None = None
        """Directories whose creates and unlinks this VFS answers from memory (``leases.py``)."""
        if self.known is not None and config.dir_leases:
            # on a write-behind mount, a close that finds its create held goes behind it
            self.leases = DirLeases(self.meta, client.nursery, self._lease_granted,
                                    self._lease_ended, self._lease_failed,
                                    writing=self._writing if config.write_behind else None)
        self.xattrs = Xattrs(self.meta, inodes, self.stats, self._attr_age, self._writable)
        self.xattrs.settle = self._settle
        self._unopened: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Inode -> (the handle its first READ opened, the bytes it holds), where the kernel
        sends no OPEN."""
        self._unopened_bytes = 0
        self._opening: dict[int, trio.Event] = {}
        self._introduced: dict[int, trio.Event] = {}
        """Directories whose entries this VFS made the kernel hold (``_hand_to_kernel``)."""
        self._handed: dict[int, Handed] = {}
        """Inode -> a file given to the kernel but for its last page, until that is read."""
        self._hand_group = 0
        """Files handed whole since the last one handed without its last page."""
        self._hand_carry = 0
        """... and their bytes."""
        if prefetcher.config.handoff:
            client.nursery.start_soon(self._take_handoffs)
        self._behind: dict[int, int] = {}
        """Inode -> its bytes, for files whose close was answered before they were stored."""
        self._behind_bytes = 0
        self._behind_done = trio.Event()
        self._behind_done.set()
        self._behind_lost: dict[int, int] = {}
        """Inode -> directory, for files whose bytes a store behind their close lost (until an
        fsync reports it, or a later commit stores them)."""

    @classmethod
    async def connect(cls, nursery: trio.Nursery, cluster: Cluster, cache: BlobCache,
                      config: VFSConfig, notifier: Notifier | None = None, *,
                      prefetch: bool = True) -> VFS:
        """Connect to ``cluster`` and build the VFS over ``cache`` (an opened BlobCache)."""
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
        # what sweeps and scans fetch on to it (``_take_handoffs``)
        prefetcher = Prefetcher(client.meta, client.storage.get, cache, PrefetchConfig(
            enabled=prefetch, small_file=config.small_file, layouts=config.read_only,
            kernel_ahead=config.kernel_ahead,
            handoff=config.read_only and config.notify_store), inodes.kernel_has)
        nursery.start_soon(prefetcher.run)
        return cls(client, inodes, config, notifier or NullNotifier(), prefetcher=prefetcher)

    def close(self) -> None:
        """Close the client under the VFS (its connections); a mount calls it last, as it ends."""
        self.client.close()

    # ------------------------------------------------------------------ helpers

    def attr_of(self, node: Node) -> Attr:
        """What a reader of the node sees now (a writer's size counts before its commit)."""
        w = node.writer
        if w is not None and w.size != node.attr.size:
            return node.attr.with_(size=w.size)
        return node.attr

    def _owner(self, parent: int, uid: int, gid: int, mode: int) -> tuple[int, int]:
        """(gid, mode) of a new inode: a setgid directory gives its group, and to a new
        directory its setgid bit (as Linux does on local filesystems)."""
        p = self.inodes.get(parent)
        if p is not None and p.attr.mode & stat.S_ISGID:
            gid = p.attr.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return gid, mode

    def _writable(self) -> None:
        if self.ro:
            raise error(errno.EROFS, "the mount is read-only")

    def _changed_dir(self, *inos: int) -> None:
        """Directories whose entries (and so times, nlink) changed, attributes unknown."""
        for ino in inos:
            self.prefetcher.forget_dir(ino)
        self.inodes.stale(*inos)

    def _post_op(self, ino: int, attr: Attr | None) -> None:
        """A directory changed and the shard said how it is now (its post-op attributes)."""
        self.prefetcher.forget_dir(ino)
        if attr is None:
            self.inodes.stale(ino)
        else:
            self.inodes.update(attr)

    @contextmanager
    def _names_of(self, *dirs: int) -> Iterator[None]:
        """Around a namespace change: if it fails, what this VFS knew of the directories' names
        may be wrong (EEXIST where it knew of nothing): forget it."""
        try:
            yield
        except JPFSError:
            if self.known is not None:
                for d in dirs:
                    self.known.drop(d)
            raise

    def _made_in(self, parent: int, name: bytes, child: Attr, subdir: bool = False) -> None:
        """``child`` was just made in ``parent``. Made in one transaction on the parent's shard
        (files, symlinks, directories placed there), the parent's new mtime and ctime are the
        child's ctime to the nanosecond (and a directory adds a link): no need to ask again,
        and the attributes stay as fresh as they were. Anything else: ask next time."""
        self.prefetcher.forget_dir(parent)
        here = shard_of(child.ino) == shard_of(parent)
        if self.known is not None:
            self.known.changed(parent, added=name)
        node = self.inodes.get(parent)
        if node is None:
            return
        if not here or node.fetched == float("-inf"):
            self.inodes.stale(parent)
            return
        t = child.ctime_ns
        node.attr = node.attr.with_(mtime_ns=t, ctime_ns=t,
                                    nlink=node.attr.nlink + (1 if subdir else 0))

    async def _node(self, ino: int) -> Node:
        node = self.inodes.get(ino)
        if node is None:
            attr = await self.meta.getattr(ino)
            node = self.inodes.get(ino) or self.inodes.remember(attr, 0, b"", lookup=False)
        return node

    def _handle(self, fh: int) -> FileHandle:
        h = self.handles.get(fh)
        if type(h) is not FileHandle:
            raise error(errno.EBADF, "no such file handle")
        return h

    def name_of(self, node: Node) -> str:
        """The node's path from the mount's root for log lines, or ``inode N`` where it is
        unknown."""
        return self.inodes.path(node) or f"inode {node.ino}"

    def snapshot(self) -> dict:
        """The VFS's counts (inodes, handles, counters, names, leases), as one JSON-able object."""
        return {"inodes": len(self.inodes), "handles": len(self.handles),
                **self.stats.as_dict(),
                "names": self.known.as_dict() if self.known is not None else {},
                "leases": self.leases.as_dict() if self.leases is not None else {}}

    # ------------------------------------------------------------------ leases

    async def _settle(self, *inos: int) -> None:
        """Files this VFS answered from a lease and directories holding them: known to the
        shard before it is asked about them."""
        leases = self.leases
        if leases is not None and leases.dirs:
            await leases.book.settle(*inos)

    async def _give_back(self, *dirs: int) -> None:
        """Before this VFS changes these directories' names through the shard."""
        leases = self.leases
        if leases is not None and leases.dirs:
            for d in dirs:
                if d in leases.dirs:
                    await leases.give_back(d)

    def _writing(self, ino: int) -> bool:
        node = self.inodes.get(ino)
        return node is not None and node.writer is not None and node.writer.refs > 0

    def _lease_granted(self, parent: int, names: list[bytes]) -> None:
        assert self.known is not None
        self.known.pin(parent, names)

    def _lease_ended(self, parent: int, lost: bool) -> None:
        assert self.known is not None
        if lost:
            self.known.drop(parent)
        else:
            self.known.unpin(parent)

    def _lease_failed(self, parent: int, name: bytes, attr: Attr | None, err: OSError,
                      change: str) -> None:
        node = self.inodes.get(attr.ino) if attr is not None else None
        what = self.name_of(node) if node is not None else f"{name!r} in directory {parent:#x}"
        if attr is None:
            log.error("%s: the metadata shard refused its %s (%s); the names may be as they "
                      "were before it", what, change, err.strerror or err)
        else:
            log.error("%s: the metadata shard refused the new file (%s); it is lost", what,
                      err.strerror or err)
            self.inodes.stale(attr.ino)
        if self.known is not None:
            self.known.drop(parent)
        self._changed_dir(parent)

    # ------------------------------------------------------------------ names

    async def lookup(self, parent: int, name: bytes) -> Attr:
        """The entry ``name`` in ``parent`` (the kernel counts one more lookup of it)."""
        leases = self.leases
        if leases is not None and leases.dirs:
            new = leases.book.entry(parent, name)
            if new is not None:  # answered from the lease, not committed yet
                held = self.inodes.get(new.ino)
                node = self.inodes.remember(held.attr if held is not None else new, parent,
                                            name, fetched=held.fetched if held else None)
                return self.attr_of(node)
            held = self.inodes.get(leases.book.named(parent, name) or 0)
            if held is not None:  # the lease vouches for the name, the kernel knows the inode
                leases.stats["lookups"] += 1
                node = self.inodes.remember(held.attr, parent, name, fetched=held.fetched)
                return self.attr_of(node)  # with what is left of its attributes' time
        lst = self.prefetcher.listings.get(parent, self._listing_age)
        if lst is not None:
            i = lst.pos.get(name)
            if i is not None:
                self.stats.lookups_listed += 1
                node = self.inodes.remember(lst.attrs[i], parent, name, fetched=lst.fetched)
                return self.attr_of(node)
            if lst.complete:
                raise error(errno.ENOENT, "no such entry")
        known = self.known
        if known is not None and known.absent(parent, check_name(name)):
            raise error(errno.ENOENT, "no such entry")
        try:
            attr = await self.meta.lookup(parent, name)
        except JPFSError as e:
            if known is not None and e.errno == errno.ENOENT:
                await known.missed(parent)
            raise
        if leases is not None and leases.book.busy(attr.ino):  # a leased directory, behind
            await leases.book.settle(attr.ino)
            attr = await self.meta.getattr(attr.ino)
        self.stats.lookups_asked += 1
        if self._listing_age > 0:  # a stat of every file there lists it (``looked_up``)
            self.prefetcher.looked_up(parent, self._listing_age)
        return self.attr_of(self.inodes.remember(attr, parent, name))

    def fresh_for(self, ino: int) -> float:
        """How much longer the attributes this VFS holds of ``ino`` may be trusted (the
        attribute timeout less their age): what the kernel may cache them for."""
        if self.ro:  # attributes never go stale here (_attr_age is infinite)
            return self.config.attr_timeout
        node = self.inodes.get(ino)
        if node is None:
            return self.config.attr_timeout
        return max(0.0, min(self.config.attr_timeout,
                            self._attr_age - (time.monotonic() - node.fetched)))

    def forget(self, items) -> None:
        """FORGET: the kernel dropped these ``(inode, nlookup)`` references; a node no longer looked
        up loses its kernel-held state and goes once nothing uses it."""
        for ino, n in items:
            node = self.inodes.get(ino)
            if node is not None and node.lookups <= n:
                if ino in self._unopened:
                    self._close_unopened(ino)
                self._unhand(ino)
            self.inodes.forget(ino, n)

    async def getattr(self, ino: int) -> Attr:
        """The inode's attributes: from memory within the attribute timeout (unless this VFS changed
        it), else from its shard. A file removed while still open answers nlink 0, not ENOENT."""
        node = self.inodes.get(ino)
        if node is not None and time.monotonic() - node.fetched < self._attr_age:
            return self.attr_of(node)
        await self._settle(ino)
        try:
            attr = await self.meta.getattr(ino)
        except JPFSError as e:
            if e.errno == errno.ENOENT and node is not None and (node.opens or node.writer):
                node.attr, node.fetched = node.attr.with_(nlink=0), time.monotonic()
                return self.attr_of(node)  # removed, still open
            raise
        node = self.inodes.update(attr)
        return self.attr_of(node) if node is not None else attr

    async def setattr(self, ino: int, changes: dict[str, int], size: int | None = None) -> Attr:
        """Change ``mode``/``uid``/``gid``/``atime_ns``/``mtime_ns``/``ctime_ns`` and the size."""
        self._writable()
        await self._settle(ino)
        node = self.inodes.get(ino)
        w = node.writer if node is not None else None
        before = node.attr.version if node is not None else None
        if size is not None:
            if node is not None and w is not None:
                async with w.lock:
                    await w.truncate(size)
                self._committed(node, w)
            else:
                changes = {**changes, "size": size}
        elif node is not None and w is not None and ("mtime_ns" in changes or
                                                     "atime_ns" in changes):
            await self._commit(node, w)  # or it overwrites the times
        if not changes and size is None:
            # the kernel asks with nothing to set for chown(f, -1, -1) and the like: a change
            # all the same, as on a local filesystem (the kernel leaves ctime to us)
            changes = {"ctime_ns": time.time_ns()}
        new = await self.meta.setattr(ino, **changes) if changes else \
            await self.meta.getattr(ino)
        node = self.inodes.update(new)
        if node is not None and size is not None and node.kernel_version == before:
            node.kernel_version = new.version  # the kernel truncated its own pages
            node.layout = None
        return self.attr_of(node) if node is not None else new

    async def readlink(self, ino: int) -> bytes:
        """The target of symlink ``ino``."""
        return await self.meta.readlink(ino)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        """A regular file, FIFO, socket or block/character device (metadata only: type, mode
        and device number; the kernel does their I/O)."""
        self._writable()
        await self._give_back(parent)
        gid, mode = self._owner(parent, uid, gid, mode)
        with self._names_of(parent):
            attr = await self.meta.mknod(parent, name, mode,
                                         rdev if stat.S_IFMT(mode) in _DEVICES else 0, uid, gid)
        self._made_in(parent, name, attr)
        return self.attr_of(self.inodes.remember(attr, parent, name))

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """Make directory ``name`` in ``parent`` owned by ``uid``/``gid`` (a setgid parent gives its
        group and bit); its attributes. EEXIST if the name is taken, EROFS on a read-only mount."""
        self._writable()
        await self._give_back(parent)
        gid, mode = self._owner(parent, uid, gid, stat.S_IFDIR | (mode & 0o7777))
        sent = time.monotonic()
        with self._names_of(parent):
            attr, after = await self.meta.mkdir(parent, name, mode & 0o7777, uid, gid)
        self._made_in(parent, name, attr, subdir=True)
        if after is not None:
            self._post_op(parent, after)
        if self.known is not None:
            self.known.made(attr.ino, sent)
        return self.attr_of(self.inodes.remember(attr, parent, name))

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int
                      ) -> Attr:
        """Make symlink ``name`` in ``parent`` pointing at ``target``; its attributes. EEXIST if the
        name is taken, EROFS on a read-only mount."""
        self._writable()
        await self._give_back(parent)
        gid, _ = self._owner(parent, uid, gid, stat.S_IFLNK)
        with self._names_of(parent):
            attr = await self.meta.symlink(parent, name, target, uid, gid)
        self._made_in(parent, name, attr)
        return self.attr_of(self.inodes.remember(attr, parent, name))

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        """Give inode ``ino`` the new name ``name`` in ``parent``; its attributes after. EEXIST if
        the name is taken, EROFS on a read-only mount."""
        self._writable()
        await self._settle(ino)
        await self._give_back(parent)
        with self._names_of(parent):
            attr = await self.meta.link(ino, parent, name)
        self._changed_dir(parent)
        if self.known is not None:
            self.known.changed(parent, added=name)
        return self.attr_of(self.inodes.remember(attr, parent, name))

    async def unlink(self, parent: int, name: bytes) -> None:
        """Remove the non-directory ``name`` from ``parent`` (answered at once from the directory's
        lease where this VFS holds it); ENOENT, EISDIR or EROFS as unlink(2)."""
        self._writable()
        leases = self.leases
        node = self.inodes.child(parent, name)
        if leases is not None and node is not None and not node.attr.is_dir:
            ld = await leases.hold(parent)
            if ld is not None and leases.book.removable(ld, name, node.ino):
                try:
                    await leases.remove(ld, name, node.ino)
                except GiveBack:
                    pass
                else:
                    self._unlinked(parent, name)
                    return
        await self._give_back(parent)
        with self._names_of(parent), self._changing(parent):
            after = await self.meta.unlink(parent, name)
        gone = self.inodes.unname(parent, name)
        if self.known is not None:
            self.known.changed(parent, removed=name)
        self._post_op(parent, after)
        if gone is not None:
            self.inodes.stale(gone.ino)  # nlink and ctime changed

    def _unlinked(self, parent: int, name: bytes) -> None:
        """An unlink answered from a lease: what the shard's post-op answer would have told."""
        gone = self.inodes.unname(parent, name)
        if self.known is not None:
            self.known.changed(parent, removed=name)
        self._touched_in_lease(parent)
        if gone is not None:
            self.inodes.stale(gone.ino)  # nlink and ctime: asked (after the batch) next time

    async def rmdir(self, parent: int, name: bytes) -> None:
        """Remove the empty directory ``name`` from ``parent``; ENOTEMPTY, ENOTDIR or EROFS as
        rmdir(2)."""
        self._writable()
        await self._give_back(parent)
        child = self.inodes.child(parent, name)
        if child is not None:
            await self._give_back(child.ino)  # its own entries, which it must not have
        with self._names_of(parent):
            after = await self.meta.rmdir(parent, name)
        gone = self.inodes.unname(parent, name)
        if self.known is not None:
            self.known.changed(parent, removed=name)
            if gone is not None:
                self.known.drop(gone.ino)
        self._post_op(parent, after)
        if gone is not None:
            self.inodes.stale(gone.ino)
        self.inodes.moved()

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int) -> None:
        """Rename as ``rename(2)``, with RENAME_NOREPLACE (1) and RENAME_EXCHANGE (2). A plain
        rename of a file within a directory this mount holds the lease of keeps the lease: it
        is answered from the lease and committed behind when the lease's names vouch for both
        names (``DirLeases.movable``); else what the lease answered there is committed first,
        and the shard lets the holder's rename pass (the lease's names follow it)."""
        self._writable()
        leases = self.leases
        ld = None
        moving = self.inodes.child(parent_old, name_old)
        if leases is not None and parent_old == parent_new and not flags and moving is not None \
                and moving.attr.is_reg and shard_of(moving.ino) == shard_of(parent_old):
            # one shard's transaction (a file made in the directory): no self-recall
            ld = await leases.hold(parent_old)
            target = self.inodes.child(parent_new, name_new)
            if ld is not None and (target is None or target.attr.is_reg) and leases.book.movable(
                    ld, name_old, moving.ino, name_new, target.ino if target else None):
                leases.rename(ld, name_old, name_new)
                if target is None or target.ino != moving.ino:  # else rename(2) does nothing
                    self._moved(parent_old, name_old, parent_new, name_new, 0, None)
                return
            if ld is not None:
                await leases.book.settle(parent_old)
        if ld is None:
            await self._give_back(parent_old, parent_new)
        with self._names_of(parent_old, parent_new), self._changing(parent_old), \
                self._changing(parent_new):
            src_after, dst_after = await self.meta.rename(
                parent_old, name_old, parent_new, name_new, flags,
                session=leases.session if leases is not None and ld is not None else None)
        if leases is not None and ld is not None:
            leases.book.renamed(ld, name_old, name_new)
        self._moved(parent_old, name_old, parent_new, name_new, flags, (src_after, dst_after))

    def _moved(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int, after: tuple | None) -> None:
        """What this VFS knows after a rename: ``after``, the shard's post-op attributes of both
        directories, or None for a rename answered from the lease (the directory's times are
        now; the moved file's ctime is asked after the batch)."""
        if self.known is not None:
            exchange = bool(flags & 2)
            self.known.changed(parent_old, removed=None if exchange else name_old)
            self.known.changed(parent_new, added=name_new)
            if exchange:
                self.known.changed(parent_old, added=name_old)
        moved = self.inodes.unname(parent_old, name_old)
        other = self.inodes.unname(parent_new, name_new)
        if after is None:
            self._touched_in_lease(parent_old)
        else:
            self._post_op(parent_old, after[0])
            if parent_new != parent_old:
                self._post_op(parent_new, after[1])
        for node, p, n in ((moved, parent_new, name_new),
                           (other if flags & 2 else None, parent_old, name_old)):
            if node is not None:  # keep the names right: co-access learning works on paths
                self.inodes.remember(node.attr, p, n, lookup=False)
                self.inodes.stale(node.ino)  # its ctime moved
        if other is not None and not flags & 2:
            self.inodes.stale(other.ino)  # replaced: one link fewer
        self.inodes.moved()

    def _touched_in_lease(self, parent: int) -> None:
        """``parent``'s names changed by a change answered from its lease: its times are
        now."""
        self.prefetcher.forget_dir(parent)
        node = self.inodes.get(parent)
        if node is not None and node.fetched != float("-inf"):
            t = time.time_ns()
            node.attr = node.attr.with_(mtime_ns=t, ctime_ns=t)

    # ------------------------------------------------------------------ files

    async def open(self, ino: int, flags: int, stream: int = 0) -> OpenFile:
        """Open a file; ``stream`` identifies the reader (a thread or process) for prefetch."""
        await self._settle(ino)
        node = self.inodes.get(ino) or await self._node(ino)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            return await self._open_write(node, flags)
        if node.writer is not None:  # being written here: reads go through the writer
            node.opens += 1
            self.stats.opens["memory"] += 1
            return OpenFile(self.handles.add(FileHandle(node, writer=None)), True)
        if self.ro and node.kernel_version == node.attr.version and node.layout is not None:
            node.opens += 1  # the kernel holds these bytes: nothing to fetch, nothing to check
            self.stats.opens["kernel"] += 1
            return OpenFile(self.handles.add(FileHandle(node, node.layout)), True)
        return await self._open_read(node, stream)

    async def _open_read(self, node: Node, stream: int, *, by_kernel: bool = False
                         ) -> OpenFile:
        """Open for reading; ``by_kernel``: the kernel opened the file without asking and is
        reading it now (its pages are missing, and the READ answers with the bytes)."""
        ino = node.ino
        cfg = self.config
        layout: Layout | None = None
        if self.ro:
            layout = node.layout or self.prefetcher.layout(ino)
        elif cfg.open_cache > 0 and node.layout is not None \
                and time.monotonic() - node.fetched < cfg.open_cache:
            layout = node.layout
        if layout is None:
            layout = await self.meta.get_layout(ino)
            self.inodes.update(layout.attr)
        elif node.attr.version != layout.attr.version:
            self.inodes.update(layout.attr)
        if node.writer is not None:  # a writer opened it while we fetched
            node.opens += 1
            self.stats.opens["memory"] += 1
            return OpenFile(self.handles.add(FileHandle(node)), True)
        node.layout = layout
        attr = layout.attr
        version = attr.version
        stale = node.kernel_version is not None and node.kernel_version != version
        keep = not by_kernel and node.kernel_version == version
        h = FileHandle(node, layout)
        fh = self.handles.add(h)
        node.opens += 1
        try:
            if node.parent and self.prefetcher.enabled:
                path = self.inodes.path(node)
                if path is not None:
                    ready = all(not self.cache.needs(c.blob) for c in layout.chunks)
                    self.prefetcher.opened(stream, ino, node.parent, node.name, path, attr,
                                           ready)
            if keep:
                outcome = "kernel"
            elif not layout.chunks or attr.size == 0:
                outcome = "empty"
            elif attr.size <= cfg.small_file:
                sources: set[str] = set()
                try:
                    (h.data,) = await self.reader.whole([layout], sources)
                except JPFSError as e:
                    log.warning("cannot read %s: %s", self.name_of(node), e.strerror)
                    raise
                outcome = outcome_of(sources)
                # Only when no other handle is open: then no READ of this inode can hold page
                # locks that the store would wait for while we cannot answer.
                if not stale and not by_kernel and node.opens == 1 and cfg.notify_store \
                        and self.notifier.store(ino, h.data):
                    keep = True
                    self.stats.notify_store_bytes += len(h.data)
                    self.cache.delivered([c.blob for c in layout.chunks])
            else:
                outcome = "deferred"
        except BaseException:
            self.handles.pop(fh)
            node.opens -= 1
            raise
        if stale and (by_kernel or not self.ro):
            # the kernel's size may be stale too; where it keeps pages across opens, its next
            # look at the attributes drops the old version's pages (mtime and size changed)
            self.notifier.invalidate_attr(ino)
        node.kernel_version = version
        self.stats.opens[outcome] += 1
        return OpenFile(fh, keep)

    async def read_unopened(self, ino: int, off: int, size: int, stream: int = 0
                            ) -> memoryview | bytearray | bytes:
        """A READ of a file the kernel opened without asking (a read-only mount that answers
        OPEN with ENOSYS): the first READ opens it here (what prefetch learns from an open, a
        small file fetched whole), and that handle is closed once the reads have covered the
        file (the kernel's pages hold it), when the kernel forgets the inode, or when it is the
        oldest past ``UNOPENED_MAX`` handles or ``UNOPENED_BYTES``."""
        handed = self._unhand(ino)
        if handed is not None and off >= handed.cut:
            node = self.inodes.get(ino)
            if node is not None and node.attr.version == handed.version:
                self.stats.handed_reads += 1
                path = self.inodes.path(node) if node.parent else None
                if path is not None:
                    self.prefetcher.opened(stream, ino, node.parent, node.name, path,
                                           node.attr, True)
                self.stats.read_bytes += min(size, len(handed.tail))
                return handed.tail[off - handed.cut:off - handed.cut + size]
        held = self._unopened.get(ino)
        if held is None:
            fh = await self._open_unopened(ino, stream)
        else:
            fh = held[0]
            self._unopened.move_to_end(ino)
        h = self._handle(fh)
        out = await self.read(fh, off, size)
        h.served += len(out)
        held = self._unopened.get(ino)
        if h.served >= h.node.attr.size and held is not None and held[0] == fh:
            if h.data is not None and h.layout is not None and self.config.notify_store:
                self.cache.delivered([c.blob for c in h.layout.chunks])
            self._close_unopened(ino)
        return out

    async def _take_handoffs(self) -> None:
        """Hand each batch the prefetcher fetched for the kernel, each in a task of its own."""
        async with trio.open_nursery() as nursery:
            async for batch in self.prefetcher.handoffs:
                nursery.start_soon(self._hand_batch, batch)

    async def _hand_batch(self, batch: KernelBatch) -> None:
        handed, failed = 0, False
        try:
            handed = await self._hand_to_kernel(batch.parent, batch.attrs)
        except Exception:
            failed = True  # prefetch is a hint: the files' READs fetch what this missed
            log.exception("a prefetch task failed")
        finally:
            self.prefetcher.handed(batch, handed, failed=failed)

    async def _hand_to_kernel(self, parent: int, attrs: list[Attr]) -> int:
        """A read-only mount's directory sweep or scan fetched ``attrs`` (files of ``parent``):
        give them to the kernel's page cache now, before anybody reads them. Their readers then
        make no request at all (the kernel holds the entries, the pages and, with no OPEN, the
        open), where each cost a LOOKUP and a READ carrying the file, and the mount frees the
        blobs at once, so its memory is reused warm rather than grown into (page faults,
        docs/perf.md).

        The kernel says nothing when it serves a file, and prefetch must still know how far
        ahead of its readers it is (handed bytes count against ``kernel_ahead``). So one file
        in ``HAND_SAMPLE`` is handed without its last page and carries the bytes of the files
        handed whole before it: the READ of that page, answered from memory, releases them and
        counts as the file's open for prefetch. A shuffled reader reaches the sampled files at
        the pace it reaches the rest; a scan takes an in-order reader's jump past the files it
        handed as the reader's progress. Files whose opens co-access rules predict from (an
        episode's parquet, whose videos are fetched when it is opened) all keep their last page
        while the partners' directory is not swept, so those opens are still seen.

        The kernel must hold an inode to take pages for it: the first batch of a directory
        lists it through the mount (its entries then are lookups the kernel counts), and a
        batch that finds files the kernel let go of lists it again. A file open or being
        opened here is left to its READs, which find the blob in the cache."""
        ready = self._introduced.get(parent)
        if ready is not None and ready.is_set() and any(
                self.inodes.get(a.ino) is None for a in attrs):
            ready = None
        if ready is None:
            while len(self._introduced) >= INTRODUCED_MAX:
                del self._introduced[next(iter(self._introduced))]
            ready = self._introduced[parent] = trio.Event()
            path = self.inodes.dir_path(parent)
            try:
                if path is not None:
                    await self.notifier.introduce(path)
            finally:
                ready.set()
        await ready.wait()
        files: list[tuple[int, memoryview]] = []
        picked: list[tuple[Node, Layout, memoryview]] = []
        for a in attrs:
            node = self.inodes.get(a.ino)
            if node is None or node.lookups <= 0 or node.opens or node.writer is not None \
                    or a.ino in self._opening or a.ino in self._handed \
                    or node.kernel_version == a.version:
                continue
            layout = node.layout or self.prefetcher.layout(a.ino)
            if layout is None or layout.attr.version != a.version or not layout.chunks:
                continue
            views = [self.cache.peek(c) for c in layout.chunks]
            if any(v is None for v in views):
                continue
            node.layout = layout
            data = views[0] if len(views) == 1 else \
                memoryview(b"".join(views))  # type: ignore[arg-type]
            assert data is not None
            files.append((a.ino, data))
            picked.append((node, layout, data))
        if not files:
            return 0
        samples: dict[int, int] = {}
        for k, ((ino, data), (node, _, _)) in enumerate(zip(files, picked, strict=True)):
            path = self.inodes.path(node)
            seen = path is not None and self.prefetcher.predicts_from(path)
            if (seen or self._hand_group + 1 >= HAND_SAMPLE) and len(data) > PAGE:
                samples[ino] = cut = (len(data) - 1) // PAGE * PAGE
                files[k] = (ino, data[:cut])
                self._hand_group = 0
            else:
                self._hand_group += 1
        stored = await self.notifier.store_many(files)
        handed = 0
        for (node, layout, data), ok in zip(picked, stored, strict=True):
            if ok and node.ino in self._unopened:
                self._stored_under_reader(node.ino, len(data))
            if not ok or self.inodes.get(node.ino) is not node or node.opens \
                    or node.kernel_version == layout.attr.version:
                continue  # gone, or read meanwhile: its READs opened it, the kernel has it
            node.kernel_version = layout.attr.version
            self.stats.handed_files += 1
            handed += len(data)
            self._hand_carry += len(data)
            held = samples.get(node.ino)
            if held is not None:
                self._handed[node.ino] = Handed(layout.attr.version, held, bytes(data[held:]),
                                                self._hand_carry)
                self._hand_carry = 0
            self.stats.notify_store_bytes += len(data) if held is None else held
            self.cache.delivered([c.blob for c in layout.chunks])
        return handed

    def _stored_under_reader(self, ino: int, nbytes: int) -> None:
        """A file was read (its first READ opened it) while its hand-off was being stored:
        the kernel now holds its first ``nbytes`` and will READ at most the rest (a sampled
        file's last page), so the handle counts them as served and closes once the file is
        covered, where it would have stayed open until the kernel forgot the inode."""
        fh = self._unopened[ino][0]
        h = self._handle(fh)
        h.served = max(h.served, nbytes)
        if h.served >= h.node.attr.size:
            self._close_unopened(ino)

    def _unhand(self, ino: int) -> Handed | None:
        """A handed file's last page was asked for, or the kernel let go of it."""
        h = self._handed.pop(ino, None)
        if h is not None:
            self.prefetcher.reached(h.carries)
        return h

    async def _open_unopened(self, ino: int, stream: int) -> int:
        while (busy := self._opening.get(ino)) is not None:  # another READ is opening it
            await busy.wait()
            held = self._unopened.get(ino)
            if held is not None:
                return held[0]
        done = self._opening[ino] = trio.Event()
        try:
            node = self.inodes.get(ino) or await self._node(ino)
            if not node.attr.is_reg:
                raise error(errno.EINVAL, "JPFS stores bytes for regular files only")
            fh = (await self._open_read(node, stream, by_kernel=True)).fh
            h = self._handle(fh)
            nbytes = len(h.data) if h.data is not None else 0
            self._unopened[ino] = (fh, nbytes)
            self._unopened_bytes += nbytes
            while len(self._unopened) > UNOPENED_MAX or (
                    self._unopened_bytes > UNOPENED_BYTES and len(self._unopened) > 1):
                self._close_unopened(next(iter(self._unopened)))
            return fh
        finally:
            del self._opening[ino]
            done.set()

    def _close_unopened(self, ino: int) -> None:
        fh, nbytes = self._unopened.pop(ino)
        self._unopened_bytes -= nbytes
        self._close_reader(fh)

    async def _open_write(self, node: Node, flags: int, *, new: Layout | None = None
                          ) -> OpenFile:
        self._writable()
        if node.attr.is_dir:
            raise error(errno.EISDIR, "is a directory")
        if not node.attr.is_reg:
            raise error(errno.EINVAL, "JPFS stores bytes for regular files only")
        w = node.writer
        if w is None:
            layout = new or await self.meta.get_layout(node.ino)
            w = node.writer
            if w is None:
                w = node.writer = FileWriter(self.data, self.reader, layout, node.parent,
                                             self.name_of(node))
                w.settle = self._settle
                if self.leases is not None:
                    w.attach = self.leases.book.attach
                self.inodes.update(layout.attr)
        w.refs += 1
        node.opens += 1
        fh = self.handles.add(FileHandle(node, writer=w))
        try:
            if flags & os.O_TRUNC and (w.size or w.dirty):
                async with w.lock:
                    await w.truncate(0)
                self._committed(node, w)
        except BaseException:
            self.handles.pop(fh)
            node.opens -= 1
            await self._drop_writer(node, w)
            raise
        keep = node.kernel_version == w.version
        node.kernel_version = w.version
        self.stats.opens["write"] += 1
        return OpenFile(fh, keep)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[OpenFile, Attr]:
        """open(O_CREAT): the file (made if missing; EEXIST with O_EXCL), opened."""
        self._writable()
        gid, mode = self._owner(parent, uid, gid, mode)
        sent = time.monotonic()
        leases = self.leases
        if leases is not None and leases.dirs and leases.book.entry(parent, name) is not None:
            if flags & os.O_EXCL:  # made from the lease, not sent yet: it exists all the same
                raise error(errno.EEXIST, "file exists")
            return await self._open_pending(parent, name, flags)
        if leases is not None and stat.S_IFMT(mode) in (0, stat.S_IFREG):
            ld = await leases.take(parent)
            if ld is not None and self.known is not None and \
                    self.known.absent(parent, check_name(name)):
                return await self._create_leased(ld, parent, name, mode, flags, uid, gid, sent)
        with self._names_of(parent), self._changing(parent):
            attr, created = await self.meta.create(parent, name, mode, uid, gid,
                                                   exclusive=bool(flags & os.O_EXCL))
        if created:
            self._made_in(parent, name, attr)
            self.xattrs.none_since(attr.ino, sent)  # a new file has no extended attributes
        elif self.known is not None:
            self.known.drop(parent)  # it was there (made elsewhere) after all
        node = self.inodes.remember(attr, parent, name)
        if created:
            node.kernel_version = attr.version
        new = Layout(attr, self.data.chunk_size, ()) if created else None
        try:
            opened = await self._open_write(node, flags, new=new)
        except BaseException:
            self.inodes.forget(node.ino, 1)  # the kernel never saw the entry
            raise
        return opened, self.attr_of(node)

    async def _create_leased(self, ld: LeasedDir, parent: int, name: bytes, mode: int,
                             flags: int, uid: int, gid: int, sent: float
                             ) -> tuple[OpenFile, Attr]:
        """``create`` in a directory this VFS holds the lease of: answered now, committed
        behind (``leases.py``)."""
        assert self.leases is not None
        attr = self.leases.add(ld, name, mode, uid, gid)
        self._made_in(parent, name, attr)
        self.xattrs.none_since(attr.ino, sent)
        node = self.inodes.remember(attr, parent, name)
        node.kernel_version = attr.version
        try:
            opened = await self._open_write(node, flags,
                                            new=Layout(attr, self.data.chunk_size, ()))
        except BaseException:
            self.inodes.forget(node.ino, 1)
            raise
        return opened, self.attr_of(node)

    async def _open_pending(self, parent: int, name: bytes, flags: int
                            ) -> tuple[OpenFile, Attr]:
        """``create`` of a name this VFS made from a lease and has not sent: open that file."""
        attr = await self.lookup(parent, name)  # the kernel counts the entry create answers
        node = self.inodes.get(attr.ino)
        assert node is not None
        if node.writer is None:
            await self._settle(node.ino)  # its layout is read from the shard
        try:
            opened = await self._open_write(node, flags)
        except BaseException:
            self.inodes.forget(node.ino, 1)
            raise
        return opened, self.attr_of(node)

    @contextmanager
    def _changing(self, parent: int) -> Iterator[None]:
        """Around a create or unlink sent to the shard: a lease is not asked for meanwhile (the
        change would meet it and recall it)."""
        leases = self.leases
        if leases is None:
            yield
            return
        leases.begin(parent)
        try:
            yield
        finally:
            leases.end(parent)

    async def read(self, fh: int, off: int, size: int) -> memoryview | bytearray | bytes:
        """Up to ``size`` bytes at ``off`` through handle ``fh`` (fewer at end of file): from the
        bytes fetched at open, the handle's writer, or the file's chunks."""
        h = self._handle(fh)
        out: memoryview | bytearray | bytes
        if h.data is not None:
            out = h.data[off:off + size]
        elif h.node.writer is not None:
            w = h.node.writer
            async with w.lock:
                out = await w.read(off, size)
        else:
            out = await self._read_layout(h, off, size)
        self.stats.read_bytes += len(out)
        return out

    async def _read_layout(self, h: FileHandle, off: int, size: int):
        try:
            return await self._read_from_layout(h, off, size)
        except Moved:
            # the healer moved every copy of a chunk since this layout was read (a drain, a
            # rebalance): the record names the new nodes, and the bytes are the same
            stale = h.layout
            fresh = await self.meta.get_layout(h.node.ino)
            if stale is not None and fresh.attr.version != stale.attr.version:
                raise  # rewritten meanwhile: not the bytes this open saw
            h.layout, h.chunks, h.node.layout = fresh, None, fresh
            self.stats.layouts_refreshed += 1
            return await self._read_from_layout(h, off, size)

    async def _read_from_layout(self, h: FileHandle, off: int, size: int):
        layout = h.layout
        if layout is None:
            layout = h.layout = h.node.layout or await self.meta.get_layout(h.node.ino)
        fsize = layout.attr.size
        if off >= fsize or size <= 0:
            return b""
        if fsize <= self.config.small_file:
            (h.data,) = await self.reader.whole([layout])
            return h.data[off:off + size]
        chunks = h.chunks
        if chunks is None:
            chunks = h.chunks = chunk_map(layout.chunks)
        self.prefetcher.read(h, layout, off, min(size, fsize - off))
        return await self.reader.read(chunks, fsize, layout.chunk_size, off, size)

    async def write(self, fh: int, off: int, buf) -> int:
        """Write ``buf`` at ``off`` through handle ``fh`` (buffered in the file's writer, committed
        past the dirty bound); the bytes taken. EBADF if the handle is not open for writing."""
        h = self._handle(fh)
        w = h.writer
        if w is None:
            raise error(errno.EBADF, "not open for writing")
        if not w.lock.locked():  # no commit or read in progress: write at once, no yield
            now = w.write_now(off, buf)
            if now is not None:
                self.stats.write_bytes += now
                return now
        commits = w.commits
        async with w.lock:
            n = await w.write(off, buf)
        if w.commits != commits:
            self._committed(h.node, w)  # it passed the dirty bound and committed
        self.stats.write_bytes += n
        return n

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """Allocate as ``fallocate(2)``: modes 0 and FALLOC_FL_KEEP_SIZE (others:
        EOPNOTSUPP)."""
        h = self._handle(fh)
        if mode & ~FALLOC_FL_KEEP_SIZE:
            raise error(errno.EOPNOTSUPP, "fallocate: only modes 0 and FALLOC_FL_KEEP_SIZE")
        w = h.writer
        if w is None:
            raise error(errno.EBADF, "not open for writing")
        async with w.lock:
            await w.allocate(off, length, bool(mode & FALLOC_FL_KEEP_SIZE))

    async def flush(self, fh: int) -> None:
        """Commit what the handle wrote (close-to-open: the next open elsewhere sees it); on a
        write-behind mount a file made under a lease is committed behind the close (the module
        docstring)."""
        h = self._handle(fh)
        if h.writer is not None and not self._close_behind(h.node, h.writer):
            await self._commit(h.node, h.writer)

    def _close_behind(self, node: Node, w: FileWriter) -> bool:
        """Start committing ``w`` behind its close, if its file was made under a lease and is
        not sent yet, nothing else commits it, and the bound allows: True if started."""
        leases = self.leases
        if leases is None or not self.config.write_behind:
            return False
        if w.lock.locked() or not w.dirty or w.discarded or w.ino in self._behind or \
                len(self._behind) >= BEHIND_FILES:
            return False
        n = w.dirty_bytes
        if self._behind_bytes + n > BEHIND_BYTES:
            return False
        stored = leases.book.store_behind(w.ino)
        if stored is None:
            return False
        self._behind[w.ino] = n
        self._behind_bytes += n
        self._behind_done = trio.Event()
        self.client.nursery.start_soon(self._commit_behind, node, w, stored)
        return True

    async def _commit_behind(self, node: Node, w: FileWriter, stored: trio.Event) -> None:
        try:
            await self._commit(node, w)
            self.stats.closes_behind += 1
        except Exception as e:  # noqa: BLE001 - a task of the mount's own: log, never crash it
            self.stats.closes_behind_failed += 1
            self._behind_lost[w.ino] = node.parent
            if len(self._behind_lost) > 65536:  # nobody asks: keep the newest
                del self._behind_lost[next(iter(self._behind_lost))]
            why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            log.error("could not store %s after it was closed (%s); its release tries again, "
                      "and its create is committed without its bytes", self.name_of(node), why)
        finally:
            stored.set()
            self._behind_bytes -= self._behind.pop(w.ino)
            if not self._behind:
                self._behind_done.set()

    async def fsync(self, fh: int) -> None:
        """Commit, and return once the file's bytes and metadata are durable (its blobs are
        fsynced by the storage nodes before any commit; the shard's sync covers the rest)."""
        h = self._handle(fh)
        if h.writer is not None:
            await self._commit(h.node, h.writer)
        await self._settle(h.node.ino)
        await self.meta.sync([shard_of(h.node.ino)])
        self._report_lost(h.node.ino, None)

    async def fsyncdir(self, ino: int) -> None:
        """Return once the directory's entries are durable."""
        await self._settle(ino)
        await self.meta.sync([shard_of(ino)])
        self._report_lost(None, ino)

    def _report_lost(self, ino: int | None, parent: int | None) -> None:
        """EIO, once, for the file ``ino`` or the files in ``parent`` whose bytes could not be
        stored behind their close (as a local filesystem's fsync reports a writeback error)."""
        lost = [i for i, p in self._behind_lost.items() if i == ino or p == parent]
        for i in lost:
            del self._behind_lost[i]
        if lost:
            raise error(errno.EIO, f"the bytes of {len(lost)} file(s) closed here could not be "
                        "stored after their close (see the mount's log)")

    async def release(self, fh: int) -> None:
        """RELEASE of handle ``fh``: the last handle writing a file commits what is left."""
        h = self.handles.get(fh)
        if type(h) is not FileHandle:
            self.handles.pop(fh)
            return
        if h.writer is None:
            self._close_reader(fh)
            return
        self.handles.pop(fh)
        node = h.node
        node.opens -= 1
        try:
            await self._drop_writer(node, h.writer)
        finally:
            if node.lookups <= 0:
                self.inodes.drop_if_unused(node)

    def _close_reader(self, fh: int) -> None:
        h = self.handles.pop(fh)
        if type(h) is not FileHandle:
            return
        node = h.node
        node.opens -= 1
        if h.chunks is not None:
            self.prefetcher.closed(h)
        if node.lookups <= 0:
            self.inodes.drop_if_unused(node)

    async def _drop_writer(self, node: Node, w: FileWriter) -> None:
        w.refs -= 1
        if w.refs > 0:
            return
        try:
            await self._commit(node, w)
        finally:
            if w.refs == 0 and node.writer is w:
                node.writer = None
                if self.leases is not None:
                    self.leases.book.closed(node.ino)
                if node.lookups <= 0:
                    self.inodes.drop_if_unused(node)

    async def _commit(self, node: Node, w: FileWriter) -> None:
        if not w.lock.locked() and (not w.dirty or w.discarded):
            return  # nothing to commit and none in progress (the close of a clean handle)
        async with w.lock:
            if not w.dirty or w.discarded:
                return
            await w.commit()
        if not w.discarded:
            self._committed(node, w)

    def _committed(self, node: Node, w: FileWriter) -> None:
        now = time.time_ns()
        node.attr = node.attr.with_(size=w.size, version=w.version, mtime_ns=now, ctime_ns=now)
        node.fetched = float("-inf")  # the service has the exact times
        node.layout = None
        node.kernel_version = w.version  # the kernel's pages were written through it
        self.stats.commits += 1
        self._behind_lost.pop(node.ino, None)  # stored after all
        if node.parent:
            self.prefetcher.forget_dir(node.parent)

    async def commit_all(self) -> None:
        """Commit every file with buffered writes and make every change durable (before an
        unmount); errors are logged."""
        await self._behind_done.wait()
        for h in self.handles.values():
            if type(h) is FileHandle and h.writer is not None:
                try:
                    await self._commit(h.node, h.writer)
                except JPFSError as e:
                    log.error("could not commit %s before unmounting: %s",
                              self.name_of(h.node), e.strerror)
        if self.leases is not None:
            await self.leases.close()
        if not self.ro:
            try:
                await self.meta.sync()
            except JPFSError as e:
                log.error("could not make the metadata durable before unmounting: %s",
                          e.strerror)

    # ------------------------------------------------------------------ directories

    def opendir(self, ino: int) -> int:
        """A directory handle on ``ino`` (``readdir`` reads through it)."""
        return self.handles.add(DirHandle(ino))

    async def readdir(self, fh: int, start: int
                      ) -> AsyncGenerator[tuple[bytes, Attr, int], None]:
        """Entries from position ``start`` on: (name, attributes, position after it), with
        "." and ".." first. Use with ``contextlib.aclosing``."""
        h = self.handles.get(fh)
        if type(h) is not DirHandle:
            raise error(errno.EBADF, "not a directory handle")
        if self.leases is not None and self.leases.dirs:
            # what this VFS answered from leases is listed by the shard, with the attributes
            # of leased directories as they are after it
            await self.leases.book.settle_all()
        # positions: 1 after ".", 2 after "..", then 3 + i after entry i
        if start == 0:
            yield b".", self.attr_of(await self._node(h.ino)), 1
        if start <= 1:
            yield b"..", self._parent_attr(h.ino), 2
        i = max(0, start - 2)
        if i < h.base:  # rewound past what is kept: list again from the start
            h.entries, h.base, h.done, h.after = [], 0, False, b""
        elif i - h.base > self.config.readdir_page:  # keep a window, not a million entries
            cut = min(i - h.base, len(h.entries))
            del h.entries[:cut]
            h.base += cut
        while True:
            if i - h.base >= len(h.entries) and not h.done:
                await self._more(h, i)
            k = i - h.base
            if k >= len(h.entries):
                return
            name, attr = h.entries[k]
            yield name, attr, i + 3
            self.inodes.remember(attr, h.ino, name)
            i += 1

    def _parent_attr(self, ino: int) -> Attr:
        node = self.inodes.get(ino)
        up = self.inodes.get(node.parent) if node is not None and node.parent else None
        return (up or node or self.inodes.root).attr

    async def _more(self, h: DirHandle, want: int) -> None:
        """Fetch pages until entry ``want`` is held (or the directory ends)."""
        page = self.config.readdir_page
        while not h.done and want - h.base >= len(h.entries):
            got, raw = [], 0
            async with aclosing(self.meta.readdir(h.ino, plus=True, page=page,
                                                  after=h.after)) as it:
                async for e in it:
                    raw += 1
                    if e.attr is not None:
                        got.append((e.name, e.attr))
                    h.after = e.name
                    if raw >= page:
                        break
            h.entries.extend(got)
            if raw < page:
                h.done = True

    def releasedir(self, fh: int) -> None:
        """Free directory handle ``fh``."""
        self.handles.pop(fh)

    # ------------------------------------------------------------------ filesystem

    async def statfs(self) -> StatFS:
        """Capacity as JPFS sees it: its own stored bytes (over the replicas) as used, and the
        free space of each distinct storage disk (over the replicas) as what may still be
        written; storage nodes that share a disk count it once."""
        at, cached = self._statfs
        if cached is not None and time.monotonic() - at < 1.0:
            return cached
        totals = await self.meta.statfs()
        storage = self.client.storage
        assert storage is not None
        nodes: list[dict] = []

        async def one(i: int) -> None:
            try:
                nodes.append(await storage.stats(i))
            except JPFSError:
                pass

        async with trio.open_nursery() as nursery:
            for i in range(storage.n_nodes):
                nursery.start_soon(one, i)
        r = max(1, self.client.cluster.replicas)
        disks: dict[object, int] = {}
        for n in nodes:
            key = n.get("disk_id") or ("node", n.get("node"))
            disks[key] = n.get("disk_free", 0)
        bs = 4096
        used = sum(n.get("bytes_used", 0) for n in nodes) // r
        free = sum(disks.values()) // r
        free_inodes = 1 << 40
        s = StatFS(block_size=bs, blocks=(used + free) // bs, blocks_free=free // bs,
                   files=totals.get("inodes", 0) + free_inodes, files_free=free_inodes)
        self._statfs = (time.monotonic(), s)
        return s

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
