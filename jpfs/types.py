"""Small frozen records shared by every part of JPFS, and their wire forms.

Records travel as msgpack arrays (``to_wire``/``from_wire``), not maps: they are on every hot path
and arrays are both smaller and faster to pack. Names are ``bytes`` everywhere below the path-level
client API, as POSIX names are; the client converts with ``os.fsencode``/``os.fsdecode``.
"""

from __future__ import annotations

import stat as _stat
from dataclasses import dataclass, replace

ROOT_INO = 1
"""The root directory's inode id (shard 0, counter 1); equal to pyfuse3.ROOT_INODE."""

NAME_MAX = 255
"""Longest name, in bytes, as on Linux."""


@dataclass(frozen=True, slots=True)
class Attr:
    """An inode's attributes. Times are nanoseconds since the epoch."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    version: int = 0
    """Bumped on every change of the file's bytes; caches key on it."""

    @property
    def is_dir(self) -> bool:
        """Whether the mode is a directory's."""
        return _stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        """Whether the mode is a regular file's."""
        return _stat.S_ISREG(self.mode)

    @property
    def is_link(self) -> bool:
        """Whether the mode is a symbolic link's."""
        return _stat.S_ISLNK(self.mode)

    @property
    def blocks(self) -> int:
        """512-byte blocks, as st_blocks counts them."""
        return (self.size + 511) // 512

    def with_(self, **changes) -> Attr:
        """A copy with the given fields changed (``dataclasses.replace``)."""
        return replace(self, **changes)

    def to_wire(self) -> list:
        """The msgpack array form: the fields in declaration order."""
        return [
            self.ino, self.mode, self.nlink, self.uid, self.gid, self.size,
            self.atime_ns, self.mtime_ns, self.ctime_ns, self.rdev, self.version,
        ]

    @classmethod
    def from_wire(cls, w: list | tuple) -> Attr:
        """The record from its ``to_wire`` array."""
        return cls(*w)


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One directory entry; ``attr`` is filled by readdirplus and scandir."""

    name: bytes
    ino: int
    kind: int
    """The file type bits of the mode (``stat.S_IFMT(mode)``)."""
    attr: Attr | None = None

    @property
    def is_dir(self) -> bool:
        """Whether the entry names a directory."""
        return self.kind == _stat.S_IFDIR

    def to_wire(self) -> list:
        """The msgpack array form; ``attr`` is ``None`` or its own array."""
        return [self.name, self.ino, self.kind, self.attr.to_wire() if self.attr else None]

    @classmethod
    def from_wire(cls, w: list | tuple) -> DirEntry:
        """The record from its ``to_wire`` array."""
        return cls(w[0], w[1], w[2], Attr.from_wire(w[3]) if w[3] is not None else None)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a file's bytes: file offset ``index * chunk_size``, stored as one blob.

    A blob is immutable and named by a random 128-bit id; ``nodes`` are the storage nodes that
    hold its replicas. ``length`` is how many of the blob's bytes belong to the file (a truncate
    can shorten it without rewriting); ``xxh`` is the xxh3-64 of the whole blob.
    """

    index: int
    blob: bytes
    nodes: tuple[int, ...]
    length: int
    blob_len: int
    xxh: int

    def to_wire(self) -> list:
        """The msgpack array form: the fields in declaration order, ``nodes`` as a list."""
        return [self.index, self.blob, list(self.nodes), self.length, self.blob_len, self.xxh]

    @classmethod
    def from_wire(cls, w: list | tuple) -> Chunk:
        """The record from its ``to_wire`` array."""
        return cls(w[0], w[1], tuple(w[2]), w[3], w[4], w[5])


@dataclass(frozen=True, slots=True)
class Layout:
    """What a reader needs to fetch a file: its attributes and chunks (holes are absent)."""

    attr: Attr
    chunk_size: int
    chunks: tuple[Chunk, ...]

    def to_wire(self) -> list:
        """The msgpack array form: ``[attr, chunk_size, [chunk, ...]]``, nested as arrays."""
        return [self.attr.to_wire(), self.chunk_size, [c.to_wire() for c in self.chunks]]

    @classmethod
    def from_wire(cls, w: list | tuple) -> Layout:
        """The record from its ``to_wire`` array."""
        return cls(Attr.from_wire(w[0]), w[1], tuple(Chunk.from_wire(c) for c in w[2]))


@dataclass(frozen=True, slots=True)
class StatFS:
    """Filesystem totals, summed over shards and storage nodes."""

    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int = NAME_MAX

    def to_wire(self) -> list:
        """The msgpack array form: the fields in declaration order."""
        return [self.block_size, self.blocks, self.blocks_free, self.files, self.files_free,
                self.name_max]

    @classmethod
    def from_wire(cls, w: list | tuple) -> StatFS:
        """The record from its ``to_wire`` array."""
        return cls(*w)
