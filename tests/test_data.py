"""The data path end to end: real metadata shards and storage nodes, the native client."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import jpfs
from jpfs import config, localcluster
from jpfs.errors import ChecksumError

CHUNK = 1 << 20


@pytest.fixture(scope="module")
def data_cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    localcluster.up(d, meta_shards=2, storage_nodes=3, chunk_size=CHUNK, sync=False)
    yield d
    localcluster.down(d, timeout=5)


@pytest.fixture(scope="module")
def dc(data_cluster):
    c = jpfs.connect(data_cluster)
    yield c
    c.close()


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_round_trip_sizes(dc, size):
    data = os.urandom(size)
    dc.write_bytes(f"/rt-{size}", data)
    assert dc.stat(f"/rt-{size}").size == size
    assert dc.read_bytes(f"/rt-{size}") == data
    with dc.open(f"/rt-{size}", "rb") as f:
        assert f.read() == data


def test_round_trip_200mb_file(dc, tmp_path):
    src = tmp_path / "big"
    rng = random.Random(7)
    with open(src, "wb") as f:
        for _ in range(200):
            f.write(rng.randbytes(1 << 20))
    dc.put(src, "/big")
    assert dc.stat("/big").size == 200 << 20
    layout = dc.layout("/big")
    assert {n for c in layout.chunks for n in c.nodes} == {0, 1, 2}  # striped over every node
    dc.get("/big", tmp_path / "back")
    assert _sha(src) == _sha(tmp_path / "back")
    with dc.open("/big", "rb") as f:  # sequential reads through the file object
        h = hashlib.sha256()
        while piece := f.read(3 << 20):
            h.update(piece)
    assert h.hexdigest() == _sha(src)


def _sha(p) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while piece := f.read(1 << 22):
            h.update(piece)
    return h.hexdigest()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_overwrites_and_truncates_match_a_local_file(dc, tmp_path, seed):
    rng = random.Random(seed)
    local = tmp_path / "model"
    local.write_bytes(b"")
    path = f"/rw-{seed}"
    dc.write_bytes(path, b"")
    with open(local, "r+b") as lf, dc.open(path, "r+b", buffering=0) as jf:
        for step in range(60):
            op = rng.random()
            if op < 0.6:
                pos = rng.randrange(0, max(1, lf.seek(0, 2) + 2 * CHUNK))
                data = rng.randbytes(rng.choice([1, 100, CHUNK // 3, CHUNK + 5]))
                lf.seek(pos)
                lf.write(data)
                jf.seek(pos)
                jf.write(data)
            elif op < 0.8:
                size = rng.randrange(0, lf.seek(0, 2) + CHUNK)
                lf.truncate(size)
                jf.truncate(size)
            else:
                pos = rng.randrange(0, lf.seek(0, 2) + 1)
                n = rng.randrange(0, 2 * CHUNK)
                lf.seek(pos)
                jf.seek(pos)
                assert jf.read(n) == lf.read(n), f"step {step}"
            if step % 10 == 9:
                jf.flush()
    assert dc.read_bytes(path) == local.read_bytes()


def test_append_and_exclusive_modes(dc):
    with dc.open("/app", "wb") as f:
        f.write(b"a")
    with dc.open("/app", "ab") as f:
        f.write(b"b")
        f.seek(0)
        f.write(b"c")  # O_APPEND: always at the end
    assert dc.read_bytes("/app") == b"abc"
    with pytest.raises(FileExistsError):
        dc.open("/app", "xb")
    with pytest.raises(IsADirectoryError):
        dc.open("/", "rb")
    with pytest.raises(ValueError):
        dc.open("/app", "r")  # text mode


def test_writer_conflict_is_detected(dc):
    dc.write_bytes("/conflict", b"0" * 10)
    with dc.open("/conflict", "r+b") as a:
        a.write(b"A")
        dc.write_bytes("/conflict", b"B" * 10)  # another writer commits in between
        with pytest.raises(OSError) as e:
            a.flush()
        assert e.value.errno == 116  # ESTALE: nothing silently lost
        a.raw._f.writer.dirty_chunks.clear()  # drop the stale change so close() does not retry it
    assert dc.read_bytes("/conflict") == b"B" * 10


def test_read_many_batches(dc):
    dc.makedirs("/many")
    blobs = {f"/many/f{i:04d}": os.urandom(random.randrange(0, 5000)) for i in range(300)}
    for p, b in blobs.items():
        dc.write_bytes(p, b)
    paths = list(blobs)
    random.shuffle(paths)
    got = dc.read_many(paths)
    assert [bytes(g) for g in got] == [blobs[p] for p in paths]
    with pytest.raises(FileNotFoundError):
        dc.read_many(["/many/f0000", "/many/none"])


def test_fsspec_pandas_and_pyarrow(dc, data_cluster, monkeypatch):
    import fsspec
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("JPFS_CLUSTER", str(data_cluster))
    fs = fsspec.filesystem("jpfs")
    table = pa.table({"x": list(range(5000)), "y": [float(i) / 3 for i in range(5000)]})
    fs.makedirs("jpfs://pq", exist_ok=True)
    with fs.open("jpfs://pq/t.parquet", "wb") as f:
        pq.write_table(table, f)
    assert pq.read_table("jpfs://pq/t.parquet", filesystem=fs).equals(table)
    df = pd.read_parquet("jpfs://pq/t.parquet", storage_options={"cluster": str(data_cluster)})
    assert list(df["x"]) == list(range(5000))
    fs.pipe({"jpfs://pq/a": b"1", "jpfs://pq/b": b"22"})
    assert fs.cat(["jpfs://pq/a", "jpfs://pq/b"]) == {"/pq/a": b"1", "/pq/b": b"22"}
    assert sorted(fs.ls("jpfs://pq", detail=False)) == ["/pq/a", "/pq/b", "/pq/t.parquet"]


def _volume_with(cluster_dir: Path, node: int, needle: bytes) -> Path:
    for vol in sorted((cluster_dir / f"storage-{node}" / "volumes").iterdir()):
        if needle in vol.read_bytes():
            return vol
    raise AssertionError("blob not found on disk")


def test_corrupt_byte_is_detected_and_names_the_file(make_cluster):
    d = make_cluster(meta_shards=1, storage_nodes=1)
    with jpfs.connect(d) as c:
        payload = b"precious bytes " * 1000
        c.write_bytes("/victim", payload)
        vol = _volume_with(Path(d), 0, payload)
        raw = bytearray(vol.read_bytes())
        at = raw.index(payload) + 100
        raw[at] ^= 0xFF
        vol.write_bytes(bytes(raw))
        with pytest.raises(ChecksumError) as e:
            c.read_bytes("/victim")
        assert "checksum" in str(e.value) or "good bytes" in str(e.value)
        assert e.value.filename == "/victim" or "/victim" in str(e.value) or e.value.errno == 5


def test_corrupt_replica_is_served_from_the_other(make_cluster):
    d = make_cluster(meta_shards=1, storage_nodes=2, replicas=2)
    with jpfs.connect(d) as c:
        payload = os.urandom(50_000)
        c.write_bytes("/two", payload)
        first = c.layout("/two").chunks[0].nodes[0]
        vol = _volume_with(Path(d), first, payload)
        raw = bytearray(vol.read_bytes())
        raw[raw.index(payload) + 10] ^= 1
        vol.write_bytes(bytes(raw))
    with jpfs.connect(d, first_copy=0) as c:  # asks the corrupt copy first
        assert c.read_bytes("/two") == payload


def test_readers_spread_over_the_copies(make_cluster):
    """Each client reads one copy of every chunk first (its ``first_copy``), so clients
    together use every copy instead of leaving all but the first idle; a directory's files
    still come from one node per client (one batch)."""
    d = make_cluster(meta_shards=1, storage_nodes=2, replicas=2)
    with jpfs.connect(d) as c:
        for k in range(6):
            c.makedirs(f"/spread/d{k}")
            for i in range(10):
                c.write_bytes(f"/spread/d{k}/f{i}", os.urandom(2000 + i))
        paths = [f"/spread/d{k}/f{i}" for k in range(6) for i in range(10)]
        firsts = [c.layout(p).chunks[0].nodes for p in paths]

    def sent() -> list[int]:
        """Blobs each node served: sent, or located for this host's reader to read itself."""
        with jpfs.connect(d) as c:
            stats = [c.run(lambda ac, n=n: ac.storage.stats(n)) for n in (0, 1)]
        return [st.blobs_sent + st.blobs_located for st in stats]

    for copy in (0, 1):
        before = sent()
        with jpfs.connect(d, first_copy=copy) as c:
            assert len(c.read_many(paths)) == len(paths)
        after = sent()
        want = [sum(nodes[copy] == n for nodes in firsts) for n in (0, 1)]
        assert [a - b for a, b in zip(after, before, strict=True)] == want


