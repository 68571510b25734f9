"""Image features (frames stored in the parquet, as ``LeRobotDataset.create(use_videos=False)``
writes them) and LeRobot's default keys, on real datasets.

The datasets are JPFS-generated v2.1 episodes to which image columns are added the way LeRobot
stores them (HF datasets ``Image()``: ``struct<bytes: binary, path: string>``, PNG and JPEG), and
the v3.0 conversion of that. References are computed independently: each row's image decoded
with Pillow and converted as torchvision's ``ToTensor`` (LeRobot's ``hf_transform_to_torch``)
does, ``uint8 -> float32, / 255``, windows clamped to the episode with pandas.
"""

from __future__ import annotations

import glob
import io
import json
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from jpfs.torch import ShardDataset, to_device

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

FPS = 10
PNG = "observation.images.front"  # lossless
JPG = "observation.images.wrist"  # lossy: decoded by the same library as LeRobot's
H, W = 12, 16
DELTAS = {PNG: [-1 / FPS, 0.0, 2 / FPS], "action": [0.0, 1 / FPS]}


def _encode(rng: np.random.Generator, fmt: str) -> bytes:
    img = rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt)
    return buf.getvalue()


def _add_images(root: str) -> None:
    """Add two image features to every episode parquet and to meta/info.json."""
    info_path = os.path.join(root, "meta", "info.json")
    info = json.load(open(info_path))
    for key in (PNG, JPG):
        info["features"][key] = {"dtype": "image", "shape": [H, W, 3],
                                 "names": ["height", "width", "channel"]}
    json.dump(info, open(info_path, "w"), indent=4)
    img_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for n, path in enumerate(sorted(glob.glob(f"{root}/data/*/*.parquet"))):
        table = pq.read_table(path)
        rng = np.random.default_rng(n)
        md = json.loads(table.schema.metadata[b"huggingface"])
        for key, fmt in ((PNG, "PNG"), (JPG, "JPEG")):
            rows = [{"bytes": _encode(rng, fmt), "path": f"frame_{i:06d}.{fmt.lower()}"}
                    for i in range(table.num_rows)]
            table = table.append_column(key, pa.array(rows, img_type))
            md["info"]["features"][key] = {"_type": "Image"}
        table = table.replace_schema_metadata({b"huggingface": json.dumps(md).encode()})
        pq.write_table(table, path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from jpfs.lerobot.convert import convert
    from jpfs.lerobot.generate import generate
    from jpfs.lerobot.verify import verify

    base = tmp_path_factory.mktemp("images")
    v21, v30 = str(base / "v21"), str(base / "v30")
    generate(v21, episodes=6, cameras=0, frames_per_episode=(4, 14), fps=FPS, seed=3,
             state_dim=3, action_dim=2, progress=False)
    _add_images(v21)
    convert(v21, v30, data_file_mb=0.02, progress=False)
    assert len(glob.glob(f"{v30}/data/*/*.parquet")) >= 2
    report = verify(v21, v30, workers=1, progress=False)  # image columns compare too
    assert report["ok"] and report["frames_checked"] > 0, report["problems"]
    return {"v2.1": v21, "v3.0": v30}


def _frames(root: str) -> pd.DataFrame:
    files = sorted(glob.glob(f"{root}/data/*/*.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files]).set_index("index", drop=False)


def _to_tensor(blob: bytes) -> torch.Tensor:
    """torchvision.transforms.ToTensor on the PIL image HF datasets decodes."""
    with Image.open(io.BytesIO(blob)) as img:
        a = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
    return a.to(dtype=torch.float32).div(255)


def _want(df: pd.DataFrame, i: int, key: str, deltas: list[float] | None):
    ep = df.at[i, "episode_index"]
    rows = df.index[df["episode_index"] == ep]
    lo, hi = rows.min(), rows.max()
    if deltas is None:
        return _to_tensor(df.at[i, key]["bytes"]), None
    q = [i + round(d * FPS) for d in deltas]
    imgs = torch.stack([_to_tensor(df.at[min(max(j, lo), hi), key]["bytes"]) for j in q])
    return imgs, torch.tensor([j < lo or j > hi for j in q])


def _samples(loader) -> list[dict]:
    out = []
    for b in loader:
        out += [{k: (v[j].clone() if isinstance(v, torch.Tensor) else v[j]) for k, v in b.items()}
                for j in range(len(b["index"]))]
    return out


def test_image_features_are_returned_as_lerobot_does(images):
    root = images["v2.1"]
    df = _frames(root)
    tasks = {int(r["task_index"]): r["task"] for r in
             map(json.loads, open(f"{root}/meta/tasks.jsonl"))}
    ds = ShardDataset(root, seed=1, shuffle_buffer=20)
    samples = _samples(DataLoader(ds, batch_size=5, num_workers=0))
    assert sorted(int(s["index"]) for s in samples) == sorted(df.index)
    for s in samples:
        i = int(s["index"])
        # LeRobotDataset's keys: every feature, and the task string, without being asked.
        assert {PNG, JPG, "action", "observation.state", "task"} <= set(s)
        assert s["task"] == tasks[int(df.at[i, "task_index"])]
        for key in (PNG, JPG):
            assert s[key].shape == (3, H, W) and s[key].dtype == torch.float32
            assert torch.equal(s[key], _want(df, i, key, None)[0]), (i, key)


@pytest.mark.parametrize("fmt", ["v2.1", "v3.0"])
def test_image_windows_and_pads_in_dataloader_workers(images, fmt):
    root = images[fmt]
    df = _frames(root)
    ds = ShardDataset(root, delta_timestamps=DELTAS, seed=2, shuffle_buffer=16)
    samples = _samples(DataLoader(ds, batch_size=4, num_workers=2))
    assert len(samples) == len(df)
    pads = 0
    for s in samples:
        i = int(s["index"])
        want, pad = _want(df, i, PNG, DELTAS[PNG])
        assert s[PNG].shape == (3, 3, H, W)
        assert torch.equal(s[PNG], want), i
        assert torch.equal(s[f"{PNG}_is_pad"], pad), i
        assert torch.equal(s[JPG], _want(df, i, JPG, None)[0]), i
        pads += int(pad.sum())
    assert pads > 0  # both episode edges were exercised


def test_v21_and_v30_with_images_yield_the_same_batches(images):
    kw = dict(delta_timestamps=DELTAS, seed=4, shuffle_buffer=16, batch_size=6)
    a = list(DataLoader(ShardDataset(images["v2.1"], **kw), batch_size=None, num_workers=2))
    b = list(DataLoader(ShardDataset(images["v3.0"], **kw), batch_size=None, num_workers=2))
    assert len(a) == len(b) > 1
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        assert x["task"] == y["task"] and isinstance(x["task"], list)
        for k in x:
            if k != "task":
                assert torch.equal(x[k], y[k]), k
    # The pinned pipeline passes the task strings through beside the tensors.
    c = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
         for t in to_device(ShardDataset(images["v2.1"], **kw), "cpu")]
    assert [t["task"] for t in c] == [t["task"] for t in ShardDataset(images["v2.1"], **kw)]


def test_columns_uint8_and_video_false(images):
    root = images["v3.0"]
    df = _frames(root)
    ds = ShardDataset(root, columns=["index", PNG], video_dtype="uint8", with_task=False,
                      delta_timestamps={PNG: [0.0, 1 / FPS]}, shuffle=False)
    got = list(ds)
    assert set(got[0]) == {"index", PNG, f"{PNG}_is_pad"}
    for s in got:
        want = (_want(df, int(s["index"]), PNG, [0.0, 1 / FPS])[0] * 255).round().to(torch.uint8)
        assert s[PNG].dtype == torch.uint8 and torch.equal(s[PNG], want)
    # Tabular only: image features are camera frames, left out unless named.
    plain = next(iter(ShardDataset(root, video=False, delta_timestamps=DELTAS)))
    assert PNG not in plain and JPG not in plain and "action_is_pad" in plain
    named = next(iter(ShardDataset(root, video=False, columns=[JPG, "index"])))
    assert named[JPG].shape == (3, H, W)
    with pytest.raises(KeyError, match="observation.images.nope"):
        ShardDataset(root, columns=["observation.images.nope"])


def test_uint8_to_float_is_lerobots_division():
    # Every uint8 value, converted the way ShardDataset does it, equals torch's u8.float() / 255
    # (what LeRobot's video decoders and ToTensor do); u8 * (1 / 255) does not.
    from jpfs.torch.assemble import to_float

    u8 = np.arange(256, dtype=np.uint8)
    out = np.empty(256, np.float32)
    to_float(u8, out)
    want = torch.from_numpy(u8).to(torch.float32) / 255
    assert torch.equal(torch.from_numpy(out), want)
    assert not np.array_equal(u8 * np.float32(1 / 255), want.numpy())
