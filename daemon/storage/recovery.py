"""Recovery at start: make a storage node's volume files and its index agree again.

Crash safety rests on one rule, **bytes are durable before the index names them**, so what a
crash (kill -9, a power failure) can leave is always more on disk than the index knows: volume
files the index does not list (a compaction target never switched in, an old volume whose
switch committed but whose unlink did not happen), which are deleted; and bytes past a volume's
committed end, which are truncated, except the puts whose records lie past the active volume's
end: answered once their bytes were synced, with their index entries still in memory
(``pending.py``), they are indexed again here from their records (``replay``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import xxhash

from .commit import WriterState
from .formats import (
    BYVOL_KEY,
    BYVOL_VAL,
    ENTRY,
    REC_ENTRY,
    REC_HEAD,
    REC_MAGIC,
    REC_MAX_BLOBS,
    REC_SUM,
    REPLAY_MAX,
    SEALED,
    U64,
    VOL_KEY,
    VolRec,
    volume_of,
)

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)


def recover(store: Store) -> WriterState:
    """Drop orphan volumes, index again the puts past the active volume's end, truncate
    unindexed tails and note short volumes (``store.short``); the writer's state to go on
    from."""
    with store.env.begin() as txn:
        recs = {VOL_KEY.unpack(k)[0]: VolRec.unpack(v) for k, v in txn.cursor(db=store.vols)}
        raw_next = txn.get(b"next_volume", db=store.meta)
        raw_active = txn.get(b"active", db=store.meta)
    on_disk = {}
    for name in os.listdir(store.vol_dir):
        vol = volume_of(name)
        if vol is None:
            log.warning("ignoring stray file %s in %s", name, store.vol_dir)
            continue
        on_disk[vol] = store.vol_dir / name
    for vol, path in sorted(on_disk.items()):
        if vol not in recs:
            log.info("removing orphan volume %s (never committed, or already compacted)",
                     path.name)
            path.unlink()
    active = U64.unpack(raw_active)[0] if raw_active else None
    if active is not None and active in recs and active in on_disk \
            and not recs[active].flags & SEALED:
        recs[active] = replay(store, active, recs[active])
    for vol, rec in sorted(recs.items()):
        path = store.vol_path(vol)
        size = path.stat().st_size if vol in on_disk else -1
        if size < 0:
            log.error("volume %s is missing: its %d blobs are lost", path.name, rec.live_blobs)
            store.short[vol] = 0
        elif size > rec.end:
            log.info("truncating %d unindexed tail bytes of %s", size - rec.end, path.name)
            os.truncate(path, rec.end)
        elif size < rec.end:
            log.error("volume %s has %d bytes but the index says %d (lost writes?)",
                      path.name, size, rec.end)
            store.short[vol] = size
    store.fsync_dir()
    top = max([*recs, *on_disk], default=0)
    w = WriterState()
    w.next_volume = max(U64.unpack(raw_next)[0] if raw_next else 1, top + 1)
    if active is not None and active in recs and not recs[active].flags & SEALED \
            and active not in store.short:
        w.active, w.end = active, recs[active].end
        w.filled = w.end  # the tail past the end was truncated above
        w.fd = os.open(store.vol_path(active), os.O_RDWR)
    log.info("index has %d volumes, %d blobs; appending to %s", len(recs),
             sum(r.live_blobs for r in recs.values()),
             store.vol_path(w.active).name if w.active is not None else "a new volume")
    return w


def replay(store: Store, vol: int, rec: VolRec) -> VolRec:
    """Index the puts whose records lie past the committed end of active volume ``vol``.

    A put is answered once its record and bytes are fdatasync-ed; its index entries wait in
    memory (``pending``) until the next synced LMDB commit. A restart after kill -9 or a
    power failure that came first finds them here: every record whose checksum and blobs'
    checksums match is indexed again, in order, up to the first that does not (a put cut
    short, never answered, truncated with the rest of the tail). A record can also be a put
    whose process died between its data sync and its answer (never answered either): its
    blobs are indexed, as they are intact.
    """
    path = store.vol_path(vol)
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
            if magic != REC_MAGIC or not 0 < n <= REC_MAX_BLOBS or end + hlen > size:
                break
            body = head + f.read(hlen - REC_HEAD.size)
            (want,) = REC_SUM.unpack_from(body, hlen - REC_SUM.size)
            if xxhash.xxh3_64_intdigest(body[:-REC_SUM.size]) != want:
                break
            entries = [REC_ENTRY.unpack_from(body, REC_HEAD.size + k * REC_ENTRY.size)
                       for k in range(n)]
            total = sum(e[1] for e in entries)
            if total > REPLAY_MAX or end + hlen + total > size:
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
    with store.env.begin(write=True) as txn:
        for bid, off, length, xxh in found:
            if txn.get(bid, db=store.blobs) is not None:
                continue  # cannot happen (a re-put of a stored id writes nothing); keep it
            txn.put(bid, ENTRY.pack(vol, off, length, xxh, now), db=store.blobs)
            txn.put(BYVOL_KEY.pack(vol, off, bid), BYVOL_VAL.pack(length, xxh),
                    db=store.byvol)
            new.live_bytes += length
            new.live_blobs += 1
        txn.put(VOL_KEY.pack(vol), new.pack(), db=store.vols)
    store.env.sync(True)
    log.info("volume %s: %d blobs of puts past the index's end indexed again from their "
             "records", path.name, len(found))
    return new
