"""Fast, clear failure with a daemon down: real daemons, killed with SIGKILL; no mocks.

The bounds below (``BOUND``) are deadlines, which are behaviour, not speed: before this work
each of these cases waited out a 10-15 s retry window on a refused connection. A refused
connection is now answered at once and a silent peer within ``peer_timeout`` (1.5 s by
default); the bounds are generous (several times what is measured on an idle machine) so a
loaded 2-core machine does not make them flaky, and still far below the old waits.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time

import pytest
import trio

import jpfs
from jpfs import config, localcluster
from jpfs.cli.main import main
from jpfs.errors import Unavailable
from jpfs.placement import shard_of
from jpfs.rpc import Pool, Silent

BOUND = 5.0
"""Seconds within which a call to a dead daemon must have failed (see the module docstring)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 shards, 2 storage nodes, replicas 1: every file has one copy, on one node."""
    d = tmp_path_factory.mktemp("failure")
    localcluster.up(d, meta_shards=2, storage_nodes=2, replicas=1, sync=False)
    yield d
    localcluster.down(d, timeout=5)


def _dir_on_shard(c, shard: int, prefix: str, parent: str = "") -> str:
    for i in range(200):
        name = f"{parent}/{prefix}{i}"
        c.mkdir(name)
        if shard_of(c.stat(name).ino) == shard:
            return name
    raise AssertionError("no directory landed on the shard")


def _files_by_node(c, top: str, n: int) -> dict[int, list[str]]:
    """``n`` one-chunk files under ``top``, each in its own directory, grouped by the node
    holding their only copy."""
    by: dict[int, list[str]] = {}
    for i in range(n):
        c.makedirs(f"{top}/s{i}")
        c.write_bytes(f"{top}/s{i}/f", os.urandom(100 + i))
        by.setdefault(c.layout(f"{top}/s{i}/f").chunks[0].nodes[0], []).append(f"{top}/s{i}/f")
    return by


def _cli(capsys, *argv: str) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    rc = main(list(argv))
    secs = time.monotonic() - t0
    out = capsys.readouterr()
    return rc, out.out, out.err, secs


def test_ls_and_du_of_a_directory_on_a_dead_shard_fail_at_once(cluster, capsys):
    with jpfs.connect(cluster) as c:
        d = _dir_on_shard(c, 1, "ls")
        c.write_bytes(f"{d}/x", b"x")
    addr = config.load(cluster).meta[1].address
    localcluster.stop(cluster, "meta", 1, sig=signal.SIGKILL)
    try:
        for cmd in ("ls", "du"):
            rc, _, err, secs = _cli(capsys, "--cluster", str(cluster), cmd, f"jpfs:{d}")
            assert rc == 1 and secs < BOUND, (cmd, secs, err)
            assert f"jpfs {cmd}: jpfs:{d}: metadata shard 1 ({addr}) refused" in err, err
            assert "jpfs cluster status" in err
    finally:
        localcluster.start(cluster, "meta", 1, sync=False)
    rc, out, _, _ = _cli(capsys, "--cluster", str(cluster), "ls", f"jpfs:{d}")
    assert rc == 0 and out.split() == ["x"]


def test_cat_of_a_file_on_a_dead_node_names_the_path_and_the_node(cluster, capsys):
    with jpfs.connect(cluster) as c:
        by = _files_by_node(c, "/cat", 12)
    assert set(by) == {0, 1}, by  # directories spread their files over both nodes
    victim = by[1][0]
    addr = config.load(cluster).storage[1].address
    localcluster.stop(cluster, "storage", 1, sig=signal.SIGKILL)
    try:
        rc, _, err, secs = _cli(capsys, "--cluster", str(cluster), "cat", f"jpfs:{victim}")
        assert rc == 1 and secs < BOUND, (secs, err)
        assert f"jpfs cat: jpfs:{victim}: chunk 0: storage node 1 ({addr}) refused" in err, err
        assert "no other replica holds it" in err and "jpfs cluster status" in err
        with jpfs.connect(cluster) as c:  # the path API names the path too
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                c.read_bytes(victim)
            assert time.monotonic() - t0 < BOUND
            assert isinstance(e.value, Unavailable) and e.value.filename == victim
            assert c.read_bytes(by[0][0])  # files on the live node still read
    finally:
        localcluster.start(cluster, "storage", 1, sync=False)


def test_export_copies_the_rest_lists_the_failure_and_a_rerun_finishes(cluster, capsys,
                                                                       tmp_path):
    with jpfs.connect(cluster) as c:
        by = _files_by_node(c, "/exp", 12)
        dead_dir = _dir_on_shard(c, 1, "expd")
        c.rename(dead_dir, "/exp/sub")  # a directory whose entries live on shard 1
        c.write_bytes("/exp/sub/g", b"g")
    assert by.get(1) and by.get(0)
    out = tmp_path / "out"
    localcluster.stop(cluster, "storage", 1, sig=signal.SIGKILL)
    try:
        rc, _, err, secs = _cli(capsys, "--cluster", str(cluster), "export", "--no-progress",
                                "jpfs:/exp", str(out))
        assert rc == 1 and secs < 4 * BOUND, (secs, err)
        for p in by[1]:
            assert f"error: jpfs:{p}: chunk 0: storage node 1" in err, err
            assert not (out / os.path.relpath(p, "/exp")).exists()
        for p in by[0]:
            assert (out / os.path.relpath(p, "/exp")).exists()
        assert "rerun the same command" in err
    finally:
        localcluster.start(cluster, "storage", 1, sync=False)
    rc, _, err, _ = _cli(capsys, "--cluster", str(cluster), "export", "--no-progress",
                         "jpfs:/exp", str(out))
    assert rc == 0, err
    with jpfs.connect(cluster) as c:
        for p in by[0] + by[1] + ["/exp/sub/g"]:
            assert (out / os.path.relpath(p, "/exp")).read_bytes() == c.read_bytes(p)


def test_export_goes_on_past_a_directory_on_a_dead_shard(cluster, capsys, tmp_path):
    # top (shard 0) holds a file and sub (shard 0), which holds deep (shard 1): listing sub
    # needs shard 1 (deep's attributes), listing top does not
    with jpfs.connect(cluster) as c:
        top = _dir_on_shard(c, 0, "exq")
        c.write_bytes(f"{top}/a", b"a")
        sub = _dir_on_shard(c, 0, "sub", top)
        deep = _dir_on_shard(c, 1, "deep", sub)
        c.write_bytes(f"{deep}/b", b"b")
    out = tmp_path / "out"
    localcluster.stop(cluster, "meta", 1, sig=signal.SIGKILL)
    try:
        rc, _, err, _ = _cli(capsys, "--cluster", str(cluster), "export", "--no-progress",
                             f"jpfs:{top}", str(out))
        assert rc == 1 and f"error: jpfs:{sub}: metadata shard 1" in err, err
        assert (out / "a").read_bytes() == b"a"
    finally:
        localcluster.start(cluster, "meta", 1, sync=False)
    rc, _, err, _ = _cli(capsys, "--cluster", str(cluster), "export", "--no-progress",
                         f"jpfs:{top}", str(out))
    assert rc == 0, err
    assert (out / os.path.relpath(deep, top) / "b").read_bytes() == b"b"


def test_replicas_two_reads_fail_over_to_the_live_node(make_cluster):
    d = make_cluster(meta_shards=1, storage_nodes=2, replicas=2)
    files = {f"/r/f{i}": os.urandom(1000 + i) for i in range(10)}
    with jpfs.connect(d) as c:
        c.makedirs("/r")
        for p, b in files.items():
            c.write_bytes(p, b)
    for victim in (0, 1):
        localcluster.stop(d, "storage", victim, sig=signal.SIGKILL)
        try:
            with jpfs.connect(d) as c:
                t0 = time.monotonic()
                assert [bytes(v) for v in c.read_many(list(files))] == list(files.values())
                assert all(c.read_bytes(p) == b for p, b in files.items())
                assert time.monotonic() - t0 < BOUND
        finally:
            localcluster.start(d, "storage", victim, sync=False)


@pytest.fixture
def silent_listener():
    """A loopback listener that accepts connections and never answers: a hung daemon."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for s in held:
        s.close()
    srv.close()


