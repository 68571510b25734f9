"""``jpfs://`` URLs follow the cluster they name now, not the one a cached filesystem saw first.

fsspec caches one ``JPFSFileSystem()`` per set of arguments, so every ``jpfs://`` URL without a
``cluster`` option gets the same object: which cluster it reaches must be decided per call.
"""

from __future__ import annotations

import shutil

import fsspec
import pandas as pd
import pytest

import jpfs
from jpfs import localcluster


def _put(cluster, path: str, data: bytes) -> None:
    with jpfs.connect(cluster) as c:
        c.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        c.write_bytes(path, data)


def test_jpfs_urls_follow_jpfs_cluster_between_two_live_clusters(make_cluster, monkeypatch):
    a = make_cluster(meta_shards=1, storage_nodes=1)
    b = make_cluster(meta_shards=1, storage_nodes=1)
    _put(a, "/x/f", b"from a")
    _put(b, "/x/f", b"from b")
    for cluster, want in ((a, b"from a"), (b, b"from b"), (a, b"from a")):
        monkeypatch.setenv("JPFS_CLUSTER", str(cluster))
        with fsspec.open("jpfs://x/f", "rb") as f:
            assert f.read() == want
        assert fsspec.filesystem("jpfs").cat("jpfs://x/f") == want
    # The storage option still wins over the environment.
    assert fsspec.filesystem("jpfs", cluster=str(b)).cat_file("/x/f") == b"from b"


def test_jpfs_urls_reach_a_new_cluster_made_where_an_old_one_was(make_cluster, monkeypatch,
                                                                  tmp_path):
    """The flake this fixes: an earlier test's cluster is gone, a new one answers at the
    same cluster-file path (or $JPFS_CLUSTER now names another), and a cached client still
    dialled the dead daemons ("Connection refused")."""
    d = tmp_path / "c"
    localcluster.up(d, meta_shards=1, storage_nodes=1, sync=False)
    try:
        monkeypatch.setenv("JPFS_CLUSTER", str(d))
        _put(d, "/t/a.parquet", b"")
        pd.DataFrame({"v": [1, 2]}).to_parquet("jpfs://t/a.parquet")
        assert pd.read_parquet("jpfs://t/a.parquet")["v"].tolist() == [1, 2]
    finally:
        localcluster.down(d, timeout=5)
    shutil.rmtree(d)
    localcluster.up(d, meta_shards=1, storage_nodes=1, sync=False)  # new ports, same path
    try:
        pd.DataFrame({"v": [3]}).to_parquet("jpfs://t.parquet")
        assert pd.read_parquet("jpfs://t.parquet")["v"].tolist() == [3]
        with pytest.raises(FileNotFoundError):
            fsspec.filesystem("jpfs").info("jpfs://t/a.parquet")  # the old cluster's file
    finally:
        localcluster.down(d, timeout=5)
