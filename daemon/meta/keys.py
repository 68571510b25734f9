"""How a shard lays out its records in LMDB.

Named databases of one environment:

- ``inode``   ino (u64 BE) -> Inode record (msgpack array)
- ``dentry``  parent (u64 BE) + name -> child ino (u64 BE) + kind (u32 BE); big-endian ids make one
              directory's entries one contiguous, name-ordered key range (readdir is a cursor walk)
- ``chunk``   ino + chunk index (u64 BE each) -> [blob, nodes, length, blob_len, xxh]
- ``xattr``   ino + name -> value
- ``lock``    lock key -> txid: keys held by a prepared cross-shard transaction
- ``prepared`` txid -> participant record (ops, coordinator)
- ``intent``  txid -> coordinator record (state, participants)
- ``state``   small singletons (inode counter, shard index, replication position)
- ``request`` client request id -> [time ns, result]: a namespace change retried after a
              failover answers what it did the first time (replicated shards)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from jpfs.types import Attr, Chunk

U64 = struct.Struct(">Q")
DENTRY_VALUE = struct.Struct(">QI")

DBS = ("inode", "dentry", "chunk", "xattr", "lock", "prepared", "intent", "state", "request")


def ino_key(ino: int) -> bytes:
    """The ``inode`` key of ``ino`` (u64 big-endian)."""
    return U64.pack(ino)


def dentry_key(parent: int, name: bytes) -> bytes:
    """The ``dentry`` key of ``name`` in ``parent``."""
    return U64.pack(parent) + name


def dentry_prefix(parent: int) -> bytes:
    """The prefix of every ``dentry`` key in ``parent`` (a directory's entries are one key
    range)."""
    return U64.pack(parent)


def split_dentry_key(key: bytes | memoryview) -> tuple[int, bytes]:
    """``(parent, name)`` of a ``dentry`` key."""
    return U64.unpack_from(key)[0], bytes(key[8:])


def dentry_value(ino: int, kind: int) -> bytes:
    """A ``dentry`` value: the child's inode and file type bits."""
    return DENTRY_VALUE.pack(ino, kind)


def split_dentry_value(value: bytes | memoryview) -> tuple[int, int]:
    """``(ino, kind)`` of a ``dentry`` value."""
    return DENTRY_VALUE.unpack(value)


def chunk_key(ino: int, index: int) -> bytes:
    """The ``chunk`` key of chunk ``index`` of ``ino`` (a file's chunks are one key range, in
    order)."""
    return U64.pack(ino) + U64.pack(index)


def split_chunk_key(key: bytes | memoryview) -> tuple[int, int]:
    """``(ino, index)`` of a ``chunk`` key."""
    return U64.unpack_from(key)[0], U64.unpack_from(key, 8)[0]


def xattr_key(ino: int, name: bytes) -> bytes:
    """The ``xattr`` key of attribute ``name`` of ``ino``."""
    return U64.pack(ino) + name


# Lock keys name what a prepared transaction holds: a directory entry or a whole inode.
def lock_dentry(parent: int, name: bytes) -> bytes:
    """The lock key of entry ``name`` in ``parent``."""
    return b"d" + U64.pack(parent) + name


def lock_dir(parent: int) -> bytes:
    """Prefix of every dentry lock in ``parent`` (readdir waits for them)."""
    return b"d" + U64.pack(parent)


def lock_inode(ino: int) -> bytes:
    """The lock key of a whole inode."""
    return b"i" + U64.pack(ino)


def pack(obj: object) -> bytes:
    """A record as msgpack (bytes kept binary, so they read back as bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | memoryview) -> Any:
    """Decode a msgpack record. ``Any``: its shape is the one the database it came from holds
    (this module's docstring), which the caller knows and msgpack cannot say."""
    return msgpack.unpackb(data, raw=False, use_list=True)


@dataclass(slots=True)
class Inode:
    """A shard's inode record. ``parent`` is maintained for directories (``..``, loop checks);
    for files it is the directory the file was created in (storage placement only)."""

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
    parent: int = 0
    target: bytes | None = None

    def encode(self) -> bytes:
        """The record as stored in the ``inode`` database (a msgpack array; ``ino`` is the key)."""
        return pack([self.mode, self.nlink, self.uid, self.gid, self.size, self.atime_ns,
                     self.mtime_ns, self.ctime_ns, self.rdev, self.version, self.parent,
                     self.target])

    @classmethod
    def decode(cls, ino: int, data: bytes | memoryview) -> Inode:
        """The record of ``ino`` from its stored value."""
        return cls(ino, *unpack(data))

    def attr(self) -> Attr:
        """The attributes clients see (without ``parent`` and ``target``)."""
        return Attr(self.ino, self.mode, self.nlink, self.uid, self.gid, self.size,
                    self.atime_ns, self.mtime_ns, self.ctime_ns, self.rdev, self.version)


def encode_chunk(c: Chunk) -> bytes:
    """A chunk as stored in the ``chunk`` database (``index`` is in the key)."""
    return pack([c.blob, list(c.nodes), c.length, c.blob_len, c.xxh])


def decode_chunk(ino_index: tuple[int, int], data: bytes | memoryview) -> Chunk:
    """The chunk of ``(ino, index)`` (``split_chunk_key``) from its stored value."""
    blob, nodes, length, blob_len, xxh = unpack(data)
    return Chunk(ino_index[1], blob, tuple(nodes), length, blob_len, xxh)
