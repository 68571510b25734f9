"""A replicated shard added to a running cluster: the running shards follow the map (their
peers grow, directory placement hashes over the new count), so new directories land on the new
shard and cross-shard changes reach it, with no restart."""

from __future__ import annotations

import shutil
import time

import pytest

import jpfs
from jpfs import localcluster
from jpfs.client.fsck import fsck
from jpfs.placement import shard_of

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")


def test_a_new_shard_takes_new_directories(tmp_path):
    localcluster.up(tmp_path, meta_shards=1, storage_nodes=1, etcd=True, meta_replicas=3)
    client = jpfs.connect(localcluster.cluster_file(tmp_path))
    try:
        client.mkdir("/old")
        client.write_bytes("/old/f", b"before")
        localcluster.up(tmp_path, meta_shards=2)  # grows the map and starts shard 1's copies

        def shards_seen() -> set[int]:
            infos = client.run(lambda ac: ac.meta.call(0, "shard_info"))
            return {infos["shards"]}

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
