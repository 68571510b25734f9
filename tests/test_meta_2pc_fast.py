"""The short two-phase commit (daemon/meta/coordinator.py): the coordinator's own ops run in
the decision, the caller of a mkdir or rmdir is answered before the participants commit (whoever
touches what they hold waits for it), and participants abort prepared records their
coordinator forgot without waiting for a restart. What a user would check: a directory just
made elsewhere takes creates at once (they wait for its commit, never fail), opposite
cross-shard renames do not deadlock, a kill -9 at every step of a cross-shard rmdir leaves it
whole or undone, and fsck is clean."""

from __future__ import annotations

import itertools
import os
import stat
import threading
import time

import pytest
import trio
from test_meta_crash import DECIDED, _check_clean, _dirs_on_shards, _swallow, _wait_dead

import jpfs
from jpfs import localcluster
from jpfs.client.tools.fsck import fsck
from jpfs.placement import new_dir_shard, shard_of


def _named_for(parent: int, shard: int, shards: int, prefix: str) -> str:
    """A name under directory ``parent`` whose new directory would live on ``shard``."""
    return next(f"{prefix}{i}" for i in itertools.count()
                if new_dir_shard(parent, f"{prefix}{i}".encode(), shards) == shard)


def test_a_create_in_a_directory_just_made_on_another_shard_waits_for_it(make_cluster):
    """One client makes directories whose inodes land on another shard (the mkdir is answered
    once decided; the new inode's shard commits it a round trip later); another client creates
    a file in each as soon as its name appears. The create waits for that commit: it never
    fails with ENOENT and every file is there afterwards."""
    d = make_cluster(meta_shards=2)
    maker = jpfs.connect(d, dir_cache_ttl=0)
    other = jpfs.connect(d, dir_cache_ttl=0)
    try:
        maker.mkdir("/p")
        pino = maker.stat("/p").ino
        names = [n for n in (f"x{i}" for i in range(400))
                 if new_dir_shard(pino, n.encode(), 2) != shard_of(pino)][:100]
        failures: list[str] = []
        made = threading.Event()

        def make():
            try:
                for n in names:
                    maker.mkdir(f"/p/{n}")
            finally:
                made.set()

        def follow():
            for n in names:
                while not other.exists(f"/p/{n}"):
                    if made.is_set() and not other.exists(f"/p/{n}"):
                        failures.append(f"{n} never appeared")
                        return
                try:
                    other.create(f"/p/{n}/f")
                except OSError as e:
                    failures.append(f"{n}: {e!r}")

        threads = [threading.Thread(target=make), threading.Thread(target=follow)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:5]
        for n in names:
            assert maker.listdir(f"/p/{n}") == ["f"]
            assert maker.stat(f"/p/{n}").nlink == 2
        assert maker.stat("/p").nlink == 2 + len(names)
        _check_clean(maker)
    finally:
        maker.close()
        other.close()


def test_a_mkdir_answers_the_attributes_a_stat_then_finds(make_cluster):
    """A directory made on another shard is answered with the attributes its prepare will
    commit there (nobody asks that shard, which would wait for the commit): a stat right
    after finds the same ones, times to the nanosecond, and so does one after a restart."""
    d = make_cluster(meta_shards=2)
    c = jpfs.connect(d, dir_cache_ttl=0)
    try:
        c.mkdir("/q")
        pino = c.stat("/q").ino
        names = [_named_for(pino, s, 2, f"s{s}-") for s in (0, 1)]
        names += [f"x{i}" for i in range(30)]
        made = {n: c.mkdir(f"/q/{n}", 0o750) for n in names}
        assert {shard_of(a.ino) for a in made.values()} == {0, 1}
        for n, a in made.items():
            assert c.stat(f"/q/{n}") == a
            assert a.nlink == 2 and stat.S_ISDIR(a.mode)
    finally:
        c.close()
    localcluster.down(d)
    localcluster.up(d)
    with jpfs.connect(d, dir_cache_ttl=0) as c:
        for n, a in made.items():
            assert c.stat(f"/q/{n}") == a


