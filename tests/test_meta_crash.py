"""Crash safety of cross-shard operations: kill -9 a shard at every step of two-phase commit
(and at random moments), restart it, and check that fsck finds the namespace clean and that
every operation either happened entirely or not at all."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

import jpfs
from jpfs import localcluster
from jpfs.client.tools.fsck import fsck
from jpfs.placement import new_dir_shard, shard_of


def _dirs_on_shards(client, parent="/", shards=3) -> dict[int, str]:
    pino = client.stat(parent).ino
    out: dict[int, str] = {}
    for i in itertools.count():
        name = f"s{i}"
        out.setdefault(new_dir_shard(pino, name.encode(), shards), name)
        if len(out) == shards:
            break
    for name in out.values():
        client.mkdir(f"/{name}")
    return out


def _wait_dead(d, role, index, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(x.alive for x in localcluster.status(d) if (x.role, x.index) == (role, index)):
            return True
        time.sleep(0.02)
    return False


def _check_clean(client) -> None:
    report = client.run(lambda ac: fsck(ac.meta))
    assert report.clean, report.problems


def _where(client, dirs, name) -> list[str]:
    return [d for d in dirs if client.exists(f"/{d}/{name}")]


POINTS = [
    # (fault point, which shard dies: the coordinator or a participant)
    ("coordinator.intent", "coordinator"),
    ("coordinator.prepared_one", "coordinator"),
    ("coordinator.decided", "coordinator"),
    ("coordinator.committed", "coordinator"),
    ("coordinator.finished", "coordinator"),
    ("participant.prepared", "participant"),
    ("participant.committed", "participant"),
]


DECIDED = ("coordinator.decided", "coordinator.committed", "coordinator.finished",
           "participant.committed")
"""Points past the commit point: the change must be there after the restart."""


@pytest.mark.parametrize("point,who", POINTS)
def test_kill_at_each_step_of_cross_shard_rename(make_cluster, point, who):
    d = make_cluster(meta_shards=3)
    client = jpfs.connect(d, dir_cache_ttl=0)
    try:
        dirs = _dirs_on_shards(client)
        src_dir, dst_dir = dirs[0], dirs[1]
        client.create(f"/{src_dir}/f")
        ino = client.stat(f"/{src_dir}/f").ino
        # the source directory's shard coordinates; the destination's participates
        victim = shard_of(client.stat(f"/{src_dir}").ino) if who == "coordinator" \
            else shard_of(client.stat(f"/{dst_dir}").ino)
        localcluster.stop(d, "meta", victim)
        localcluster.start(d, "meta", victim, sync=False, env={"JPFS_FAULTS": point})

        outcome: list = []

        def move():
            try:
                client.rename(f"/{src_dir}/f", f"/{dst_dir}/f")
                outcome.append("ok")
            except OSError as e:
                outcome.append(e)

        t = threading.Thread(target=move)
        t.start()
        assert _wait_dead(d, "meta", victim), f"{point} was never reached"
        localcluster.up(d, sync=False)  # restart it on its data, without the fault
        t.join(60)
        assert not t.is_alive()
        # readers wait out the unfinished transaction instead of seeing half of it
        where = _where(client, [src_dir, dst_dir], "f")
        assert len(where) == 1, where
        assert client.stat(f"/{where[0]}/f").ino == ino
        assert client.stat(f"/{where[0]}/f").nlink == 1
        if outcome == ["ok"]:
            assert where == [dst_dir]
        if point in DECIDED:
            assert where == [dst_dir]  # decided before the crash: must be applied
        _check_clean(client)
    finally:
        client.close()


@pytest.mark.parametrize("point", ["coordinator.intent", "coordinator.prepared_one",
                                   "coordinator.decided", "coordinator.committed",
                                   "coordinator.finished"])
def test_kill_during_cross_shard_mkdir(make_cluster, point):
    d = make_cluster(meta_shards=3)
    client = jpfs.connect(d, dir_cache_ttl=0)
    try:
        # a name under / whose directory inode is placed on another shard than the root's
        name = next(f"x{i}" for i in itertools.count()
                    if new_dir_shard(1, f"x{i}".encode(), 3) != 0)
        localcluster.stop(d, "meta", 0)
        localcluster.start(d, "meta", 0, sync=False, env={"JPFS_FAULTS": point})
        t = threading.Thread(target=lambda: _swallow(client.mkdir, f"/{name}"))
        t.start()
        assert _wait_dead(d, "meta", 0)
        localcluster.up(d, sync=False)
        t.join(60)
        if client.exists(f"/{name}"):
            client.mkdir(f"/{name}/inner")  # a half-made directory would fail here
            assert client.listdir(f"/{name}") == ["inner"]
        if point in DECIDED:
            assert client.exists(f"/{name}")
        _check_clean(client)
    finally:
        client.close()


def _swallow(fn, *args):
    try:
        fn(*args)
    except OSError:
        pass


@pytest.mark.slow
def test_random_kills_during_cross_shard_work(make_cluster):
    """Rename files around three shards and make directories while shards are killed at random
    moments; after every restart fsck is clean and nothing is lost or doubled."""
    d = make_cluster(meta_shards=3)
    rng = random.Random(1234)
    client = jpfs.connect(d, dir_cache_ttl=0)
    try:
        dirs = list(_dirs_on_shards(client).values())
        files = [f"f{i}" for i in range(6)]
        for f in files:
            client.create(f"/{dirs[0]}/{f}")
        made: set[str] = set()
        for round_ in range(8):
            stop = threading.Event()

            def work(seed=round_, stop=stop):
                r = random.Random(seed)
                n = 0
                while not stop.is_set() and n < 200:
                    n += 1
                    f = r.choice(files)
                    try:  # a killed shard refuses at once: the worker carries on past it
                        here = [x for x in dirs if client.exists(f"/{x}/{f}")]
                        if r.random() < 0.2:
                            name = f"m{seed}-{n}"
                            made.add(name)
                            client.mkdir(f"/{r.choice(dirs)}/{name}")
                        elif here:
                            client.rename(f"/{here[0]}/{f}", f"/{r.choice(dirs)}/{f}")
                    except OSError:
                        pass

            t = threading.Thread(target=work)
            t.start()
            time.sleep(rng.uniform(0.05, 0.4))
            localcluster.kill(d, "meta", rng.randrange(3))
            time.sleep(rng.uniform(0.0, 0.3))
            localcluster.up(d, sync=False)
            stop.set()
            t.join(120)
            assert not t.is_alive()
            for f in files:
                assert len(_where(client, dirs, f)) == 1, f"round {round_}: {f}"
            _check_clean(client)
    finally:
        client.close()


def test_a_create_waits_out_a_prepared_change_then_succeeds(make_cluster):
    """A write that meets a name held by a prepared cross-shard change waits for the change to
    resolve, then runs (and is answered) instead of failing or seeing half of it."""
    d = make_cluster(meta_shards=3)
    client = jpfs.connect(d, dir_cache_ttl=0)
    other = jpfs.connect(d, dir_cache_ttl=0)
    try:
        dirs = _dirs_on_shards(client)
        src_dir, dst_dir = dirs[1], dirs[2]  # the root's shard (0) stays up for lookups
        ino = client.create(f"/{src_dir}/f").ino
        localcluster.stop(d, "meta", 1)
        # the coordinator dies once the destination prepared (the coordinator's own ops run in
        # the decision, never prepared): the destination holds dst/f
        localcluster.start(d, "meta", 1, sync=False,
                           env={"JPFS_FAULTS": "coordinator.prepared_one"})
        mover = threading.Thread(target=lambda: _swallow(client.rename, f"/{src_dir}/f",
                                                         f"/{dst_dir}/f"))
        mover.start()
        assert _wait_dead(d, "meta", 1), "the coordinator never reached the fault point"
        outcome: list = []

        def create():
            try:
                outcome.append(other.create(f"/{dst_dir}/f", exclusive=False))
            except OSError as e:
                outcome.append(e)

        writer = threading.Thread(target=create)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive() and not outcome, f"did not wait for the prepared change: {outcome}"
        localcluster.up(d, sync=False)  # the coordinator's restart resolves the change
        writer.join(60)
        mover.join(60)
        assert outcome and not isinstance(outcome[0], OSError), outcome
        # either the move was undone (presumed abort) and the create made a new file, or the
        # move happened first and the create found the moved file: never half of either
        got = outcome[0].ino
        if got == ino:
            assert _where(client, [src_dir, dst_dir], "f") == [dst_dir]
        else:
            assert client.stat(f"/{src_dir}/f").ino == ino
            assert client.stat(f"/{dst_dir}/f").ino == got
        _check_clean(client)
    finally:
        client.close()
        other.close()
