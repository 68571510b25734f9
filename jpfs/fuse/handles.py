"""Open file and directory handles of the mount, and the write state handles share.

All handles that write one file on this mount share one buffer (a ``WriteState`` around an
``AsyncFile``), as a local filesystem shares its page cache: a second writer sees the first one's
bytes, and one commit publishes both. The state commits on flush (close), fsync and release, and
when its dirty bytes pass the AsyncFile's flush threshold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import trio

from ..client.files import AsyncFile
from ..types import Attr, Chunk, Layout
from .inodes import Node


class WriteState:
    """One file's buffered writes on this mount; ``lock`` serialises use of ``file``."""

    __slots__ = ("file", "lock", "refs", "discarded")

    def __init__(self, file: AsyncFile):
        self.file = file
        self.lock = trio.Lock()
        self.refs = 0
        self.discarded = False
        """The file was removed while open: its unwritten bytes are dropped."""

    @property
    def dirty(self) -> bool:
        f = self.file
        return bool(f._dirty or f._size_dirty)


@dataclass(slots=True, eq=False)
class FileHandle:
    node: Node
    layout: Layout | None = None
    data: memoryview | None = None
    """The whole file, when it was fetched whole at open (small files)."""
    write: WriteState | None = None
    readable: bool = True
    chunks: dict[int, Chunk] | None = None
    """The layout's chunks by index, built on the first read of a large file."""


@dataclass(slots=True, eq=False)
class DirHandle:
    ino: int
    entries: list[tuple[bytes, Attr]] = field(default_factory=list)
    done: bool = False
    base: int = 0
    """Index (in the whole listing) of ``entries[0]``: consumed entries are dropped."""
    after: bytes = b""
    """The last name fetched, where the next page starts."""


@dataclass(slots=True, eq=False)
class ControlHandle:
    ino: int
    content: bytes = b""
    pending: bytearray = field(default_factory=bytearray)
    writable: bool = False


Handle = FileHandle | DirHandle | ControlHandle


class Handles:
    """Handle numbers (never reused while the mount runs) to handle records."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._open: dict[int, Handle] = {}

    def __len__(self) -> int:
        return len(self._open)

    def add(self, h: Handle) -> int:
        fh = next(self._next)
        self._open[fh] = h
        return fh

    def get(self, fh: int) -> Handle | None:
        return self._open.get(fh)

    def pop(self, fh: int) -> Handle | None:
        return self._open.pop(fh, None)

    def values(self):
        return list(self._open.values())
