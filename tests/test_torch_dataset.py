"""jpfs.torch.ShardDataset on real datasets: generated LeRobot v2.1 / v3.0 copies of one dataset
(real parquet, real AV1 video) and plain parquet shards written here with pyarrow.

References are computed independently: frames with pandas from the same parquet files, video
frames by decoding each episode's mp4 from start to end with PyAV.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from jpfs.torch import ShardDataset, collate, to_device

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning"),
]

FPS = 30
EPISODES = 8
CAM = "observation.images.cam_high"
# Past and future offsets, beyond both ends of short episodes: exercises clamping and pads.
DELTAS = {"action": [i / FPS for i in range(-2, 14)], "observation.state": [-1 / FPS, 0.0]}
VIDEO_DELTAS = {**DELTAS, CAM: [-2 / FPS, 0.0, 3 / FPS]}


@pytest.fixture(scope="module")
def lerobot(tmp_path_factory):
    """v2.1 and v3.0 copies of one small dataset (several v3.0 data files), real video."""
    from jpfs.lerobot.generate import generate

    base = tmp_path_factory.mktemp("lerobot")
    common = dict(episodes=EPISODES, cameras=1, frames_per_episode=(6, 30), fps=FPS,
                  video="encoded", seed=7, state_dim=4, action_dim=3, resolution=(32, 24),
                  progress=False)
    v21 = str(base / "v21")
    v30 = str(base / "v30")
    generate(v21, format="v2.1", **common)
    generate(v30, format="v3.0", data_file_mb=0.004, video_file_mb=0.02, **common)
    assert len(glob.glob(f"{v30}/data/*/*.parquet")) >= 3  # several files, several episodes each
    return {"v2.1": v21, "v3.0": v30}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain parquet shards (no meta/info.json): 5 files, episodes of varying length."""
    root = tmp_path_factory.mktemp("plain")
    rng = np.random.default_rng(3)
    index = 0
    for f in range(5):
        cols: dict[str, list] = {"episode_index": [], "frame_index": [], "index": [], "x": [],
                                 "v": []}
        for e in range(f * 3, f * 3 + 3):
            n = int(rng.integers(3, 15))
            cols["episode_index"] += [e] * n
            cols["frame_index"] += list(range(n))
            cols["index"] += list(range(index, index + n))
            cols["x"] += rng.normal(size=n).astype(np.float32).tolist()
            cols["v"] += [rng.normal(size=2).astype(np.float32).tolist() for _ in range(n)]
            index += n
        table = pa.table({
            "episode_index": pa.array(cols["episode_index"], pa.int64()),
            "frame_index": pa.array(cols["frame_index"], pa.int64()),
            "index": pa.array(cols["index"], pa.int64()),
            "x": pa.array(cols["x"], pa.float32()),
            "v": pa.array(cols["v"], pa.list_(pa.float32(), 2)),
            "note": pa.array(["text"] * len(cols["x"])),  # not numeric: skipped
        })
        os.makedirs(root / "shards", exist_ok=True)
        pq.write_table(table, root / "shards" / f"part-{f:03d}.parquet")
    return str(root)


def frames_df(root: str) -> pd.DataFrame:
    files = sorted(glob.glob(os.path.join(root, "**", "*.parquet"), recursive=True))
    files = [f for f in files if "/meta/" not in f]
    return pd.concat([pd.read_parquet(f) for f in files]).set_index("index", drop=False)


def reference(df: pd.DataFrame, deltas: dict[str, list[float]], fps: float) -> dict[int, dict]:
    """What LeRobotDataset[i] holds for each index: windows clamped to the episode, pad masks."""
    bounds = df.groupby("episode_index")["index"].agg(["min", "max"])
    out = {}
    for i, row in df.iterrows():
        lo, hi = bounds.loc[row["episode_index"]]
        item = {}
        for key, secs in deltas.items():
            q = [i + round(s * fps) for s in secs]
            if key in df.columns:
                item[key] = np.stack([np.asarray(df.at[min(max(j, lo), hi), key]) for j in q])
            item[f"{key}_is_pad"] = np.array([j < lo or j > hi for j in q])
            item[f"{key}_rows"] = [min(max(j, lo), hi) for j in q]
        out[int(i)] = item
    return out


