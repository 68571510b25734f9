"""The storage node's blocking half called directly: group commits, recovery, descriptors."""

from __future__ import annotations

import errno
import os

import pytest
import xxhash
from jpfs_daemon.storage.store import DeleteOp, PutOp, SealOp, Store, record_size
from jpfs_daemon.storage.volume_fds import VolumeFds

from jpfs.errors import JPFSError


def put_op(*datas: bytes) -> tuple[PutOp, list[bytes]]:
    ids = [os.urandom(16) for _ in datas]
    entries = [(b, len(d), xxhash.xxh3_64_intdigest(d)) for b, d in zip(ids, datas, strict=True)]
    return PutOp(entries, memoryview(b"".join(datas))), ids


def read(store: Store, bid: bytes) -> bytes:
    (e,) = store.lookup([bid])
    vol, offset, length, _, _ = e
    with open(store.vol_path(vol), "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_one_failing_op_does_not_fail_its_group(tmp_path):
    store = Store(tmp_path, volume_size=1 << 20)
    try:
        first, (a,) = put_op(b"a" * 100)
        assert store.commit([first]) == [[1, 0]]
        clash = PutOp([(a, 100, 12345)], memoryview(b"b" * 100))  # same id, other bytes
        good, (b, c) = put_op(b"x" * 10, b"y" * 20)
        again = PutOp(first.entries, first.data)  # a retry of the first put
        results = store.commit([clash, good, again, DeleteOp([a, os.urandom(16)])])
        assert isinstance(results[0], JPFSError) and results[0].errno == errno.EEXIST
        assert results[1:] == [[2, 0], [0, 1], 1]
        assert store.lookup([a]) == [None]
        assert read(store, b) == b"x" * 10 and read(store, c) == b"y" * 20
        usage = store.usage()
        assert usage["blobs"] == 2 and usage["live_bytes"] == 30 and usage["dead_bytes"] == 100
    finally:
        store.close()


def test_batches_stay_contiguous_and_volumes_roll(tmp_path):
    one = record_size(4) + 400  # a put of four 100-byte blobs, with its record
    store = Store(tmp_path, volume_size=2 * one)
    try:
        ops = [put_op(*(os.urandom(100) for _ in range(4)))[0] for _ in range(5)]
        assert store.commit(ops) == [[4, 0]] * 5
        recs = store.volume_records()
        assert len(recs) == 3 and [r.end for r in recs.values()] == [2 * one, 2 * one, one]
        for op in ops:  # each batch back to back in one volume
            es = store.lookup([b for b, _, _ in op.entries])
            assert len({e[0] for e in es}) == 1
            assert [e[1] for e in es] == [es[0][1] + 100 * k for k in range(4)]
        store.commit([SealOp(max(recs))])
        store.commit([put_op(b"z")[0]])
        assert len(store.volume_records()) == 4  # a sealed volume takes no more appends
    finally:
        store.close()


def test_restart_truncates_tails_and_drops_orphans(tmp_path):
    store = Store(tmp_path)
    op, (a,) = put_op(b"k" * 1000)
    store.commit([op])
    (vol,) = store.volume_records()
    store.close()
    with open(store.vol_path(vol), "ab") as f:
        f.write(b"garbage never indexed")
    orphan = store.vol_path(vol + 7)
    orphan.write_bytes(b"a compaction target that was never switched in")
    store = Store(tmp_path)
    try:
        end = record_size(1) + 1000
        assert store.vol_path(vol).stat().st_size == end
        assert not orphan.exists()
        assert read(store, a) == b"k" * 1000
        op2, (b,) = put_op(b"n" * 10)
        store.commit([op2])
        assert store.lookup([b])[0][:2] == (vol, end + record_size(1))  # after the tail
        op3, (c,) = put_op(b"m" * 10)
        store.commit([SealOp(vol), op3])
        assert store.lookup([c])[0][0] > vol + 7  # ids are never reused, orphans' included
    finally:
        store.close()


def test_descriptors_are_bounded_and_pinned_ones_survive(tmp_path):
    store = Store(tmp_path, volume_size=100)
    try:
        store.commit([put_op(os.urandom(100))[0] for _ in range(6)])
        vols = sorted(store.volume_records())
        files = VolumeFds(store, keep=2)
        pinned = [files.pin(v) for v in vols[:3]]  # three pinned: over the limit, all kept
        assert len(files._fds) == 3
        files.unpin(vols[:3])
        files.pin(vols[3])
        assert len(files._fds) == 2 and vols[3] in files._fds
        for fd in pinned[:2]:
            with pytest.raises(OSError):
                os.fstat(fd)
        files.retire(vols[3])  # still pinned: stays open until unpinned
        assert vols[3] in files._fds
        files.unpin([vols[3]])
        assert vols[3] not in files._fds
        files.close()
    finally:
        store.close()


def _lose_last_commit(tmp_path, commit) -> None:
    """Run ``commit`` and then put the index back as it was before it: what a power failure
    does to a commit whose LMDB meta page had not reached the disk (metasync off)."""
    index = tmp_path / "index.lmdb" / "data.mdb"
    before = index.read_bytes()
    commit()
    index.write_bytes(before)


def test_a_put_the_index_lost_is_indexed_again_from_its_record(tmp_path):
    store = Store(tmp_path)
    op, (a,) = put_op(b"a" * 5000)
    store.commit([op])
    store.close()
    store = Store(tmp_path)
    op2, (b, c) = put_op(b"b" * 3000, b"c" * 7)

    def commit():
        assert store.commit([op2]) == [[2, 0]]
        store.close()

    _lose_last_commit(tmp_path, commit)
    store = Store(tmp_path)
    try:
        assert read(store, a) == b"a" * 5000
        assert read(store, b) == b"b" * 3000 and read(store, c) == b"c" * 7
        usage = store.usage()
        assert usage["blobs"] == 3 and usage["live_bytes"] == 8007 and usage["dead_bytes"] == 0
        assert usage["bytes_used"] == 8007 + record_size(1) + record_size(2)
        (vol,) = store.volume_records()
        assert store.vol_path(vol).stat().st_size == usage["bytes_used"]  # zeros reclaimed
        op3, (d,) = put_op(b"d" * 10)
        store.commit([op3])
        assert store.lookup([d])[0][1] == usage["bytes_used"] + record_size(1)
        assert read(store, d) == b"d" * 10
    finally:
        store.close()


def test_a_put_cut_short_is_not_indexed(tmp_path):
    store = Store(tmp_path)
    op, (a,) = put_op(b"a" * 5000)
    store.commit([op])
    store.close()
    store = Store(tmp_path)
    (vol,) = store.volume_records()
    end = 5000 + record_size(1)
    op2, (b,) = put_op(b"b" * 3000)

    def commit():  # the failure kept the record, not all of the bytes (never answered)
        store.commit([op2])
        store.close()
        with open(store.vol_path(vol), "r+b") as f:
            f.seek(end + record_size(1) + 2000)
            f.write(b"\0" * 1000)

    _lose_last_commit(tmp_path, commit)
    store = Store(tmp_path)
    try:
        assert store.lookup([b]) == [None]
        assert read(store, a) == b"a" * 5000
        assert store.vol_path(vol).stat().st_size == end  # the tail was reclaimed
        op3, (c,) = put_op(b"c" * 10)
        store.commit([op3])
        assert store.lookup([c])[0][:2] == (vol, end + record_size(1))
    finally:
        store.close()


def test_an_index_from_before_records_is_read(tmp_path):
    from jpfs_daemon.storage.formats import VOLREC_V1, VolRec

    old = VolRec.unpack(VOLREC_V1.pack(1000, 900, 3, 0))
    assert (old.end, old.live_bytes, old.live_blobs, old.record_bytes) == (1000, 900, 3, 0)
    assert old.dead_bytes == 100 and VolRec.unpack(old.pack()) == old
