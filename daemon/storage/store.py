"""A storage node's volumes and blob index: the facade the server, scrubber and puller use.

``Store`` holds what every part shares (the volumes directory, the LMDB environment and its
databases, the bad ids, the short volumes, the pending overlay) and answers the reads itself;
the rest lives in a module per part:

- ``formats.py``: the index's records and the volumes' put records (the data directory's layout)
- ``recovery.py``: at start, files and index made to agree; puts past the index indexed again
- ``commit.py``: the commit engine (group commits of ``ops.py``'s operations, the single writer)
- ``pending.py``: index entries of appends that are durable but not yet in LMDB
- ``scrub_reads.py``: the scrubber's reads and re-verification, the bad list
- ``compaction.py``: rewriting volumes with much dead space

Crash safety rests on one rule: **bytes are durable before the index names them** (see
``recovery.py`` for what a restart finds and does, ``compaction.py`` for the order of its steps).

Everything here blocks (disk, fsync, LMDB writes) and runs in worker threads; the methods that
change the index are called from one writer task at a time (see ``server.py``), so the writer
state has a single owner. Reads (``lookup``) use their own short read transactions.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import lmdb

from jpfs.errors import JPFSError
from jpfs.proto.storage import volume_file

from . import scrub_reads
from .commit import CommitEngine
from .formats import ENTRY, VOL_KEY, Entry, VolRec, record_size
from .ops import AllocOp, DeleteOp, Op, PutOp, ScrubOp, SealOp, SwitchOp
from .pending import Pending
from .recovery import recover
from .volumes import fsync_dir

__all__ = ["AllocOp", "DeleteOp", "Entry", "Op", "PutOp", "ScrubOp", "SealOp", "Store",
           "SwitchOp", "VolRec", "record_size"]

log = logging.getLogger(__name__)


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
        self.pending: Pending = Pending()
        """Index changes of appends that their records make durable, not yet in LMDB (see
        ``commit``); replaced whole by the writer, never mutated, so readers need no lock."""
        self._engine = CommitEngine(self, recover(self))

    def vol_path(self, vol: int) -> Path:
        """The path of volume ``vol``'s file."""
        return self.vol_dir / volume_file(vol)

    def fsync_dir(self) -> None:
        """Make the volumes directory's entries durable (with ``fsync`` on)."""
        if self.fsync:
            fsync_dir(self.vol_dir)

    def close(self) -> None:
        """Write the pending index entries (a failure is logged: the records on disk make up for it)
        and close the active volume and the index."""
        if self.pending.blobs:
            try:
                self.flush()
            except (JPFSError, OSError, lmdb.Error) as e:  # the records make up for it
                log.error("could not write the last puts to the index: %s", e)
        self._engine.close()
        self.env.close()

    # ------------------------------------------------------------------ writes (commit.py)

    def commit(self, ops: Sequence[Op]) -> list:
        """Apply ``ops`` durably; one result (or JPFSError) per op (``CommitEngine.commit``)."""
        return self._engine.commit(ops)

    def flush(self) -> None:
        """Write the pending index entries to LMDB (one durable transaction)."""
        self._engine.flush()

    # ------------------------------------------------------------------ reads

    def lookup(self, ids: Sequence[bytes]) -> list[Entry | None]:
        """Index entries for ``ids``, None where unknown: one short read transaction."""
        unpack = ENTRY.unpack
        new = tuple.__new__  # Entry._make less its length check: the per-blob hot path
        pending = self.pending.blobs  # before the transaction: see CommitEngine.commit
        with self.env.begin(db=self.blobs) as txn:
            get = txn.get
            if pending:
                return [new(Entry, unpack(raw))
                        if (raw := pending.get(b) or get(b)) is not None else None for b in ids]
            return [new(Entry, unpack(raw)) if (raw := get(b)) is not None else None
                    for b in ids]

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
                    out.append([key, Entry.unpack(raw).created])
                    if len(out) >= limit:
                        break
        if pending:
            seen = {e[0] for e in out}
            out += [[k, Entry.unpack(v).created] for k, v in list(pending.items())
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

    # ------------------------------------------------------------------ scrubbing (scrub_reads.py)

    def scrub_entries(self, after: bytes, limit: int) -> list[tuple[bytes, int, int, int, int]]:
        """Up to ``limit`` live blobs after byvol key ``after`` (b"" for the start), in disk
        order: (byvol key, volume, offset, length, xxh)."""
        return scrub_reads.scrub_entries(self, after, limit)

    def verify(self, entries: Sequence[tuple[bytes, int, int, int, int]]
               ) -> list[tuple[bytes, int, int, int, int, str]]:
        """Re-read ``entries`` (as ``scrub_entries`` gives them) and check each against its
        xxh3; the failures as (id, volume, offset, length, xxh, reason)."""
        return scrub_reads.verify(self, entries)

    def scrub_state(self) -> bytes | None:
        """The scrubber's saved progress (JSON), None before its first save."""
        return scrub_reads.scrub_state(self)

    def repaired(self) -> int:
        """Bad copies replaced by a re-put, ever."""
        return scrub_reads.repaired(self)

    def bad_blobs(self, after: bytes, limit: int) -> list[list]:
        """Up to ``limit`` [id, length, xxh, found, reason] with id > ``after``, in id order."""
        return scrub_reads.bad_blobs(self, after, limit)
