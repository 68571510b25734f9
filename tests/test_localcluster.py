"""``jpfs cluster up`` (``localcluster.up``) either brings a cluster up or leaves it as it was:
a daemon that does not start fails the call with its log's tail, and nothing the call started
is left running behind the error (a test fixture whose ``up`` fails never reaches its
``down``)."""

from __future__ import annotations

import pytest

from jpfs import localcluster


def _running(d) -> list[str]:
    return sorted(p.stem for p in d.glob("*.pid")
                  if localcluster.pid_alive(int(p.read_text())))


@pytest.mark.parametrize("etcd", [False, True])
def test_a_cluster_that_does_not_come_up_leaves_nothing_running(tmp_path, etcd):
    with pytest.raises(RuntimeError, match="meta-0.*exited with status 2"):
        localcluster.up(tmp_path, meta_shards=1, storage_nodes=2, etcd=etcd,
                        extra_args={"meta": ["--no-such-flag"]})
    assert _running(tmp_path) == []
    # and the same directory comes up once the daemons start
    localcluster.up(tmp_path, meta_shards=1, storage_nodes=2)
    try:
        assert _running(tmp_path) == sorted(
            ["meta-0", "storage-0", "storage-1", *(["etcd"] if etcd else [])])
    finally:
        localcluster.down(tmp_path, timeout=5)
    assert _running(tmp_path) == []


def test_a_failed_growth_leaves_the_running_cluster_running(tmp_path):
    localcluster.up(tmp_path, meta_shards=1, storage_nodes=1, etcd=True)
    try:
        before = _running(tmp_path)
        with pytest.raises(RuntimeError, match="storage-1"):
            localcluster.up(tmp_path, storage_nodes=2, extra_args={"storage": ["--no-such-flag"]})
        assert _running(tmp_path) == before
    finally:
        localcluster.down(tmp_path, timeout=5)
