"""A cluster whose shape lives in a cluster map (etcd): made, restarted and grown while it serves.

Real etcd, real daemons, a real client that follows the map without a restart.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

import jpfs
from jpfs import config, localcluster
from jpfs.placement import shard_of

pytestmark = pytest.mark.skipif(localcluster.shutil.which("etcd") is None,
                                reason="etcd is not installed (apt install etcd-server)")


def _jpfs(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "jpfs.cli.main", *args], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "JPFS_CLUSTER": ""})
    if check and r.returncode:
        raise AssertionError(f"jpfs {' '.join(args)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r


def test_cluster_up_keeps_the_shape_in_etcd_and_restarts_on_it(tmp_path):
    d = tmp_path / "c"
    out = _jpfs("cluster", "up", "--dir", str(d), "--meta-replicas", "1").stdout
    assert "map in etcd" in out and "replicas 2" in out  # 2 nodes: every chunk twice
    text = (d / "cluster.toml").read_text()
    assert "etcd" in text and "[[meta]]" not in text and "[[storage]]" not in text
    try:
        before = config.load(d / "cluster.toml")
        assert before.n_shards == 2 and before.n_nodes == 2 and before.epoch > 0
        with jpfs.connect(d) as c:
            c.write_bytes("/f", b"kept")
        status = _jpfs("cluster", "status", "--dir", str(d)).stdout
        assert "etcd" in status and "cluster map epoch" in status
        _jpfs("cluster", "down", "--dir", str(d))
        again = _jpfs("cluster", "up", "--dir", str(d)).stdout
        assert "started 5 daemons" in again  # etcd and the four daemons, on their old data
        after = config.load(d / "cluster.toml")
        assert after.meta_replicas == before.meta_replicas and after.storage == before.storage
        with jpfs.connect(d) as c:
            assert c.read_bytes("/f") == b"kept"
    finally:
        localcluster.down(d)


def test_a_static_cluster_cannot_grow_and_says_so(tmp_path):
    d = tmp_path / "s"
    _jpfs("cluster", "up", "--dir", str(d), "--static", "--storage-nodes", "1")
    try:
        r = _jpfs("cluster", "up", "--dir", str(d), "--storage-nodes", "2", check=False)
        assert r.returncode != 0 and "no cluster map, so it cannot grow" in r.stderr
        r = _jpfs("--cluster", str(d), "shard", "add", "127.0.0.1:1", check=False)
        assert r.returncode != 0 and "static cluster file" in r.stderr
    finally:
        localcluster.down(d)


async def test_a_running_client_follows_growth(tmp_path):
    """Grow 2 -> 3 storage nodes and 2 -> 3 shards while a client writes and reads: nothing
    fails, the client sees the new map without a restart, new files reach the new node and new
    directories reach the new shard."""
    d = tmp_path / "g"
    await trio.to_thread.run_sync(lambda: localcluster.up(d, etcd=True, replicas=1))
    try:
        async with jpfs.aconnect(d) as c:
            await c.mkdir("/old")
            for i in range(20):
                await c.write_bytes(f"/old/f{i}", b"%d" % i * 1000)
            grown = await trio.to_thread.run_sync(
                lambda: localcluster.up(d, storage_nodes=3, meta_shards=3))
            with trio.fail_after(10):
                while c.cluster.epoch < grown.epoch:
                    await trio.sleep(0.02)
            assert c.cluster.n_nodes == 3 and c.meta.n_shards == 3
            for i in range(20):  # old files read as before
                assert await c.read_bytes(f"/old/f{i}") == b"%d" % i * 1000
            for i in range(60):  # new writes spread over every node, the new one included
                await c.mkdir(f"/new{i}")
                await c.write_bytes(f"/new{i}/f", b"x" * 5000)
            nodes = {n for i in range(60)
                     for ch in (await c.layout(f"/new{i}/f")).chunks for n in ch.nodes}
            assert 2 in nodes
            shards = {shard_of((await c.stat(f"/new{i}")).ino) for i in range(60)}
            assert 2 in shards
    finally:
        await trio.to_thread.run_sync(localcluster.down, d)


def test_cluster_init_writes_the_map_of_a_real_cluster(tmp_path):
    url = localcluster.start_etcd(tmp_path / "etcd")
    try:
        f = tmp_path / "conf" / "cluster.toml"
        out = _jpfs("cluster", "init", str(f), "--etcd", url, "--name", "prod",
                    "--shard", "10.0.0.1:7301,10.0.0.2:7301", "--shard",
                    "10.0.0.2:7302,10.0.0.1:7302", "--node", "10.0.0.3:7401", "--node",
                    "10.0.0.4:7401").stdout
        assert "jpfs-meta --cluster" in out and "--index 1 --replica 1" in out
        c = config.load(f)
        assert c.name == "prod" and c.replicas == 2 and c.n_meta_replicas == 2
        assert [s.address for s in c.meta_replicas[1]] == ["10.0.0.2:7302", "10.0.0.1:7302"]
        assert c.writable_nodes == (0, 1) and (f.parent / "secret").stat().st_mode & 0o077 == 0
        again = _jpfs("cluster", "init", str(tmp_path / "other.toml"), "--etcd", url, "--name",
                      "prod", "--shard", "10.9.9.9:1", check=False)
        assert again.returncode != 0 and "already holds a different map" in again.stderr
    finally:
        localcluster.stop(tmp_path / "etcd", "etcd", 0)


def test_down_stops_every_daemon_even_with_etcd_gone(tmp_path):
    d = tmp_path / "gone"
    localcluster.up(d, etcd=True, meta_shards=1, storage_nodes=1)
    pids = [int(p.read_text()) for p in d.glob("*.pid")]
    assert len(pids) == 3
    localcluster.kill(d, "etcd", 0)  # the map can no longer be read
    stopped = localcluster.down(d, timeout=5)
    assert sorted(stopped) == ["meta-0", "storage-0"]
    assert not any(localcluster.pid_alive(p) for p in pids)
