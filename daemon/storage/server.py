"""The storage server: blobs in append-only volumes, served with ``sendfile``.

Writes (fsync policy). ``--fsync always`` (the default): a ``put_blobs`` is answered only after its
bytes (and the record naming them) are appended to the active volume and ``fdatasync``-ed; the
index entries follow in memory and reach LMDB within a second (the writer writes them when idle
or with the next other commit), and a restart indexes again from the records what the index did
not have yet (``store.py``); an acknowledged blob survives a power cut. Concurrent requests
share one group commit: while one commit is in a worker thread, the next requests queue and then
go to disk together with one ``fdatasync``, so many writers cost few syncs.
``--fsync never`` skips the syncs: an acknowledged blob survives the server process dying (the
page cache keeps it) but not the machine crashing, when the index may even name bytes that never
reached the disk (readers then see a checksum error and fail over). Use it for scratch clusters
and benchmarks only.

Reads. ``get_blobs`` looks ids up in one LMDB read transaction on the trio thread (microseconds,
no await inside), coalesces blobs that are neighbours on disk into one ``FileSegment`` and lets the
RPC layer ``os.sendfile`` them. Because ``sendfile`` on the trio thread would block the whole
server on a page that is not cached, each segment is first probed with ``preadv(RWF_NOWAIT)``; if
any probe misses, a worker thread pulls the segments into the page cache (``posix_fadvise``
WILLNEED for all of them, so the disk works on them in parallel, then ``sendfile`` to /dev/null,
no copy to user space) before the answer is sent. Measured on the project VM (bench/storage_micro.py
--cold, shuffled 1-64 KiB blobs, 3 runs): cold-read throughput was the same or better with the
warm-up (2.6-6.9k against 2.6-4.7k blobs/s), and a cached read issued meanwhile waited a median
9-40 ms behind the stalled event loop without it, 2-8 ms with it.
(``--cold-reads direct`` turns the warm-up off, to measure.)

Scrubbing (``scrub.py``): a task re-reads the live blobs in disk order at ``--scrub-rate`` bytes/s
(default 32 MiB/s; 0 turns it off) and marks those whose bytes fail their checksum; reads refuse
a marked blob with ``EIO`` (clients fail over to a replica), and a ``put_blobs`` of its id with its
checksum replaces the copy (``jpfs scrub repair``, or the metadata shards' healers, which ask the
node to ``pull_blobs`` a good copy from another node itself: ``pull.py``). ``--scrub-pause`` is
the wait between passes. A client whose read fails its checksum calls ``report_bad``, which
re-verifies those blobs at once.

Volumes in use by an answer being sent are pinned (``volume_fds.py``): compaction
(``compaction.py``) retires them, but the open file descriptor is closed only after the last
send.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import trio
import xxhash

from jpfs import config
from jpfs.errors import error
from jpfs.proto import storage as P
from jpfs.rpc import FileSegment, Handler, Limits, Reply, Service, serve

from .. import common
from .compaction import Compactor
from .ops import DeleteOp, Op, PutOp
from .pending import PENDING_AGE
from .pull import Puller
from .scrub import DEFAULT_PAUSE, DEFAULT_RATE, Scrubber
from .store import Store
from .volume_fds import VolumeFds

log = logging.getLogger(__name__)

_HASH_INLINE = 256 << 10
"""Payloads smaller than this are checksummed on the trio thread (a thread hop costs more)."""

_PROBE_STEP = 2 << 20

_INLINE_MAX = 64 << 10
"""get_blobs answers up to this size are read (from the page cache) and sent with the header."""


@dataclass
class _Queued:
    op: Op
    done: trio.Event = field(default_factory=trio.Event)
    result: object = None


INLINE_PUT_BYTES = 256 << 10
"""A group commit whose puts carry at most this much may run on the event loop (``_Writer``)."""


def _small(ops: list[Op]) -> bool:
    """Whether a group commit is only small puts and deletes (an fsync of a few pages)."""
    total = 0
    for op in ops:
        if isinstance(op, PutOp):
            total += len(op.data)
        elif not isinstance(op, DeleteOp):
            return False
    return total <= INLINE_PUT_BYTES


class _Writer:
    """The single owner of index writes: queues ops and commits them in groups. A group of
    small puts commits on the event loop while such commits are fast (``BlockingCalls``: a
    thread hop costs more than writing and fsyncing 100 KB), anything else in a worker thread."""

    def __init__(self, store: Store):
        self.store = store
        self._queue: list[_Queued] = []
        self._wake = trio.Event()
        self.commits = 0
        self.calls = common.BlockingCalls()

    async def submit(self, op: Op):
        q = _Queued(op)
        self._queue.append(q)
        self._wake.set()
        await q.done.wait()
        if isinstance(q.result, BaseException):
            raise q.result
        return q.result

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if self.store.pending.blobs:
                # appends' index entries wait in memory (their records make them durable):
                # write them to the index when the writer has been idle for a while
                with trio.move_on_after(PENDING_AGE):
                    await self._wake.wait()
                if not self._wake.is_set():
                    try:
                        await self.calls.run(self.store.flush)
                    except Exception:
                        log.exception("writing pending index entries failed (the volume's "
                                      "records keep them)")
                        await trio.sleep(PENDING_AGE)
                    continue
            await self._wake.wait()
            self._wake = trio.Event()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            try:
                # Not cancellable: a shutdown waits for the transaction in hand to finish.
                ops = [q.op for q in batch]
                results = await self.calls.run(self.store.commit, ops, eligible=_small(ops))
                self.commits += 1
            except Exception as e:
                log.exception("group commit of %d operations failed", len(batch))
                err = getattr(e, "errno", None) or errno.EIO
                why = f"storage commit failed: {getattr(e, 'strerror', None) or e}"
                results = [error(err, why) for _ in batch]
            for q, r in zip(batch, results, strict=True):
                q.result = r
                q.done.set()


class StorageServer:
    """The storage service's handlers over one ``Store``. Start ``run`` before serving."""

    def __init__(self, store: Store, node: int = 0, *, warm_cold_reads: bool = True,
                 scrub_rate: float = DEFAULT_RATE, scrub_pause: float = DEFAULT_PAUSE,
                 secret: bytes = b""):
        self.store = store
        self.node = node
        self.warm_cold_reads = warm_cold_reads
        self.writer = _Writer(store)
        self.scrubber = Scrubber(store, self.writer.submit, rate=scrub_rate, pause=scrub_pause)
        self.files = VolumeFds(store)
        self.puller = Puller(store, self.writer.submit, secret, node)
        self._devnull = os.open(os.devnull, os.O_WRONLY)
        self.counters = dict.fromkeys(
            ("puts", "blobs_put", "gets", "blobs_sent", "segments_sent", "bytes_sent",
             "cold_warmups", "compactions", "locates", "blobs_located"), 0)
        self.compactor = Compactor(store, self.writer.submit, self.files, self.counters)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The group-commit writer and the scrubber; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.writer.run)
            await nursery.start(self.scrubber.run)
            self.puller.start(nursery)
            task_status.started()

    def close(self) -> None:
        """Close the puller's connections and the node's files (volumes, index)."""
        self.puller.close()
        self.files.close()
        os.close(self._devnull)

    def handlers(self) -> dict:
        """Every method of ``jpfs.proto.storage`` bound to its handler (none answers inline:
        each may wait on the disk or the group commit)."""
        return {
            P.PUT_BLOBS: Handler(self.put_blobs, recycles=True),
            P.GET_BLOBS: Handler(self.get_blobs),
            P.DELETE_BLOBS: Handler(self.delete_blobs),
            P.LIST_BLOBS: Handler(self.list_blobs),
            P.COMPACT: Handler(self.compact),
            P.STATS: Handler(self.stats),
            P.SCRUB_STATUS: Handler(self.scrub_status),
            P.SCRUB_START: Handler(self.scrub_start),
            P.BAD_BLOBS: Handler(self.bad_blobs),
            P.PULL_BLOBS: Handler(self.puller.pull),
            P.REPORT_BAD: Handler(self.puller.report_bad),
            P.HOST_INFO: Handler(self.host_info),
            P.LOCATE_BLOBS: Handler(self.locate_blobs),
        }

    # ------------------------------------------------------------------ put

    async def put_blobs(self, entries: list, payload: memoryview) -> list[int]:
        """PUT_BLOBS: store the blobs of ``entries`` (id, length, xxh) lying back to back in the
        payload; ``[stored, already_present]`` once durable. EIO for a blob that does not match
        its checksum, EINVAL/E2BIG for a malformed or too large request."""
        checked = _check_put(entries, len(payload))
        if len(payload) < _HASH_INLINE:
            _verify(checked, payload)
        else:
            await trio.to_thread.run_sync(_verify, checked, payload)
        result = await self.writer.submit(PutOp(checked, payload))
        self.counters["puts"] += 1
        self.counters["blobs_put"] += result[0]
        return result

    # ------------------------------------------------------------------ get

    async def get_blobs(self, ids: list) -> Reply:
        """GET_BLOBS: per id ``[length, xxh]`` or an errno name (ENOENT, EIO for a copy found bad),
        the bytes found following in the payload (sendfile from the volumes); E2BIG past
        ``MAX_GET_BYTES`` in one request."""
        P.check_ids(ids, "get_blobs")
        entries = self.store.lookup(ids)
        total = sum(e.length for e in entries if e is not None)
        if total > P.MAX_GET_BYTES:
            raise error(errno.E2BIG, f"get_blobs: {total} bytes asked for in one request "
                                     f"(at most {P.MAX_GET_BYTES})")
        # Look up, pin and coalesce with no await in between: compaction cannot retire a volume
        # between our lookup and our pin.
        statuses: list = []
        pinned: list[int] = []
        segments: list[FileSegment] = []
        seg_vol = seg_fd = seg_start = seg_end = -1
        sent = nbytes = 0
        short = self.store.short
        bad = self.store.bad_ids
        try:
            for bid, e in zip(ids, entries, strict=True):
                if e is None:
                    statuses.append("ENOENT")
                    continue
                if bad and bid in bad:  # the scrubber found this copy bad: fail over now
                    statuses.append("EIO")
                    continue
                vol, offset, length, xxh, _ = e
                if short and vol in short and offset + length > short[vol]:
                    log.error("blob %s lies past the end of volume %d", P.blob_name(bid), vol)
                    statuses.append("EIO")
                    continue
                if length:
                    if vol == seg_vol and offset == seg_end:
                        seg_end += length
                    else:
                        try:
                            fd = self.files.pin(vol)
                        except OSError as exc:
                            log.error("cannot open volume %d for blob %s: %s", vol,
                                      P.blob_name(bid), exc)
                            statuses.append("EIO")
                            continue
                        if seg_vol >= 0:
                            segments.append(FileSegment(seg_fd, seg_start, seg_end - seg_start))
                        pinned.append(vol)
                        seg_vol, seg_fd, seg_start, seg_end = vol, fd, offset, offset + length
                statuses.append([length, xxh])
                sent += 1
                nbytes += length
            if seg_vol >= 0:
                segments.append(FileSegment(seg_fd, seg_start, seg_end - seg_start))
            if segments and self.warm_cold_reads and not _cached(segments):
                # sendfile on this thread would stall every connection on the disk: read the
                # pages in with a worker thread first.
                self.counters["cold_warmups"] += 1
                await trio.to_thread.run_sync(_warm, self._devnull, segments)
            if nbytes <= _INLINE_MAX:
                # Small answers go out in one sendmsg with the header: a separate sendfile
                # would cost a second syscall and wake the reader twice.
                payload: list = [_read_segments(segments, nbytes)] if nbytes else []
                self.files.unpin(pinned)
                pinned = []
        except BaseException:
            self.files.unpin(pinned)
            raise
        c = self.counters
        c["gets"] += 1
        c["blobs_sent"] += sent
        c["segments_sent"] += len(segments)
        c["bytes_sent"] += nbytes
        if nbytes <= _INLINE_MAX:
            return Reply(statuses, payload)
        return Reply(statuses, segments, on_sent=functools.partial(self.files.unpin, pinned))

    # ------------------------------------------------------------------ short-circuit reads

    async def host_info(self) -> dict:
        """HOST_INFO: where this node runs and keeps its volumes (``P.HostInfo``): a client on
        the same host (same boot, same network namespace, the same directory at that path)
        reads them itself."""
        st = os.stat(self.store.vol_dir)
        return P.HostInfo(host=P.host_identity(), volumes=str(self.store.vol_dir.resolve()),
                          volumes_id=[st.st_dev, st.st_ino]).to_wire()

    async def locate_blobs(self, ids: list) -> list:
        """Where each blob's bytes lie, for a client that reads them itself; refused as
        ``get_blobs`` would refuse them (unknown, marked bad, past a volume's end)."""
        P.check_ids(ids, "locate_blobs")
        entries = self.store.lookup(ids)
        short = self.store.short
        bad = self.store.bad_ids
        out: list = []
        for bid, e in zip(ids, entries, strict=True):
            if e is None:
                out.append("ENOENT")
                continue
            vol, offset, length, xxh, _ = e
            if (bad and bid in bad) or (short and vol in short and offset + length > short[vol]):
                out.append("EIO")
                continue
            out.append([vol, offset, length, xxh])
        self.counters["locates"] += 1
        self.counters["blobs_located"] += len(ids)
        return out

    # ------------------------------------------------------------------ delete, list

    async def delete_blobs(self, ids: list) -> int:
        """DELETE_BLOBS: drop these blobs from the index (ids not stored are skipped); how many
        went."""
        P.check_ids(ids, "delete_blobs")
        return await self.writer.submit(DeleteOp(list(ids)))

    async def list_blobs(self, after: bytes, limit: int) -> list:
        """LIST_BLOBS: ``(id, created)`` of up to ``limit`` blobs after ``after``, in id order
        (gc)."""
        if len(after) > P.BLOB_ID_BYTES:
            raise error(errno.EINVAL, "list_blobs: 'after' must be a blob id or b''")
        if limit < 0:
            raise error(errno.EINVAL, "list_blobs: negative limit")
        return await trio.to_thread.run_sync(self.store.list_blobs, after,
                                             min(limit, P.MAX_LIST))

    # ------------------------------------------------------------------ stats, compaction

    async def stats(self) -> dict:
        """STATS: the node's usage, counters and scrub totals (``P.Stats``); also the metrics'
        snapshot."""
        usage = await trio.to_thread.run_sync(self.store.usage)
        sc = self.scrubber.s
        figures: dict[str, Any] = {**usage, **self.counters, **self.puller.counters}
        return P.Stats(node=self.node, **figures, commits=self.writer.commits,
                       scrub_passes=sc["passes"], scrub_bytes=sc["bytes_verified"],
                       scrub_bad_found=sc["bad_found"],
                       scrub_repaired=await trio.to_thread.run_sync(self.store.repaired)
                       ).to_wire()

    async def compact(self, min_dead_ratio: float) -> dict:
        """COMPACT: rewrite the volumes whose dead share is at least ``min_dead_ratio``; what
        was done (``P.CompactSummary``)."""
        return (await self.compactor.compact(min_dead_ratio)).to_wire()

    # ------------------------------------------------------------------ scrub

    async def scrub_status(self) -> dict:
        """SCRUB_STATUS: the scrubber's progress and the copies repaired (``P.ScrubStatus``)."""
        repaired = await trio.to_thread.run_sync(self.store.repaired)
        return self.scrubber.status(repaired).to_wire()

    async def scrub_start(self) -> dict:
        """SCRUB_START: start a scrub pass now; EINVAL when scrubbing is off (``--scrub-rate
        0``)."""
        if not self.scrubber.enabled:
            raise error(errno.EINVAL, f"scrub_start: scrubbing is off on storage node "
                                      f"{self.node} (--scrub-rate 0)")
        self.scrubber.start_now()
        return await self.scrub_status()

    async def bad_blobs(self, after: bytes, limit: int) -> list:
        """BAD_BLOBS: up to ``limit`` blobs after ``after`` that the scrubber found bad, in id
        order."""
        if len(after) > P.BLOB_ID_BYTES:
            raise error(errno.EINVAL, "bad_blobs: 'after' must be a blob id or b''")
        if limit < 0:
            raise error(errno.EINVAL, "bad_blobs: negative limit")
        return await trio.to_thread.run_sync(self.store.bad_blobs, after,
                                             min(limit, P.MAX_LIST))


