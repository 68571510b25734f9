"""The changes a storage node's index takes: one record per kind of write operation.

The server's writer queues these and the commit engine (``commit.py``) applies a group of them
at once; they are plain records so that every part that changes the index (puts, deletes, the
scrubber, compaction, pulls) speaks the same small language to the one writer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PutOp:
    """Store blobs: ``entries`` (id, length, xxh) whose bytes lie back to back in ``data``.

    Checksums are verified before the op is queued; the writer checks ids and appends.
    """

    entries: list[tuple[bytes, int, int]]
    data: memoryview


@dataclass
class DeleteOp:
    """Delete blobs from the index (their bytes become dead space for compaction)."""
    ids: list[bytes]


@dataclass
class SealOp:
    """Stop appending to volume ``vol`` (compaction is about to rewrite it)."""

    vol: int


@dataclass
class AllocOp:
    """Reserve a fresh volume id (committed, so a crash never lets the name be reused)."""


@dataclass
class SwitchOp:
    """Compaction's commit: moved blobs now live in ``new_vol``; ``old_vols`` are dropped."""

    old_vols: list[int]
    new_vol: int | None
    """None when nothing in ``old_vols`` was live."""
    new_end: int
    moves: list[tuple[bytes, int, int, int, int]]
    """(id, old volume, old offset, new offset, length) for every blob copied."""


@dataclass
class ScrubOp:
    """The scrubber's findings and progress: mark ``bad`` blobs, save ``state`` (JSON).

    ``bad`` holds (id, volume, offset, length, xxh, reason) as read; a blob is marked only if
    the index still has it at that place with that checksum (a blob moved by compaction or
    deleted meanwhile was read from a stale place and proves nothing).
    """

    bad: list[tuple[bytes, int, int, int, int, str]]
    state: bytes | None = None


Op = PutOp | DeleteOp | SealOp | AllocOp | SwitchOp | ScrubOp
