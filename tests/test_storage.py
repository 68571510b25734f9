"""Storage servers and the storage client, end to end: real daemons on loopback, real files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import xxhash
from jpfs_daemon.storage.store import record_size
from storage_cluster import StorageCluster, blob_data, storage_cluster  # noqa: F401

from jpfs.client.wire.storage import StorageClient
from jpfs.errors import ChecksumError, JPFSError, Unavailable
from jpfs.proto import storage as P
from jpfs.types import Chunk

MiB = 1 << 20


def new_id() -> bytes:
    return os.urandom(16)


def chunks_of(blobs, results) -> list[Chunk]:
    return [Chunk(k, bid, nodes, len(data), len(data), xxh)
            for k, ((bid, _, data), (nodes, xxh)) in enumerate(zip(blobs, results, strict=True))]


def find_in_volumes(data_dir: Path, needle: bytes) -> tuple[Path, int]:
    """The volume file and offset where ``needle`` (unique random bytes) is stored."""
    for vol in sorted((data_dir / "volumes").iterdir()):
        pos = vol.read_bytes().find(needle)
        if pos >= 0:
            return vol, pos
    raise AssertionError("bytes not found in any volume")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def resident_pages(path: Path, offset: int, length: int) -> int:
    """How many pages of ``path[offset:offset + length]`` are in the page cache (mincore: unlike
    a read, even one with RWF_NOWAIT, it starts no readahead)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    first, last = offset >> 12, (offset + length - 1) >> 12
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the view is dropped at once
        n = last - first + 1
        vec = (ctypes.c_ubyte * n)()
        if libc.mincore(ctypes.c_void_p(base + (first << 12)), n << 12, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec)