def collect(loader) -> list[dict]:
    """Samples of a loader of batches, unbatched (and cloned: safe to keep)."""
    out = []
    for batch in loader:
        n = len(batch["index"])
        out += [{k: v[j].clone() if isinstance(v, torch.Tensor) else v[j]
                 for k, v in batch.items()} for j in range(n)]
    return out


def indices(loader) -> list[int]:
    return [int(i) for b in loader for i in b["index"]]


# -------------------------------------------------------------------------------------------


def test_formats_detected(lerobot, plain):
    assert ShardDataset(lerobot["v2.1"], video=False).source.format == "v2.1"
    assert ShardDataset(lerobot["v3.0"], video=False).source.format == "v3.0"
    ds = ShardDataset(plain)
    assert ds.source.format == "parquet"
    assert set(ds.source.columns) == {"episode_index", "frame_index", "index", "x", "v"}


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_exactly_once_across_ranks_and_workers(lerobot, world, workers):
    total = ShardDataset(lerobot["v3.0"], video=False).num_samples
    seen = []
    per_rank = []
    for rank in range(world):
        ds = ShardDataset(lerobot["v3.0"], video=False, seed=5, shuffle_buffer=16, rank=rank,
                          world_size=world)
        ds.set_epoch(3)
        got = indices(DataLoader(ds, batch_size=7, num_workers=workers))
        assert len(got) == len(ds)
        per_rank.append(len(got))
        seen += got
    assert sorted(seen) == list(range(total))
    assert max(per_rank) - min(per_rank) <= 1


def test_exactly_once_plain_parquet_batched(plain):
    df = frames_df(plain)
    seen = []
    for rank in range(2):
        ds = ShardDataset(plain, rank=rank, world_size=2, batch_size=4, shuffle_buffer=8)
        seen += indices(DataLoader(ds, batch_size=None, num_workers=3))
    assert sorted(seen) == sorted(df["index"].tolist())


def test_order_is_deterministic_and_follows_the_epoch(lerobot):
    def run(epoch, workers, seed=11, persistent_ds=None):
        ds = persistent_ds or ShardDataset(lerobot["v2.1"], video=False, seed=seed)
        ds.set_epoch(epoch)
        return indices(DataLoader(ds, batch_size=5, num_workers=workers))

    a = run(0, 2)
    assert a == run(0, 2)
    assert run(1, 2) != a
    assert run(0, 2, seed=12) != a
    # Same (seed, epoch): the same global order however it is read, and it is the order()
    # the dataset predicts.
    ds = ShardDataset(lerobot["v2.1"], video=False, seed=11)
    assert run(0, 0) == ds.order(0).tolist()
    # set_epoch reaches persistent workers (the epoch lives in shared memory).
    ds = ShardDataset(lerobot["v2.1"], video=False, seed=11)
    loader = DataLoader(ds, batch_size=5, num_workers=2, persistent_workers=True)
    first = indices(loader)
    ds.set_epoch(1)
    second = indices(loader)
    assert first == a and second == run(1, 2)


@pytest.mark.parametrize("fmt", ["v2.1", "v3.0"])
def test_windows_and_pads_match_pandas_reference(lerobot, fmt):
    root = lerobot[fmt]
    ref = reference(frames_df(root), DELTAS, FPS)
    ds = ShardDataset(root, delta_timestamps=DELTAS, video=False, seed=2, shuffle_buffer=32)
    samples = collect(DataLoader(ds, batch_size=8, num_workers=2))
    assert sorted(int(s["index"]) for s in samples) == sorted(ref)
    pads = 0
    for s in samples:
        r = ref[int(s["index"])]
        for key in DELTAS:
            np.testing.assert_array_equal(s[key].numpy(), r[key])
            np.testing.assert_array_equal(s[f"{key}_is_pad"].numpy(), r[f"{key}_is_pad"])
        pads += int(s["action_is_pad"].sum())
    assert pads > 0  # the edges were exercised


