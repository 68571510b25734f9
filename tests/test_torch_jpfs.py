"""ShardDataset over ``jpfs://`` on a real cluster (daemons on loopback) equals the local read."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from jpfs.torch import ShardDataset

CAM = "observation.images.cam_high"
DELTAS = {"action": [i / 30 for i in range(-1, 6)], CAM: [-1 / 30, 0.0]}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    from jpfs.lerobot.generate import generate

    base = tmp_path_factory.mktemp("jpfs-torch")
    common = dict(episodes=6, cameras=1, frames_per_episode=(8, 20), video="encoded", seed=2,
                  state_dim=3, action_dim=2, resolution=(32, 24), progress=False)
    generate(str(base / "v21"), format="v2.1", **common)
    generate(str(base / "v30"), format="v3.0", **common)
    return base


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:  # the task strings
            assert a[k] == b[k], k


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_jpfs_url_equals_local(make_cluster, datasets):
    import fsspec

    cluster = str(make_cluster(meta_shards=2, storage_nodes=2))
    fs = fsspec.filesystem("jpfs", cluster=cluster)
    for fmt in ("v21", "v30"):
        fs.put(str(datasets / fmt), f"/data/{fmt}", recursive=True)
        kw = dict(delta_timestamps=DELTAS, seed=7, shuffle_buffer=16)
        url = f"jpfs://data/{fmt}"
        opts = {"storage_options": {"cluster": cluster}}
        # Samples through DataLoader workers (each has its own client).
        local = list(DataLoader(ShardDataset(str(datasets / fmt), **kw), batch_size=5,
                                num_workers=2))
        remote = list(DataLoader(ShardDataset(url, **opts, **kw), batch_size=5, num_workers=2))
        assert len(local) == len(remote) > 0
        for a, b in zip(local, remote, strict=True):
            same(a, b)
        # Batches in process: shards fetched in batched reads.
        ds = ShardDataset(url, batch_size=8, readahead_files=4, **opts, **kw)
        got = list(ds)
        want = list(ShardDataset(str(datasets / fmt), batch_size=8, **kw))
        for a, b in zip(want, got, strict=True):
            same(a, b)
        assert ds.stats["fetched_files"] == len(ds.source.shards)
        if fmt == "v30":  # episodes as row-group shards: ranged reads over the client
            assert all(s.row_groups for s in ds.source.shards)
        assert ds.stats["fetch_calls"] < ds.stats["fetched_files"]