def test_a_copy_replacing_a_down_node_keeps_out_of_the_other_copys_domain(make_cluster):
    """Four nodes in two failure domains; a blob preferring nodes 2 (down) and 0 gets its
    second copy on node 3, the other domain, not on node 1 next round the ring."""
    import dataclasses

    from jpfs.client.wire.storage import StorageClient

    d = make_cluster(meta_shards=1, storage_nodes=4, replicas=2)
    path = localcluster.cluster_file(d)
    c = config.load(path)
    nodes = tuple(dataclasses.replace(s, domain="ab"[i // 2]) for i, s in enumerate(c.storage))
    c = dataclasses.replace(c, storage=nodes)
    assert c.node_domains == ("a", "a", "b", "b")
    localcluster.kill(d, "storage", 2)

    async def main() -> tuple[int, ...]:
        async with trio.open_nursery() as nursery:
            client = StorageClient(nursery, c)
            try:
                ((stored, _),) = await client.put([(os.urandom(16), (2, 0), b"x" * 1000)])
            finally:
                client.close()
            return stored

    assert sorted(trio.run(main)) == [0, 3]


def test_kill_a_storage_node_with_two_replicas(make_cluster):
    d = make_cluster(meta_shards=2, storage_nodes=3, replicas=2, chunk_size=CHUNK)
    files = {f"/k/f{i}": os.urandom(random.randrange(1, 3 * CHUNK)) for i in range(40)}
    with jpfs.connect(d) as c:
        c.makedirs("/k")
        for p, b in files.items():
            c.write_bytes(p, b)
    for victim in range(3):
        localcluster.kill(d, "storage", victim)
        with jpfs.connect(d) as c:
            for p, b in files.items():
                assert c.read_bytes(p) == b, (victim, p)
            c.write_bytes(f"/k/new{victim}", b"written while a node is down")
        localcluster.up(d, sync=False)
        with jpfs.connect(d) as c:
            assert c.read_bytes(f"/k/new{victim}") == b"written while a node is down"


_WORKER = r"""
import os, sys, hashlib, jpfs
cluster, me, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = jpfs.connect(cluster)
for r in range(rounds):
    data = hashlib.sha256(f"{me}-{r}".encode()).digest() * (1 + (me * 31 + r) % 500)
    c.write_bytes(f"/conc/w{me}-{r}", data)
    other = f"/conc/w{(me + 1) % 4}-{r // 2}"
    if c.exists(other):
        got = c.read_bytes(other)
        o = (me + 1) % 4
        want = hashlib.sha256(f"{o}-{r // 2}".encode()).digest() * (1 + (o * 31 + r // 2) % 500)
        assert got == want, other
c.close()
"""


def test_concurrent_writers_and_readers_in_processes(dc, data_cluster):
    dc.makedirs("/conc")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(data_cluster), str(i), "40"])
             for i in range(4)]
    assert [p.wait(120) for p in procs] == [0] * 4
    import hashlib
    for me in range(4):
        for r in range(40):
            want = hashlib.sha256(f"{me}-{r}".encode()).digest() * (1 + (me * 31 + r) % 500)
            assert dc.read_bytes(f"/conc/w{me}-{r}") == want


