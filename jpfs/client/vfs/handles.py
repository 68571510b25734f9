"""Open file and directory handles of the VFS.

A handle is what ``open``/``opendir`` hand out and every later read, write and release names.
Handles that write one file share the node's ``FileWriter`` (see ``writer``); a reading handle
holds the layout it opened (close-to-open: it reads the version it opened) and, for a small
file, the whole file.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ...types import Attr, Chunk, Layout
from ..data.writer import FileWriter
from .inodes import Node


@dataclass(slots=True, eq=False)
class FileHandle:
    """An open file: the node, what the reader opened (layout, whole small file), the writer."""

    node: Node
    layout: Layout | None = None
    data: memoryview | None = None
    """The whole file, when it was fetched whole at open (small files)."""
    writer: FileWriter | None = None
    """Set when the handle writes (``O_WRONLY``/``O_RDWR``); then reads go through it too."""
    chunks: dict[int, Chunk] | None = None
    """The layout's chunks by index, built on the first read of a large file."""
    served: int = 0
    """Bytes read through the handle (where the kernel opened the file without asking, the
    VFS's own handle is closed once they cover the file)."""


@dataclass(slots=True, eq=False)
class DirHandle:
    """An open directory: a window of its listing, paged in as the reader moves on."""

    ino: int
    entries: list[tuple[bytes, Attr]] = field(default_factory=list)
    done: bool = False
    base: int = 0
    """Index (in the whole listing) of ``entries[0]``: consumed entries are dropped."""
    after: bytes = b""
    """The last name fetched, where the next page starts."""


Handle = FileHandle | DirHandle


class Handles:
    """Handle numbers (never reused while the VFS runs) to handle records."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._open: dict[int, Handle] = {}

    def __len__(self) -> int:
        return len(self._open)

    def add(self, h: Handle) -> int:
        """Register ``h``; its new handle number."""
        fh = next(self._next)
        self._open[fh] = h
        return fh

    def get(self, fh: int) -> Handle | None:
        """The handle numbered ``fh``, or None if it is not open."""
        return self._open.get(fh)

    def pop(self, fh: int) -> Handle | None:
        """Forget handle ``fh``; the handle, or None if it was not open."""
        return self._open.pop(fh, None)

    def values(self) -> list[Handle]:
        """Every open handle (a copy: the caller may open and release meanwhile)."""
        return list(self._open.values())


__all__ = ["DirHandle", "FileHandle", "Handle", "Handles"]