async def test_a_silent_peer_is_given_up_within_the_deadline(nursery, silent_listener):
    from jpfs.proto import meta as P

    for peer_timeout in (0.5, 1.5):
        pool = Pool(nursery, [silent_listener], b"secret", role="meta",
                    peer_timeout=peer_timeout)
        t0 = trio.current_time()
        with pytest.raises(Silent) as e:
            await pool.call(0, P.GETATTR, P.InoReq(1))
        took = trio.current_time() - t0
        # the deadline, not a speed: at least the timeout, and not much more than it
        assert peer_timeout * 0.9 <= took < peer_timeout + 1.5, took
        assert f"metadata shard 0 ({silent_listener}) did not answer within" in e.value.strerror
        pool.close()


def test_the_cluster_file_sets_the_deadline(cluster, silent_listener, tmp_path, capsys):
    c = config.load(cluster)
    text = (cluster / "cluster.toml").read_text()
    f = tmp_path / "cluster.toml"
    f.write_text(text.replace(c.meta[1].address, silent_listener).replace(
        "[cluster]\n", "[cluster]\npeer_timeout = 0.6\n"))
    (tmp_path / "secret").write_bytes((cluster / "secret").read_bytes())
    assert config.load(f).peer_timeout == 0.6
    with jpfs.connect(cluster) as client:
        d = _dir_on_shard(client, 1, "silent")
    rc, _, err, secs = _cli(capsys, "--cluster", str(f), "ls", f"jpfs:{d}")
    assert rc == 1 and secs < BOUND, (secs, err)
    assert f"metadata shard 1 ({silent_listener}) did not answer within 0.6 s" in err, err
    # and a client given another deadline in code
    assert dataclasses.replace(config.load(f), peer_timeout=2.0).peer_timeout == 2.0


