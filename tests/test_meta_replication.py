"""Metadata shards with three copies on a real etcd: kill -9 a shard's leader again and again
while clients create, rename across shards and remove; nothing acknowledged is lost, nothing
is half-applied, fsck is clean and every copy agrees. A restarted old leader holding an entry
nobody acknowledged throws it away (a snapshot) and agrees with the new leader."""

from __future__ import annotations

import itertools
import shutil
import signal
import threading
import time
from pathlib import Path

import lmdb
import pytest
import repl_support as rs
import trio

import jpfs
from jpfs import localcluster
from jpfs.client.tools.fsck import fsck
from jpfs.errors import JPFSError
from jpfs.placement import new_dir_shard
from jpfs.proto import replica as R

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow]

COPIES = 3


def _up(d: Path, shards: int = 2, extra: list[str] | None = None):
    return localcluster.up(d, meta_shards=shards, storage_nodes=1, etcd=True,
                           meta_replicas=COPIES, extra_args={"meta": extra or []})


def _statuses(client, shard: int) -> list[R.ReplStatus | None]:
    """Every copy's replication status (None for a copy that does not answer)."""
    async def ask(ac):
        pool = ac.meta.pool.pools[shard]
        out: list[R.ReplStatus | None] = []
        for j in range(len(pool)):
            try:
                out.append(await rs.repl_status(pool, j, shard, timeout=2.0))
            except JPFSError:
                out.append(None)
        return out
    return client.run(ask)


def _leader(client, shard: int, timeout: float = 30.0) -> int:
    """The copy that leads ``shard`` and answers clients."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in _statuses(client, shard):
            if s is not None and s.role == "leader":
                return s.replica
        time.sleep(0.1)
    raise AssertionError(f"shard {shard} elected no leader within {timeout} s")


def _wait_agree(client, shard: int, timeout: float = 30.0) -> list[R.ReplStatus]:
    """Wait until every copy of ``shard`` is at the leader's position."""
    deadline = time.monotonic() + timeout
    while True:
        got = _statuses(client, shard)
        live = [s for s in got if s is not None]
        if (len(live) == COPIES and len({(s.term, s.seq) for s in live}) == 1
                and not any(s.resyncing for s in live)):
            return live
        if time.monotonic() > deadline:
            raise AssertionError(f"copies of shard {shard} disagree: {got}")
        time.sleep(0.1)


def _dump(path: Path) -> dict:
    """Every record of one copy's LMDB environment (read with the daemon stopped)."""
    env = lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    out: dict = {}
    with env.begin() as t:
        for name, _ in t.cursor():
            db = env.open_db(bytes(name), txn=t, create=False)
            out[bytes(name)] = {bytes(k): bytes(v) for k, v in t.cursor(db=db)}
    env.close()
    return out


def _dirs_on_shards(client, shards: int) -> dict[int, str]:
    root = client.stat("/").ino
    out: dict[int, str] = {}
    for i in itertools.count():
        out.setdefault(new_dir_shard(root, f"d{i}".encode(), shards), f"d{i}")
        if len(out) == shards:
            break
    for name in out.values():
        client.mkdir(f"/{name}")
    return out


def test_killing_shard_leaders_loses_nothing(tmp_path):
    c = _up(tmp_path)
    client = jpfs.connect(c)
    try:
        dirs = _dirs_on_shards(client, 2)
        a, b = dirs[0], dirs[1]
        stop = threading.Event()
        lock = threading.Lock()
        expect: dict[str, str | None] = {}  # name -> the directory it is in (None: removed)
        errors: list[str] = []
        slowest = [0.0]

        def worker(w: int) -> None:
            wc = jpfs.connect(c)
            try:
                for n in itertools.count():
                    if stop.is_set():
                        return
                    name = f"w{w}-{n}"
                    try:
                        t0 = time.monotonic()
                        wc.write_bytes(f"/{a}/{name}", name.encode())
                        with lock:
                            expect[name] = a
                        if n % 3 == 0:  # across shards: two-phase commit
                            wc.rename(f"/{a}/{name}", f"/{b}/{name}")
                            with lock:
                                expect[name] = b
                        if n % 5 == 0:
                            wc.remove(f"/{expect[name]}/{name}")
                            with lock:
                                expect[name] = None
                        slowest[0] = max(slowest[0], time.monotonic() - t0)
                    except OSError as e:
                        with lock:
                            errors.append(f"{name}: {e}")
                            expect.pop(name, None)  # its outcome is unknown: not checked
            finally:
                wc.close()

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        try:
            for kill in range(5):
                time.sleep(0.5)
                shard = kill % 2
                victim = _leader(client, shard)
                localcluster.stop(tmp_path, "meta", shard, sig=signal.SIGKILL, replica=victim)
                new = _leader(client, shard)
                assert new != victim
                localcluster.start(tmp_path, "meta", shard, replica=victim)
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        print(f"{len(expect)} operations checked, slowest {slowest[0]:.2f} s, errors {errors}")
        assert not errors
        assert len(expect) > 20
        for name, where in expect.items():
            found = [d for d in (a, b) if client.exists(f"/{d}/{name}")]
            assert found == ([where] if where else []), name
            if where:
                assert client.read_bytes(f"/{where}/{name}") == name.encode()
        report = client.run(lambda ac: fsck(ac.meta))
        assert report.clean, report.problems
        for shard in range(2):
            _wait_agree(client, shard)
    finally:
        client.close()
        localcluster.down(tmp_path)


def test_old_leader_with_an_unacknowledged_entry_resyncs(tmp_path):
    c = _up(tmp_path, shards=1, extra=["--stall-timeout", "3"])
    client = jpfs.connect(c)
    try:
        client.mkdir("/d")
        client.write_bytes("/d/kept", b"acknowledged")
        old = _leader(client, 0)
        followers = [j for j in range(COPIES) if j != old]
        for j in followers:
            localcluster.stop(tmp_path, "meta", 0, sig=signal.SIGKILL, replica=j)

        async def create_unacknowledged(ac):
            d = (await ac.meta.lookup(1, b"d")).ino
            with trio.fail_after(60):
                try:
                    await ac.meta.create(d, b"lost", 0o644)
                except TimeoutError as e:
                    return e.strerror
            return "acknowledged"

        # no majority: never acknowledged; after --stall-timeout an error says why
        assert "did not confirm" in client.run(create_unacknowledged)

        async def look(ac):
            try:
                d = (await ac.meta.lookup(1, b"d")).ino
                return await ac.meta.lookup(d, b"lost")
            except OSError as e:
                return e.strerror

        # the leader holds the entry, but no reader is shown what a failover may drop: with
        # no majority it answers no read at all
        assert "did not confirm" in client.run(look)
        localcluster.stop(tmp_path, "meta", 0, sig=signal.SIGKILL, replica=old)
        for j in followers:
            localcluster.start(tmp_path, "meta", 0, replica=j)
        new = _leader(client, 0)
        assert new in followers
        client.write_bytes("/d/after", b"new leader")
        localcluster.start(tmp_path, "meta", 0, replica=old)
        _wait_agree(client, 0)
        assert sorted(client.listdir("/d")) == ["after", "kept"]
        assert client.read_bytes("/d/kept") == b"acknowledged"
        report = client.run(lambda ac: fsck(ac.meta))
        assert report.clean, report.problems
    finally:
        client.close()
        localcluster.down(tmp_path)
    cluster = c
    dumps = [_dump(cluster.data_dir("meta", 0, j)) for j in range(COPIES)]
    assert dumps[0] == dumps[1] == dumps[2]
