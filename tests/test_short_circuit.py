"""Short-circuit reads: a client on a storage node's host reads the node's volume files itself
(real storage daemons on loopback, real volume files, a real kernel mount)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from fuse_support import mounted, requires_fuse
from storage_cluster import blob_data, storage_cluster  # noqa: F401
from test_storage import chunks_of, client_for, find_in_volumes, flip_byte, new_id  # noqa: F401

import jpfs
from jpfs.client.wire import shortcircuit
from jpfs.client.wire.shortcircuit import same_host
from jpfs.proto import storage as P


def held_volumes(under: Path) -> list[str]:
    """Volume files under ``under`` this process holds open (``(deleted)`` once unlinked).
    Only those of the test's own cluster: a client an earlier test left cached (an fsspec
    ``jpfs://`` instance) may hold volumes of a cluster whose directory is gone."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{under}/") and target.split(" ")[0].endswith(".vol"):
            out.append(target)
    return out


async def test_reads_come_from_the_volume_files_not_the_socket(
        storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=2, replicas=1)
    client = client_for(sc, short_circuit=True)
    blobs = [(new_id(), (i % 2,), os.urandom(size))
             for i, size in enumerate([0, 1, 4096, 300_000, 5 << 20])]
    chunks = chunks_of(blobs, await client.put(blobs))
    got = await client.get(chunks)
    assert [bytes(g) for g in got] == [d for _, _, d in blobs]
    # into the caller's buffers, as a socket read would fill them
    bufs = [bytearray(len(d)) for _, _, d in blobs]
    got = await client.get(chunks, into=[memoryview(b) for b in bufs])
    assert all(g.obj is b and bytes(b) == d for g, b, (_, _, d) in zip(got, bufs, blobs,
                                                                      strict=True))
    assert client.as_dict() == {"local_nodes": 2, "local_blobs": 10,
                                "local_bytes": 2 * sum(len(d) for _, _, d in blobs),
                                "local_fallbacks": 0}
    for node in range(2):
        st = await client.stats(node)
        assert st.gets == 0 and st.blobs_sent == 0  # nothing came over the socket
        assert st.blobs_located == 2 * sum(n == (node,) for _, n, _ in blobs)
    # the same reads with short-circuit off go over the socket
    remote = client_for(sc)
    assert [bytes(g) for g in await remote.get(chunks)] == [d for _, _, d in blobs]
    assert remote.as_dict()["local_blobs"] == 0
    assert sum([(await remote.stats(n)).blobs_sent for n in range(2)]) == len(blobs)


async def test_a_corrupt_copy_read_locally_fails_over(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=2, replicas=2)
    client = client_for(sc, first_copy=0, short_circuit=True)
    bid = new_id()
    data = blob_data(bid, 200_000)
    (chunk,) = chunks_of([(bid, (0, 1), data)], await client.put([(bid, (0, 1), data)]))
    vol, off = find_in_volumes(sc.data_dir(0), data[:64])
    flip_byte(vol, off + 100_000)
    (got,) = await client.get([chunk])
    assert bytes(got) == data  # from node 1's copy, after node 0's failed its checksum
    c = client.as_dict()
    assert c["local_fallbacks"] == 1 and c["local_blobs"] == 1
    # the bad copy was reported as any socket read reports it
    with trio.fail_after(10):
        while (await client.stats(0)).reports_bad == 0:
            await trio.sleep(0.05)