def _stopped(d, role: str, index: int):
    """SIGSTOP a daemon (a hung process: its sockets stay open, nothing answers)."""
    pid = int((d / f"{role}-{index}.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_daemon_that_hangs_mid_call_is_found_within_the_deadline(cluster):
    """Connections already up when a daemon hangs: the probe finds it (not the 60 s call
    deadline), the error says so, and the client works again once the daemon resumes."""
    with jpfs.connect(cluster) as c:
        by = _files_by_node(c, "/hang", 8)
        node, paths = next(iter(by.items()))
        d = _dir_on_shard(c, 1, "hung")
        c.read_bytes(paths[0])  # connections to the node and the shard are up
        c.listdir(d)
        resume = _stopped(cluster, "storage", node)
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                c.read_bytes(paths[-1])
            assert time.monotonic() - t0 < BOUND
            assert f"storage node {node}" in str(e.value)
            assert "stopped answering" in str(e.value) or "did not answer" in str(e.value)
        finally:
            resume()
        assert c.read_bytes(paths[-1])
        resume = _stopped(cluster, "meta", 1)
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                c.listdir(d)
            assert time.monotonic() - t0 < BOUND
            assert "metadata shard 1" in str(e.value)
        finally:
            resume()
        assert c.listdir(d) == []


def test_a_shard_whose_port_was_taken_while_stopped_restarts_on_another(tmp_path):
    """Something took a stopped shard's port (another program, or a client's outgoing port):
    the shard exits with the address-in-use status and `up` moves it to a free port, rather
    than failing. Its data is there on the new port."""
    d = tmp_path / "c"
    localcluster.up(d, meta_shards=1, storage_nodes=1)
    try:
        with jpfs.connect(d) as c:
            c.mkdir("/kept")
        (shard,) = [x for x in localcluster.status(d) if x.role == "meta"]
        localcluster.stop(d, "meta", 0)
        host, port = shard.address.rsplit(":", 1)
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind((host, int(port)))
            squatter.listen()
            localcluster.up(d)
            (moved,) = [x for x in localcluster.status(d) if x.role == "meta"]
            assert moved.alive and moved.address != shard.address
            with jpfs.connect(d) as c:
                assert c.listdir("/") == ["kept"]
    finally:
        localcluster.down(d, timeout=5)