# ---------------------------------------------------------------------- helpers (pure / blocking)


def _check_put(entries: list, payload_len: int) -> list[tuple[bytes, int, int]]:
    if len(entries) > P.MAX_BATCH_BLOBS:
        raise error(errno.E2BIG, f"put_blobs: {len(entries)} blobs in one request "
                                 f"(at most {P.MAX_BATCH_BLOBS})")
    out = []
    total = 0
    for item in entries:
        if not (isinstance(item, list) and len(item) == 3):
            raise error(errno.EINVAL, "put_blobs: each entry must be [id, length, xxh]")
        bid, length, xxh = item
        P.check_id(bid)
        if type(length) is not int or type(xxh) is not int or length < 0 or \
                not 0 <= xxh < (1 << 64):
            raise error(errno.EINVAL, f"put_blobs: bad length or checksum for blob "
                                      f"{P.blob_name(bid)}")
        total += length
        out.append((bid, length, xxh))
    if total != payload_len:
        raise error(errno.EINVAL, f"put_blobs: entries add up to {total} bytes but the payload "
                                  f"has {payload_len}")
    return out


def _verify(entries: list[tuple[bytes, int, int]], payload: memoryview) -> None:
    pos = 0
    for bid, length, xxh in entries:
        if xxhash.xxh3_64_intdigest(payload[pos:pos + length]) != xxh:
            raise error(errno.EIO, f"put_blobs: blob {P.blob_name(bid)} does not match its "
                                   f"checksum (corrupted in transit?)")
        pos += length


