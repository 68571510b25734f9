"""Durable metadata on a synced shard: changes are answered once committed, one fsync covers many
of them, ``sync`` waits for it, and a killed shard loses nothing it answered."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio

import jpfs
from jpfs import localcluster
from jpfs.proto.meta import ShardInfo


def _info(c) -> ShardInfo:
    return c.run(lambda ac: ac.meta.shard_info(0))


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
            syncs = after.syncs - before.syncs
            assert 1 <= syncs < 400 / 4, syncs  # fsyncs are shared by many changes
        localcluster.stop(d, "meta", 0, sig=signal.SIGKILL)
        localcluster.start(d, "meta", 0, sync=True)
        with jpfs.connect(d) as c:
            assert len(c.listdir("/d")) == 400
    finally:
        localcluster.down(d, timeout=5)


@contextmanager
def _with_sync_delay(tmp_path, shards: int, delay: float) -> Iterator[jpfs.Client]:
    """A client of a synced cluster whose shards run with ``--sync-delay delay``, and ``/d``."""
    d = tmp_path / "c"
    localcluster.up(d, meta_shards=shards, storage_nodes=1, sync=True,
                    extra_args={"meta": ["--sync-delay", str(delay)]})
    try:
        with jpfs.connect(d) as c:
            c.makedirs("/d")
            yield c
    finally:
        localcluster.down(d, timeout=5)


def test_a_long_sync_delay_holds_back_no_waiter(tmp_path):
    """Changes nobody waits for are fsynced within ``--sync-delay``; ``sync`` (fsync(2)) and
    the durable steps of a cross-shard mkdir are fsynced at once whatever the delay."""
    with _with_sync_delay(tmp_path, 2, 60) as c:
        async def waiters(ac) -> int:
            with trio.fail_after(20):  # none of them waits out the 60 s delay
                await ac.sync()
                for i in range(20):  # spread over both shards: two-phase commits
                    await ac.mkdir(f"/d/sub{i}")
                before = await syncs(ac)
                await ac.create("/d/f")
                await ac.sync()
                return before

        async def syncs(ac) -> int:
            return sum([(await ac.meta.shard_info(i)).syncs for i in (0, 1)])

        before = c.run(waiters)
        assert c.run(syncs) > before


def test_changes_nobody_waits_for_are_fsynced_within_the_delay(tmp_path):
    with _with_sync_delay(tmp_path, 1, 0.2) as c:
        c.sync()
        before = _info(c).syncs
        c.create("/d/f")  # answered once committed; nobody calls sync
        deadline = time.monotonic() + 10
        while _info(c).syncs == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _info(c).syncs > before
