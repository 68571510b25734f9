"""What the VFS knows about each inode its kernel holds.

FUSE inode numbers are JPFS inode ids. The kernel counts lookups (every entry we hand it) and
sends FORGET when it drops an inode; a node is kept while the kernel holds it or a handle is open
on it. A node remembers its last attributes and when they were fetched, the name it was last seen
under (the path is needed to learn co-access patterns), its layout, and which version of the file's
bytes the kernel's page cache may hold: opening an unchanged file then lets the kernel keep its
pages and never ask us for them again.

Attributes are answered from the node only while they are fresh: every change the VFS makes
marks the nodes it touched (the target, its old and new parents) ``stale``, so a process reads
its own changes at once; only other nodes' changes wait for the attribute timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ...types import ROOT_INO, Attr, Layout
from ..data.writer import FileWriter


@dataclass(slots=True, eq=False)
class Node:
    """One inode the kernel holds (see the module docstring)."""

    ino: int
    attr: Attr
    fetched: float
    """time.monotonic() when ``attr`` came from the metadata service."""
    parent: int = 0
    name: bytes = b""
    lookups: int = 0
    opens: int = 0
    layout: Layout | None = None
    kernel_version: int | None = None
    """The file version whose bytes the kernel may have cached (None: it caches none)."""
    writer: FileWriter | None = None
    """The writer that handles writing this file on this mount share."""


class Inodes:
    """The node table, with paths of directories computed from names and cached, and the
    names each inode was handed out under (to find what an unlink or rename changed)."""

    def __init__(self, root: Attr):
        self._nodes: dict[int, Node] = {ROOT_INO: Node(ROOT_INO, root, time.monotonic(),
                                                       lookups=1 << 62)}
        self._paths: dict[int, str] = {ROOT_INO: ""}
        self._names: dict[tuple[int, bytes], int] = {}
        self.named: Callable[[Attr, int, bytes], None] | None = None
        """Told of every entry handed to the kernel (``VFS.attach_owner``)."""

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, ino: int) -> Node | None:
        """The node of inode ``ino``, or None if nothing holds it (no lookup, open or writer)."""
        return self._nodes.get(ino)

    @property
    def root(self) -> Node:
        """The root directory's node: held from the start, never forgotten or dropped."""
        return self._nodes[ROOT_INO]

    def remember(self, attr: Attr, parent: int, name: bytes, *, fetched: float | None = None,
                 lookup: bool = True) -> Node:
        """Record an entry handed to the kernel (``lookup``: it counts one more lookup)."""
        now = time.monotonic() if fetched is None else fetched
        node = self._nodes.get(attr.ino)
        if parent:
            self._names[(parent, name)] = attr.ino
        if node is None:
            node = self._nodes[attr.ino] = Node(attr.ino, attr, now, parent, name)
        else:
            if now >= node.fetched:
                node.attr, node.fetched = attr, now
            if node.parent != parent or node.name != name:
                node.parent, node.name = parent, name
                if attr.is_dir:
                    self._paths.clear()
        if lookup:
            node.lookups += 1
            if self.named is not None and parent:
                self.named(attr, parent, name)
        return node

    def update(self, attr: Attr) -> Node | None:
        """Fresh attributes of a known inode."""
        node = self._nodes.get(attr.ino)
        if node is not None:
            node.attr, node.fetched = attr, time.monotonic()
        return node

    def child(self, parent: int, name: bytes) -> Node | None:
        """The node last handed out as ``name`` in ``parent``, if it is still held."""
        ino = self._names.get((parent, name))
        return self._nodes.get(ino) if ino is not None else None

    def unname(self, parent: int, name: bytes) -> Node | None:
        """``name`` left ``parent`` (unlinked or renamed away); returns its node if held."""
        ino = self._names.pop((parent, name), None)
        return self._nodes.get(ino) if ino is not None else None

    def stale(self, *inos: int) -> None:
        """These inodes changed: their next getattr asks the metadata service."""
        for ino in inos:
            node = self._nodes.get(ino)
            if node is not None:
                node.fetched = float("-inf")

    def forget(self, ino: int, n: int) -> None:
        """FORGET: the kernel dropped ``n`` lookups of ``ino``; the node goes when nothing uses
        it."""
        node = self._nodes.get(ino)
        if node is None or ino == ROOT_INO:
            return
        node.lookups -= n
        self.drop_if_unused(node)

    def drop_if_unused(self, node: Node) -> None:
        """Drop ``node`` if nothing holds it: no kernel lookups, no open handles, no writer (never
        the root)."""
        if node.lookups <= 0 and node.opens <= 0 and node.writer is None \
                and node.ino != ROOT_INO:
            self._nodes.pop(node.ino, None)
            self._paths.pop(node.ino, None)
            if self._names.get((node.parent, node.name)) == node.ino:
                del self._names[(node.parent, node.name)]
            if len(self._names) > 2 * len(self._nodes) + 1024:  # names of dropped hard links
                self._names = {k: v for k, v in self._names.items() if v in self._nodes}

    def moved(self) -> None:
        """A directory was renamed or removed: cached paths may be wrong."""
        self._paths.clear()
        self._paths[ROOT_INO] = ""

    def dir_path(self, ino: int) -> str | None:
        """``/a/b`` for a directory the kernel holds (None if its chain of names is unknown)."""
        p = self._paths.get(ino)
        if p is not None:
            return p
        chain: list[str] = []
        cur = ino
        while cur != ROOT_INO:
            node = self._nodes.get(cur)
            if node is None or not node.parent or len(chain) > 4096:
                return None
            chain.append(node.name.decode("utf-8", "surrogateescape"))
            cur = node.parent
        p = "".join("/" + c for c in reversed(chain))
        self._paths[ino] = p
        return p

    def path(self, node: Node) -> str | None:
        """The node's path from the mount's root (``/a/b/name``), or None if a name on the way is
        unknown."""
        d = self.dir_path(node.parent) if node.parent else None
        if d is None:
            return None
        return f"{d}/{node.name.decode('utf-8', 'surrogateescape')}"

    def kernel_has(self, ino: int, version: int) -> bool:
        """Whether the kernel may hold this version of the file's bytes already."""
        node = self._nodes.get(ino)
        return node is not None and node.kernel_version == version