def test_gc_reclaims_space_and_keeps_live_files(make_cluster):
    from jpfs.client.tools.gc import collect

    d = make_cluster(meta_shards=2, storage_nodes=2, chunk_size=CHUNK)
    keep = {f"/gc/keep{i}": os.urandom(20_000 + i) for i in range(50)}
    with jpfs.connect(d) as c:
        c.makedirs("/gc")
        for p, b in keep.items():
            c.write_bytes(p, b)
        for i in range(50):
            c.write_bytes(f"/gc/drop{i}", os.urandom(100_000))
        for i in range(50):
            c.remove(f"/gc/drop{i}")
        for p in list(keep)[:10]:  # overwrites leave dead blobs too
            keep[p] = os.urandom(30_000)
            c.write_bytes(p, keep[p])
        before = sum(c.run(lambda ac, n=n: ac.storage.stats(n)).bytes_used for n in range(2))
        report = c.run(lambda ac: collect(ac, grace=0, min_dead_ratio=0.1))
        after = sum(c.run(lambda ac, n=n: ac.storage.stats(n)).bytes_used for n in range(2))
        assert sum(r["deleted"] for r in report["nodes"].values()) == 60
        assert after < before - 4_000_000
        for p, b in keep.items():
            assert c.read_bytes(p) == b


