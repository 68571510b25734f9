"""A replicated shard added to a running cluster: the running shards follow the map (their
peers grow, directory placement hashes over the new count), so new directories land on the new
shard and cross-shard changes reach it, with no restart."""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest
import repl_support as rs
from jpfs_bench.harness import free_port
from jpfs_daemon.meta.replica import POLL, TTL

import jpfs
from jpfs import config, localcluster
from jpfs.client.tools.fsck import fsck
from jpfs.coord import clustermap
from jpfs.placement import shard_of

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow]


def test_a_new_shard_takes_new_directories(tmp_path):
    localcluster.up(tmp_path, meta_shards=1, storage_nodes=1, etcd=True, meta_replicas=3)
    client = jpfs.connect(localcluster.cluster_file(tmp_path))
    try:
        client.mkdir("/old")
        client.write_bytes("/old/f", b"before")
        localcluster.up(tmp_path, meta_shards=2)  # grows the map and starts shard 1's copies

        def shards_seen() -> set[int]:
            info = client.run(lambda ac: ac.meta.shard_info(0))
            return {info.shards}

        deadline = time.monotonic() + 30
        while shards_seen() != {2}:
            assert time.monotonic() < deadline, "shard 0 did not follow the map"
            time.sleep(0.2)
        fresh = jpfs.connect(localcluster.cluster_file(tmp_path))
        try:
            placed = []
            for i in range(16):
                fresh.mkdir(f"/n{i}")
                placed.append(shard_of(fresh.stat(f"/n{i}").ino))
            assert 1 in placed and 0 in placed, placed
            target = next(i for i, s in enumerate(placed) if s == 1)
            fresh.rename("/old/f", f"/n{target}/f")  # shard 0 -> shard 1: two-phase commit
            assert fresh.read_bytes(f"/n{target}/f") == b"before"
            report = fresh.run(lambda ac: fsck(ac.meta))
            assert report.clean, report.problems
        finally:
            fresh.close()
    finally:
        client.close()
        localcluster.down(tmp_path)


def test_copies_added_to_a_shard_with_data_fill_from_it(tmp_path):
    """New copies start marked as needing a snapshot, so the copy that holds the data leads
    even though every copy's log is empty (a shard that had no copies before)."""
    c = localcluster.up(tmp_path, meta_shards=1, storage_nodes=1, etcd=True)
    client = jpfs.connect(c)
    try:
        client.mkdir("/kept")
        client.write_bytes("/kept/f", b"data")
        client.close()
        localcluster.stop(tmp_path, "meta", 0)

        def more_copies(current):
            host = current.meta[0].address.rsplit(":", 1)[0]
            copies = (current.meta[0],) + tuple(
                config.Server(f"{host}:{free_port()}", f"meta-0-r{j}") for j in (1, 2))
            return dataclasses.replace(current, meta_replicas=(copies,))

        clustermap.update_map_sync(c, more_copies)
        for j in (1, 2):  # the new copies first: empty, they must not elect one of them
            localcluster.start(tmp_path, "meta", 0, replica=j)
        client = jpfs.connect(localcluster.cluster_file(tmp_path))
        # nothing must happen: wait past a lease, the copies' looks at the key and an election
        time.sleep(TTL + 2 * POLL + 1.0)
        for j in (1, 2):
            st = client.run(lambda ac, j=j: rs.repl_status(ac.meta.pool.pools[0], j, 0))
            assert st.role == "follower" and st.resyncing, st
        localcluster.up(tmp_path)  # copy 0 (and the rest) back
        assert client.read_bytes("/kept/f") == b"data"
        deadline = time.monotonic() + 30
        while True:
            got = [client.run(lambda ac, j=j: rs.repl_digest(ac.meta.pool.pools[0], j, 0))
                   for j in range(3)]
            if len({(g.seq, g.digest) for g in got}) == 1:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got[0].records > 5
    finally:
        client.close()
        localcluster.down(tmp_path)
