"""The on-disk formats of a storage node: its index's records and its volumes' put records.

Kept apart from the code that reads and writes them, so that every layout a node's data
directory holds is in one place (a change here is a change of format: never made lightly).

Layout of a data directory::

    volumes/v00000001.vol ...   append-only volume files; blobs back to back, in arrival order
    index.lmdb/                 LMDB: blob id -> where it is; per-volume accounting

LMDB databases:

- ``blobs``:   id (16 bytes) -> ``ENTRY`` (volume, offset, length, xxh3-64, created time)
- ``byvol``:   volume u32 | offset u64 | id (big-endian, so a cursor walks a volume in disk order)
               -> (length, xxh); what compaction copies, in order
- ``volumes``: volume u32 -> ``VOLREC`` (committed end, live bytes, live blobs, flags, record
               bytes; indexes written before records existed lack the last)
- ``meta``:    ``next_volume`` (ids are never reused), ``active`` (the volume appends go to),
               ``scrub`` (the scrubber's progress, JSON), ``repaired`` (bad copies replaced)
- ``bad``:     id -> ``BAD_VAL`` (length, xxh, found time) + reason: blobs the scrubber found
               whose bytes do not match their checksum (or cannot be read). Reads refuse them
               (``EIO``, so clients fail over at once); a put of the same id and checksum writes
               a fresh copy, points the index at it and clears the record (the repair).

A put appends to its volume a record (``REC_HEAD``, then ``REC_ENTRY`` per blob, then
``REC_SUM``) ahead of its blobs, so that a restart can index it again (``recovery.py``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

ENTRY = struct.Struct("<IQQQd")
"""blobs value: volume, offset, length, xxh, created (seconds since the epoch)."""
BYVOL_KEY = struct.Struct(">IQ16s")
BYVOL_VAL = struct.Struct("<QQ")
VOL_KEY = struct.Struct(">I")
VOLREC = struct.Struct("<QQQIQ")
"""volumes value: committed end, live bytes, live blobs, flags, bytes of put records."""
VOLREC_V1 = struct.Struct("<QQQI")
"""volumes value of an index written before put records existed (no record bytes)."""
U64 = struct.Struct("<Q")
BAD_VAL = struct.Struct("<QQd")
"""bad value: length, xxh, found (seconds since the epoch); the reason follows, UTF-8."""
REC_HEAD = struct.Struct("<4sI")
"""A put's record in its volume, ahead of its blobs: magic, blob count; then REC_ENTRY per blob
and REC_SUM, the xxh3-64 of all before it."""
REC_ENTRY = struct.Struct("<16sQQ")
"""id, length, xxh of one blob of a put record."""
REC_SUM = struct.Struct("<Q")
REC_MAGIC = b"JPV1"
REC_MAX_BLOBS = 4096
"""A record naming more blobs than this is not a record."""
REPLAY_MAX = 64 << 20
"""A record naming more bytes than this is not a record (puts are at most MAX_PUT_BYTES)."""

SEALED = 1
"""Volume flag: no more appends (rolled over, or a compaction target)."""


class Entry(NamedTuple):
    """Where blob bytes lie (``ENTRY`` in the ``blobs`` database): volume, offset, length, xxh3-64
    and the time it was stored. A tuple, so building one per blob read stays cheap."""

    vol: int
    offset: int
    length: int
    xxh: int
    created: float

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        """The entry from its packed ``ENTRY`` value."""
        return cls._make(ENTRY.unpack(raw))

    def pack(self) -> bytes:
        """The entry as its packed ``ENTRY`` value."""
        return ENTRY.pack(*self)


@dataclass(slots=True)
class VolRec:
    """A volume's accounting (``VOLREC`` in the ``volumes`` database): committed end, live bytes and
    blobs, flags (``SEALED``), bytes of put records."""
    end: int = 0
    live_bytes: int = 0
    live_blobs: int = 0
    flags: int = 0
    record_bytes: int = 0
    """Bytes of the put records among the blobs (neither live nor garbage: compaction, which
    copies blobs alone, drops them)."""

    @classmethod
    def unpack(cls, raw: bytes) -> VolRec:
        """The record from its packed value (an older index's lacks ``record_bytes``: 0)."""
        if len(raw) == VOLREC_V1.size:
            return cls(*VOLREC_V1.unpack(raw))
        return cls(*VOLREC.unpack(raw))

    def pack(self) -> bytes:
        """The record as its packed ``VOLREC`` value."""
        return VOLREC.pack(self.end, self.live_bytes, self.live_blobs, self.flags,
                           self.record_bytes)

    @property
    def dead_bytes(self) -> int:
        """Bytes of the volume no live blob uses (what compaction would reclaim)."""
        return self.end - self.live_bytes - self.record_bytes


def record_size(n: int) -> int:
    """Bytes of the record of a put of ``n`` new blobs."""
    return REC_HEAD.size + n * REC_ENTRY.size + REC_SUM.size


def pack_record(entries: list[tuple[bytes, int, int]]) -> bytes:
    """A put's record (see REC_HEAD) for its (id, length, xxh) ``entries``."""
    body = REC_HEAD.pack(REC_MAGIC, len(entries)) + b"".join(
        REC_ENTRY.pack(bid, length, xxh) for bid, length, xxh in entries)
    return body + REC_SUM.pack(xxhash.xxh3_64_intdigest(body))


def volume_of(name: str) -> int | None:
    """The volume id of a file name of the volumes directory; None for a stray file."""
    if name.startswith("v") and name.endswith(".vol") and name[1:-4].isdigit():
        return int(name[1:-4])
    return None
