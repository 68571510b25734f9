"""The client's blob cache: memory and disk, each an LRU bounded in bytes, checksummed.

Blobs are immutable and named by random 128-bit ids, so the cache is keyed by blob id and never
needs invalidating: a changed file points at new blob ids. Storage reads are verified by the
storage client; a blob read back from the disk cache is verified here against the xxh3-64 that its
chunk record carries, so a corrupt cache file is detected and the blob fetched again.

The disk cache packs blobs into segment files (``segments/seg-<n>``), appended in batches by one
writer task in a worker thread (O_DIRECT where the filesystem allows: cached bytes do not crowd
the page cache). A file per blob would cost an inode allocation per small file and a slow scan of
millions of files at mount; segments cost neither. Each record is a header (magic, blob id,
length, checksum) and the blob. Space is reserved before a batch is written, and the oldest
segment is dropped when a batch does not fit, so the disk cache never holds more than its bound;
a blob read from the oldest half is written again at the head, which makes the order LRU-like.
After a remount the index is rebuilt from the segments; a record torn by a crash ends its segment.

What goes to disk (``admit``): by default a blob is written to the disk cache when it is
fetched from storage a second time (seen in a bounded set of recent fetches: the dataset is
read again and the kernel's page cache no longer held it) or pushed out of memory before its
reader used it (prefetched too far ahead); a blob read once on its way to the kernel's page
cache is not written at all. Writing every fetched blob doubled the disk traffic of a cold
epoch (the storage servers read from the same disks) for data the page cache then held anyway.
``admit="all"`` writes every fetched blob (a mount whose disk cache should fill on first use).

Prefetched blobs are tagged until a reader uses them: a use counts as a prefetch hit, an eviction
of a still-unused blob as wasted bytes. Concurrent requests for one blob share one fetch.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import trio

from ...types import Chunk
from .segments import (
    ALIGN,
    RECORD,
    Staging,
    aligned,
    append_batch,
    delete_segments,
    lock_dir,
    read_records,
    scan_all,
)

log = logging.getLogger(__name__)

SEGMENT_BYTES = 64 << 20

WRITE_QUEUE_BYTES = 64 << 20
"""Blobs waiting for the disk writer; beyond this, new blobs are not written (it is a cache)."""

WRITE_BATCH_BYTES = 16 << 20

SEEN_MAX = 1 << 18
"""Blob ids remembered as fetched once, for admission on the second fetch."""

Fetch = Callable[[Sequence[Chunk]], Awaitable[list[memoryview]]]
"""Fetches whole blobs from storage, verified (``StorageClient.get``)."""


@dataclass
class CacheStats:
    """Counters; bytes are blob bytes."""

    mem_hits: int = 0
    mem_hit_bytes: int = 0
    disk_hits: int = 0
    disk_hit_bytes: int = 0
    misses: int = 0
    miss_bytes: int = 0
    joined: int = 0
    """Requests that waited for a fetch already in flight instead of starting another."""
    prefetched: int = 0
    prefetched_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_hit_bytes: int = 0
    prefetch_wasted: int = 0
    prefetch_wasted_bytes: int = 0
    prefetch_cancelled: int = 0
    mem_evictions: int = 0
    mem_evicted_bytes: int = 0
    disk_evictions: int = 0
    disk_evicted_bytes: int = 0
    disk_writes: int = 0
    disk_write_bytes: int = 0
    disk_write_dropped: int = 0
    disk_corrupt: int = 0
    """Cache files whose bytes failed their checksum when read (deleted, fetched again)."""
    disk_stale: int = 0
    """Records found torn when the cache was opened (a crash while writing): dropped."""
    disk_rewrites: int = 0
    """Blobs read from the older half of the segments and written again at the head."""
    disk_errors: int = 0


class _Cancelled(Exception):
    """A prefetch was cancelled before its blob arrived: whoever waited fetches it itself."""


class _InFlight:
    __slots__ = ("event", "view", "error", "prefetch", "waiters")

    def __init__(self, prefetch: bool):
        self.event = trio.Event()
        self.view: memoryview | None = None
        self.error: BaseException | None = None
        self.prefetch = prefetch
        self.waiters = 0


class _Segment:
    __slots__ = ("seq", "size", "blobs")

    def __init__(self, seq: int, size: int = 0):
        self.seq = seq
        self.size = size
        self.blobs: list[bytes] = []


class BlobCache:
    """Blobs by id in memory (``memory_bytes``) and on disk (``disk_bytes`` under ``disk_dir``).

    Call ``await open(nursery)`` before use (it locks and indexes the disk cache and starts the
    writer) and ``close()`` at the end. All methods run on the owner's trio loop.
    """

    def __init__(self, memory_bytes: int, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0, *, write_queue_bytes: int = WRITE_QUEUE_BYTES,
                 admit: str = "second", seen_max: int = SEEN_MAX):
        if admit not in ("second", "all"):
            raise ValueError(f"admit must be 'second' or 'all', not {admit!r}")
        self.memory_bytes = max(0, int(memory_bytes))
        self.disk_dir = Path(disk_dir) if disk_dir is not None and disk_bytes > 0 else None
        self.disk_bytes = max(0, int(disk_bytes)) if self.disk_dir else 0
        self.write_queue_bytes = write_queue_bytes
        self.stats = CacheStats()
        self.admit = admit
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # recently fetched (admission)
        self._seen_max = seen_max
        self._xxh: dict[bytes, int] = {}  # checksums of blobs in memory (for writes on eviction)
        self._mem: OrderedDict[bytes, memoryview] = OrderedDict()
        self._mem_used = 0
        self._unused: dict[bytes, int] = {}  # prefetched, not yet read: blob -> bytes
        self._unused_bytes = 0
        self._inflight: dict[bytes, _InFlight] = {}
        self._disk: dict[bytes, tuple[int, int, int]] = {}  # blob -> (segment, offset, length)
        self._segs: OrderedDict[int, _Segment] = OrderedDict()  # oldest first
        self._seg_bytes = min(SEGMENT_BYTES, max(ALIGN, aligned(self.disk_bytes // 8)))
        self._disk_used = 0  # bytes of segment files plus space reserved for a write under way
        self._wq: deque[tuple[bytes, int, memoryview]] = deque()
        self._wq_blobs: dict[bytes, memoryview] = {}
        self._wq_bytes = 0
        self._wq_ready = trio.Event()
        self._lock_fd: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def open(self, nursery: trio.Nursery) -> None:
        """Lock and index the disk cache (reused from an earlier mount) and start its writer."""
        if self.disk_dir is None:
            return
        self._lock_fd = await trio.to_thread.run_sync(lock_dir, self.disk_dir)
        segs, torn = await trio.to_thread.run_sync(scan_all, self.disk_dir)
        for seq, size, records in segs:
            seg = self._segs[seq] = _Segment(seq, size)
            self._disk_used += size
            for blob, off, n in records:
                self._disk[blob] = (seq, off, n)
                seg.blobs.append(blob)
        self.stats.disk_stale += torn
        victims = self._reserve(0)
        if victims:
            await trio.to_thread.run_sync(delete_segments, self.disk_dir, victims)
        log.info("disk cache %s: %d blobs in %d segments, %.1f MiB of %.1f MiB", self.disk_dir,
                 len(self._disk), len(self._segs), self._disk_used / 2**20,
                 self.disk_bytes / 2**20)
        nursery.start_soon(self._write_forever)

    def close(self) -> None:
        """Stop the disk writer (blobs still queued are not written) and unlock the disk
        directory."""
        self._closed = True
        self._wq_ready.set()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ queries

    @property
    def memory_used(self) -> int:
        """Bytes of blobs held in memory."""
        return self._mem_used

    @property
    def disk_used(self) -> int:
        """Bytes of the disk cache's segments, padding included."""
        return self._disk_used

    @property
    def prefetched_unused_bytes(self) -> int:
        """Bytes of prefetched blobs in memory that no read has used yet."""
        return self._unused_bytes

    def has(self, blob: bytes) -> bool:
        """In memory, on disk, or on its way."""
        return blob in self._mem or blob in self._inflight or blob in self._disk \
            or blob in self._wq_blobs

    def needs(self, blob: bytes) -> bool:
        """Not in memory and not on its way there (it may be on disk)."""
        return blob not in self._mem and blob not in self._inflight and blob not in self._wq_blobs

    def peek(self, chunk: Chunk) -> memoryview | None:
        """The blob if it is in memory (a read: counted, and it becomes most recently used)."""
        view = self._mem.get(chunk.blob)
        if view is not None:
            self._mem.move_to_end(chunk.blob)
            self._hit(chunk.blob, len(view))
        return view

    def delivered(self, blobs: Iterable[bytes]) -> None:
        """These blobs now live where their reader reads them (the kernel's page cache): drop
        them from memory at once. Memory that is freed and allocated again is cheap; memory
        the cache keeps growing into costs a page fault per page (docs/perf.md), and the pages
        would be held twice."""
        for b in blobs:
            view = self._mem.pop(b, None)
            if view is not None:
                self._xxh.pop(b, None)
                self._mem_used -= len(view)
                m = self._unused.pop(b, None)
                if m is not None:
                    self._unused_bytes -= m

    def waiting_on(self, blobs: Sequence[bytes]) -> bool:
        """Whether a reader waits for any of these blobs (a prefetch of them is still wanted)."""
        return any(f.waiters for b in blobs if (f := self._inflight.get(b)) is not None)

    # ------------------------------------------------------------------ reads

    async def get(self, chunks: Sequence[Chunk], fetch: Fetch,
                  sources: set[str] | None = None, *, keep: bool = True) -> list[memoryview]:
        """Whole blobs of ``chunks``, in order: from memory, disk, a fetch in flight, or ``fetch``
        (one call for all misses); read-only views. ``sources`` collects where they came from:
        "memory", "prefetched", "disk", "joined" (a demand fetch in flight), "fetched".
        Without ``keep``, blobs fetched now are handed to the caller only, and prefetched ones
        leave the memory cache (the caller holds them from now on)."""
        src = sources if sources is not None else set()
        out: list[memoryview | None] = [None] * len(chunks)
        waits: list[tuple[int, _InFlight]] = []
        on_disk: list[int] = []
        missing: list[int] = []
        first: dict[bytes, int] = {}
        dups: list[tuple[int, int]] = []
        for i, c in enumerate(chunks):
            b = c.blob
            if b in first:
                dups.append((i, first[b]))
                continue
            first[b] = i
            view = self._mem.get(b)
            if view is not None:
                self._mem.move_to_end(b)
                src.add(self._hit(b, len(view)))
                out[i] = view
                continue
            f = self._inflight.get(b)
            if f is not None:
                f.waiters += 1
                waits.append((i, f))
                self.stats.joined += 1
            elif b in self._wq_blobs:
                view = self._wq_blobs[b]
                self._insert(b, c.xxh, view, prefetch=False, write=False)
                self.stats.mem_hits += 1
                self.stats.mem_hit_bytes += len(view)
                src.add("memory")
                out[i] = view
            elif b in self._disk:
                on_disk.append(i)
            else:
                missing.append(i)
        if on_disk:
            bad = await self._load(chunks, on_disk, out, prefetch=False)
            if len(bad) < len(on_disk):
                src.add("disk")
            missing += bad
        if missing:
            src.add("fetched")
            await self._fetch(chunks, missing, out, fetch, prefetch=False, keep=keep)
        for i, f in waits:
            out[i] = await self._wait(chunks[i], f, fetch, src)
        for i, j in dups:
            out[i] = out[j]
        if not keep:
            self.delivered(first)
        # Every index is set above (a hit, a wait, a load, a fetch or a duplicate) or it raised.
        return cast("list[memoryview]", out)

    async def prefetch(self, chunks: Sequence[Chunk], fetch: Fetch) -> int:
        """Bring blobs into memory ahead of their readers (one ``fetch`` for all that are not
        cached or on their way); returns the bytes fetched or loaded. Cancelling it leaves
        nothing half-done: readers that joined its fetch fetch for themselves."""
        todo: list[int] = []
        on_disk: list[int] = []
        seen: set[bytes] = set()
        for i, c in enumerate(chunks):
            b = c.blob
            if b in seen or b in self._mem or b in self._inflight or b in self._wq_blobs:
                continue
            seen.add(b)
            if c.blob_len > self.memory_bytes:
                continue
            (on_disk if b in self._disk else todo).append(i)
        out: list[memoryview | None] = [None] * len(chunks)
        if on_disk:
            todo += await self._load(chunks, on_disk, out, prefetch=True)
        if todo:
            await self._fetch(chunks, todo, out, fetch, prefetch=True)
        return sum(len(v) for v in out if v is not None)

    async def _wait(self, chunk: Chunk, f: _InFlight, fetch: Fetch, src: set[str]
                    ) -> memoryview:
        try:
            await f.event.wait()
        finally:
            f.waiters -= 1
        if f.view is not None:
            if f.prefetch:
                src.add(self._hit(chunk.blob, len(f.view)))
            else:
                src.add("joined")
            return f.view
        if isinstance(f.error, _Cancelled):
            (view,) = await self.get([chunk], fetch, src)
            return view
        assert f.error is not None  # a flight settles with a view or an error
        raise f.error

    async def _fetch(self, chunks: Sequence[Chunk], idx: list[int], out: list,
                     fetch: Fetch, *, prefetch: bool, keep: bool = True) -> None:
        flights = {}
        for i in idx:
            f = _InFlight(prefetch)
            self._inflight[chunks[i].blob] = f
            flights[i] = f
        want = [chunks[i] for i in idx]
        try:
            views = await fetch(want)
        except BaseException as e:
            # A cancellation belongs to the task that fetched, never to those that joined it
            # (it may arrive wrapped in the fetch's exception group): they fetch again.
            cancelled = _has_cancel(e)
            for i, f in flights.items():
                self._inflight.pop(chunks[i].blob, None)
                f.error = _Cancelled() if cancelled or not isinstance(e, Exception) else e
                f.event.set()
            if prefetch and cancelled:
                self.stats.prefetch_cancelled += len(idx)
            raise
        st = self.stats
        for i, view in zip(idx, views, strict=True):
            view = view.toreadonly()
            b = chunks[i].blob
            self._inflight.pop(b, None)
            if keep:
                self._insert(b, chunks[i].xxh, view, prefetch=prefetch,
                             write=self._admit_fetched(b))
            f = flights[i]
            f.view = view
            f.event.set()
            out[i] = view
            if prefetch:
                st.prefetched += 1
                st.prefetched_bytes += len(view)
            else:
                st.misses += 1
                st.miss_bytes += len(view)

    async def _load(self, chunks: Sequence[Chunk], idx: list[int], out: list, *,
                    prefetch: bool) -> list[int]:
        """Read blobs from the disk cache into memory; returns the indexes that were not there
        (or were corrupt: those files are deleted)."""
        flights = {}
        for i in idx:
            f = _InFlight(prefetch)
            self._inflight[chunks[i].blob] = f
            flights[i] = f
        want = [(chunks[i], self._disk[chunks[i].blob]) for i in idx]
        root = self.disk_dir
        assert root is not None  # blobs are in _disk only with a disk cache
        old_half = set(list(self._segs)[:len(self._segs) // 2])
        got: list = [None] * len(idx)
        try:
            got = await trio.to_thread.run_sync(read_records, root, want)
        except BaseException as e:
            for i, f in flights.items():
                self._inflight.pop(chunks[i].blob, None)
                f.error = _Cancelled()
                f.event.set()
            if not isinstance(e, Exception):
                raise
            log.warning("disk cache read failed: %s", e)
            self.stats.disk_errors += 1
            return list(idx)
        missing = []
        for i, res in zip(idx, got, strict=True):
            b = chunks[i].blob
            self._inflight.pop(b, None)
            f = flights[i]
            if isinstance(res, memoryview):
                view = res.toreadonly()
                loc = self._disk.get(b)
                again = loc is not None and loc[0] in old_half  # keep it: write it at the head
                self._insert(b, chunks[i].xxh, view, prefetch=prefetch, write=False)
                if again:
                    self._queue_write(b, chunks[i].xxh, view)
                    self.stats.disk_rewrites += 1
                self.stats.disk_hits += 1
                self.stats.disk_hit_bytes += len(view)
                f.view = view
                out[i] = view
            else:
                if res == "corrupt":
                    self.stats.disk_corrupt += 1
                    log.warning("the disk cache's copy of blob %s is corrupt: fetching it "
                                "again", b.hex())
                self._disk.pop(b, None)
                f.error = _Cancelled()
                missing.append(i)
            f.event.set()
        return missing

    # ------------------------------------------------------------------ memory LRU

    def _hit(self, blob: bytes, n: int) -> str:
        st = self.stats
        m = self._unused.pop(blob, None)
        if m is not None:
            self._unused_bytes -= m
            st.prefetch_hits += 1
            st.prefetch_hit_bytes += n
            return "prefetched"
        st.mem_hits += 1
        st.mem_hit_bytes += n
        return "memory"

    def _admit_fetched(self, blob: bytes) -> bool:
        """Whether a blob just fetched from storage goes to the disk cache (see ``admit``)."""
        if self.disk_dir is None:
            return False
        if self.admit == "all" or blob in self._seen:
            self._seen.pop(blob, None)
            return True
        self._seen[blob] = None
        if len(self._seen) > self._seen_max:
            self._seen.popitem(last=False)
        return False

    def _insert(self, blob: bytes, xxh: int, view: memoryview, *, prefetch: bool,
                write: bool = True) -> None:
        n = len(view)
        if n <= self.memory_bytes and blob not in self._mem:
            while self._mem_used + n > self.memory_bytes and self._mem:
                old, oldv = self._mem.popitem(last=False)
                oldx = self._xxh.pop(old, None)
                self._mem_used -= len(oldv)
                self.stats.mem_evictions += 1
                self.stats.mem_evicted_bytes += len(oldv)
                m = self._unused.pop(old, None)
                if m is not None:
                    self._unused_bytes -= m
                    self.stats.prefetch_wasted += 1
                    self.stats.prefetch_wasted_bytes += len(oldv)
                if self.disk_dir is not None and oldx is not None and old not in self._disk:
                    self._queue_write(old, oldx, oldv)  # pushed out before its use: keep it
            self._mem[blob] = view
            self._xxh[blob] = xxh
            self._mem_used += n
            if prefetch:
                self._unused[blob] = n
                self._unused_bytes += n
        elif prefetch and blob not in self._mem:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_bytes += n
        if write and self.disk_dir is not None and blob not in self._disk:
            self._queue_write(blob, xxh, view)

    # ------------------------------------------------------------------ disk LRU

    def _queue_write(self, blob: bytes, xxh: int, view: memoryview) -> None:
        if RECORD.size + len(view) > self._seg_bytes or blob in self._wq_blobs:
            return
        if self._wq_bytes + len(view) > self.write_queue_bytes:
            self.stats.disk_write_dropped += 1
            return
        self._wq.append((blob, xxh, view))
        self._wq_blobs[blob] = view
        self._wq_bytes += len(view)
        self._wq_ready.set()

    def _reserve(self, n: int, keep: int | None = None) -> list[int]:
        """Drop the oldest segments until ``n`` more bytes fit; returns the victims."""
        victims = []
        while self._disk_used + n > self.disk_bytes and self._segs:
            seq = next(iter(self._segs))
            if seq == keep and len(self._segs) == 1:
                break
            seg = self._segs.pop(seq)
            self._disk_used -= seg.size
            victims.append(seq)
            for b in seg.blobs:
                loc = self._disk.get(b)
                if loc is not None and loc[0] == seq:
                    del self._disk[b]
                    self.stats.disk_evictions += 1
                    self.stats.disk_evicted_bytes += loc[2]
        return victims

    async def _write_forever(self) -> None:
        """The disk writer, started again if it fails: a cache failure must never end the
        nursery it runs in (the mount's)."""
        while not self._closed:
            try:
                await self._writer()
                return
            except Exception:
                self.stats.disk_errors += 1
                log.exception("the disk cache writer failed; starting it again")
                await trio.sleep(1)

    async def _writer(self) -> None:
        """Append queued blobs to the head segment in batches, dropping old segments first to
        make room, and starting a new segment when the head is full."""
        root = self.disk_dir
        assert root is not None
        staging = Staging()
        limit = min(WRITE_BATCH_BYTES, self._seg_bytes)
        while not self._closed:
            await self._wq_ready.wait()
            self._wq_ready = trio.Event()
            while self._wq and not self._closed:
                taken: list[tuple[bytes, int, memoryview]] = []
                size = 0
                while self._wq and (not taken or size + RECORD.size + len(self._wq[0][2])
                                    <= limit):
                    item = self._wq.popleft()
                    taken.append(item)
                    size += RECORD.size + len(item[2])
                batch = taken
                need = aligned(sum(RECORD.size + len(v) for _, _, v in batch))
                head = next(reversed(self._segs)) if self._segs else None
                if head is None or self._segs[head].size + need > self._seg_bytes:
                    head = (head or 0) + 1
                    self._segs[head] = _Segment(head)
                victims = self._reserve(need, keep=head)
                if head not in self._segs:  # dropped to make room: start it again
                    self._segs[head] = _Segment(head)
                seg = self._segs[head]
                offset = seg.size
                seg.size += need
                self._disk_used += need
                try:
                    placed = await trio.to_thread.run_sync(
                        append_batch, root, head, offset, batch, victims, staging)
                except OSError as e:
                    log.warning("disk cache write failed: %s", e)
                    self.stats.disk_errors += 1
                    placed = []
                    if seg.size == offset + need:  # nothing was appended after it: give back
                        seg.size = offset
                        self._disk_used -= need
                finally:
                    for blob, _, view in taken:
                        if self._wq_blobs.get(blob) is view:
                            del self._wq_blobs[blob]
                            self._wq_bytes -= len(view)
                for blob, off, n in placed:
                    self._disk[blob] = (head, off, n)
                    seg.blobs.append(blob)
                    self.stats.disk_writes += 1
                    self.stats.disk_write_bytes += n

    def as_dict(self) -> dict:
        """The counters and sizes of both tiers, as one JSON-able object (the mount's stats)."""
        d = asdict(self.stats)
        d.update(memory_bytes=self.memory_bytes, memory_used=self._mem_used,
                 memory_blobs=len(self._mem), disk_bytes=self.disk_bytes,
                 disk_used=self._disk_used, disk_blobs=len(self._disk),
                 disk_segments=len(self._segs),
                 disk_dir=str(self.disk_dir) if self.disk_dir else None,
                 prefetched_unused_bytes=self.prefetched_unused_bytes,
                 write_queue_bytes=self._wq_bytes)
        return d


def _has_cancel(e: BaseException) -> bool:
    """Whether ``e`` is a trio cancellation or an exception group holding one."""
    if isinstance(e, trio.Cancelled):
        return True
    if isinstance(e, BaseExceptionGroup):
        return any(_has_cancel(x) for x in e.exceptions)
    return False


__all__ = ["BlobCache", "CacheStats"]
