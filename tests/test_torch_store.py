"""ShardDataset over ``jpfs://`` reads through the native client: one metadata call per directory
per batch, counted by the shards themselves (their Prometheus request counters), in process and
in real DataLoader workers. Also the fsspec class's ``cat`` without a stat per path."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from metrics_support import scrape
from torch.utils.data import DataLoader

from jpfs import config
from jpfs.client.fsspec_impl import JPFSFileSystem
from jpfs.torch import ShardDataset
from jpfs.torch.store import ClientStore, open_store

EPISODES = 24
FILES = 8  # readahead_files: shards per batched read


def _requests(cluster: str) -> Counter:
    """Requests each method got, summed over the metadata shards."""
    got: Counter = Counter()
    for shard in config.load(cluster).meta:
        for s in scrape(shard.metrics):
            if s.name == "jpfs_meta_rpc_requests_total":
                got[s.labels["method"]] += int(s.value)
    return got


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A v2.1 dataset (every data file in one directory) on a cluster whose shards count."""
    from jpfs import localcluster
    from jpfs.lerobot.generate import generate

    base = tmp_path_factory.mktemp("store")
    generate(str(base / "v21"), format="v2.1", episodes=EPISODES, cameras=0,
             frames_per_episode=(5, 12), video="stub", seed=3, state_dim=2, action_dim=2,
             progress=False)
    d = base / "cluster"
    localcluster.up(d, meta_shards=2, storage_nodes=2, sync=False, metrics=True)
    cluster = str(localcluster.cluster_file(d))
    JPFSFileSystem(cluster=cluster).put(str(base / "v21"), "/data/v21", recursive=True)
    yield cluster, base / "v21"
    localcluster.down(d, timeout=5)


def _dataset(cluster: str) -> ShardDataset:
    return ShardDataset("jpfs://data/v21", batch_size=16, readahead_files=FILES, video=False,
                        seed=1, storage_options={"cluster": cluster})


# Resolving the data directory, once per process: a lookup per component (/data, /data/v21,
# .../data, .../chunk-000) and a getattr for each directory whose inode lives on another shard.
WALK = 4


def test_one_metadata_call_per_directory_per_batch(served):
    cluster, local = served
    ds = _dataset(cluster)
    assert isinstance(ds.source.store, ClientStore)
    before = _requests(cluster)
    got = list(ds)
    calls = _requests(cluster) - before
    assert sum(len(b["index"]) for b in got) == ds.source.total
    batches = ds.stats["fetch_calls"]
    assert batches == math.ceil(EPISODES / FILES)
    # one lookup_layouts per batch (one directory), the directory resolved once, nothing else
    assert calls["lookup_layouts"] == batches, calls
    assert calls["lookup"] <= WALK and calls["getattr"] <= WALK, calls
    assert set(calls) <= {"lookup_layouts", "lookup", "getattr"}, calls
    # the next epoch: the directory is known, each batch is exactly one call
    ds.set_epoch(1)
    before = _requests(cluster)
    assert sum(len(b["index"]) for b in ds) == ds.source.total
    assert _requests(cluster) - before == Counter({"lookup_layouts": batches})
    want = list(ShardDataset(str(local), batch_size=16, video=False, seed=1))
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_workers_read_with_their_own_client_as_few_calls(served):
    cluster, _ = served
    ds = _dataset(cluster)
    before = _requests(cluster)
    n = sum(len(b["index"]) for b in DataLoader(ds, batch_size=None, num_workers=2))
    calls = _requests(cluster) - before
    assert n == ds.source.total
    # each worker reads its half: its batches, plus at most one shard shared at the cut
    assert calls["lookup_layouts"] <= math.ceil(EPISODES / FILES) + 2, calls
    assert calls["lookup"] <= 2 * WALK and calls["getattr"] <= 2 * WALK, calls
    assert set(calls) <= {"lookup_layouts", "lookup", "getattr"}, calls


def test_client_store_hands_out_views(served):
    cluster, _ = served
    fs, path, store = open_store("jpfs://data/v21", {"cluster": cluster})
    assert path == "/data/v21" and isinstance(fs, JPFSFileSystem)
    names = sorted(fs.find("/data/v21/data"))[:3]
    views = store.read_many(names)
    assert all(isinstance(v, memoryview) and v.readonly for v in views)
    assert [bytes(v) for v in views] == [fs.cat_file(p) for p in names]
    (part,) = store.read_ranges(names[:1], [4], [10])
    assert bytes(part) == fs.cat_file(names[0])[4:10]


def test_fsspec_cat_batches_without_a_stat_per_path(served):
    cluster, _ = served
    fs = JPFSFileSystem(cluster=cluster)
    names = sorted(fs.find("/data/v21/data"))
    assert len({p.rsplit("/", 1)[0] for p in names}) == 1
    fs.cat(names[:1] * 2)  # the directory resolved in this client
    before = _requests(cluster)
    got = fs.cat(names)
    calls = _requests(cluster) - before
    assert calls == Counter({"lookup_layouts": 1}), calls
    assert list(got) == names and all(type(v) is bytes for v in got.values())
    with pytest.raises(IsADirectoryError):
        fs.cat([names[0], "/data/v21/data"])
    assert isinstance(fs.cat([names[0], "/data/v21/nope"], on_error="return")["/data/v21/nope"],
                      FileNotFoundError)
    assert list(fs.cat([names[0], "/data/v21/nope"], on_error="omit")) == [names[0]]
    tree = fs.cat("/data/v21/data", recursive=True)
    assert sorted(tree) == names
    assert fs.cat(names[0]) == got[names[0]]
