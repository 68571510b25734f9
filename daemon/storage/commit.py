"""The commit engine: a storage node's single writer of volumes and index.

A group of write operations (``ops.py``) is applied at once. Puts that append to the active
volume (no new volume, no repair) are durable once their bytes and records are fdatasync-ed;
their index entries go to the pending overlay (``pending.py``) instead of a synced LMDB
transaction, one sync per put instead of three. Anything else (deletes, compaction's switch,
seals, a new volume, repairs, scrub marks) is one durable LMDB transaction, each op in a nested
transaction so that an op that fails its own checks fails alone. Zeros are laid ahead of the
appends (``_lay_ahead``), so a put's fdatasync overwrites blocks the file already has and needs
no journal commit.

Everything here blocks (disk, fsync, LMDB writes) and runs in worker threads, called by one
writer task at a time (the server's ``_Writer``): the writer state has a single owner.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from jpfs.errors import JPFSError, error
from jpfs.proto.storage import blob_name

from .formats import (
    BAD_VAL,
    BYVOL_KEY,
    BYVOL_VAL,
    ENTRY,
    SEALED,
    U64,
    VOL_KEY,
    Entry,
    VolRec,
    pack_record,
    record_size,
)
from .ops import AllocOp, DeleteOp, Op, PutOp, ScrubOp, SealOp, SwitchOp
from .pending import Pending, PendingView
from .volumes import crash_point, pwrite_all, unlink_quietly

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)

PREFILL = 1 << 20
"""Zeros laid ahead of the appends of the active volume (see ``CommitEngine._lay_ahead``)."""
_ZEROS = memoryview(bytes(1 << 20))


@dataclass
class WriterState:
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

    state: WriterState
    recs: dict[int, VolRec] = field(default_factory=dict)
    dirty: dict[int, int] = field(default_factory=dict)
    """volume -> fd to fdatasync before the index commit."""
    opened: list[tuple[int, int]] = field(default_factory=list)
    """(volume, fd) created in this commit; closed and unlinked if it aborts."""
    meta_changed: bool = False
    bad_added: set[bytes] = field(default_factory=set)
    bad_removed: set[bytes] = field(default_factory=set)
    repaired: int = 0


class CommitEngine:
    """Applies groups of ops to ``store``'s volumes and index; ``state``: the writer state
    recovery left (``recovery.recover``). Not thread-safe: one writer at a time."""

    def __init__(self, store: Store, state: WriterState):
        self.store = store
        self.state = state
        self.env = store.env
        self.blobs, self.byvol, self.vols = store.blobs, store.byvol, store.vols
        self.meta, self.bad_db = store.meta, store.bad_db
        self.fsync = store.fsync
        self.volume_size = store.volume_size

    def close(self) -> None:
        """Close the active volume's descriptor."""
        if self.state.fd is not None:
            os.close(self.state.fd)
            self.state.fd = None

    def commit(self, ops: Sequence[Op]) -> list:
        """Apply ``ops`` durably; one result (or JPFSError) per op.

        Puts that append to the active volume (no new volume, no repair) are durable once their
        bytes and records are fdatasync-ed: their index entries wait in ``pending`` (read with
        the index) and reach LMDB with the next other commit, at ``PENDING_MAX`` entries, or
        after ``PENDING_AGE`` seconds (``flush``); a restart indexes them again from their
        records (``recovery.replay``). One sync per put instead of three. Anything else is one
        durable LMDB transaction (the pending entries first), data appended by its puts fsynced
        before it commits. An op that fails its own checks (EEXIST, ENOSPC) fails alone; a
        failure of the commit itself fails them all.
        """
        if ops and self._appends_only(ops):
            return self._commit_appends(ops)
        c = _Commit(replace(self.state))
        results: list = []
        pending = self.store.pending
        try:
            with self.env.begin(write=True) as txn:
                pending.write_to(txn, self.store)
                for op in ops:
                    results.append(self._apply_alone(txn, c, op))
                if c.dirty and self.fsync:
                    for fd in c.dirty.values():
                        os.fdatasync(fd)
                if c.opened:
                    self.store.fsync_dir()
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
                unlink_quietly(self.store.vol_path(vol))
            raise
        if pending is self.store.pending:  # now in LMDB (readers looked here first: see lookup)
            self.store.pending = Pending()
        old_fd = self.state.fd
        if old_fd is not None and old_fd != c.state.fd:
            os.close(old_fd)
        for _vol, fd in c.opened:
            if fd != c.state.fd:
                os.close(fd)
        self.state = c.state
        if c.bad_added or c.bad_removed:
            self.store.bad_ids = (self.store.bad_ids - c.bad_removed) | c.bad_added
        return results

    def flush(self) -> None:
        """Write the pending index entries to LMDB (one durable transaction)."""
        self.commit([])

    def _appends_only(self, ops: Sequence[Op]) -> bool:
        """Whether ``ops`` are puts that fit the active volume and repair nothing."""
        s = self.state
        if s.active is None or s.fd is None:
            return False
        need = 0
        bad = self.store.bad_ids
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
        c = _Commit(replace(self.state))
        results: list = []
        before = self.store.pending
        with self.env.begin(db=self.blobs) as rtxn:
            view = PendingView(self.store, rtxn, before)
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
        self.state = c.state
        if self.store.pending.due():
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
                unlink_quietly(self.store.vol_path(vol))
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
        record = pack_record([(n[0], n[1], n[2]) for n in new])
        vol, fd, at = self._room(txn, c, len(record) + total)
        pwrite_all(fd, memoryview(record), at)
        start = at + len(record)
        # Write the new blobs back to back: runs that are contiguous in the payload in one go.
        off = start
        i = 0
        while i < len(new):
            j, run = i, new[i][1]
            while j + 1 < len(new) and new[j + 1][3] == new[j][3] + new[j][1]:
                j += 1
                run += new[j][1]
            pwrite_all(fd, op.data[new[i][3]:new[i][3] + run], off)
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
            fd = os.open(self.store.vol_path(vol), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            c.opened.append((vol, fd))
            s.active, s.end, s.fd, s.filled = vol, 0, fd, 0
            c.recs[vol] = VolRec()
            c.meta_changed = True
        assert s.fd is not None  # an active volume is open for appending
        if self.fsync and s.end + size > s.filled:
            self._lay_ahead(s, s.end + size)
        return s.active, s.fd, s.end

    def _lay_ahead(self, s: WriterState, need: int) -> None:
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
            return self.store.bad_ids
        return (self.store.bad_ids - c.bad_removed) | c.bad_added

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
