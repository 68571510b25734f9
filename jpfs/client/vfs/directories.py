"""Directory listings through handles: opendir, readdir, releasedir.

A directory handle keeps a window of its listing, paged in from the shard with attributes
(readdirplus, ``readdir_page`` entries a call) as the reader moves on, so that a directory of a
million entries holds a page, not a million. What this VFS answered from leases is committed
before a listing, so the shard lists it.
"""

from __future__ import annotations

import errno
from collections.abc import AsyncGenerator
from contextlib import aclosing

from ...errors import error
from ...types import Attr
from .handles import DirHandle
from .leasing import Leasing
from .shared import SharedState


class Directories:
    """The directory handles' listings (see the module docstring)."""

    def __init__(self, shared: SharedState, leasing: Leasing):
        self.shared = shared
        self.leases = leasing.leases
        self.meta = shared.meta
        self.inodes = shared.inodes
        self.handles = shared.handles
        self.config = shared.config

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
            yield b".", self.shared.attr_of(await self.shared.node(h.ino)), 1
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


__all__ = ["Directories"]