async def test_compaction_under_a_local_reader(storage_cluster, client_for,  # noqa: F811
                                               monkeypatch):
    """A reader holding a volume open reads right across a compaction, and lets go of the old
    volume (its space is freed) within a check, though it reads nothing meanwhile; volumes no
    read used for a while are let go too."""
    monkeypatch.setattr(shortcircuit, "CHECK_EVERY", 0.05)
    sc = storage_cluster(n=1, replicas=1, args=("--volume-size", "1MiB"))
    client = client_for(sc, short_circuit=True)
    blobs = [(new_id(), (0,), os.urandom(50_000 + i)) for i in range(60)]
    chunks = chunks_of(blobs, await client.put(blobs))
    assert [bytes(g) for g in await client.get(chunks)] == [d for _, _, d in blobs]
    before = held_volumes(sc.data_dir(0))
    assert before and not any("(deleted)" in v for v in before)
    await client.delete([(bid, (0,)) for bid, _, _ in blobs[::2]])
    summary = await client.compact(0, 0.3)
    assert summary.volumes_compacted >= 1
    with trio.fail_after(10):  # idle: no read comes to notice the unlinked volumes
        while any("(deleted)" in v for v in held_volumes(sc.data_dir(0))):
            await trio.sleep(0.05)
    keep = chunks[1::2]
    assert [bytes(g) for g in await client.get(keep)] == [d for _, _, d in blobs[1::2]]
    assert client.as_dict()["local_blobs"] == len(chunks) + len(keep)
    assert held_volumes(sc.data_dir(0))
    monkeypatch.setattr(shortcircuit, "IDLE_CLOSE", 0.2)
    with trio.fail_after(10):
        while held_volumes(sc.data_dir(0)):
            await trio.sleep(0.05)
    assert [bytes(g) for g in await client.get(keep)] == [d for _, _, d in blobs[1::2]]
    assert client.as_dict()["local_fallbacks"] == 0


async def test_a_node_elsewhere_is_read_over_the_socket(storage_cluster, client_for):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1)
    client = client_for(sc, short_circuit=True)
    info = P.HOST_INFO.decode(await client.pool.call(0, P.HOST_INFO, P.NoArgs()))
    assert same_host(info)
    boot, netns = info.host
    assert not same_host(info._replace(host=[boot, netns + 1]))  # another network namespace
    assert not same_host(info._replace(host=["another-boot", netns]))  # another machine
    assert not same_host(info._replace(volumes_id=[info.volumes_id[0], 1]))  # a look-alike
    assert not same_host(info._replace(volumes=str(Path(info.volumes) / "missing")))


@requires_fuse
@pytest.mark.fuse
def test_mount_reads_local_volumes_and_can_be_told_not_to(make_cluster, tmp_path):
    cluster = make_cluster(meta_shards=1, storage_nodes=2)
    files = {f"/sc/{i}": os.urandom(150_000 + i) for i in range(12)}
    with jpfs.connect(cluster) as c:
        c.makedirs("/sc")
        for p, b in files.items():
            c.write_bytes(p, b)
    for options, local in ((("--read-only",), True),
                           (("--read-only", "--no-short-circuit"), False), ((), True)):
        with mounted(cluster, tmp_path / "m", *options) as m:
            for p, b in files.items():
                assert (m.path / p.lstrip("/")).read_bytes() == b
            st = m.stats()["storage"]
            assert (st["local_blobs"] > 0) == local and st["local_fallbacks"] == 0, options
            assert (st["local_nodes"] > 0) == local


async def test_a_local_node_that_dies_fails_over_to_the_next_copy(
        storage_cluster, client_for):  # noqa: F811
    """Reading a volume file needs its node alive: it says where the blob lies (a dead node's
    files may be mid-compaction, or its disk gone)."""
    sc = storage_cluster(n=2, replicas=2)
    client = client_for(sc, first_copy=0, short_circuit=True)
    blobs = [(new_id(), (0, 1), os.urandom(70_000 + i)) for i in range(5)]
    chunks = chunks_of(blobs, await client.put(blobs))
    assert [bytes(g) for g in await client.get(chunks)] == [d for _, _, d in blobs]
    assert client.as_dict()["local_nodes"] == 1  # only node 0 was asked
    sc.kill(0)
    with trio.fail_after(5):
        assert [bytes(g) for g in await client.get(chunks)] == [d for _, _, d in blobs]
    assert client.is_down(0)
    assert client.as_dict()["local_blobs"] == 10 and client.as_dict()["local_nodes"] == 2
