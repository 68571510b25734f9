"""Durable metadata on a synced shard: changes are answered once committed, one fsync covers many
of them, ``sync`` waits for it, and a killed shard loses nothing it answered."""

from __future__ import annotations

import signal

import trio

import jpfs
from jpfs import localcluster


def _info(c) -> dict:
    return c.run(lambda ac: ac.meta.call(0, "shard_info"))


def test_answered_changes_survive_a_kill_and_share_fsyncs(tmp_path):
    d = tmp_path / "c"
    localcluster.up(d, meta_shards=1, storage_nodes=1, sync=True)  # every change synced
    try:
        with jpfs.connect(d) as c:
            c.makedirs("/d")
            before = _info(c)

            async def create_many(ac) -> None:
                async with trio.open_nursery() as nursery:
                    for w in range(8):  # 8 writers at once, as 8 processes of a job would
                        async def one(w=w) -> None:
                            for i in range(50):
                                await ac.create(f"/d/w{w}-{i:03d}")
                        nursery.start_soon(one)

            c.run(create_many)
            c.sync()  # returns once all 400 are durable
            after = _info(c)
            syncs = after["syncs"] - before["syncs"]
            assert 1 <= syncs < 400 / 4, syncs  # fsyncs are shared by many changes
        localcluster.stop(d, "meta", 0, sig=signal.SIGKILL)
        localcluster.start(d, "meta", 0, sync=True)
        with jpfs.connect(d) as c:
            assert len(c.listdir("/d")) == 400
    finally:
        localcluster.down(d, timeout=5)