def evict(path: Path, offset: int, length: int = 1) -> bool:
    """Drop ``path``'s pages from the page cache; whether every page from the one before
    ``offset`` (a record header may sit there) to ``offset + length`` went."""
    start = max(0, offset - 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(50):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not resident_pages(path, start, offset + length - start):
                return True
            time.sleep(0.02)  # pages still on another CPU's LRU list: try again
        return False
    finally:
        os.close(fd)


@pytest.fixture
async def client_for(nursery):
    made = []

    def make(sc: StorageCluster, **kw) -> StorageClient:
        # these tests read through the nodes' sockets (what a client on another host does);
        # test_short_circuit_* read the volume files of nodes on this host
        kw.setdefault("short_circuit", False)
        c = StorageClient(nursery, sc.cluster, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# ---------------------------------------------------------------------- round trips


async def test_round_trip_sizes(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=3, replicas=2)
    client = client_for(sc)
    cs = sc.cluster.chunk_size
    sizes = [0, 1, cs - 1, cs, cs + 1]
    blobs = [(new_id(), (i % 3, (i + 1) % 3), os.urandom(s)) for i, s in enumerate(sizes)]
    results = await client.put(blobs)
    for (_, pref, data), (nodes, xxh) in zip(blobs, results, strict=True):
        assert nodes == pref and xxh == xxhash.xxh3_64_intdigest(data)
    chunks = chunks_of(blobs, results)
    got = await client.get(chunks)
    assert [bytes(g) for g in got] == [d for _, _, d in blobs]
    # straight into the caller's buffers (bigger than needed is fine)
    bufs = [bytearray(len(d) + 7) for _, _, d in blobs]
    got = await client.get(chunks, into=[memoryview(b) for b in bufs])
    for g, b, (_, _, d) in zip(got, bufs, blobs, strict=True):
        assert bytes(g) == d and bytes(b[:len(d)]) == d and g.obj is b
    # every replica holds every byte: read each blob from its second node only
    second = [Chunk(c.index, c.blob, c.nodes[1:], c.length, c.blob_len, c.xxh) for c in chunks]
    assert [bytes(g) for g in await client.get(second)] == [d for _, _, d in blobs]


async def test_batch_of_500_small_blobs(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=3, replicas=2)
    client = client_for(sc, batch_bytes=64 << 20)
    blobs = []
    for i in range(500):
        bid = new_id()
        blobs.append((bid, ((i // 50) % 3, (i // 50 + 1) % 3), blob_data(bid, 10 + 97 * i)))
    results = await client.put(blobs)
    chunks = chunks_of(blobs, results)
    got = await client.get(chunks)
    assert all(bytes(g) == d for g, (_, _, d) in zip(got, blobs, strict=True))
    # one put and one get request per node carried them all
    for node in range(3):
        st = await client.stats(node)
        assert st.puts == 1 and st.gets == 1
        assert st.blobs == sum(node in n for n, _ in results)


async def test_put_is_idempotent_and_refuses_other_bytes(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc)
    bid, data = new_id(), os.urandom(1000)
    (nodes, xxh), = await client.put([(bid, (0,), data)])
    (nodes2, xxh2), = await client.put([(bid, (0,), data)])  # a retry: no-op
    assert (nodes, xxh) == (nodes2, xxh2)
    st = await client.stats(0)
    assert st.blobs == 1 and st.live_bytes == 1000
    assert st.bytes_used == 1000 + record_size(1)  # the retry wrote nothing
    with pytest.raises(JPFSError) as info:
        await client.put([(bid, (0,), os.urandom(1000))])
    assert info.value.errno == errno.EEXIST and bid.hex() in info.value.strerror
    assert bytes((await client.get([Chunk(0, bid, (0,), 1000, 1000, xxh)]))[0]) == data


async def test_group_commit_shares_fsyncs(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc, connections_per_node=4)

    async def one() -> None:
        await client.put([(new_id(), (0,), os.urandom(5000))])

    async with trio.open_nursery() as n:
        for _ in range(100):
            n.start_soon(one)
    st = await client.stats(0)
    assert st.puts == 100 and st.blobs == 100
    assert st.commits < 100  # concurrent puts shared group commits


# ---------------------------------------------------------------------- coalescing, cold reads


async def test_neighbours_are_coalesced(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc)
    blobs = [(new_id(), (0,), os.urandom(100 + i)) for i in range(200)]
    chunks = chunks_of(blobs, await client.put(blobs))
    before = await client.stats(0)
    got = await client.get(chunks)
    after = await client.stats(0)
    assert [bytes(g) for g in got] == [d for _, _, d in blobs]
    assert after.blobs_sent - before.blobs_sent == 200
    assert after.segments_sent - before.segments_sent == 1  # one sendfile for all
    # asked for in reverse, nothing is adjacent in request order: one segment each
    await client.get(chunks[::-1])
    again = await client.stats(0)
    assert again.segments_sent - after.segments_sent == 200


async def test_cold_pages_are_warmed_off_the_event_loop(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc)
    blobs = [(new_id(), (0,), os.urandom(3 * MiB))]
    chunks = chunks_of(blobs, await client.put(blobs))
    vol, pos = find_in_volumes(sc.data_dir(0), blobs[0][2][:64])
    # Something (kernel readahead finishing late) can bring evicted pages back before the read;
    # then the read is rightly not counted as cold. Evict again and retry a few times.
    for _ in range(5):
        if not evict(vol, pos, len(blobs[0][2])):
            pytest.skip("this kernel keeps the pages cached despite POSIX_FADV_DONTNEED")
        before = (await client.stats(0)).cold_warmups
        assert bytes((await client.get(chunks))[0]) == blobs[0][2]
        after = (await client.stats(0)).cold_warmups
        assert after - before in (0, 1)
        if after == before + 1:
            break
    else:
        pytest.fail("a read of evicted pages was never warmed in a thread")
    await client.get(chunks)  # now cached: sent straight away
    assert (await client.stats(0)).cold_warmups == after


# ---------------------------------------------------------------------- failures and replicas


async def test_corrupt_byte_is_detected_and_served_from_replica(storage_cluster,  # noqa: F811
                                                                client_for):
    sc = storage_cluster(n=2, replicas=2)
    client = client_for(sc)
    both = (new_id(), (0, 1), os.urandom(200_000))
    only0 = (new_id(), (0,), os.urandom(50_000))
    res = await client.put([both, only0])
    assert res[0][0] == (0, 1) and res[1][0] == (0,)
    chunks = chunks_of([both, only0], res)
    for _, _, data in (both, only0):
        vol, pos = find_in_volumes(sc.data_dir(0), data[:64])
        flip_byte(vol, pos + 1234)
    got = await client.get([chunks[0]])  # node 0's copy is bad: node 1 serves it
    assert bytes(got[0]) == both[2]
    with pytest.raises(ChecksumError) as info:
        await client.get([chunks[1]])  # no good copy anywhere
    assert info.value.errno == errno.EIO
    assert only0[0].hex() in str(info.value) and "checksum" in str(info.value)


async def test_a_closing_client_waits_for_its_report_of_a_bad_copy(storage_cluster,  # noqa: F811
                                                                  client_for):
    """A node drops a request whose connection closes: a client closed right after a read that
    failed its checksum must still get its report answered, or the copy is never healed."""
    sc = storage_cluster(n=2, replicas=2)
    client = client_for(sc, first_copy=0)
    blob = (new_id(), (0, 1), os.urandom(100_000))
    res = await client.put([blob])
    assert res[0][0] == (0, 1)
    vol, pos = find_in_volumes(sc.data_dir(0), blob[2][:64])
    flip_byte(vol, pos + 777)
    call = client.pool.call

    async def slow_report(index, method, args, *a, **kw):  # a busy node takes its time
        if method is P.REPORT_BAD:
            await trio.sleep(0.5)
        return await call(index, method, args, *a, **kw)

    client.pool.call = slow_report  # type: ignore[method-assign]
    got = await client.get(chunks_of([blob], res))  # node 0 reads bad: node 1 serves it
    assert bytes(got[0]) == blob[2]
    with trio.CancelScope() as scope:  # closing as a cancelled caller does
        scope.cancel()
        assert await client.reports_answered()
    client.close()
    other = client_for(sc)
    bad = P.BAD_BLOBS.decode(await other.pool.call(0, P.BAD_BLOBS, P.BadBlobsReq(b"", 10)))
    assert [b[0] for b in bad] == [blob[0]], bad


async def test_kill9_replica_failover_and_restart(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=3, replicas=2)
    client = client_for(sc, down_for=0.5)
    blobs = [(new_id(), (i % 3, (i + 1) % 3), os.urandom(1000 + 10 * i)) for i in range(120)]
    chunks = chunks_of(blobs, await client.put(blobs))
    assert sc.kill(0) == -9
    with trio.fail_after(5):
        got = await client.get(chunks)
    assert [bytes(g) for g in got] == [d for _, _, d in blobs]
    # the dead node is remembered: the next read does not wait on it
    with trio.fail_after(1):
        got = await client.get(chunks)
    assert [bytes(g) for g in got] == [d for _, _, d in blobs]
    # writes preferring node 0 go round the ring to keep two live copies
    more = [(new_id(), (0, 1), os.urandom(500)) for _ in range(10)]
    res = await client.put(more)
    assert all(nodes == (1, 2) for nodes, _ in res)
    # restart: it serves again (its blobs survived kill -9)
    sc.start(0)
    await trio.sleep(0.6)  # past down_for
    mine = [c for c in chunks if c.nodes[0] == 0]
    only0 = [Chunk(c.index, c.blob, (0,), c.length, c.blob_len, c.xxh) for c in mine]
    got = await client.get(only0)
    assert [bytes(g) for g in got] == [blob_data_of(blobs, c.blob) for c in mine]
    assert (await client.stats(0)).gets >= 1
    assert [bytes(g) for g in await client.get(chunks_of(more, res))] == [d for _, _, d in more]


def blob_data_of(blobs, bid: bytes) -> bytes:
    return next(d for b, _, d in blobs if b == bid)


async def test_all_replicas_down_is_unavailable(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=2, replicas=2)
    client = client_for(sc, retry_for=0.3)
    blobs = [(new_id(), (0, 1), b"x" * 100)]
    chunks = chunks_of(blobs, await client.put(blobs))
    sc.kill(0)
    sc.kill(1)
    with pytest.raises(Unavailable) as info:
        await client.get(chunks)
    assert blobs[0][0].hex() in str(info.value)
    with pytest.raises(Unavailable):
        await client.put([(new_id(), (0, 1), b"y")])


async def test_missing_blob_is_eio_naming_it(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=2, replicas=2)
    client = client_for(sc)
    ghost = Chunk(0, new_id(), (0, 1), 10, 10, 123)
    with pytest.raises(JPFSError) as info:
        await client.get([ghost])
    assert info.value.errno == errno.EIO and ghost.blob.hex() in str(info.value)
    assert "ENOENT" in str(info.value)


async def test_concurrent_processes_lose_and_mix_nothing(storage_cluster,  # noqa: F811
                                                         client_for):
    sc = storage_cluster(n=3, replicas=2)
    script = Path(__file__).with_name("storage_cluster.py")
    workers = 4

    def run_workers() -> list:
        procs = [subprocess.Popen([sys.executable, str(script), "worker", str(sc.path), str(s),
                                   "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for s in range(workers)]
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr.decode()
            out += json.loads(stdout)
        return out

    written = await trio.to_thread.run_sync(run_workers)
    assert len(written) == workers * 300
    assert len({w[0] for w in written}) == len(written)
    client = client_for(sc)
    chunks = [Chunk(0, bytes.fromhex(h), tuple(n), size, size, xxh) for h, n, size, xxh in written]
    got = await client.get(chunks)
    for c, g in zip(chunks, got, strict=True):
        assert bytes(g) == blob_data(c.blob, c.blob_len)
    total = sum(len(c.nodes) for c in chunks)
    assert sum([(await client.stats(i)).blobs for i in range(3)]) == total


# ---------------------------------------------------------------------- delete, list, compact


async def _fill(client, n=300, node=0, seed=0):
    blobs = []
    for i in range(n):
        bid = new_id()
        blobs.append((bid, (node,), blob_data(bid, 2000 + (i * 7919 + seed) % 30000)))
    res = []
    for k in range(0, n, 50):  # several batches, so several volumes
        res += await client.put(blobs[k:k + 50])
    return blobs, chunks_of(blobs, res)


async def _check_all(client, blobs, chunks):
    got = await client.get(chunks)
    for g, (_, _, d) in zip(got, blobs, strict=True):
        assert bytes(g) == d


async def test_delete_list_and_compact(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1, args=("--volume-size", "1MiB"))
    client = client_for(sc)
    blobs, chunks = await _fill(client)
    st0 = await client.stats(0)
    assert st0.volumes >= 3 and st0.dead_bytes == 0
    # list pages through every id in order
    listed, after = [], b""
    while page := await client.list_blobs(0, after, 64):
        listed += page
        after = page[-1][0]
    assert [b for b, _ in listed] == sorted(b for b, _, _ in blobs)
    assert all(isinstance(t, float) and t > 1.6e9 for _, t in listed)
    gone = [(b, (0,)) for k, (b, _, _) in enumerate(blobs) if k % 3]
    await client.delete(gone)
    await client.delete(gone)  # idempotent
    keep = [k for k in range(len(blobs)) if k % 3 == 0]
    st1 = await client.stats(0)
    assert st1.blobs == len(keep) and st1.dead_bytes > 0
    assert st1.bytes_used == st0.bytes_used
    summary = await client.compact(0, 0.3)
    assert summary.volumes_compacted >= 3 and summary.bytes_reclaimed > 0
    st2 = await client.stats(0)
    assert st2.live_bytes == st1.live_bytes == st2.bytes_used
    assert st2.dead_bytes == 0 and st2.blobs == len(keep)
    files = list((sc.data_dir(0) / "volumes").iterdir())
    assert len(files) == st2.volumes
    assert sum(f.stat().st_size for f in files) == st2.bytes_used
    await _check_all(client, [blobs[k] for k in keep], [chunks[k] for k in keep])
    with pytest.raises(JPFSError) as info:
        await client.get([chunks[1]])
    assert "ENOENT" in str(info.value)
    # compaction keeps disk order: the kept blobs are still neighbours, one segment per volume
    before = (await client.stats(0)).segments_sent
    await client.get([chunks[k] for k in keep])
    assert (await client.stats(0)).segments_sent - before <= st2.volumes
    # the space of compacted volumes keeps being reclaimed after a restart, and new writes work
    sc.stop(0)
    sc.start(0)
    more, more_chunks = await _fill(client, 20, seed=1)
    await _check_all(client, [blobs[k] for k in keep] + more,
                     [chunks[k] for k in keep] + more_chunks)


async def test_reads_and_writes_during_compaction(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1, args=("--volume-size", "1MiB"))
    client = client_for(sc)
    blobs, chunks = await _fill(client, 300)
    await client.delete([(b, (0,)) for k, (b, _, _) in enumerate(blobs) if k % 2])
    keep = [k for k in range(len(blobs)) if k % 2 == 0]
    kept_blobs, kept_chunks = [blobs[k] for k in keep], [chunks[k] for k in keep]
    done = trio.Event()
    rounds = 0
    extra: list = []

    async def read_until_done() -> None:
        nonlocal rounds
        while not done.is_set():
            await _check_all(client, kept_blobs, kept_chunks)
            rounds += 1

    async def write_until_done() -> None:
        while not done.is_set():
            more, more_chunks = await _fill(client, 10, seed=len(extra))
            extra.append((more, more_chunks))

    async with trio.open_nursery() as n:
        n.start_soon(read_until_done)
        n.start_soon(write_until_done)
        summary = await client.compact(0, 0.3)
        done.set()
    assert summary.volumes_compacted >= 3 and rounds >= 1
    await _check_all(client, kept_blobs, kept_chunks)
    for more, more_chunks in extra:
        await _check_all(client, more, more_chunks)
    st = await client.stats(0)
    assert st.blobs == len(keep) + 10 * len(extra)


@pytest.mark.parametrize("step", ["compact_copying", "compact_copied", "compact_switched"])
async def test_kill9_during_compaction_loses_nothing(storage_cluster, client_for,  # noqa: F811
                                                     step):
    sc = storage_cluster(n=1, replicas=1, args=("--volume-size", "1MiB"))
    client = client_for(sc, retry_for=0.5)
    blobs, chunks = await _fill(client, 200)
    await client.delete([(b, (0,)) for k, (b, _, _) in enumerate(blobs) if k % 2])
    keep = [k for k in range(len(blobs)) if k % 2 == 0]
    kept_blobs, kept_chunks = [blobs[k] for k in keep], [chunks[k] for k in keep]
    sc.stop(0)
    sc.start(0, env={"JPFS_FAULTS": f"storage.{step}"})
    with pytest.raises(Unavailable):
        await client.compact(0, 0.3)
    assert sc.wait_exit(0) in (-9, 137)  # died at the fault point
    sc.start(0)
    await _check_all(client, kept_blobs, kept_chunks)
    st = await client.stats(0)
    assert st.blobs == len(keep)
    files = list((sc.data_dir(0) / "volumes").iterdir())
    assert len(files) == st.volumes  # orphans of the interrupted compaction are gone
    await client.compact(0, 0.3)  # rerun
    st = await client.stats(0)
    assert st.dead_bytes == 0 and st.blobs == len(keep)
    await _check_all(client, kept_blobs, kept_chunks)


async def test_kill9_between_data_and_index_loses_nothing(storage_cluster,  # noqa: F811
                                                          client_for):
    """A put whose node died after its bytes and record were synced, before its index commit
    (never answered): the restart indexes it from its record, and the client's retry finds it
    stored. Puts cut short are not indexed (tests/test_storage_store.py)."""
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc, retry_for=0.3, write_retry_for=0.3)
    blobs, chunks = await _fill(client, 20)
    used = (await client.stats(0)).bytes_used
    sc.stop(0)
    sc.start(0, env={"JPFS_FAULTS": "storage.put_written"})
    lost = (new_id(), (0,), os.urandom(100_000))
    with pytest.raises(Unavailable):
        await client.put([lost])
    assert sc.wait_exit(0) in (-9, 137)  # died at the fault point
    vol = max((sc.data_dir(0) / "volumes").iterdir())
    with open(vol, "rb") as f:  # the bytes reached the disk, unindexed (zeros laid past them)
        f.seek(used + record_size(1))
        assert f.read(100_000) == lost[2]
    sc.start(0)
    end = used + record_size(1) + 100_000
    assert vol.stat().st_size == end  # indexed from its record; the zeros past it reclaimed
    xxh = xxhash.xxh3_64_intdigest(lost[2])
    assert bytes((await client.get([Chunk(0, lost[0], (0,), 100_000, 100_000, xxh)]))[0]) \
        == lost[2]
    await _check_all(client, blobs, chunks)
    (nodes, _), = await client.put([lost])  # the retry a client would make: already there
    assert nodes == (0,)
    st = await client.stats(0)
    assert st.bytes_used == end and st.dead_bytes == 0


async def test_answered_puts_survive_kill9_before_the_index_has_them(storage_cluster,  # noqa: F811
                                                                     client_for):
    """A put is answered once its bytes and record are synced; its index entry reaches LMDB
    up to a second later (or with the next delete). Until then reads and stats see it, and a
    kill -9 loses nothing: the restart indexes it from its record."""
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc, retry_for=5.0)
    blobs, chunks = await _fill(client, 40)
    st = await client.stats(0)
    assert st.blobs == 40 and st.live_bytes == sum(len(d) for _, _, d in blobs)
    await _check_all(client, blobs, chunks)
    assert sc.kill(0) in (-9, 137)  # at once: the index has none of them yet
    sc.start(0)
    assert (await client.stats(0)).blobs == 40
    await _check_all(client, blobs, chunks)
    await client.delete([(blobs[0][0], (0,))])
    more, more_chunks = await _fill(client, 10, seed=1)
    assert sc.kill(0) in (-9, 137)
    sc.start(0)
    st = await client.stats(0)
    assert st.blobs == 49 and st.dead_bytes == len(blobs[0][2])
    await _check_all(client, blobs[1:] + more, chunks[1:] + more_chunks)
    with pytest.raises(JPFSError):
        await client.get(chunks[:1])