def test_gc_report_counts_what_the_grace_period_kept_and_each_nodes_dead_share(make_cluster):
    """collect() says in one pass what `jpfs gc` prints: blobs kept by --grace, and the dead
    bytes compaction left (no rescan by the CLI)."""
    from jpfs.client.tools.gc import collect

    d = make_cluster(meta_shards=1, storage_nodes=2, chunk_size=CHUNK)
    with jpfs.connect(d) as c:
        c.makedirs("/r")
        c.write_bytes("/r/keep", os.urandom(50_000))
        for i in range(7):
            c.write_bytes(f"/r/drop{i}", os.urandom(20_000))
            c.remove(f"/r/drop{i}")
        young = c.run(lambda ac: collect(ac, grace=600))
        assert young["live_blobs"] == 1
        assert sum(r["kept_by_grace"] for r in young["nodes"].values()) == 7
        assert sum(r["deleted"] for r in young["nodes"].values()) == 0
        dry = c.run(lambda ac: collect(ac, grace=0, dry_run=True))
        assert [r["kept_by_grace"] for r in dry["nodes"].values()] == [0, 0]
        assert sum(r["deleted"] for r in dry["nodes"].values()) == 7
        # Deleted but not compacted: the dead bytes stay, and the report says how many.
        done = c.run(lambda ac: collect(ac, grace=0, compact=False))
        assert sum(r["deleted"] for r in done["nodes"].values()) == 7
        for node, r in done["nodes"].items():
            st = c.run(lambda ac, n=node: ac.storage.stats(n))
            assert (r["live_bytes"], r["dead_bytes"]) == (st.live_bytes, st.dead_bytes)
            total = st.live_bytes + st.dead_bytes
            assert r["dead_share"] == (st.dead_bytes / total if total else 0.0)
            assert "compact" not in r
        assert sum(r["dead_bytes"] for r in done["nodes"].values()) >= 7 * 20_000
        # Compacted with a low threshold: what was dead is gone, and the report shows it.
        again = c.run(lambda ac: collect(ac, grace=0, min_dead_ratio=0.01))
        assert sum(r["compact"]["bytes_reclaimed"] for r in again["nodes"].values()) > 0
        assert all(r["dead_bytes"] == 0 and r["dead_share"] == 0.0
                   for r in again["nodes"].values())
        assert len(c.read_bytes("/r/keep")) == 50_000


