"""Volumes and the blob index: the blocking half of a storage node.

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

Crash safety rests on one rule: **bytes are durable before the index names them.** A put appends
to the active volume past its committed end a record (REC_HEAD: the ids, lengths and checksums
of its blobs, itself checksummed) and then the blobs, and fdatasyncs: from then on the put is
durable, and it is answered. Its index entries wait in memory (``pending``; reads, stats and
scrubs see them) and reach LMDB in one synced transaction with the next commit of anything else,
at PENDING_MAX entries, or after PENDING_AGE seconds: one sync per put instead of three (volume,
LMDB pages, LMDB meta page). A restart (after kill -9 or a power failure) indexes again every
record past the active volume's committed end whose checksums (record and blobs) match, in
order, up to the first that does not: a put cut short, never answered, which is truncated with
the rest of the tail. Commits of anything but appends to the active volume (deletes,
compaction, seals, a new volume, repairs, scrub marks) are one durable LMDB transaction, as
before. Zeros are laid ahead of the appends (``_lay_ahead``), so a put's fdatasync overwrites
blocks the file already has and needs no journal commit; a restart truncates them too.

Volume files that the index does not list (a compaction target that was never switched in, an
old volume whose switch committed but whose unlink did not happen) are deleted on restart.
Compaction copies live blobs to a fresh volume, fsyncs it, then switches every moved
entry and drops the old volume's record in one transaction; only after that is the old file
unlinked. ``kill -9`` between any two steps therefore never loses a live blob.

Everything here blocks (disk, fsync, LMDB writes) and runs in worker threads; the methods that
change the index are called from one writer task at a time (see ``server.py``), so the writer
state below has a single owner. Reads (``lookup``) use their own short read transactions.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import lmdb
import xxhash

from jpfs.errors import JPFSError, error
from jpfs.proto.storage import blob_name, volume_file

from ..common import fault_point

log = logging.getLogger(__name__)

ENTRY = struct.Struct("<IQQQd")
"""blobs value: volume, offset, length, xxh, created (seconds since the epoch)."""
BYVOL_KEY = struct.Struct(">IQ16s")
BYVOL_VAL = struct.Struct("<QQ")
VOL_KEY = struct.Struct(">I")
VOLREC = struct.Struct("<QQQIQ")
"""volumes value: committed end, live bytes, live blobs, flags, bytes of put records."""
_VOLREC_V1 = struct.Struct("<QQQI")
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
_REPLAY_MAX = 64 << 20
"""A record naming more bytes than this is not a record (puts are at most MAX_PUT_BYTES)."""

SEALED = 1
"""Volume flag: no more appends (rolled over, or a compaction target)."""

_COPY_BUFFER = 8 << 20

PREFILL = 1 << 20
"""Zeros laid ahead of the appends of the active volume (see ``Store._lay_ahead``)."""
_ZEROS = memoryview(bytes(1 << 20))


def crash_point(step: str) -> None:
    """Test hook: ``JPFS_FAULTS=storage.<step>`` makes the process die here like ``kill -9``.

    Steps: ``put_written`` (data fsynced, index not committed), ``compact_copying`` (half the
    live blobs copied), ``compact_copied`` (new volume fsynced, index not switched),
    ``compact_switched`` (index switched, old volume not unlinked).
    """
    fault_point(f"storage.{step}")


@dataclass(slots=True)
class Entry:
    """Where blob bytes lie (``ENTRY`` in the ``blobs`` database): volume, offset, length, xxh3-64
    and the time it was stored."""
    vol: int
    offset: int
    length: int
    xxh: int
    created: float

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        """The entry from its packed ``ENTRY`` value."""
        return cls(*ENTRY.unpack(raw))

    def pack(self) -> bytes:
        """The entry as its packed ``ENTRY`` value."""
        return ENTRY.pack(self.vol, self.offset, self.length, self.xxh, self.created)


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
        if len(raw) == _VOLREC_V1.size:
            return cls(*_VOLREC_V1.unpack(raw))
        return cls(*VOLREC.unpack(raw))

    def pack(self) -> bytes:
        """The record as its packed ``VOLREC`` value."""
        return VOLREC.pack(self.end, self.live_bytes, self.live_blobs, self.flags,
                           self.record_bytes)

    @property
    def dead_bytes(self) -> int:
        """Bytes of the volume no live blob uses (what compaction would reclaim)."""
        return self.end - self.live_bytes - self.record_bytes


# ------------------------------------------------------------------------------ write operations


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


@dataclass
class _WriterState:
    """What only the writer touches: the volume appends go to and where they go."""

    active: int | None = None
    end: int = 0
    fd: int | None = None
    next_volume: int = 1
    filled: int = 0
    """Bytes of the active volume already written (data or the zeros laid ahead of it): an
    append below this is an overwrite, whose fdatasync needs no journal commit."""


@dataclass
class _Commit:
    """Tentative changes of one group commit, applied to the writer state only if it commits."""

    state: _WriterState
    recs: dict[int, VolRec] = field(default_factory=dict)
    dirty: dict[int, int] = field(default_factory=dict)
    """volume -> fd to fdatasync before the index commit."""
    opened: list[tuple[int, int]] = field(default_factory=list)
    """(volume, fd) created in this commit; closed and unlinked if it aborts."""
    meta_changed: bool = False
    bad_added: set[bytes] = field(default_factory=set)
    bad_removed: set[bytes] = field(default_factory=set)
    repaired: int = 0


class Store:
    """A storage node's volumes and index. Not thread-safe for writers: one writer at a time."""

    def __init__(
        self,
        data: str | os.PathLike,
        *,
        volume_size: int = 1 << 30,
        fsync: bool = True,
        map_size: int = 64 << 30,
    ):
        self.dir = Path(data)
        self.vol_dir = self.dir / "volumes"
        self.vol_dir.mkdir(parents=True, exist_ok=True)
        self.volume_size = volume_size
        self.fsync = fsync
        self.env = lmdb.open(
            str(self.dir / "index.lmdb"), map_size=map_size, max_dbs=8, max_readers=1024,
            sync=fsync, metasync=fsync,
        )
        self.blobs = self.env.open_db(b"blobs")
        self.byvol = self.env.open_db(b"byvol")
        self.vols = self.env.open_db(b"volumes")
        self.meta = self.env.open_db(b"meta")
        self.bad_db = self.env.open_db(b"bad")
        with self.env.begin(db=self.bad_db) as txn:
            self.bad_ids: frozenset[bytes] = frozenset(bytes(k) for k, _ in txn.cursor())
        """Ids in ``bad``, for reads to refuse; replaced whole (never mutated) by commits."""
        self.short: dict[int, int] = {}
        """Volumes whose file is shorter than the index says (lost writes): vol -> real size."""
        self.pending: _Pending = _Pending()
        """Index changes of appends that their records make durable, not yet in LMDB (see
        ``commit``); replaced whole by the writer, never mutated, so readers need no lock."""
        self._w = _WriterState()
        self._recover()

    # ------------------------------------------------------------------ paths and recovery

    def vol_path(self, vol: int) -> Path:
        """The path of volume ``vol``'s file."""
        return self.vol_dir / volume_file(vol)

    @staticmethod
    def _vol_of(name: str) -> int | None:
        if name.startswith("v") and name.endswith(".vol") and name[1:-4].isdigit():
            return int(name[1:-4])
        return None

    def _recover(self) -> None:
        """Make the files agree with the index: drop orphans, truncate unindexed tails."""
        with self.env.begin() as txn:
            recs = {VOL_KEY.unpack(k)[0]: VolRec.unpack(v) for k, v in txn.cursor(db=self.vols)}
            raw_next = txn.get(b"next_volume", db=self.meta)
            raw_active = txn.get(b"active", db=self.meta)
        on_disk = {}
        for name in os.listdir(self.vol_dir):
            vol = self._vol_of(name)
            if vol is None:
                log.warning("ignoring stray file %s in %s", name, self.vol_dir)
                continue
            on_disk[vol] = self.vol_dir / name
        for vol, path in sorted(on_disk.items()):
            if vol not in recs:
                log.info("removing orphan volume %s (never committed, or already compacted)",
                         path.name)
                path.unlink()
        active = U64.unpack(raw_active)[0] if raw_active else None
        if active is not None and active in recs and active in on_disk \
                and not recs[active].flags & SEALED:
            recs[active] = self._replay(active, recs[active])
        for vol, rec in sorted(recs.items()):
            path = self.vol_path(vol)
            size = path.stat().st_size if vol in on_disk else -1
            if size < 0:
                log.error("volume %s is missing: its %d blobs are lost", path.name, rec.live_blobs)
                self.short[vol] = 0
            elif size > rec.end:
                log.info("truncating %d unindexed tail bytes of %s", size - rec.end, path.name)
                os.truncate(path, rec.end)
            elif size < rec.end:
                log.error("volume %s has %d bytes but the index says %d (lost writes?)",
                          path.name, size, rec.end)
                self.short[vol] = size
        self._fsync_dir()
        top = max([*recs, *on_disk], default=0)
        w = self._w
        w.next_volume = max(U64.unpack(raw_next)[0] if raw_next else 1, top + 1)
        if active is not None and active in recs and not recs[active].flags & SEALED \
                and active not in self.short:
            w.active, w.end = active, recs[active].end
            w.filled = w.end  # the tail past the end was truncated above
            w.fd = os.open(self.vol_path(active), os.O_RDWR)
        log.info("index has %d volumes, %d blobs; appending to %s", len(recs),
                 sum(r.live_blobs for r in recs.values()),
                 self.vol_path(w.active).name if w.active is not None else "a new volume")

    def _replay(self, vol: int, rec: VolRec) -> VolRec:
        """Index the puts whose records lie past the committed end of active volume ``vol``.

        A put is answered once its record and bytes are fdatasync-ed; its index entries wait in
        memory (``pending``) until the next synced LMDB commit. A restart after kill -9 or a
        power failure that came first finds them here: every record whose checksum and blobs'
        checksums match is indexed again, in order, up to the first that does not (a put cut
        short, never answered, truncated with the rest of the tail). A record can also be a put
        whose process died between its data sync and its answer (never answered either): its
        blobs are indexed, as they are intact.
        """
        path = self.vol_path(vol)
        found: list[tuple[bytes, int, int, int]] = []  # id, offset, length, xxh
        end = rec.end
        records = 0
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            while end + REC_HEAD.size + REC_SUM.size <= size:
                f.seek(end)
                head = f.read(REC_HEAD.size)
                magic, n = REC_HEAD.unpack(head)
                hlen = REC_HEAD.size + n * REC_ENTRY.size + REC_SUM.size
                if magic != REC_MAGIC or not 0 < n <= 4096 or end + hlen > size:
                    break
                body = head + f.read(hlen - REC_HEAD.size)
                (want,) = REC_SUM.unpack_from(body, hlen - REC_SUM.size)
                if xxhash.xxh3_64_intdigest(body[:-REC_SUM.size]) != want:
                    break
                entries = [REC_ENTRY.unpack_from(body, REC_HEAD.size + k * REC_ENTRY.size)
                           for k in range(n)]
                total = sum(e[1] for e in entries)
                if total > _REPLAY_MAX or end + hlen + total > size:
                    break
                data = f.read(total)
                pos, ok, blobs = 0, True, []
                for bid, length, xxh in entries:
                    if xxhash.xxh3_64_intdigest(data[pos:pos + length]) != xxh:
                        ok = False
                        break
                    blobs.append((bid, end + hlen + pos, length, xxh))
                    pos += length
                if not ok:
                    break
                found += blobs
                end += hlen + total
                records += hlen
        if not found:
            return rec
        now = time.time()
        new = replace(rec, end=end, record_bytes=rec.record_bytes + records)
        with self.env.begin(write=True) as txn:
            for bid, off, length, xxh in found:
                if txn.get(bid, db=self.blobs) is not None:
                    continue  # cannot happen (a re-put of a stored id writes nothing); keep it
                txn.put(bid, ENTRY.pack(vol, off, length, xxh, now), db=self.blobs)
                txn.put(BYVOL_KEY.pack(vol, off, bid), BYVOL_VAL.pack(length, xxh),
                        db=self.byvol)
                new.live_bytes += length
                new.live_blobs += 1
            txn.put(VOL_KEY.pack(vol), new.pack(), db=self.vols)
        self.env.sync(True)
        log.info("volume %s: %d blobs of puts past the index's end indexed again from their "
                 "records", path.name, len(found))
        return new

    def _fsync_dir(self) -> None:
        if not self.fsync:
            return
        fd = os.open(self.vol_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Write the pending index entries (a failure is logged: the records on disk make up for it)
        and close the active volume and the index."""
        if self.pending.blobs:
            try:
                self.flush()
            except (JPFSError, OSError, lmdb.Error) as e:  # the records make up for it
                log.error("could not write the last puts to the index: %s", e)
        if self._w.fd is not None:
            os.close(self._w.fd)
            self._w.fd = None
        self.env.close()

    # ------------------------------------------------------------------ reads

    def lookup(self, ids: Sequence[bytes]) -> list[tuple | None]:
        """Index entries for ``ids`` as (volume, offset, length, xxh, created) tuples, None where
        unknown: one short read transaction (plain tuples: this is the per-blob hot path)."""
        unpack = ENTRY.unpack
        pending = self.pending.blobs  # before the transaction: see commit()
        with self.env.begin(db=self.blobs) as txn:
            get = txn.get
            if pending:
                return [unpack(raw) if (raw := pending.get(b) or get(b)) is not None else None
                        for b in ids]
            return [unpack(raw) if (raw := get(b)) is not None else None for b in ids]

    def list_blobs(self, after: bytes, limit: int) -> list[list]:
        """Up to ``limit`` [id, created] with id > ``after``, in id order (pending ones too)."""
        out: list[list] = []
        pending = self.pending.blobs
        with self.env.begin(db=self.blobs) as txn:
            cur = txn.cursor()
            if cur.set_range(after):
                for key, raw in cur:
                    if key == after:
                        continue
                    out.append([key, ENTRY.unpack(raw)[4]])
                    if len(out) >= limit:
                        break
        if pending:
            seen = {e[0] for e in out}
            out += [[k, ENTRY.unpack(v)[4]] for k, v in list(pending.items())
                    if k > after and k not in seen]
            out.sort()
            del out[limit:]
        return out

    def volume_records(self) -> dict[int, VolRec]:
        """Every volume's record, pending changes included, by volume."""
        pending = self.pending.vols
        with self.env.begin(db=self.vols) as txn:
            recs = {VOL_KEY.unpack(k)[0]: VolRec.unpack(v) for k, v in txn.cursor()}
        recs.update((VOL_KEY.unpack(k)[0], VolRec.unpack(v)) for k, v in list(pending.items()))
        return recs

    def usage(self) -> dict:
        """The node's usage: volumes, blobs, bytes used, live and dead, the disk's free and total
        bytes, an id of the disk (nodes sharing one report the same) and bad blobs."""
        recs = self.volume_records()
        st = os.statvfs(self.dir)
        return {
            "volumes": len(recs),
            "blobs": sum(r.live_blobs for r in recs.values()),
            "bytes_used": sum(r.end for r in recs.values()),
            "live_bytes": sum(r.live_bytes for r in recs.values()),
            "dead_bytes": sum(r.dead_bytes for r in recs.values()),
            "disk_free": st.f_bavail * st.f_frsize,
            "disk_total": st.f_blocks * st.f_frsize,
            "disk_id": f"{socket.gethostname()}:{os.stat(self.dir).st_dev}",
            # nodes that share a disk (a local cluster) report the same id: count it once
            "bad_blobs": len(self.bad_ids),
        }

    # ------------------------------------------------------------------ scrubbing (read side)

    def scrub_entries(self, after: bytes, limit: int) -> list[tuple[bytes, int, int, int, int]]:
        """Up to ``limit`` live blobs after byvol key ``after`` (b"" for the start), in disk
        order: (byvol key, volume, offset, length, xxh)."""
        out: list[tuple[bytes, int, int, int, int]] = []
        pending = self.pending.byvol  # appends not yet in LMDB are scrubbed as well
        with self.env.begin(db=self.byvol) as txn:
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

    def verify(self, entries: Sequence[tuple[bytes, int, int, int, int]]
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
                        fd = fds[vol] = os.open(self.vol_path(vol), os.O_RDONLY)
                    except OSError as e:
                        fd = fds[vol] = f"volume {vol} cannot be opened: {e.strerror or e}"
                if isinstance(fd, str):
                    reason = fd
                elif length and vol in self.short and off + length > self.short[vol]:
                    reason = f"lies past the end of volume {vol} ({self.short[vol]} bytes)"
                else:
                    reason = self._verify_one(fd, off, length, xxh, probe)
                if reason is not None:
                    log.error("scrub: blob %s (volume %d, offset %d, %d bytes): %s",
                              blob_name(bid), vol, off, length, reason)
                    bad.append((bid, vol, off, length, xxh, reason))
        finally:
            for fd in fds.values():
                if isinstance(fd, int):
                    os.close(fd)
        return bad

    @staticmethod
    def _verify_one(fd: int, off: int, length: int, xxh: int, probe: list) -> str | None:
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

    def scrub_state(self) -> bytes | None:
        """The scrubber's saved progress (JSON), None before its first save."""
        with self.env.begin(db=self.meta) as txn:
            raw = txn.get(b"scrub")
            return bytes(raw) if raw is not None else None

    def repaired(self) -> int:
        """Bad copies replaced by a re-put, ever."""
        with self.env.begin(db=self.meta) as txn:
            raw = txn.get(b"repaired")
            return U64.unpack(raw)[0] if raw else 0

    def bad_blobs(self, after: bytes, limit: int) -> list[list]:
        """Up to ``limit`` [id, length, xxh, found, reason] with id > ``after``, in id order."""
        out: list[list] = []
        with self.env.begin(db=self.bad_db) as txn:
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

    # ------------------------------------------------------------------ the group commit

    def commit(self, ops: Sequence[Op]) -> list:
        """Apply ``ops`` durably; one result (or JPFSError) per op.

        Puts that append to the active volume (no new volume, no repair) are durable once their
        bytes and records are fdatasync-ed: their index entries wait in ``pending`` (read with
        the index) and reach LMDB with the next other commit, at ``PENDING_MAX`` entries, or
        after ``PENDING_AGE`` seconds (``flush``); a restart indexes them again from their
        records (``_replay``). One sync per put instead of three. Anything else is one durable
        LMDB transaction (the pending entries first), data appended by its puts fsynced before
        it commits. An op that fails its own checks (EEXIST, ENOSPC) fails alone; a failure of
        the commit itself fails them all.
        """
        if ops and self._appends_only(ops):
            return self._commit_appends(ops)
        c = _Commit(replace(self._w))
        results: list = []
        pending = self.pending
        try:
            with self.env.begin(write=True) as txn:
                pending.write_to(txn, self)
                for op in ops:
                    results.append(self._apply_alone(txn, c, op))
                if c.dirty and self.fsync:
                    for fd in c.dirty.values():
                        os.fdatasync(fd)
                if c.opened:
                    self._fsync_dir()
                if c.dirty:
                    crash_point("put_written")
                for vol, rec in c.recs.items():
                    txn.put(VOL_KEY.pack(vol), rec.pack(), db=self.vols)
                if c.meta_changed:
                    txn.put(b"next_volume", U64.pack(c.state.next_volume), db=self.meta)
                    txn.put(b"active", U64.pack(c.state.active or 0), db=self.meta)
                if c.repaired:
                    raw = txn.get(b"repaired", db=self.meta)
                    before = U64.unpack(raw)[0] if raw else 0
                    txn.put(b"repaired", U64.pack(before + c.repaired), db=self.meta)
        except BaseException:
            for vol, fd in c.opened:
                os.close(fd)
                _unlink_quietly(self.vol_path(vol))
            raise
        if pending is self.pending:  # now in LMDB (readers looked here first: see lookup)
            self.pending = _Pending()
        old_fd = self._w.fd
        if old_fd is not None and old_fd != c.state.fd:
            os.close(old_fd)
        for _vol, fd in c.opened:
            if fd != c.state.fd:
                os.close(fd)
        self._w = c.state
        if c.bad_added or c.bad_removed:
            self.bad_ids = (self.bad_ids - c.bad_removed) | c.bad_added
        return results

    def flush(self) -> None:
        """Write the pending index entries to LMDB (one durable transaction)."""
        self.commit([])

    @property
    def pending_due(self) -> bool:
        """Whether the pending index entries are due for LMDB (``PENDING_MAX`` of them, or older
        than ``PENDING_AGE`` seconds)."""
        p = self.pending
        return bool(p.blobs) and (len(p.blobs) >= PENDING_MAX
                                  or time.monotonic() - p.since >= PENDING_AGE)

    def _appends_only(self, ops: Sequence[Op]) -> bool:
        """Whether ``ops`` are puts that fit the active volume and repair nothing."""
        s = self._w
        if s.active is None or s.fd is None:
            return False
        need = 0
        bad = self.bad_ids
        for op in ops:
            if type(op) is not PutOp:
                return False
            if bad and any(e[0] in bad for e in op.entries):
                return False
            need += len(op.data) + record_size(len(op.entries))
        return s.end == 0 or s.end + need <= self.volume_size

    def _commit_appends(self, ops: Sequence[Op]) -> list:
        """``commit`` of puts appended to the active volume: data and records synced, index
        entries to ``pending``."""
        c = _Commit(replace(self._w))
        results: list = []
        before = self.pending
        with self.env.begin(db=self.blobs) as rtxn:
            view = _PendingView(self, rtxn, before)
            for op in ops:
                saved = replace(c.state)
                try:
                    assert isinstance(op, PutOp)  # _appends_only
                    results.append(self._put(view, c, op))
                except (JPFSError, OSError) as e:  # before it wrote to the view: it fails alone
                    c.state = saved
                    if isinstance(e, JPFSError):
                        results.append(e)
                    else:
                        results.append(error(e.errno or errno.EIO,
                                             f"writing a volume failed: {e.strerror or e}"))
        assert not c.opened and not c.meta_changed and not c.repaired
        if c.dirty and self.fsync:
            for fd in c.dirty.values():
                os.fdatasync(fd)
        if c.dirty:
            crash_point("put_written")
        if view.blobs:
            for vol, rec in c.recs.items():
                view.vols[VOL_KEY.pack(vol)] = rec.pack()
            before.absorb(view)
        self._w = c.state
        if self.pending_due:
            self.flush()
        return results

    def _apply_alone(self, txn, c: _Commit, op: Op):
        """Apply one op in a nested transaction, so an op that fails leaves no trace."""
        saved = (replace(c.state), {v: replace(r) for v, r in c.recs.items()}, dict(c.dirty),
                 len(c.opened), c.meta_changed, set(c.bad_added), set(c.bad_removed),
                 c.repaired)
        try:
            with self.env.begin(write=True, parent=txn) as sub:
                return self._apply(sub, c, op)
        except (JPFSError, OSError) as e:
            (c.state, c.recs, c.dirty, n_opened, c.meta_changed, c.bad_added, c.bad_removed,
             c.repaired) = saved
            for vol, fd in c.opened[n_opened:]:
                os.close(fd)
                _unlink_quietly(self.vol_path(vol))
            del c.opened[n_opened:]
            if isinstance(e, JPFSError):
                return e
            # ENOSPC, EIO from pwrite: this op fails, the others go on
            return error(e.errno or errno.EIO, f"writing a volume failed: {e.strerror or e}")

    def _rec(self, txn, c: _Commit, vol: int) -> VolRec:
        rec = c.recs.get(vol)
        if rec is None:
            raw = txn.get(VOL_KEY.pack(vol), db=self.vols)
            rec = c.recs[vol] = VolRec.unpack(raw) if raw else VolRec()
        return rec

    def _apply(self, txn, c: _Commit, op: Op):
        if isinstance(op, PutOp):
            return self._put(txn, c, op)
        if isinstance(op, DeleteOp):
            return self._delete(txn, c, op)
        if isinstance(op, SealOp):
            if c.state.active == op.vol:
                self._rec(txn, c, op.vol).flags |= SEALED
                c.state.active, c.state.end = None, 0
                c.meta_changed = True
            return None
        if isinstance(op, AllocOp):
            vol = c.state.next_volume
            c.state.next_volume += 1
            c.meta_changed = True
            return vol
        if isinstance(op, SwitchOp):
            return self._switch(txn, c, op)
        if isinstance(op, ScrubOp):
            return self._scrub(txn, c, op)
        raise TypeError(f"unknown op {op!r}")

    def _put(self, txn, c: _Commit, op: PutOp) -> list[int]:
        new: list[tuple[bytes, int, int, int]] = []  # id, length, xxh, payload offset
        present = 0
        batch: set[bytes] = set()
        replaced: dict[bytes, Entry] = {}  # bad copies this put supersedes
        pos = 0
        for bid, length, xxh in op.entries:
            raw = txn.get(bid, db=self.blobs)
            if raw is not None or bid in batch:
                have = Entry.unpack(raw) if raw is not None else None
                same = (have.length, have.xxh) == (length, xxh) if have else any(
                    n[0] == bid and (n[1], n[2]) == (length, xxh) for n in new)
                if not same:
                    raise error(errno.EEXIST, f"blob {blob_name(bid)} exists with other bytes")
                if have is not None and bid not in batch and bid in self._bad_now(c) \
                        and txn.get(bid, db=self.bad_db) is not None:
                    # A repair: the payload was verified against this checksum, the stored
                    # copy was not; write the good bytes afresh.
                    replaced[bid] = have
                    batch.add(bid)
                    new.append((bid, length, xxh, pos))
                else:
                    present += 1
            else:
                batch.add(bid)
                new.append((bid, length, xxh, pos))
            pos += length
        if not new:
            return [0, present]
        total = sum(n[1] for n in new)
        record = _record([(n[0], n[1], n[2]) for n in new])
        vol, fd, at = self._room(txn, c, len(record) + total)
        _pwrite_all(fd, memoryview(record), at)
        start = at + len(record)
        # Write the new blobs back to back: runs that are contiguous in the payload in one go.
        off = start
        i = 0
        while i < len(new):
            j, run = i, new[i][1]
            while j + 1 < len(new) and new[j + 1][3] == new[j][3] + new[j][1]:
                j += 1
                run += new[j][1]
            _pwrite_all(fd, op.data[new[i][3]:new[i][3] + run], off)
            off += run
            i = j + 1
        now = time.time()
        off = start
        for bid, length, xxh, _ in new:
            old = replaced.get(bid)
            if old is not None:
                txn.delete(BYVOL_KEY.pack(old.vol, old.offset, bid), db=self.byvol)
                old_rec = self._rec(txn, c, old.vol)
                old_rec.live_bytes -= old.length
                old_rec.live_blobs -= 1
                txn.delete(bid, db=self.bad_db)
                c.bad_removed.add(bid)
                c.bad_added.discard(bid)
                c.repaired += 1
                log.info("blob %s: bad copy in volume %d at %d replaced by a good one",
                         blob_name(bid), old.vol, old.offset)
            created = now if old is None else old.created
            txn.put(bid, ENTRY.pack(vol, off, length, xxh, created), db=self.blobs)
            txn.put(BYVOL_KEY.pack(vol, off, bid), BYVOL_VAL.pack(length, xxh), db=self.byvol)
            off += length
        rec = self._rec(txn, c, vol)
        rec.end = c.state.end = start + total
        rec.live_bytes += total
        rec.record_bytes += len(record)
        rec.live_blobs += len(new)
        c.dirty[vol] = fd
        return [len(new), present]

    def _room(self, txn, c: _Commit, size: int) -> tuple[int, int, int]:
        """The active volume, fd and append offset for ``size`` more bytes, rolling if full."""
        s = c.state
        if s.active is None or (s.end > 0 and s.end + size > self.volume_size):
            if s.active is not None:
                self._rec(txn, c, s.active).flags |= SEALED
            vol = s.next_volume
            s.next_volume += 1
            fd = os.open(self.vol_path(vol), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            c.opened.append((vol, fd))
            s.active, s.end, s.fd, s.filled = vol, 0, fd, 0
            c.recs[vol] = VolRec()
            c.meta_changed = True
        assert s.fd is not None  # an active volume is open for appending
        if self.fsync and s.end + size > s.filled:
            self._lay_ahead(s, s.end + size)
        return s.active, s.fd, s.end

    def _lay_ahead(self, s: _WriterState, need: int) -> None:
        """Write zeros past ``need`` (up to PREFILL bytes, not past the volume size), so that
        the next appends overwrite blocks the file already has. An append that grows the file
        makes its ``fdatasync`` commit the filesystem's journal (the new size and blocks), the
        slow part of a sync when other writers share the disk; an overwrite's flushes the data
        alone. This commit's own fdatasync makes the zeros durable with its data. Bytes past
        the committed end are never read (the index names none) and a restart truncates
        them, as any unindexed tail."""
        assert s.fd is not None
        start = max(need, s.filled)
        stop = max(need, min(need + PREFILL, self.volume_size))
        off = start
        while off < stop:
            off += os.pwrite(s.fd, _ZEROS[:min(len(_ZEROS), stop - off)], off)
        s.filled = stop

    def _delete(self, txn, c: _Commit, op: DeleteOp) -> int:
        n = 0
        for bid in op.ids:
            raw = txn.pop(bid, db=self.blobs)
            if raw is None:
                continue
            e = Entry.unpack(raw)
            txn.delete(BYVOL_KEY.pack(e.vol, e.offset, bid), db=self.byvol)
            rec = self._rec(txn, c, e.vol)
            rec.live_bytes -= e.length
            rec.live_blobs -= 1
            if bid in self._bad_now(c) and txn.delete(bid, db=self.bad_db):
                c.bad_removed.add(bid)
                c.bad_added.discard(bid)
            n += 1
        return n

    def _bad_now(self, c: _Commit) -> frozenset[bytes] | set[bytes]:
        """Bad ids as this commit sees them so far (a set lookup before any LMDB get)."""
        if not c.bad_added and not c.bad_removed:
            return self.bad_ids
        return (self.bad_ids - c.bad_removed) | c.bad_added

    def _scrub(self, txn, c: _Commit, op: ScrubOp) -> int:
        """Mark the blobs still where they were read as bad; save the state. Returns how many
        were newly marked."""
        marked = 0
        now = time.time()
        for bid, vol, off, length, xxh, reason in op.bad:
            raw = txn.get(bid, db=self.blobs)
            if raw is None:
                continue
            e = Entry.unpack(raw)
            if (e.vol, e.offset, e.length, e.xxh) != (vol, off, length, xxh):
                continue
            if txn.get(bid, db=self.bad_db) is None:
                marked += 1
            txn.put(bid, BAD_VAL.pack(length, xxh, now) + reason.encode()[:512], db=self.bad_db)
            c.bad_added.add(bid)
            c.bad_removed.discard(bid)
        if op.state is not None:
            txn.put(b"scrub", op.state, db=self.meta)
        return marked

    def _switch(self, txn, c: _Commit, op: SwitchOp) -> dict:
        new_rec = VolRec(end=op.new_end, flags=SEALED)
        if op.new_vol is None and op.moves:
            raise ValueError("moves without a target volume")
        moved = 0
        for bid, old_vol, old_off, new_off, length in op.moves:
            raw = txn.get(bid, db=self.blobs)
            if raw is None:
                continue  # deleted while it was being copied: its copy is dead
            e = Entry.unpack(raw)
            if (e.vol, e.offset) != (old_vol, old_off):
                continue
            txn.put(bid, ENTRY.pack(op.new_vol, new_off, length, e.xxh, e.created), db=self.blobs)
            txn.delete(BYVOL_KEY.pack(old_vol, old_off, bid), db=self.byvol)
            txn.put(BYVOL_KEY.pack(op.new_vol, new_off, bid), BYVOL_VAL.pack(length, e.xxh),
                    db=self.byvol)
            new_rec.live_bytes += length
            new_rec.live_blobs += 1
            moved += 1
        cur = txn.cursor(db=self.byvol)
        for old in op.old_vols:
            prefix = VOL_KEY.pack(old)
            if cur.set_range(prefix) and cur.key()[:4] == prefix:
                # Something still lives there (it was not in the snapshot): keep the volume.
                raise error(errno.EAGAIN, f"volume {old} gained blobs during compaction")
        for old in op.old_vols:
            txn.delete(VOL_KEY.pack(old), db=self.vols)
            c.recs.pop(old, None)
        if op.new_vol is not None:
            c.recs[op.new_vol] = new_rec
        return {"moved": moved, "live_bytes": new_rec.live_bytes}

    # ------------------------------------------------------------------ compaction (copy side)

    def volume_entries(self, vol: int) -> list[tuple[int, bytes, int, int]]:
        """(offset, id, length, xxh) of the blobs in ``vol``, in disk order."""
        out: list[tuple[int, bytes, int, int]] = []
        prefix = VOL_KEY.pack(vol)
        with self.env.begin(db=self.byvol) as txn:
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
        self, old_vol: int, entries: list[tuple[int, bytes, int, int]], dst_fd: int, dst_off: int
    ) -> tuple[list[tuple[bytes, int, int, int, int]], int, int]:
        """Copy ``entries`` of ``old_vol`` to ``dst_fd`` from ``dst_off``, checking checksums.

        Returns (moves, new end, blobs whose bytes did not match their checksum). Corrupt blobs
        are copied as they are: the reader's end-to-end check fails over to another replica.
        """
        moves = []
        bad = 0
        buf = bytearray(_COPY_BUFFER)
        src = os.open(self.vol_path(old_vol), os.O_RDONLY)
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
                _pwrite_all(dst_fd, view, dst_off)
                moves.append((bid, old_vol, off, dst_off, length))
                dst_off += length
        finally:
            os.close(src)
        return moves, dst_off, bad

    def create_volume(self, vol: int) -> int:
        """Create (truncating) volume ``vol``'s file; its fd, open for reading and writing."""
        return os.open(self.vol_path(vol), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def sync_volume(self, fd: int) -> None:
        """Make volume file ``fd`` durable (fdatasync, then fsync the volumes directory); with
        ``fsync`` off, nothing."""
        if self.fsync:
            os.fdatasync(fd)
            self._fsync_dir()

    def unlink_volume(self, vol: int) -> None:
        """Delete volume ``vol``'s file (missing is fine) and fsync the directory (with ``fsync``
        on)."""
        _unlink_quietly(self.vol_path(vol))
        self._fsync_dir()


PENDING_MAX = 4096
"""Pending index entries (appends synced with their records) written to LMDB at once."""
PENDING_AGE = 1.0
"""Seconds after which pending index entries are written to LMDB (also by the server's writer
when idle)."""


@dataclass
class _Pending:
    """Index changes not yet in LMDB: raw values by key, for the blobs, byvol and volumes
    databases. Only the writer adds to them (single dict operations, atomic for readers in
    other threads, which iterate over copies: ``list(d.items())``); once they are in LMDB the
    writer replaces the whole object, so a reader holding the old one still finds them."""

    blobs: dict[bytes, bytes] = field(default_factory=dict)
    byvol: dict[bytes, bytes] = field(default_factory=dict)
    vols: dict[bytes, bytes] = field(default_factory=dict)
    since: float = 0.0

    def absorb(self, view: _PendingView) -> None:
        if not self.blobs:
            self.since = time.monotonic()
        self.byvol.update(view.byvol)
        self.vols.update(view.vols)
        self.blobs.update(view.blobs)  # last: a reader that finds a blob finds its volume

    def write_to(self, txn, store: Store) -> None:
        for k, v in self.blobs.items():
            txn.put(k, v, db=store.blobs)
        for k, v in self.byvol.items():
            txn.put(k, v, db=store.byvol)
        for k, v in self.vols.items():
            txn.put(k, v, db=store.vols)


class _PendingView:
    """What ``Store._put`` sees as its transaction in an append-only commit: LMDB (a read
    transaction) under the pending entries; what it writes is collected here."""

    def __init__(self, store: Store, rtxn, pending: _Pending):
        self.store = store
        self.rtxn = rtxn
        self.pending = pending
        self.blobs: dict[bytes, bytes] = {}
        self.byvol: dict[bytes, bytes] = {}
        self.vols: dict[bytes, bytes] = {}

    def _sets(self, db) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
        st, p = self.store, self.pending
        if db is st.blobs:
            return self.blobs, p.blobs
        if db is st.byvol:
            return self.byvol, p.byvol
        if db is st.vols:
            return self.vols, p.vols
        raise AssertionError("an append-only commit touches blobs, byvol and volumes only")

    def get(self, key: bytes, db=None):
        if db is self.store.bad_db:
            return self.rtxn.get(key, db=db)
        mine, pend = self._sets(db)
        v = mine.get(key)
        if v is None:
            v = pend.get(key)
        return v if v is not None else self.rtxn.get(key, db=db)

    def put(self, key: bytes, value: bytes, db=None) -> None:
        self._sets(db)[0][key] = value

    def delete(self, key: bytes, db=None) -> bool:
        raise AssertionError("an append-only commit deletes nothing")


def record_size(n: int) -> int:
    """Bytes of the record of a put of ``n`` new blobs."""
    return REC_HEAD.size + n * REC_ENTRY.size + REC_SUM.size


def _record(entries: list[tuple[bytes, int, int]]) -> bytes:
    """A put's record (see REC_HEAD), written ahead of its blobs."""
    body = REC_HEAD.pack(REC_MAGIC, len(entries)) + b"".join(
        REC_ENTRY.pack(bid, length, xxh) for bid, length, xxh in entries)
    return body + REC_SUM.pack(xxhash.xxh3_64_intdigest(body))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