def test_windows_plain_parquet_need_fps(plain):
    deltas = {"x": [-2.0, 0.0, 1.0, 5.0], "v": [0.0, 1.0]}
    with pytest.raises(ValueError):
        ShardDataset(plain, delta_timestamps=deltas)
    ref = reference(frames_df(plain), deltas, 1.0)
    ds = ShardDataset(plain, delta_timestamps=deltas, fps=1.0)
    samples = collect(DataLoader(ds, batch_size=3, num_workers=0))
    assert len(samples) == len(ref)
    for s in samples:
        r = ref[int(s["index"])]
        for key in deltas:
            np.testing.assert_array_equal(s[key].numpy(), r[key])
            np.testing.assert_array_equal(s[f"{key}_is_pad"].numpy(), r[f"{key}_is_pad"])


def _decode_all(path: str) -> list[np.ndarray]:
    import av

    with av.open(path) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_video_frames_match_a_full_decode(lerobot):
    root = lerobot["v2.1"]
    df = frames_df(root)
    ref = reference(df, {CAM: VIDEO_DELTAS[CAM]}, FPS)
    ds = ShardDataset(root, delta_timestamps=VIDEO_DELTAS, seed=4, shuffle_buffer=40)
    samples = collect(DataLoader(ds, batch_size=6, num_workers=2))
    assert len(samples) == len(df)
    decoded = {}
    for s in samples:
        ep = int(s["episode_index"])
        if ep not in decoded:
            path = glob.glob(f"{root}/videos/*/{CAM}/episode_{ep:06d}.mp4")[0]
            decoded[ep] = _decode_all(path)
        r = ref[int(s["index"])]
        want = np.stack([decoded[ep][int(df.at[j, "frame_index"])] for j in r[f"{CAM}_rows"]])
        want = torch.from_numpy(want).permute(0, 3, 1, 2).float() / 255  # LeRobot's conversion
        assert s[CAM].shape == want.shape and s[CAM].dtype == torch.float32
        assert torch.equal(s[CAM], want)  # bit for bit
        np.testing.assert_array_equal(s[f"{CAM}_is_pad"].numpy(), r[f"{CAM}_is_pad"])
    # uint8 frames: the same pixels, without the conversion.
    raw = ShardDataset(root, delta_timestamps={CAM: VIDEO_DELTAS[CAM]}, seed=4,
                       shuffle_buffer=40, video_dtype="uint8", columns=["index"])
    samples = collect(DataLoader(ShardDataset(root, delta_timestamps=VIDEO_DELTAS, seed=4,
                                              shuffle_buffer=40), batch_size=6))
    for s, u in zip(samples, raw, strict=True):
        assert set(u) == {"index", CAM, f"{CAM}_is_pad", "task"} and u[CAM].dtype == torch.uint8
        assert torch.equal(u[CAM], (s[CAM] * 255).round().to(torch.uint8))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_v21_and_v30_copies_yield_identical_samples(lerobot):
    kw = dict(delta_timestamps=VIDEO_DELTAS, with_task=True)
    # Unshuffled: the canonical order is the same, so the streams are equal sample for sample.
    a = list(ShardDataset(lerobot["v2.1"], shuffle=False, **kw))
    b = list(ShardDataset(lerobot["v3.0"], shuffle=False, **kw))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        _same(x, y)
    assert isinstance(a[0]["task"], str) and a[0]["task"]
    # Shuffled: v3.0 files written one episode per row group are read episode by episode, so the
    # shard-level shuffle, and the whole stream, is the same as v2.1's.
    v21 = ShardDataset(lerobot["v2.1"], seed=9, **kw)
    v30 = ShardDataset(lerobot["v3.0"], seed=9, **kw)
    assert v30.source.sizes.tolist() == v21.source.sizes.tolist()
    assert any(s.row_groups for s in v30.source.shards)
    c = list(v30)
    for x, y in zip(list(v21), c, strict=True):
        _same(x, y)
    assert sorted(int(s["index"]) for s in c) == [int(s["index"]) for s in a]


