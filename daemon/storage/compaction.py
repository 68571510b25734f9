"""Compaction: rewriting volumes whose dead share is large, so deleted blobs free their space.

The steps, each safe to be killed after: seal the chosen volumes (appends stop), take a
snapshot of their live blobs, copy those to a fresh volume (several old volumes' survivors
packed into one, up to the volume size) and fsync it, then switch every moved entry and drop
the old volumes' records in one index transaction (``SwitchOp``, applied by ``commit.py``), and
only after that unlink the old files. ``kill -9`` between any two steps therefore never loses a
live blob: recovery deletes a target never switched in, or an old volume already dropped.

``Compactor`` schedules the steps (an RPC's task, one compaction at a time); the copy side
below blocks and runs in worker threads.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
import xxhash

from jpfs.errors import JPFSError, error
from jpfs.proto.storage import CompactSummary, blob_name

from .formats import BYVOL_KEY, BYVOL_VAL, VOL_KEY
from .ops import AllocOp, Op, SealOp, SwitchOp
from .volume_fds import VolumeFds
from .volumes import crash_point, pwrite_all, unlink_quietly

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)

_COPY_BUFFER = 8 << 20


class Compactor:
    """Compaction of one node's volumes.

    Args:
        store: the node's volumes and index.
        submit: the writer's ``submit`` (the single owner of index writes).
        files: the server's open volumes (a retired volume's descriptor closes after its
            last send).
        counters: the server's counters; ``compactions`` counts the volumes rewritten.
    """

    def __init__(self, store: Store, submit: Callable[[Op], Awaitable[Any]], files: VolumeFds,
                 counters: dict[str, int]):
        self.store = store
        self.submit = submit
        self.files = files
        self.counters = counters
        self._lock = trio.Lock()

    async def compact(self, min_dead_ratio: float) -> CompactSummary:
        """Rewrite volumes whose dead share is at least ``min_dead_ratio``; what was done."""
        if not 0.0 <= min_dead_ratio <= 1.0:
            raise error(errno.EINVAL, "compact: min_dead_ratio must be between 0 and 1")
        async with self._lock:
            return await self._compact(float(min_dead_ratio))

    async def _compact(self, ratio: float) -> CompactSummary:
        store = self.store
        recs = await trio.to_thread.run_sync(store.volume_records)
        candidates = sorted(
            v for v, r in recs.items()
            if v not in store.short and r.dead_bytes > 0 and r.dead_bytes >= ratio * r.end
        )
        summary = {"volumes_compacted": 0, "volumes_written": 0, "blobs_moved": 0,
                   "bytes_reclaimed": 0, "corrupt_blobs": 0}
        if not candidates:
            return CompactSummary(**summary)
        for v in candidates:  # appends must stop before we take a volume's snapshot
            await self.submit(SealOp(v))
        recs = await trio.to_thread.run_sync(store.volume_records)  # as sealed
        candidates = [v for v in candidates if v in recs]
        # Pack the survivors of several old volumes into one new volume, up to the volume size.
        groups: list[list[int]] = []
        size = 0
        for v in candidates:
            live = recs[v].live_bytes
            if groups and size + live <= store.volume_size:
                groups[-1].append(v)
                size += live
            else:
                groups.append([v])
                size = live
        for group in groups:
            done = await self._compact_group(group)
            for k in summary:
                summary[k] += done.get(k, 0)
            summary["bytes_reclaimed"] += sum(recs[v].end for v in group) - done["new_end"]
        log.info("compaction: %s", summary)
        return CompactSummary(**summary)

    async def _compact_group(self, group: list[int]) -> dict:
        store = self.store
        snapshots = [(v, await trio.to_thread.run_sync(volume_entries, store, v))
                     for v in group]
        new_vol = None
        moves: list = []
        end = bad = 0
        if any(entries for _, entries in snapshots):
            new_vol = await self.submit(AllocOp())
            fd = await trio.to_thread.run_sync(create_volume, store, new_vol)
            try:
                for v, entries in snapshots:
                    m, end, b = await trio.to_thread.run_sync(copy_live, store, v, entries, fd,
                                                              end)
                    moves += m
                    bad += b
                await trio.to_thread.run_sync(sync_volume, store, fd)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(unlink_volume, store, new_vol)
                raise
            finally:
                os.close(fd)
            crash_point("compact_copied")
        try:
            switched = await self.submit(SwitchOp(group, new_vol, end, moves))
        except JPFSError:
            if new_vol is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(unlink_volume, store, new_vol)
            raise
        crash_point("compact_switched")
        for v in group:
            self.files.retire(v)
            await trio.to_thread.run_sync(unlink_volume, store, v)
        self.counters["compactions"] += len(group)
        return {"volumes_compacted": len(group), "volumes_written": int(new_vol is not None),
                "blobs_moved": switched["moved"], "corrupt_blobs": bad, "new_end": end}


# ---------------------------------------------------------------------- the copy side (blocking)


def volume_entries(store: Store, vol: int) -> list[tuple[int, bytes, int, int]]:
    """(offset, id, length, xxh) of the blobs in ``vol``, in disk order."""
    out: list[tuple[int, bytes, int, int]] = []
    prefix = VOL_KEY.pack(vol)
    with store.env.begin(db=store.byvol) as txn:
        cur = txn.cursor()
        if not cur.set_range(prefix):
            return out
        for key, val in cur:
            if key[:4] != prefix:
                break
            _, off, bid = BYVOL_KEY.unpack(key)
            length, xxh = BYVOL_VAL.unpack(val)
            out.append((off, bid, length, xxh))
    return out


def copy_live(
    store: Store, old_vol: int, entries: list[tuple[int, bytes, int, int]], dst_fd: int,
    dst_off: int,
) -> tuple[list[tuple[bytes, int, int, int, int]], int, int]:
    """Copy ``entries`` of ``old_vol`` to ``dst_fd`` from ``dst_off``, checking checksums.

    Returns (moves, new end, blobs whose bytes did not match their checksum). Corrupt blobs
    are copied as they are: the reader's end-to-end check fails over to another replica.
    """
    moves = []
    bad = 0
    buf = bytearray(_COPY_BUFFER)
    src = os.open(store.vol_path(old_vol), os.O_RDONLY)
    try:
        half = len(entries) // 2
        for k, (off, bid, length, xxh) in enumerate(entries):
            if k == half and k:
                crash_point("compact_copying")
            view = memoryview(buf)[:length] if length <= len(buf) else \
                memoryview(bytearray(length))
            got = os.preadv(src, [view], off) if length else 0
            if got != length:
                log.error("volume %d: blob %s is cut short (%d of %d bytes); copying it "
                          "as it is", old_vol, blob_name(bid), got, length)
                view[got:] = bytes(length - got)
                bad += 1
            elif xxhash.xxh3_64_intdigest(view) != xxh:
                log.error("volume %d: blob %s fails its checksum", old_vol, blob_name(bid))
                bad += 1
            pwrite_all(dst_fd, view, dst_off)
            moves.append((bid, old_vol, off, dst_off, length))
            dst_off += length
    finally:
        os.close(src)
    return moves, dst_off, bad


def create_volume(store: Store, vol: int) -> int:
    """Create (truncating) volume ``vol``'s file; its fd, open for reading and writing."""
    return os.open(store.vol_path(vol), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)


def sync_volume(store: Store, fd: int) -> None:
    """Make volume file ``fd`` durable (fdatasync, then fsync the volumes directory); with
    ``fsync`` off, nothing."""
    if store.fsync:
        os.fdatasync(fd)
        store.fsync_dir()


def unlink_volume(store: Store, vol: int) -> None:
    """Delete volume ``vol``'s file (missing is fine) and fsync the directory (with ``fsync``
    on)."""
    unlink_quietly(store.vol_path(vol))
    store.fsync_dir()