def _cached(segments: list[FileSegment]) -> bool:
    """Whether the segments' pages look cached: probe the first and last byte of each, and one
    byte every 2 MiB in between (``preadv`` with RWF_NOWAIT fails rather than wait for disk)."""
    probe = [bytearray(1)]
    nowait = os.RWF_NOWAIT
    for s in segments:
        end = s.offset + s.length - 1
        offsets = range(s.offset, end, _PROBE_STEP) if s.length > _PROBE_STEP else (s.offset,)
        try:
            for off in offsets:
                os.preadv(s.fd, probe, off, nowait)
            if end >> 12 != s.offset >> 12:
                os.preadv(s.fd, probe, end, nowait)
        except BlockingIOError:
            return False
        except OSError:  # RWF_NOWAIT unsupported here: send directly, as without the probe
            return True
    return True


def _read_segments(segments: list[FileSegment], nbytes: int) -> bytearray:
    """The segments' bytes, back to back (pages are cached: probed or warmed before)."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    pos = 0
    for s in segments:
        end = pos + s.length
        while pos < end:
            n = os.preadv(s.fd, [view[pos:end]], s.offset + s.length - (end - pos))
            if n <= 0:
                raise error(errno.EIO, "a volume is shorter than its index says")
            pos += n
    return buf


def _warm(devnull: int, segments: list[FileSegment]) -> None:
    """Pull the segments into the page cache without copying them to user space."""
    for s in segments:  # queue the reads of all segments at once (the disk works in parallel)
        os.posix_fadvise(s.fd, s.offset, s.length, os.POSIX_FADV_WILLNEED)
    for s in segments:
        off, left = s.offset, s.length
        while left > 0:
            n = os.sendfile(devnull, s.fd, off, left)
            if n <= 0:
                break
            off += n
            left -= n


# ---------------------------------------------------------------------- the daemon


def main(argv: list[str] | None = None) -> None:
    """``jpfs-storage``: serve one storage node until SIGTERM or SIGINT."""
    p = common.parser("storage", "A JPFS storage server: blobs in append-only volumes.")
    p.add_argument("--volume-size", default="1GiB",
                   help="roll over to a new volume file at this size (default 1GiB)")
    p.add_argument("--fsync", choices=["always", "never"], default="always",
                   help="always: fsync data and index before answering a put (default); "
                        "never: survive process crashes only (scratch clusters, benchmarks)")
    p.add_argument("--no-sync", action="store_true", help="the same as --fsync never")
    p.add_argument("--cold-reads", choices=["warm", "direct"], default="warm",
                   help="warm: read uncached pages in a worker thread before sendfile (default); "
                        "direct: sendfile at once, stalling the server on the disk (to measure)")
    p.add_argument("--scrub-rate", default=f"{DEFAULT_RATE >> 20}MiB",
                   help="re-read and verify live blobs at most this fast, per second (default "
                        f"{config.format_size(DEFAULT_RATE)}; 0 turns scrubbing off)")
    p.add_argument("--scrub-pause", type=float, default=DEFAULT_PAUSE,
                   help=f"seconds from the end of one scrub pass to the start of the next "
                        f"(default {DEFAULT_PAUSE:.0f})")
    args = p.parse_args(argv)
    common.setup_logging(args.log_level, args.log_file)
    cluster, data, host, port = common.resolve(args, "storage")
    volume_size = config.parse_size(args.volume_size)
    fsync = args.fsync == "always" and not args.no_sync
    scrub_rate = config.parse_size(args.scrub_rate)

    async def amain() -> None:
        store = await trio.to_thread.run_sync(
            functools.partial(Store, data, volume_size=volume_size, fsync=fsync))
        server = StorageServer(store, node=args.index,
                               warm_cold_reads=args.cold_reads == "warm",
                               scrub_rate=scrub_rate, scrub_pause=args.scrub_pause,
                               secret=cluster.secret)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                service = Service("storage", P.METHODS, server.handlers())
                await nursery.start(
                    functools.partial(serve, limits=Limits(max_payload=P.MAX_PUT_BYTES)),
                    service, host, port, cluster.secret)
                metrics = common.metrics_address(args, cluster, "storage")
                if metrics:
                    from ..metrics import serve_metrics

                    serve_metrics(metrics, "storage", args.index, service, server.stats,
                                  frozenset(server.counters) | frozenset(server.puller.counters)
                                  | {"commits"})
                log.info("storage node %d serving %s on %s:%d (fsync %s, volumes of %s)",
                         args.index, data, host, port, "always" if fsync else "never",
                         config.format_size(volume_size))
        finally:
            server.close()
            store.close()

    common.run(args, amain)


if __name__ == "__main__":
    main()
