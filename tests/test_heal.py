"""Storage that heals and grows: real daemons, a real etcd, real volume files, no mocks.

Each test runs a small etcd-backed cluster (3 storage nodes, replicas 2 unless it grows), stores
files, changes the cluster the way an operator would (`jpfs node remove|drain|add`, a killed
daemon, a flipped byte in a volume) and checks what a user would: every file reads back
byte-identical, nothing fails meanwhile, the map and the chunk records end as promised.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import jpfs
from jpfs import config, localcluster
from jpfs.cli.main import main as cli
from jpfs.client.tools import scrub
from jpfs.proto.heal import HealStatus

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow]

CHUNK = 256 << 10
HEAL = ["--heal-interval", "0.5"]
DEADLINE = 120.0


@pytest.fixture
def cluster_dir(tmp_path):
    d = tmp_path / "c"
    yield d
    localcluster.down(d)


def up(d: Path, nodes: int = 3, replicas: int = 2, storage_args: list[str] | None = None,
       meta_replicas: int = 1, metrics: bool = False) -> config.Cluster:
    return localcluster.up(d, etcd=True, meta_shards=2, storage_nodes=nodes, replicas=replicas,
                           chunk_size=CHUNK, sync=False, meta_replicas=meta_replicas,
                           metrics=metrics,
                           extra_args={"meta": HEAL, "storage": storage_args or []})


def write_files(c: jpfs.Client, top: str, n: int, seed: int = 0) -> dict[str, bytes]:
    """``n`` files over two directories: one-chunk files and files of several chunks."""
    rnd = random.Random(seed)
    files = {}
    for i in range(n):
        path = f"{top}/{'ab'[i % 2]}/f{i:03d}"
        files[path] = rnd.randbytes(rnd.choice((1000, 60_000, CHUNK + 5, 3 * CHUNK - 7)))
    for d in {p.rsplit("/", 1)[0] for p in files}:
        c.makedirs(d, exist_ok=True)
    for path, data in files.items():
        c.write_bytes(path, data)
    return files


def chunk_records(c: jpfs.Client) -> list[tuple[int, int, bytes, list[int]]]:
    """Every chunk record of every shard: (ino, index, blob, nodes)."""
    async def all_shards(ac):
        out = []
        for shard in range(ac.meta.n_shards):
            after = b""
            while True:
                items, nxt = await ac.meta.call(shard, "scan", "chunk", after, 5000)
                out += [tuple(x) for x in items]
                if nxt is None:
                    break
                after = nxt
        return out

    return c.run(all_shards)


def heal(c: jpfs.Client) -> list[HealStatus | scrub.NoAnswer]:
    return c.run(scrub.heal_status)


def wait_healed(c: jpfs.Client, epoch: int, *, gone: int | None = None,
                timeout: float = DEADLINE) -> list[HealStatus]:
    """Until every shard finished a round that began at map ``epoch`` or later with nothing
    under-replicated (and no chunk naming node ``gone``)."""
    give_up = time.monotonic() + timeout
    while True:
        s = heal(c)
        ok = [x for x in scrub.answered(s) if not x.error]
        if len(ok) == len(s) and all(
                x.round_epoch >= epoch and x.under_replicated == 0 and x.unrepairable == 0
                and x.pending == 0 and (gone is None or not x.node_chunks.get(gone))
                for x in ok):
            return ok
        if time.monotonic() > give_up:
            raise AssertionError(f"not healed within {timeout:.0f} s: {s}")
        time.sleep(0.25)


def copies_status(cl: config.Cluster) -> list[list[HealStatus]]:
    """``heal_status`` of every copy of every shard, asked of each copy itself."""
    import trio

    from jpfs.proto import heal as H
    from jpfs.rpc import Pool

    async def ask() -> list[list[HealStatus]]:
        out = []
        async with trio.open_nursery() as nursery:
            for copies in cl.meta_replicas:
                pool = Pool(nursery, [s.address for s in copies], cl.secret, role="meta")
                out.append([H.HEAL_STATUS.decode(await pool.call(j, H.HEAL_STATUS,
                                                                 H.HealNoArgs()))
                            for j in range(len(copies))])
                pool.close()
        return out

    return trio.run(ask)


def epoch_of(d: Path) -> int:
    return config.load(localcluster.cluster_file(d)).epoch


def read_all(c: jpfs.Client, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert c.read_bytes(path) == data, path


class Loop(threading.Thread):
    """Runs ``step`` until stopped; remembers the first failure (the test re-raises it)."""

    def __init__(self, step):
        super().__init__(daemon=True)
        self.step = step
        self.stop = threading.Event()
        self.failure: BaseException | None = None
        self.rounds = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - the test re-raises it
                self.failure = e
                return
            self.rounds += 1

    def finish(self) -> int:
        self.stop.set()
        self.join(60)
        if self.failure is not None:
            raise self.failure
        return self.rounds


# ------------------------------------------------------------------------------------------


def test_remove_a_lost_node_restores_copies_then_another_loss_loses_nothing(cluster_dir):
    d = cluster_dir
    cl = up(d, meta_replicas=3)  # each shard's leader heals; its two followers do not
    path = str(localcluster.cluster_file(d))
    c = jpfs.connect(cl)
    try:
        files = write_files(c, "/data", 24)
        assert all(len(set(r[3])) == 2 for r in chunk_records(c))
        assert localcluster.kill(d, "storage", 1)
        # counted once node 1 is down: until then the rebalancer may move a chunk off it
        lost = sum(1 in r[3] for r in chunk_records(c))
        assert cli(["--cluster", path, "node", "remove", "1"]) == 0
        assert config.load(path).storage[1].state == "removed"
        status = wait_healed(c, epoch_of(d), gone=1)
        assert all(x.leader for x in status)
        copies = copies_status(config.load(path))
        for shard, answers in enumerate(copies):  # one copy heals, the others only follow
            leaders = [a for a in answers if a.leader]
            assert len(answers) == 3 and len(leaders) == 1, (shard, answers)
            assert all(a.state == "follower" and a.repaired_chunks == 0
                       for a in answers if not a.leader), answers
        # a move of node 1's copy that was under way when it died ends as a move, not a repair
        assert sum(x.repaired_chunks + x.moved_chunks for x in status) >= lost
        after = chunk_records(c)
        assert all(1 not in r[3] and len(set(r[3])) == 2 for r in after)
        assert localcluster.kill(d, "storage", 0)  # a second loss: every chunk has a copy on 2
        read_all(c, files)
    finally:
        c.close()


def test_drain_while_reading_ends_removed_and_no_chunk_names_the_node(cluster_dir, capsys):
    d = cluster_dir
    cl = up(d)
    path = str(localcluster.cluster_file(d))
    c = jpfs.connect(cl)
    reader_client = jpfs.connect(path)
    try:
        files = write_files(c, "/ds", 24, seed=1)
        assert any(2 in r[3] for r in chunk_records(c))
        reader = Loop(lambda: read_all(reader_client, files))
        reader.start()
        assert cli(["--cluster", path, "node", "drain", "2", "--wait", "--timeout",
                    str(DEADLINE)]) == 0
        assert "removed" in capsys.readouterr().out
        assert reader.finish() > 0
        assert config.load(path).storage[2].state == "removed"
        records = chunk_records(c)
        assert records and all(2 not in r[3] and len(set(r[3])) == 2 for r in records)
        localcluster.kill(d, "storage", 2)  # the drained node's daemon can go now
        read_all(c, files)
        assert cli(["--cluster", path, "node", "list"]) == 0
        out = capsys.readouterr().out
        assert "storage-2" in out and "removed" in out
        # what an operator is told when a change would be wrong
        assert cli(["--cluster", path, "node", "drain", "9"]) == 1
        assert "no storage node 9" in capsys.readouterr().err
        assert cli(["--cluster", path, "node", "remove", "2"]) == 1
        assert "removed already" in capsys.readouterr().err
        assert cli(["--cluster", path, "node", "remove", "0"]) == 1  # 1 left for replicas 2
        assert "add a node first" in capsys.readouterr().err
        assert config.load(path).storage[0].state == "active"
    finally:
        reader_client.close()
        c.close()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_a_corrupt_byte_is_found_by_the_scrubber_and_healed_without_a_command(cluster_dir):
    d = cluster_dir
    cl = up(d, storage_args=["--scrub-rate", "1GiB", "--scrub-pause", "3600"])
    c = jpfs.connect(cl)
    try:
        needle = os.urandom(50_000)
        c.makedirs("/x")
        c.write_bytes("/x/victim", needle)
        (_, _, _, nodes), = chunk_records(c)
        node = nodes[0]
        vol = next(v for v in sorted((d / f"storage-{node}" / "volumes").iterdir())
                   if needle in v.read_bytes())
        _flip(vol, vol.read_bytes().find(needle) + 1234)
        before = c.run(scrub.status)[node]["repaired"]
        c.run(scrub.start, [node])
        give_up = time.monotonic() + DEADLINE
        while True:  # found by the scrubber, then repaired by the healer: nobody runs repair
            s = c.run(scrub.status)[node]
            if s["bad_found"] >= 1 and s["bad_blobs"] == 0 and s["repaired"] > before:
                break
            assert time.monotonic() < give_up, s
            time.sleep(0.25)
        assert needle in vol.read_bytes() or any(
            needle in v.read_bytes() for v in (d / f"storage-{node}" / "volumes").iterdir())
        localcluster.kill(d, "storage", nodes[1])  # the repaired copy alone serves the file
        assert c.read_bytes("/x/victim") == needle
        assert sum(x.repaired_chunks for x in scrub.answered(heal(c))) >= 1
    finally:
        c.close()


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_grow_from_two_to_three_nodes_while_reading_and_writing(cluster_dir, capsys):
    d = cluster_dir
    cl = up(d, nodes=2, replicas=2)
    path = str(localcluster.cluster_file(d))
    c = jpfs.connect(cl)
    rw = jpfs.connect(path)
    try:
        files = write_files(c, "/old", 40, seed=2)
        written: dict[str, bytes] = {}
        when: dict[str, float] = {}
        counter = iter(range(10**6))
        for k in range(8):
            rw.makedirs(f"/new/d{k}")

        def write_one() -> None:
            k = next(counter)
            data = os.urandom((40_000, 90_000, 2 * CHUNK + 11)[k % 3])
            path = f"/new/d{k % 8}/g{k:05d}"  # directories spread their small files' runs
            when[path] = time.monotonic()
            rw.write_bytes(path, data)
            written[path] = data
            time.sleep(0.01)

        reader = Loop(lambda: read_all(rw, files))
        writer = Loop(write_one)
        reader.start()
        writer.start()
        time.sleep(0.5)
        assert cli(["--cluster", path, "node", "add", _free_address()]) == 0
        assert "storage-2 added" in capsys.readouterr().out
        localcluster.start(d, "storage", 2)
        # a write that met the node before its daemon listened avoids it for a few seconds
        settled = time.monotonic() + 4.0
        give_up = time.monotonic() + DEADLINE
        while sum(t > settled for t in list(when.values())) < 40:
            assert time.monotonic() < give_up and writer.is_alive(), writer.failure
            time.sleep(0.1)
        writer.finish()
        reader.finish()
        # new writes land on the new node
        by_ino: dict[int, set[int]] = {}
        for ino, _index, _blob, nodes in chunk_records(c):
            by_ino.setdefault(ino, set()).update(nodes)
        late = [c.stat(p).ino for p, t in when.items() if t > settled and p in written]
        assert sum(2 in by_ino[i] for i in late) >= len(late) // 3, (len(late), by_ino)
        # usage evens out within the healers' bound: max - min <= max(10% of mean, 2 chunks)
        give_up = time.monotonic() + DEADLINE
        while True:
            used = [c.run(lambda ac, n=n: ac.storage.stats(n)).live_bytes for n in range(3)]
            mean = sum(used) / 3
            if max(used) - min(used) <= max(0.1 * mean, 2 * CHUNK) + CHUNK:
                break
            assert time.monotonic() < give_up, used
            time.sleep(0.5)
        read_all(c, files)
        read_all(c, written)
    finally:
        rw.close()
        c.close()


def test_a_read_that_fails_its_checksum_is_reported_and_the_copy_healed(cluster_dir):
    d = cluster_dir
    cl = up(d, storage_args=["--scrub-rate", "0"], metrics=True)  # no scrubber: a reader tells
    c = jpfs.connect(cl)
    try:
        needle = os.urandom(70_000)
        c.makedirs("/y")
        c.write_bytes("/y/victim", needle)
        (_, _, _, nodes), = chunk_records(c)
        first = nodes[0]  # the replica a reader asks first
        vol = next(v for v in sorted((d / f"storage-{first}" / "volumes").iterdir())
                   if needle in v.read_bytes())
        _flip(vol, vol.read_bytes().find(needle) + 999)
        give_up = time.monotonic() + DEADLINE

        def reports() -> int:
            return c.run(lambda ac: ac.storage.stats(first)).reports_bad

        # A fresh client (nothing cached) reads the first recorded copy first, finds it bad and
        # reports it; on a loaded host it may instead give up on that node within its read
        # grace (0.2 s) and read the other copy without seeing the bad one (no report: the
        # scrubber, off here, would find it). Read again until the node has the report.
        while True:
            fresh = jpfs.connect(localcluster.cluster_file(d), first_copy=0)
            try:
                assert fresh.read_bytes("/y/victim") == needle  # from the other replica
            finally:
                fresh.close()  # (waits for its reports to be answered)
            if reports() >= 1:
                break
            if time.monotonic() > give_up:
                raise AssertionError(f"no read reported the bad copy to node {first} within "
                                     f"{DEADLINE:.0f} s")
        while True:  # the node re-verified the reported blob, marked it, the healer fixed it
            s = c.run(scrub.status)[first]
            if s["repaired"] >= 1 and s["bad_blobs"] == 0:
                break
            if time.monotonic() > give_up:
                raise AssertionError(
                    f"storage node {first}'s copy not healed within {DEADLINE:.0f} s: "
                    f"repaired {s.get('repaired')}, bad_blobs {s.get('bad_blobs')}, "
                    f"bad_found {s.get('bad_found')} ({s}); healers: {heal(c)}")
            time.sleep(0.25)
        localcluster.kill(d, "storage", nodes[1])
        assert c.read_bytes("/y/victim") == needle
        # Prometheus sees the healer's figures (summed over the shards)
        repaired = 0.0
        for shard in cl.meta:
            text = urllib.request.urlopen(f"http://{shard.metrics}/metrics", timeout=10).read()
            for line in text.decode().splitlines():
                if line.startswith("jpfs_meta_heal_repaired_chunks_total{"):
                    repaired += float(line.rsplit(" ", 1)[1])
        assert repaired >= 1
    finally:
        c.close()
