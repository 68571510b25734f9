"""``--metrics HOST:PORT`` on the daemons: what a Prometheus scrape of a shard and a storage
node shows after real work (counters that grew, requests by method, errors by errno)."""

from __future__ import annotations

import errno
import socket

import pytest
from metrics_support import scrape

import jpfs
from jpfs import localcluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for s in scrape(f"127.0.0.1:{port}")}


def test_daemons_export_prometheus_metrics(make_cluster):
    d = make_cluster(meta_shards=1, storage_nodes=1)
    ports = {}
    for role in ("meta", "storage"):
        ports[role] = _free_port()
        localcluster.stop(d, role, 0)
        localcluster.start(d, role, 0, sync=False,
                           extra_args=["--metrics", f"127.0.0.1:{ports[role]}"])
    with jpfs.connect(d) as c:
        c.mkdir("/m")
        for i in range(20):
            c.write_bytes(f"/m/f{i}", b"x" * 1000)
        assert c.read_bytes("/m/f3") == b"x" * 1000
        with pytest.raises(FileNotFoundError):
            c.stat("/m/missing")
    with jpfs.connect(d, short_circuit=False) as c:  # as a client on another host reads
        assert c.read_bytes("/m/f4") == b"x" * 1000
    meta = _scrape(ports["meta"])
    shard = (("shard", "0"),)
    assert meta[("jpfs_meta_commits_total", shard)] > 0
    assert meta[("jpfs_meta_inodes", shard)] >= 22  # the root, /m and 20 files
    assert meta[("jpfs_meta_rpc_requests_total", (("method", "mkdir"), ("shard", "0")))] >= 1
    enoent = ("jpfs_meta_rpc_errors_total", (("errno", errno.errorcode[errno.ENOENT]),
                                             ("shard", "0")))
    assert meta[enoent] >= 1
    storage = _scrape(ports["storage"])
    node = (("node", "0"),)
    assert storage[("jpfs_storage_blobs_put_total", node)] >= 20
    assert storage[("jpfs_storage_bytes_sent_total", node)] >= 1000
    assert storage[("jpfs_storage_live_bytes", node)] >= 20_000
    assert storage[("jpfs_storage_rpc_requests_total",
                    (("method", "get_blobs"), ("node", "0")))] >= 1
    # the first client, on the node's host, read the volume file itself
    assert storage[("jpfs_storage_blobs_located_total", node)] >= 1


def test_cluster_up_with_metrics_records_and_serves_them(tmp_path):
    d, plain = tmp_path / "c", tmp_path / "plain"
    cluster = localcluster.up(d, meta_shards=1, storage_nodes=1, sync=False, metrics=True)
    try:
        for role, server in (("meta", cluster.meta[0]), ("storage", cluster.storage[0])):
            assert server.metrics, "cluster.toml names a metrics address per daemon"
            port = int(server.metrics.rsplit(":", 1)[1])
            assert any(name.startswith(f"jpfs_{role}_") for name, _ in _scrape(port))
        # restarting on the same cluster file keeps them
        localcluster.down(d)
        again = localcluster.up(d, sync=False)
        assert again.meta[0].metrics == cluster.meta[0].metrics
        # a cluster made without them says how to add them
        localcluster.up(plain, meta_shards=1, storage_nodes=0, sync=False)
        with pytest.raises(ValueError, match="metrics"):
            localcluster.up(plain, metrics=True)
    finally:
        localcluster.down(d)
        if (plain / "cluster.toml").exists():
            localcluster.down(plain)