def test_gc_killed_midway_then_rerun(make_cluster):
    d = make_cluster(meta_shards=1, storage_nodes=2, chunk_size=CHUNK)
    keep = {f"/g/k{i}": os.urandom(10_000) for i in range(100)}
    with jpfs.connect(d) as c:
        c.makedirs("/g")
        for p, b in keep.items():
            c.write_bytes(p, b)
        for i in range(300):
            c.write_bytes(f"/g/x{i}", os.urandom(30_000))
            c.remove(f"/g/x{i}")
    env = {**os.environ, "JPFS_CLUSTER": str(d)}
    gc = [sys.executable, "-m", "jpfs.cli.main", "gc", "--grace", "0", "--min-dead", "0.05"]
    proc = subprocess.Popen(gc, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert subprocess.run(gc, env=env, capture_output=True).returncode == 0
    with jpfs.connect(d) as c:
        for p, b in keep.items():
            assert c.read_bytes(p) == b
        used = sum(c.run(lambda ac, n=n: ac.storage.stats(n)).live_bytes for n in range(2))
        assert used < 2 * 100 * 10_000


def test_import_export_round_trip_and_resume(make_cluster, tmp_path):
    d = make_cluster(meta_shards=2, storage_nodes=2, chunk_size=CHUNK)
    src = tmp_path / "src"
    rng = random.Random(3)
    for i in range(12):
        sub = src / f"dir{i % 3}" / f"sub{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"file{i}.bin").write_bytes(rng.randbytes(rng.randrange(0, 40_000)))
    (src / "big.bin").write_bytes(rng.randbytes(3 * CHUNK + 11))
    (src / "empty").write_bytes(b"")
    os.symlink("dir0", src / "link")
    env = {**os.environ, "JPFS_CLUSTER": str(d)}
    cli = [sys.executable, "-m", "jpfs.cli.main"]
    r = subprocess.run(cli + ["import", str(src), "jpfs:/ds", "--json"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert first["files"] == 14 and first["skipped"] == 0 and first["symlinks"] == 1
    again = json.loads(subprocess.run(cli + ["import", str(src), "jpfs:/ds", "--json"], env=env,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
    assert again["files"] == 0 and again["skipped"] == 14  # resumable: nothing copied twice
    (src / "dir1" / "sub1" / "file1.bin").write_bytes(b"changed")
    third = json.loads(subprocess.run(cli + ["import", str(src), "jpfs:/ds", "--json"], env=env,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
    assert third["files"] == 1
    out = tmp_path / "out"
    r = subprocess.run(cli + ["export", "jpfs:/ds", str(out), "--no-progress"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert subprocess.run(["diff", "-r", "--no-dereference", str(src), str(out)]).returncode == 0
    with jpfs.connect(d) as c:  # a directory's small files were packed on one node's volume
        nodes = {c.layout(f"/ds/dir0/sub0/{n}").chunks[0].nodes
                 for n in c.listdir("/ds/dir0/sub0") if c.stat(f"/ds/dir0/sub0/{n}").size}
        assert len(nodes) == 1


def test_import_killed_then_resumed(make_cluster, tmp_path):
    d = make_cluster(meta_shards=2, storage_nodes=2, chunk_size=CHUNK)
    src = tmp_path / "src"
    rng = random.Random(5)
    for i in range(600):
        sub = src / f"d{i // 100}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:04d}").write_bytes(rng.randbytes(20_000))
    env = {**os.environ, "JPFS_CLUSTER": str(d)}
    cmd = [sys.executable, "-m", "jpfs.cli.main", "import", str(src), "jpfs:/ds", "--no-progress",
           "--parallel", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    proc.kill()
    proc.wait()
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    with jpfs.connect(d) as c:
        for i in range(600):
            p = f"d{i // 100}/f{i:04d}"
            assert c.read_bytes(f"/ds/{p}") == (src / p).read_bytes()


def test_cluster_file_names_storage(data_cluster):
    c = config.load(localcluster.cluster_file(data_cluster))
    assert c.n_nodes == 3 and c.chunk_size == CHUNK


def test_read_ranges_and_fsspec_cat_ranges(dc, data_cluster, monkeypatch):
    import fsspec

    a, b = os.urandom(3 * CHUNK + 100), os.urandom(5000)
    dc.write_bytes("/ra", a)
    dc.write_bytes("/rb", b)
    dc.truncate("/rb", 7000)  # a tail past the stored bytes reads as zeros
    want_b = b + bytes(2000)
    ranges = [("/ra", 0, 10), ("/ra", CHUNK - 5, CHUNK + 5), ("/ra", -50, -1), ("/rb", 4990, 7000),
              ("/ra", 2 * CHUNK, 10 * CHUNK), ("/rb", 100, 50)]
    got = [bytes(v) for v in dc.read_ranges(ranges)]
    assert got == [a[0:10], a[CHUNK - 5:CHUNK + 5], a[-50:-1], want_b[4990:7000],
                   a[2 * CHUNK:], b""]
    monkeypatch.setenv("JPFS_CLUSTER", str(data_cluster))
    fs = fsspec.filesystem("jpfs")
    assert fs.cat_ranges(["jpfs://ra", "jpfs://rb"], [5, 0], [9, 3]) == [a[5:9], b[:3]]


def test_read_many_follows_links_and_inodes_on_other_shards(dc):
    from jpfs.placement import shard_of

    dc.makedirs("/mix/a")
    dc.write_bytes("/mix/a/f", b"file in a")
    dc.symlink("a/f", "/mix/link")
    # a directory on the other shard; a file moved into it keeps its inode on the first one
    other = next(f"/mix/d{i}" for i in range(100)
                 if shard_of(dc.mkdir(f"/mix/d{i}").ino) != shard_of(dc.stat("/mix/a").ino))
    dc.write_bytes("/mix/a/moved", b"moved across shards")
    dc.rename("/mix/a/moved", f"{other}/moved")
    assert shard_of(dc.stat(f"{other}/moved").ino) != shard_of(dc.stat(other).ino)
    got = dc.read_many(["/mix/a/f", "/mix/link", f"{other}/moved"])
    assert [bytes(g) for g in got] == [b"file in a", b"file in a", b"moved across shards"]
    with pytest.raises(IsADirectoryError):
        dc.read_many(["/mix/a"])


def test_prefetch_hint_serves_later_reads_from_memory(make_cluster):
    d = make_cluster(meta_shards=1, storage_nodes=2, chunk_size=CHUNK)
    files = {f"/h/f{i:03d}": os.urandom(20_000 + i) for i in range(60)}
    with jpfs.connect(d) as c:
        c.makedirs("/h")
        for p, b in files.items():
            c.write_bytes(p, b)
        c.prefetch(list(files) + ["/h/missing"])  # a hint: a bad path is skipped

        async def settled(ac):
            with trio.fail_after(30):
                while ac.cache.stats.prefetched < len(files):
                    await trio.sleep(0.01)
            return ac.cache.stats.prefetched

        assert c.run(settled) == len(files)
        got = c.read_many(list(files))
        assert [bytes(g) for g in got] == list(files.values())
        stats = c.aclient.cache.stats
        assert stats.prefetch_hits == len(files) and stats.misses == 0
