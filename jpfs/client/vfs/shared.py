"""What every part of the VFS reads: the client's parts, the node table, the handles, the
counters, the config, and the names known of directories being written; and the few answers all
of them give the same way (a node's attributes as a reader sees them, its name for log lines,
what a change of a directory makes stale).

The parts (``core.py`` lists them) each keep their own state and reach one another only through
the references their constructors are given, built in one order, lowest first: this is the
lowest.
"""

from __future__ import annotations

import errno

from ...errors import error
from ...types import Attr
from ..client import AsyncClient
from ..data.listings import KnownDirs
from ..data.prefetch import Prefetcher
from .handles import FileHandle, Handles
from .inodes import Inodes, Node
from .types import Notifier, VFSConfig, VFSStats


class SharedState:
    """The state the VFS's parts share (see the module docstring).

    Args:
        client: the client whose parts the VFS reads and writes through (it must have storage
            nodes: ``data`` and ``reader`` are not None).
        prefetcher: the prefetcher the VFS tells what it sees.
    """

    def __init__(self, client: AsyncClient, prefetcher: Prefetcher, inodes: Inodes,
                 config: VFSConfig, notifier: Notifier):
        assert client.data is not None and client.reader is not None
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
        self.listing_age = float("inf") if self.ro else config.entry_timeout
        """How long a directory's listing answers its lookups."""
        self.attr_age = float("inf") if self.ro else config.attr_timeout
        """How long a node's attributes are trusted."""
        self.known: KnownDirs | None = None if self.ro or config.entry_timeout <= 0 else \
            KnownDirs(self.meta, config.entry_timeout)
        """Names of directories being written (None on read-only mounts: listings do it)."""

    def attr_of(self, node: Node) -> Attr:
        """What a reader of the node sees now (a writer's size counts before its commit)."""
        w = node.writer
        if w is not None and w.size != node.attr.size:
            return node.attr.with_(size=w.size)
        return node.attr

    def writable(self) -> None:
        """EROFS on a read-only mount."""
        if self.ro:
            raise error(errno.EROFS, "the mount is read-only")

    def directories(self, *inos: int) -> None:
        """ENOTDIR where this VFS knows one of ``inos`` is not a directory (an inode's type never
        changes). The shard would say so itself, except of a file made under a lease and not
        sent yet, which it does not know: ENOENT, where the kernel answers ENOTDIR."""
        for ino in inos:
            node = self.inodes.get(ino)
            if node is not None and not node.attr.is_dir:
                raise error(errno.ENOTDIR, "not a directory")

    def changed_dir(self, *inos: int) -> None:
        """Directories whose entries (and so times, nlink) changed, attributes unknown."""
        for ino in inos:
            self.prefetcher.forget_dir(ino)
        self.inodes.stale(*inos)

    def post_op(self, ino: int, attr: Attr | None) -> None:
        """A directory changed and the shard said how it is now (its post-op attributes)."""
        self.prefetcher.forget_dir(ino)
        if attr is None:
            self.inodes.stale(ino)
        else:
            self.inodes.update(attr)

    async def node(self, ino: int) -> Node:
        """The node of ``ino``, its attributes asked of the shard if nothing holds it."""
        node = self.inodes.get(ino)
        if node is None:
            attr = await self.meta.getattr(ino)
            node = self.inodes.get(ino) or self.inodes.remember(attr, 0, b"", lookup=False)
        return node

    def file_handle(self, fh: int) -> FileHandle:
        """The open file ``fh``; EBADF if it is none."""
        h = self.handles.get(fh)
        if type(h) is not FileHandle:
            raise error(errno.EBADF, "no such file handle")
        return h

    def name_of(self, node: Node) -> str:
        """The node's path from the mount's root for log lines, or ``inode N`` where it is
        unknown."""
        return self.inodes.path(node) or f"inode {node.ino}"


__all__ = ["SharedState"]