def test_fsspec_url_reads_like_the_local_path(lerobot):
    # A non-local fsspec filesystem (memory://, standing in for jpfs://): batched multi-file
    # and multi-range reads, parquet row groups from fetched byte spans, video through fs.open.
    import fsspec

    mem = fsspec.filesystem("memory")
    for fmt in ("v2.1", "v3.0"):
        root = lerobot[fmt]
        dest = f"/torch-test/{fmt}"
        for path in glob.glob(f"{root}/**/*", recursive=True):
            if os.path.isfile(path):
                mem.pipe_file(f"{dest}/{os.path.relpath(path, root)}", open(path, "rb").read())
        kw = dict(delta_timestamps=VIDEO_DELTAS, seed=5, batch_size=8, readahead_files=3)
        local = list(ShardDataset(root, **kw))
        remote = ShardDataset(f"memory://{dest}", **kw)
        got = list(remote)
        assert remote.stats["fetch_calls"] < remote.stats["fetched_files"]
        assert len(got) == len(local)
        for x, y in zip(local, got, strict=True):
            _same(x, y)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_resume_after_k_batches_plain_dataloader(lerobot, workers):
    def make():
        ds = ShardDataset(lerobot["v3.0"], video=False, seed=3, shuffle_buffer=20)
        ds.set_epoch(2)
        return ds

    full = [b["index"].tolist() for b in DataLoader(make(), batch_size=6, num_workers=workers)]
    for k in (1, len(full) // 2, len(full) - 1):
        ds = make()
        ds.load_state_dict(make().state_after(k, batch_size=6, num_workers=workers))
        ds.set_epoch(2)
        rest = [b["index"].tolist() for b in DataLoader(ds, batch_size=6, num_workers=workers)]
        assert rest == full[k:]


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_applies_to_one_epoch_only(lerobot, persistent):
    def make():
        return ShardDataset(lerobot["v2.1"], video=False, seed=2, shuffle_buffer=10)

    ref = make()
    ref.set_epoch(3)
    want3 = [b["index"].tolist() for b in DataLoader(ref, batch_size=4, num_workers=2)]
    ref.set_epoch(4)
    want4 = [b["index"].tolist() for b in DataLoader(ref, batch_size=4, num_workers=2)]
    ds = make()
    ds.load_state_dict(ref.state_after(5, batch_size=4, num_workers=2, epoch=3))
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
    assert ds.epoch == 3
    assert [b["index"].tolist() for b in loader] == want3[5:]
    ds.set_epoch(4)
    assert [b["index"].tolist() for b in loader] == want4  # the next epoch starts afresh


def test_resume_batched_dataset_with_workers(lerobot):
    # Worker-side batches (DataLoader batch_size=None), a partial last batch per worker.
    def make():
        return ShardDataset(lerobot["v2.1"], video=False, seed=4, batch_size=7, shuffle_buffer=9)

    full = [b["index"].tolist() for b in DataLoader(make(), batch_size=None, num_workers=3)]
    for k in (2, len(full) - 2):
        ds = make()
        ds.load_state_dict(make().state_after(k, num_workers=3))
        assert [b["index"].tolist() for b in DataLoader(ds, batch_size=None,
                                                        num_workers=3)] == full[k:]


def test_resume_from_state_dict_in_process(lerobot):
    ds = ShardDataset(lerobot["v2.1"], video=False, seed=8, batch_size=5)
    full = [b["index"].tolist() for b in ds]
    it = iter(ds)
    head = [next(it)["index"].tolist() for _ in range(3)]
    state = ds.state_dict()
    assert state["consumed"] == {"0": 15}
    fresh = ShardDataset(lerobot["v2.1"], video=False, seed=8, batch_size=5)
    fresh.load_state_dict(state)
    assert head + [b["index"].tolist() for b in fresh] == full
    assert [b["index"].tolist() for b in fresh] == full  # the state applies to one iteration


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_resume_with_torchdata_stateful_dataloader(lerobot, workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        return ShardDataset(lerobot["v3.0"], delta_timestamps=DELTAS, video=False, seed=6,
                            shuffle_buffer=24)

    full = [b["index"].tolist() for b in sdl.StatefulDataLoader(make(), batch_size=4,
                                                                num_workers=workers)]
    k = len(full) // 3
    loader = sdl.StatefulDataLoader(make(), batch_size=4, num_workers=workers)
    it = iter(loader)
    head = [next(it)["index"].tolist() for _ in range(k)]
    state = loader.state_dict()
    del it
    again = sdl.StatefulDataLoader(make(), batch_size=4, num_workers=workers)
    again.load_state_dict(state)
    rest = [b["index"].tolist() for b in again]
    assert head == full[:k]
    assert rest == full[k:]


def test_state_mismatch_is_refused(lerobot):
    ds = ShardDataset(lerobot["v2.1"], video=False, seed=1)
    state = ds.state_after(2, batch_size=4, num_workers=2)
    with pytest.raises(ValueError):
        ShardDataset(lerobot["v2.1"], video=False, seed=2).load_state_dict(state)
    with pytest.raises(ValueError):
        ShardDataset(lerobot["v2.1"], video=False, seed=1, world_size=2,
                     rank=0).load_state_dict(state)
    other = ShardDataset(lerobot["v2.1"], video=False, seed=1)
    other.load_state_dict(state)
    with pytest.raises(ValueError):  # saved with 2 workers, read with 3
        list(DataLoader(other, batch_size=4, num_workers=0))


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_collate_equals_default_collate(lerobot, workers):
    kw = dict(delta_timestamps=VIDEO_DELTAS, seed=13, shuffle_buffer=30, with_task=True)
    want = list(DataLoader(ShardDataset(lerobot["v2.1"], **kw), batch_size=8,
                           num_workers=workers))
    got = list(DataLoader(ShardDataset(lerobot["v2.1"], **kw), batch_size=8,
                          num_workers=workers, collate_fn=collate))
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        _same(a, b)
        assert isinstance(b["task"], list) and isinstance(b["task"][0], str)


@pytest.mark.parametrize("workers", [0, 2])
def test_batched_mode_equals_default_collate(lerobot, workers):
    kw = dict(delta_timestamps=VIDEO_DELTAS, seed=13, shuffle_buffer=30)
    per_sample = list(DataLoader(ShardDataset(lerobot["v3.0"], **kw), batch_size=8,
                                 num_workers=workers))
    batched = list(DataLoader(ShardDataset(lerobot["v3.0"], batch_size=8, **kw),
                              batch_size=None, num_workers=workers))
    assert len(per_sample) == len(batched)
    for a, b in zip(per_sample, batched, strict=True):
        _same(a, b)


def test_pinned_path_on_cpu_matches_the_reference(lerobot):
    kw = dict(delta_timestamps=VIDEO_DELTAS, seed=21, shuffle_buffer=30)
    want = list(DataLoader(ShardDataset(lerobot["v2.1"], **kw), batch_size=8))
    # In-process ring: the producer thread writes straight into reused host buffers.
    got = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
           for b in to_device(ShardDataset(lerobot["v2.1"], batch_size=8, **kw), "cpu", depth=2)]
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        _same(a, b)
    # Batches from DataLoader workers go through the same helper.
    want = list(DataLoader(ShardDataset(lerobot["v2.1"], **kw), batch_size=8, num_workers=2))
    loader = DataLoader(ShardDataset(lerobot["v2.1"], batch_size=8, **kw), batch_size=None,
                        num_workers=2)
    for a, b in zip(want, to_device(loader, "cpu"), strict=True):
        _same(a, b)


def test_readahead_is_bounded_and_batched(lerobot):
    # A budget below one file: still progresses (one file at a time), the same samples.
    small = ShardDataset(lerobot["v2.1"], video=False, seed=1, readahead_bytes=1,
                         batch_size=16)
    big = ShardDataset(lerobot["v2.1"], video=False, seed=1, batch_size=16)
    a = [b["index"].tolist() for b in small]
    assert small.stats["fetch_calls"] == small.stats["fetched_files"] == EPISODES
    b = [b["index"].tolist() for b in big]
    assert a == b
    assert big.stats["fetched_files"] == EPISODES and big.stats["fetch_calls"] < EPISODES


def _rank_main(rank: int, world: int, root: str, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ds = ShardDataset(root, video=False, seed=4)
        got = indices(DataLoader(ds, batch_size=4, num_workers=1))
        np.save(os.path.join(out, f"rank{rank}.npy"), np.array(got + [ds.rank, ds.world_size]))
    finally:
        dist.destroy_process_group()


def test_rank_and_world_size_default_to_torch_distributed(lerobot, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(2, lerobot["v2.1"], port, str(tmp_path)), nprocs=2,
                       start_method="fork")
    r0 = np.load(tmp_path / "rank0.npy").tolist()
    r1 = np.load(tmp_path / "rank1.npy").tolist()
    assert r0[-2:] == [0, 2] and r1[-2:] == [1, 2]
    total = ShardDataset(lerobot["v2.1"], video=False).num_samples
    assert sorted(r0[:-2] + r1[:-2]) == list(range(total))


def _strategy_collate(samples: list[dict]) -> dict:
    """Default collate, plus the sharing strategy of the process that collates (a worker)."""
    from torch.utils.data import default_collate

    batch = default_collate(samples)
    batch["strategy"] = torch.multiprocessing.get_sharing_strategy()
    return batch


def _torch_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("torch_")}


@pytest.mark.parametrize("batched", [False, True])
def test_workers_hand_batches_over_by_shared_memory_name(lerobot, batched):
    """DataLoader workers pass their batches to the training process by shared-memory name
    (torch's ``file_system`` strategy, in the workers only): one descriptor handed over a socket
    per tensor was what bounded many workers. The samples are the same either way, the training
    process keeps torch's setting, and no shared memory is left behind."""
    main_strategy = torch.multiprocessing.get_sharing_strategy()
    before = _torch_shm()
    got = {}
    for sharing in ("file_system", None):
        ds = ShardDataset(lerobot["v3.0"], video=False, seed=2, worker_sharing=sharing,
                          batch_size=8 if batched else None,
                          delta_timestamps={"action": [0.0, 1 / 30]})
        kw = {"batch_size": None} if batched else {"batch_size": 8,
                                                    "collate_fn": _strategy_collate}
        batches = list(DataLoader(ds, num_workers=2, **kw))
        if not batched:
            assert {b.pop("strategy") for b in batches} == {sharing or main_strategy}
        got[sharing] = sorted(((int(i), b["action"][j].tolist()) for b in batches
                               for j, i in enumerate(b["index"])))
        del batches
    assert got["file_system"] == got[None] and len(got[None]) == ds.num_samples
    assert torch.multiprocessing.get_sharing_strategy() == main_strategy
    assert _torch_shm() <= before


def test_worker_sharing_is_checked():
    with pytest.raises(ValueError, match="worker_sharing"):
        ShardDataset(".", worker_sharing="by carrier pigeon")
