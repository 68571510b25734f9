"""What the scrubber reads: live blobs in disk order, their bytes re-verified, the bad list.

The blocking half of scrubbing (``scrub.py`` paces it and marks what it finds through the
writer with a ``ScrubOp``; ``pull.py`` re-verifies what a client reports). Reads only: each
function takes its own short LMDB read transaction, and appends not yet in LMDB (``pending``)
are scrubbed as well.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from jpfs.proto.storage import blob_name

from .formats import BAD_VAL, BYVOL_KEY, BYVOL_VAL, U64

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)


def scrub_entries(store: Store, after: bytes, limit: int
                  ) -> list[tuple[bytes, int, int, int, int]]:
    """Up to ``limit`` live blobs after byvol key ``after`` (b"" for the start), in disk
    order: (byvol key, volume, offset, length, xxh)."""
    out: list[tuple[bytes, int, int, int, int]] = []
    pending = store.pending.byvol  # appends not yet in LMDB are scrubbed as well
    with store.env.begin(db=store.byvol) as txn:
        cur = txn.cursor()
        ok = cur.set_range(after) if after else cur.first()
        if ok and after and bytes(cur.key()) == after:
            ok = cur.next()
        while ok and len(out) < limit:
            key = bytes(cur.key())
            try:
                vol, off, _ = BYVOL_KEY.unpack(key)
                length, xxh = BYVOL_VAL.unpack(cur.value())
            except struct.error:
                log.error("scrub: malformed index key %s skipped", key.hex())
            else:
                out.append((key, vol, off, length, xxh))
            ok = cur.next()
    if pending:
        seen = {e[0] for e in out}
        for key, val in list(pending.items()):
            if key > after and key not in seen:
                vol, off, _ = BYVOL_KEY.unpack(key)
                out.append((key, vol, off, *BYVOL_VAL.unpack(val)))
        out.sort()
        del out[limit:]
    return out


def verify(store: Store, entries: Sequence[tuple[bytes, int, int, int, int]]
           ) -> list[tuple[bytes, int, int, int, int, str]]:
    """Re-read ``entries`` (as ``scrub_entries`` gives them) from their volumes and check
    each against its xxh3; the failures as (id, volume, offset, length, xxh, reason).

    Never raises for a bad file: a missing or short volume, an unreadable range and a
    checksum mismatch are all findings. Pages that were not cached before are dropped
    again afterwards, so a pass does not push the clients' pages out of the page cache.
    """
    bad: list[tuple[bytes, int, int, int, int, str]] = []
    fds: dict[int, int | str] = {}
    probe = [bytearray(1)]
    try:
        for key, vol, off, length, xxh in entries:
            bid = key[12:]
            reason = None
            fd = fds.get(vol)
            if fd is None:
                try:
                    fd = fds[vol] = os.open(store.vol_path(vol), os.O_RDONLY)
                except OSError as e:
                    fd = fds[vol] = f"volume {vol} cannot be opened: {e.strerror or e}"
            if isinstance(fd, str):
                reason = fd
            elif length and vol in store.short and off + length > store.short[vol]:
                reason = f"lies past the end of volume {vol} ({store.short[vol]} bytes)"
            else:
                reason = _verify_one(fd, off, length, xxh, probe)
            if reason is not None:
                log.error("scrub: blob %s (volume %d, offset %d, %d bytes): %s",
                          blob_name(bid), vol, off, length, reason)
                bad.append((bid, vol, off, length, xxh, reason))
    finally:
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)
    return bad


def _verify_one(fd: int, off: int, length: int, xxh: int, probe: list) -> str | None:
    """Why the blob at ``off`` of ``fd`` is bad, None if it is good; its pages leave the cache
    again unless they were cached before."""
    cached = True
    if length:
        try:
            os.preadv(fd, probe, off, os.RWF_NOWAIT)
        except BlockingIOError:
            cached = False
        except OSError:
            pass
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    try:
        while got < length:
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                break
            got += n
    except OSError as e:
        return f"read error: {e.strerror or e}"
    finally:
        if not cached:
            try:
                os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
    if got != length:
        return f"cut short: {got} of {length} bytes in the volume"
    if xxhash.xxh3_64_intdigest(view) != xxh:
        return "checksum mismatch"
    return None


def scrub_state(store: Store) -> bytes | None:
    """The scrubber's saved progress (JSON), None before its first save."""
    with store.env.begin(db=store.meta) as txn:
        raw = txn.get(b"scrub")
        return bytes(raw) if raw is not None else None


def repaired(store: Store) -> int:
    """Bad copies replaced by a re-put, ever."""
    with store.env.begin(db=store.meta) as txn:
        raw = txn.get(b"repaired")
        return U64.unpack(raw)[0] if raw else 0


def bad_blobs(store: Store, after: bytes, limit: int) -> list[list]:
    """Up to ``limit`` [id, length, xxh, found, reason] with id > ``after``, in id order."""
    out: list[list] = []
    with store.env.begin(db=store.bad_db) as txn:
        cur = txn.cursor()
        ok = cur.set_range(after) if after else cur.first()
        if ok and after and bytes(cur.key()) == after:
            ok = cur.next()
        while ok and len(out) < limit:
            raw = bytes(cur.value())
            try:
                length, xxh, found = BAD_VAL.unpack_from(raw)
                reason = raw[BAD_VAL.size:].decode(errors="replace")
            except struct.error:
                length, xxh, found, reason = 0, 0, 0.0, "malformed record"
            out.append([bytes(cur.key()), length, xxh, found, reason])
            ok = cur.next()
    return out
