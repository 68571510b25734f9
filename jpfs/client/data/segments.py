"""The disk cache's segment files: records written and read in worker threads.

A segment (``segments/seg-<n>``) holds records back to back, each a header (magic, blob id,
length, xxh3-64) and the blob, in batches aligned for O_DIRECT. These functions run in worker
threads with no shared state (arguments in, results out); ``cache.BlobCache`` decides what goes
where.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from pathlib import Path

import xxhash

from ...errors import error
from ...types import Chunk

MAGIC = b"JPFSBLB2"
RECORD = struct.Struct("<8s16sQQ")
"""A disk cache record's header: magic, blob id, blob length, xxh3-64 of the blob."""
ALIGN = 4096
"""Batches start at multiples of this (O_DIRECT) and are padded with zeros to the next one."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def segment_path(root: Path, seq: int) -> Path:
    """The file of disk-cache segment ``seq``."""
    return root / "segments" / f"seg-{seq:012d}"


def lock_dir(root: Path) -> int:
    """Lock the cache directory for this mount (EBUSY if another holds it); the lock's fd."""
    (root / "segments").mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise error(errno.EBUSY, f"cache directory {root} is in use by another mount; give "
                    "this one its own --cache-dir") from None
    return fd


def scan_segment(path: Path) -> tuple[list[tuple[bytes, int, int]], int, bool]:
    """The records of one segment file: (blob, offset, length) each; the bytes the file holds;
    and whether it ends in a torn record."""
    out: list[tuple[bytes, int, int]] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos + RECORD.size <= size:
            head = os.pread(f.fileno(), RECORD.size, pos)
            magic, blob, n, _ = RECORD.unpack(head) if len(head) == RECORD.size else (b"",) * 4
            if magic != MAGIC:
                nxt = aligned(pos)
                if nxt == pos:  # an aligned position without a record: the end
                    return out, size, any(os.pread(f.fileno(), 64, pos))
                pos = nxt  # the padding after a batch
                continue
            if pos + RECORD.size + n > size:
                return out, size, True
            out.append((blob, pos, n))
            pos += RECORD.size + n
    return out, size, False


def scan_all(root: Path) -> tuple[list[tuple[int, int, list]], int]:
    """Every segment, oldest first: (number, bytes, records); and how many were torn."""
    segs = []
    torn = 0
    for e in sorted(os.scandir(root / "segments"), key=lambda e: e.name):
        if not e.name.startswith("seg-") or not e.name[4:].isdigit():
            continue
        records, size, bad = scan_segment(Path(e.path))
        torn += bad
        segs.append((int(e.name[4:]), size, records))
    return segs, torn


def delete_segments(root: Path, segs: list[int]) -> None:
    """Remove these segment files (missing ones are fine)."""
    for seq in segs:
        try:
            os.unlink(segment_path(root, seq))
        except FileNotFoundError:
            pass


class Staging:
    """An aligned buffer for O_DIRECT writes, used by one writer thread at a time."""

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None
        self.direct = hasattr(os, "O_DIRECT")

    def get(self, n: int) -> mmap.mmap:
        """The buffer, grown (to at least 1 MiB) when it is shorter than ``n`` bytes."""
        if self.buf is None or len(self.buf) < n:
            if self.buf is not None:
                self.buf.close()
            self.buf = mmap.mmap(-1, max(n, 1 << 20))
        return self.buf


def append_batch(root: Path, seq: int, offset: int, batch: list[tuple[bytes, int, memoryview]],
            victims: list[int], staging: Staging) -> list[tuple[bytes, int, int]]:
    """Delete the ``victims`` segments, then write ``batch`` as records at ``offset`` (aligned)
    of segment ``seq``, padded to ``ALIGN``; returns (blob, record offset, length) each."""
    delete_segments(root, victims)
    total = aligned(sum(RECORD.size + len(v) for _, _, v in batch))
    buf = staging.get(total)
    placed = []
    pos = 0
    for blob, xxh, view in batch:
        RECORD.pack_into(buf, pos, MAGIC, blob, len(view), xxh)
        buf[pos + RECORD.size:pos + RECORD.size + len(view)] = view
        placed.append((blob, offset + pos, len(view)))
        pos += RECORD.size + len(view)
    buf[pos:total] = bytes(total - pos)
    path = segment_path(root, seq)
    fd = -1
    if staging.direct:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            staging.direct = False  # tmpfs and friends: buffered it is
    if fd < 0:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, memoryview(buf)[:total], offset)
    finally:
        os.close(fd)
    return placed


def read_records(root: Path, want: list[tuple[Chunk, tuple[int, int, int]]]
                  ) -> list[memoryview | str]:
    """Each blob from its record, verified against the chunk record's id, length and xxh: a
    view, or "missing" / "corrupt"."""
    h = xxhash.xxh3_64_intdigest
    out: list[memoryview | str] = []
    fds: dict[int, int] = {}
    try:
        for c, (seq, off, n) in want:
            fd = fds.get(seq)
            if fd is None:
                try:
                    fd = fds[seq] = os.open(segment_path(root, seq), os.O_RDONLY)
                except FileNotFoundError:
                    out.append("missing")
                    continue
            buf = bytearray(RECORD.size + n)
            try:
                got = os.preadv(fd, [buf], off)
            except OSError:
                out.append("corrupt")
                continue
            ok = got == len(buf) and n == c.blob_len
            if ok:
                magic, blob, length, xxh = RECORD.unpack_from(buf)
                view = memoryview(buf)[RECORD.size:]
                ok = magic == MAGIC and blob == c.blob and length == n and xxh == c.xxh \
                    and h(view) == c.xxh
            out.append(view if ok else "corrupt")
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


__all__ = ["ALIGN", "MAGIC", "RECORD", "Staging", "aligned", "append_batch", "delete_segments",
           "lock_dir", "read_records", "scan_all", "scan_segment", "segment_path"]