def test_opposite_cross_shard_renames_do_not_deadlock(make_cluster):
    """Two clients at once: one renames a/xI over b/yI, the other b/yI over a/xI (shards 1 and
    2 coordinate one each). Each coordinator prepares the other shard first and applies its own
    ops in the decision; both may find their own key held by the other's prepare. The one that
    does aborts and plans again instead of waiting while it holds the other shard's locks (that
    wait would deadlock until the 30 s lock timeout)."""
    d = make_cluster(meta_shards=3)
    c1 = jpfs.connect(d, dir_cache_ttl=0)
    c2 = jpfs.connect(d, dir_cache_ttl=0)
    try:
        dirs = _dirs_on_shards(c1)
        a, b = dirs[1], dirs[2]
        rounds = 40
        for i in range(rounds):
            c1.create(f"/{a}/x{i}")
            c1.create(f"/{b}/y{i}")
        errors: list[str] = []
        slowest = [0.0]
        barrier = threading.Barrier(2)

        def churn(client, src, dst):
            for i in range(rounds):
                barrier.wait(60)
                t0 = time.monotonic()
                try:
                    client.rename(src.format(i), dst.format(i))
                except FileNotFoundError:
                    pass  # the other went first and took this source
                except OSError as e:
                    errors.append(repr(e))
                slowest[0] = max(slowest[0], time.monotonic() - t0)

        threads = [threading.Thread(target=churn, args=(c1, f"/{a}/x{{}}", f"/{b}/y{{}}")),
                   threading.Thread(target=churn, args=(c2, f"/{b}/y{{}}", f"/{a}/x{{}}"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:5]
        assert slowest[0] < 10.0, f"a rename took {slowest[0]:.1f} s (a deadlock timed out?)"
        for i in range(rounds):  # one file of each pair is left, once
            left = [p for p in (f"/{a}/x{i}", f"/{b}/y{i}") if c1.exists(p)]
            assert len(left) == 1, left
            assert c1.stat(left[0]).nlink == 1
        _check_clean(c1)
    finally:
        c1.close()
        c2.close()


@pytest.mark.parametrize("point", ["coordinator.intent", "coordinator.prepared_one",
                                   "coordinator.decided", "coordinator.committed",
                                   "coordinator.finished",
                                   "participant.prepared", "participant.committed"])
def test_kill_at_each_step_of_cross_shard_rmdir(make_cluster, point):
    """rmdir of a directory whose inode lives on another shard (answered once decided): a kill
    -9 of the shard at any step leaves the directory either there and usable or gone, its
    parent's link count right, fsck clean."""
    d = make_cluster(meta_shards=3)
    client = jpfs.connect(d, dir_cache_ttl=0)
    try:
        # a parent on shard 1 (the root's shard 0 stays up) and a child on shard 2
        parent = _named_for(1, 1, 3, "p")
        client.mkdir(f"/{parent}")
        pino = client.stat(f"/{parent}").ino
        child = _named_for(pino, 2, 3, "c")
        client.mkdir(f"/{parent}/{child}")
        # answered once decided: its shard commits it in the background, and a stat of it
        # waits for that, so the fault below meets the rmdir and not this commit
        client.stat(f"/{parent}/{child}")
        victim = 1 if point.startswith("coordinator") else 2
        localcluster.stop(d, "meta", victim)
        localcluster.start(d, "meta", victim, sync=False, env={"JPFS_FAULTS": point})
        t = threading.Thread(target=_swallow, args=(client.rmdir, f"/{parent}/{child}"))
        t.start()
        assert _wait_dead(d, "meta", victim), f"{point} was never reached"
        localcluster.up(d, sync=False)
        t.join(60)
        assert not t.is_alive()
        there = client.exists(f"/{parent}/{child}")
        if point in DECIDED:
            assert not there
        if there:
            client.create(f"/{parent}/{child}/f")  # a half-removed directory fails here
            assert client.listdir(f"/{parent}/{child}") == ["f"]
        assert client.stat(f"/{parent}").nlink == (3 if there else 2)
        _check_clean(client)
    finally:
        client.close()


@pytest.mark.slow
def test_a_prepared_record_its_coordinator_forgot_is_aborted_without_a_restart(make_cluster):
    """A participant holding a prepared record whose coordinator has no intent and runs no such
    transaction (its intent was lost, say to a power failure before the fsync) asks it again
    periodically, hears "unknown" and aborts: the locked name frees within seconds, without
    restarting anything, and a create waiting on it then succeeds."""
    d = make_cluster(meta_shards=2)
    client = jpfs.connect(d, dir_cache_ttl=0)
    try:
        name = _named_for(1, 1, 2, "d")
        client.mkdir(f"/{name}")
        dino = client.stat(f"/{name}").ino
        txid = os.urandom(16)
        # shard 1 prepares an entry for a transaction shard 0 never ran
        client.run(lambda ac: ac.meta.call(
            1, "tx_prepare", txid, 0, [["mkdent", dino, b"held", 12345, 0o100000, None]]))
        assert client.run(lambda ac: ac.meta.call(0, "tx_status", txid)) == "unknown"
        t0 = time.monotonic()
        client.create(f"/{name}/held")  # waits for the lock, then runs
        waited = time.monotonic() - t0
        assert waited < 25.0, waited
        assert client.listdir(f"/{name}") == ["held"]
        pending = client.run(lambda ac: ac.meta.pending(1))
        assert pending.prepared == []
        _check_clean(client)
    finally:
        client.close()


async def test_tx_status_says_active_for_a_transaction_still_running(tmp_path):
    """A participant's periodic check must not abort a transaction its coordinator is still
    running before any intent of it exists (presumed abort would otherwise abort it)."""
    from jpfs_daemon.meta.coordinator import Coordinator
    from jpfs_daemon.meta.store import Store

    store = Store(tmp_path / "s", 0, 2, sync=False)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.committer)
            coord = Coordinator(store, None)  # type: ignore[arg-type]
            txid = os.urandom(16)
            assert await coord.tx_status(txid) == "unknown"
            coord._active.add(txid)
            assert await coord.tx_status(txid) == "active"
            coord._done(txid)
            assert await coord.tx_status(txid) == "unknown"
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def test_fsck_finds_nothing_pending_after_a_burst_of_cross_shard_changes(make_cluster):
    """The background finishing (participants committed, intents dropped) leaves no intent or
    prepared record behind once the burst is over."""
    d = make_cluster(meta_shards=2, sync=True)
    client = jpfs.connect(d, dir_cache_ttl=0)
    try:
        client.mkdir("/q")
        for i in range(40):
            client.mkdir(f"/q/m{i}")
            client.create(f"/q/m{i}/f")
        for i in range(0, 40, 2):
            client.remove(f"/q/m{i}/f")
            client.rmdir(f"/q/m{i}")
        deadline = time.monotonic() + 10
        while True:
            pend = [client.run(lambda ac, s=s: ac.meta.pending(s)) for s in range(2)]
            if not any(p.intents or p.prepared for p in pend):
                break
            assert time.monotonic() < deadline, pend
            time.sleep(0.05)
        assert sorted(client.listdir("/q")) == sorted(f"m{i}" for i in range(1, 40, 2))
        report = client.run(lambda ac: fsck(ac.meta))
        assert report.clean, report.problems
    finally:
        client.close()
