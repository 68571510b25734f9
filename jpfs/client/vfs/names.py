"""Names and attributes: lookups, the kernel's forgets, getattr and setattr.

Answers come from memory where that is safe (the cost of a mount is requests per file,
docs/design-notes.md):

- attributes of a node are trusted for ``attr_timeout`` (forever with ``read_only``) unless this
  VFS changed the inode, its parent or its names since: then the next ``getattr`` asks the
  metadata service, so a process always sees its own changes (nlink, size, mode, times);
- lookups in directories being read are answered from the prefetcher's listings, and lookups
  that find nothing in directories being written from their names as this VFS knows them
  (``listings.KnownDirs``; within the entry timeout, as the kernel's caches);
- a lookup of a name a held lease vouches for, or made under it and not sent yet, needs no call
  (``lease_book.py``).
"""

from __future__ import annotations

import errno
import time

from ...errors import JPFSError, error
from ...proto.meta import check_name
from ...types import Attr
from .commits import Commits
from .handoff import Handoff
from .leasing import Leasing
from .reads import Reads
from .shared import SharedState


class Names:
    """What the VFS answers of names and attributes (see the module docstring)."""

    def __init__(self, shared: SharedState, leasing: Leasing, commits: Commits, reads: Reads,
                 handoff: Handoff):
        self.shared = shared
        self.leasing = leasing
        self.commits = commits
        self.reads = reads
        self.handoff = handoff
        self.leases = leasing.leases
        self.meta = shared.meta
        self.inodes = shared.inodes
        self.prefetcher = shared.prefetcher
        self.stats = shared.stats
        self.config = shared.config
        self.known = shared.known
        self.ro = shared.ro
        self.listing_age = shared.listing_age
        self.attr_age = shared.attr_age

    async def lookup(self, parent: int, name: bytes) -> Attr:
        """The entry ``name`` in ``parent`` (the kernel counts one more lookup of it)."""
        leases = self.leases
        if leases is not None and leases.dirs:
            new = leases.book.entry(parent, name)
            if new is not None:  # answered from the lease, not committed yet
                held = self.inodes.get(new.ino)
                node = self.inodes.remember(held.attr if held is not None else new, parent,
                                            name, fetched=held.fetched if held else None)
                return self.shared.attr_of(node)
            held = self.inodes.get(leases.book.named(parent, name) or 0)
            if held is not None:  # the lease vouches for the name, the kernel knows the inode
                leases.stats["lookups"] += 1
                if self.listing_age > 0 and time.monotonic() - held.fetched >= self.attr_age \
                        and not leases.book.busy(parent):
                    # attributes the kernel will ask again: from a listing of the directory,
                    # made once a stat of every file there shows (as for a shard's lookups;
                    # not while changes answered there are on their way: it would miss them)
                    lst = self.prefetcher.listings.get(parent, self.listing_age)
                    i = lst.pos.get(name) if lst is not None else None
                    if lst is not None and i is not None:
                        self.stats.lookups_listed += 1
                        node = self.inodes.remember(lst.attrs[i], parent, name,
                                                    fetched=lst.fetched)
                        return self.shared.attr_of(node)
                    self.prefetcher.looked_up(parent, self.listing_age)
                node = self.inodes.remember(held.attr, parent, name, fetched=held.fetched)
                return self.shared.attr_of(node)  # with what is left of its attributes' time
            if leases.book.absent(parent, check_name(name)):
                raise error(errno.ENOENT, "no such entry")  # (removed, perhaps not sent yet)
        lst = self.prefetcher.listings.get(parent, self.listing_age)
        if lst is not None:
            i = lst.pos.get(name)
            if i is not None:
                self.stats.lookups_listed += 1
                node = self.inodes.remember(lst.attrs[i], parent, name, fetched=lst.fetched)
                return self.shared.attr_of(node)
            if lst.complete:
                raise error(errno.ENOENT, "no such entry")
        known = self.known
        if known is not None and known.absent(parent, check_name(name)):
            raise error(errno.ENOENT, "no such entry")
        await self.leasing.ready(parent)
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
        if self.listing_age > 0 and not (leases is not None and leases.book.busy(parent)):
            self.prefetcher.looked_up(parent, self.listing_age)  # a stat of every file lists it
        return self.shared.attr_of(self.inodes.remember(attr, parent, name))

    def fresh_for(self, ino: int) -> float:
        """How much longer the attributes this VFS holds of ``ino`` may be trusted (the
        attribute timeout less their age): what the kernel may cache them for."""
        if self.ro:  # attributes never go stale here (_attr_age is infinite)
            return self.config.attr_timeout
        node = self.inodes.get(ino)
        if node is None:
            return self.config.attr_timeout
        return max(0.0, min(self.config.attr_timeout,
                            self.attr_age - (time.monotonic() - node.fetched)))

    def forget(self, items) -> None:
        """FORGET: the kernel dropped these ``(inode, nlookup)`` references; a node no longer looked
        up loses its kernel-held state and goes once nothing uses it."""
        for ino, n in items:
            node = self.inodes.get(ino)
            if node is not None and node.lookups <= n:
                self.reads.forgotten(ino)
                self.handoff.unhand(ino)
            self.inodes.forget(ino, n)

    async def getattr(self, ino: int) -> Attr:
        """The inode's attributes: from memory within the attribute timeout (unless this VFS changed
        it), else from its shard. A file removed while still open answers nlink 0, not ENOENT."""
        node = self.inodes.get(ino)
        if node is not None and time.monotonic() - node.fetched < self.attr_age:
            return self.shared.attr_of(node)
        await self.leasing.settle(ino)
        try:
            attr = await self.meta.getattr(ino)
        except JPFSError as e:
            if e.errno == errno.ENOENT and node is not None and (node.opens or node.writer):
                node.attr, node.fetched = node.attr.with_(nlink=0), time.monotonic()
                return self.shared.attr_of(node)  # removed, still open
            raise
        node = self.inodes.update(attr)
        return self.shared.attr_of(node) if node is not None else attr

    async def setattr(self, ino: int, changes: dict[str, int], size: int | None = None) -> Attr:
        """Change ``mode``/``uid``/``gid``/``atime_ns``/``mtime_ns``/``ctime_ns`` and the size."""
        self.shared.writable()
        await self.leasing.settle(ino)
        node = self.inodes.get(ino)
        w = node.writer if node is not None else None
        before = node.attr.version if node is not None else None
        if size is not None:
            if node is not None and w is not None:
                async with w.lock:
                    await w.truncate(size)
                self.commits.committed(node, w)
            else:
                changes = {**changes, "size": size}
        elif node is not None and w is not None and ("mtime_ns" in changes or
                                                     "atime_ns" in changes):
            await self.commits.commit(node, w)  # or it overwrites the times
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
        return self.shared.attr_of(node) if node is not None else new

    async def readlink(self, ino: int) -> bytes:
        """The target of symlink ``ino``."""
        return await self.meta.readlink(ino)


__all__ = ["Names"]
