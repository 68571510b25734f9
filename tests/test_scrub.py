"""The scrubber and the repair of bad copies: real volume files, real daemons, no mocks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from jpfs_daemon.storage.store import PutOp, ScrubOp, Store

import jpfs
from jpfs import config, localcluster
from jpfs.client.tools import scrub
from jpfs.proto import storage as P

FAST = ["--scrub-rate", "1GiB", "--scrub-pause", "3600"]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def find(data_dir: Path, needle: bytes) -> tuple[Path, int]:
    """The volume file and offset of ``needle`` (random bytes, so unique)."""
    for vol in sorted((data_dir / "volumes").iterdir()):
        pos = vol.read_bytes().find(needle)
        if pos >= 0:
            return vol, pos
    raise AssertionError("bytes not in any volume")


# ------------------------------------------------------------------------ the store alone


def _put(store: Store, blobs: list[tuple[bytes, bytes]]) -> list:
    entries = [(bid, len(d), xxhash.xxh3_64_intdigest(d)) for bid, d in blobs]
    return store.commit([PutOp(entries, memoryview(b"".join(d for _, d in blobs)))])[0]


def test_store_verify_mark_reput_and_truncation(tmp_path):
    store = Store(tmp_path, fsync=False)
    blobs = [(os.urandom(16), os.urandom(n)) for n in (1000, 5000, 0, 3000)]
    assert _put(store, blobs) == [4, 0]
    assert store.verify(store.scrub_entries(b"", 100)) == []
    vol, pos = find(tmp_path, blobs[1][1])
    flip(vol, pos + 17)
    bad = store.verify(store.scrub_entries(b"", 100))
    assert [(b[0], b[5]) for b in bad] == [(blobs[1][0], "checksum mismatch")]
    assert store.commit([ScrubOp(bad, b'{"passes": 1}')]) == [1]
    assert store.commit([ScrubOp(bad)]) == [0]  # already marked
    assert store.bad_ids == {blobs[1][0]}
    store.close()

    store = Store(tmp_path, fsync=False)  # marks and progress survive a restart
    assert store.bad_ids == {blobs[1][0]}
    assert store.scrub_state() == b'{"passes": 1}'
    (bid, length, xxh, _found, reason), = store.bad_blobs(b"", 10)
    assert (bid, length, reason) == (blobs[1][0], 5000, "checksum mismatch")
    dead_before = store.usage()["dead_bytes"]
    # the same id and checksum again replaces the bad copy; a good blob re-put stays a no-op
    assert _put(store, [blobs[1], blobs[0]]) == [1, 1]
    assert store.bad_ids == frozenset() and store.bad_blobs(b"", 10) == []
    assert store.repaired() == 1
    assert store.usage()["dead_bytes"] == dead_before + 5000
    assert store.usage()["blobs"] == 4
    assert store.verify(store.scrub_entries(b"", 100)) == []

    # a volume cut short under the index: findings, not exceptions
    os.truncate(vol, 1500)
    bad = store.verify(store.scrub_entries(b"", 100))
    assert {b[0] for b in bad} == {blobs[1][0], blobs[3][0]}
    assert all("cut short" in b[5] for b in bad)
    store.commit([ScrubOp(bad)])
    store.close()
    store = Store(tmp_path, fsync=False)  # restart: the volume is known short
    bad = store.verify(store.scrub_entries(b"", 100))
    assert {b[0] for b in bad} == {blobs[1][0], blobs[3][0]}
    assert all("past the end" in b[5] for b in bad)
    # a deleted bad blob leaves no mark; a mark for a blob that moved meanwhile is not taken
    from jpfs_daemon.storage.store import DeleteOp
    store.commit([DeleteOp([blobs[3][0]])])
    assert store.bad_ids == {blobs[1][0]}
    moved = [(blobs[0][0], 999, 0, 1000, 0, "stale")]
    assert store.commit([ScrubOp(moved)]) == [0]
    store.close()


# ------------------------------------------------------------------------ real daemons


def _wait_pass(c: jpfs.Client, node: int, passes: int, timeout: float = 30.0) -> dict:
    give_up = time.monotonic() + timeout
    while True:
        s = c.run(scrub.status)[node]
        if s.get("passes", 0) > passes and s["state"] == "waiting":
            return s
        if time.monotonic() > give_up:
            raise AssertionError(f"no scrub pass finished on node {node}: {s}")
        time.sleep(0.05)


def _scrub_once(c: jpfs.Client, node: int) -> dict:
    before = c.run(scrub.status)[node]["passes"]
    started = c.run(scrub.start, [node])
    assert started[0]["state"] == "scrubbing", started
    return _wait_pass(c, node, before)


async def _get_alone(ac, node: int, bid: bytes) -> tuple[object, bytes]:
    statuses, payload = await ac._data().storage.pool.call_payload(
        node, P.GET_BLOBS, P.IdsReq([bid]))
    return statuses[0], bytes(payload or b"")


def _files(c: jpfs.Client) -> dict[str, bytes]:
    c.makedirs("/ds/data")
    files = {f"/ds/data/ep{i:03d}.bin": os.urandom(20_000 + 997 * i) for i in range(12)}
    for path, data in files.items():
        c.write_bytes(path, data)
    return files


def test_scrub_finds_a_flipped_byte_and_repair_restores_it(make_cluster):
    d = make_cluster(1, 2, replicas=2, extra_args={"storage": FAST})
    cluster = config.load(localcluster.cluster_file(d))
    c = jpfs.connect(localcluster.cluster_file(d))
    try:
        files = _files(c)
        victim = "/ds/data/ep005.bin"
        chunk, = c.layout(victim).chunks
        node = chunk.nodes[1]
        vol, pos = find(cluster.data_dir("storage", node), files[victim][:64])
        flip(vol, pos + 1234)

        s = _scrub_once(c, node)
        assert s["bad_blobs"] == 1 and s["bad_found"] == 1 and s["progress"] == 1.0
        assert s["pass_blobs"] == len(files)
        assert s["bytes_verified"] >= sum(map(len, files.values()))
        bad = c.run(scrub.bad_blobs, node)
        assert [(b[0], b[4]) for b in bad] == [(chunk.blob, "checksum mismatch")]
        other = chunk.nodes[0]
        assert c.run(scrub.status)[other]["bad_blobs"] == 0
        # the node refuses the bad copy; the client reads the other one
        status, _ = c.run(_get_alone, node, chunk.blob)
        assert status == "EIO"
        assert c.read_bytes(victim) == files[victim]

        out = subprocess.run([sys.executable, "-m", "jpfs.cli.main", "cluster", "status",
                              "--dir", str(d)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if f"storage-{node}" in line)
        assert "scrub 2 passes done" in row and "bad 1 (found 1, repaired 0)" in row

        dry = c.run(lambda ac: scrub.repair(ac, dry_run=True))
        assert [x["result"] for x in dry.repaired] == ["would repair"]
        assert c.run(scrub.bad_blobs, node)  # nothing written
        report = c.run(scrub.repair)
        assert report.bad == 1 and not report.unrepairable and not report.errors
        assert [(x["node"], x["from"], x["ino"]) for x in report.repaired] == [
            (node, other, c.stat(victim).ino)]
        assert c.run(scrub.bad_blobs, node) == []
        # the repaired node alone serves good bytes; a new pass finds nothing
        status, data = c.run(_get_alone, node, chunk.blob)
        assert status == [len(files[victim]), chunk.xxh] and data == files[victim]
        s = _scrub_once(c, node)
        assert s["bad_blobs"] == 0 and s["repaired"] == 1 and s["bad_found"] == 1
        for path, data in files.items():
            assert c.read_bytes(path) == data
        assert c.run(scrub.repair).bad == 0
    finally:
        c.close()


def test_replicas_1_reports_the_file_and_does_not_repair(make_cluster):
    d = make_cluster(2, 2, replicas=1, extra_args={"storage": FAST})
    cluster = config.load(localcluster.cluster_file(d))
    c = jpfs.connect(localcluster.cluster_file(d))
    try:
        files = _files(c)
        victim = "/ds/data/ep007.bin"
        chunk, = c.layout(victim).chunks
        node, = chunk.nodes
        vol, pos = find(cluster.data_dir("storage", node), files[victim][:64])
        flip(vol, pos + 10)
        assert _scrub_once(c, node)["bad_blobs"] == 1
        report = c.run(scrub.repair)
        assert report.repaired == []
        (x,) = report.unrepairable
        assert (x["path"], x["node"], x["chunk"]) == (victim, node, 0)
        assert "no other replica" in x["why"]
        out = subprocess.run([sys.executable, "-m", "jpfs.cli.main", "--cluster", str(d),
                              "scrub", "repair"], capture_output=True, text=True)
        assert out.returncode == 1
        assert f"cannot repair {victim} (chunk 0)" in out.stdout
        with pytest.raises(OSError):
            c.read_bytes(victim)
        assert c.run(scrub.bad_blobs, node)  # still marked
    finally:
        c.close()


def test_a_truncated_volume_is_recorded_and_the_daemon_goes_on(make_cluster):
    d = make_cluster(1, 1, replicas=1, extra_args={"storage": FAST})
    cluster = config.load(localcluster.cluster_file(d))
    c = jpfs.connect(localcluster.cluster_file(d))
    try:
        files = _files(c)
        vol, pos = find(cluster.data_dir("storage", 0), files["/ds/data/ep006.bin"][:64])
        os.truncate(vol, pos + 100)  # ep006 cut, ep007.. past the end
        s = _scrub_once(c, 0)
        assert s["bad_blobs"] == 6
        reasons = {b[4].split(":")[0] for b in c.run(scrub.bad_blobs, 0)}
        assert reasons == {"cut short"}
        assert c.read_bytes("/ds/data/ep000.bin") == files["/ds/data/ep000.bin"]
        report = c.run(scrub.repair)
        assert sorted(x["path"] for x in report.unrepairable) == sorted(
            f"/ds/data/ep{i:03d}.bin" for i in range(6, 12))
    finally:
        c.close()
    # a restart finds the volume short; the scrubber resumes its schedule and still works
    localcluster.stop(d, "storage", 0)
    localcluster.start(d, "storage", 0, sync=False, extra_args=FAST)
    c = jpfs.connect(localcluster.cluster_file(d))
    try:
        s = _scrub_once(c, 0)
        assert s["bad_blobs"] == 6 and s["passes"] >= 3
        assert localcluster.status(d)[-1].alive
    finally:
        c.close()


def test_scrub_rate_is_bounded_and_zero_turns_it_off(make_cluster):
    d = make_cluster(1, 2, replicas=1, extra_args={"storage": ["--scrub-rate", "4MiB",
                                                               "--scrub-pause", "3600"]})
    c = jpfs.connect(localcluster.cluster_file(d))
    try:
        c.makedirs("/big")
        for i in range(6):
            c.write_bytes(f"/big/f{i}", os.urandom(2 << 20))
        node = c.layout("/big/f0").chunks[0].nodes[0]
        t0 = time.monotonic()
        s = _scrub_once(c, node)
        took = time.monotonic() - t0
        assert s["pass_bytes"] >= 4 << 20
        assert took >= s["pass_bytes"] / (4 << 20) * 0.8, (took, s)
        assert s["bytes_per_s"] <= (4 << 20) * 1.2
    finally:
        c.close()
    localcluster.stop(d, "storage", 0)
    localcluster.start(d, "storage", 0, sync=False, extra_args=["--scrub-rate", "0"])
    c = jpfs.connect(localcluster.cluster_file(d))
    try:
        assert c.run(scrub.status)[0]["state"] == "off"
        (s,) = c.run(scrub.start, [0])
        assert "scrubbing is off" in s["error"]
    finally:
        c.close()
