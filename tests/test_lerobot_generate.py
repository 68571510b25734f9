"""The synthetic LeRobot generator and the metadata reader, on tiny real datasets.

Everything is read back with the real libraries (pyarrow, PyAV, pandas) and checked against the
layouts in docs/lerobot.md; nothing is mocked.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction
from pathlib import Path

import av
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jpfs.lerobot import layout
from jpfs.lerobot.dataset import detect_version, load_meta
from jpfs.lerobot.fsutil import DatasetError
from jpfs.lerobot.generate import episode_lengths, generate
from jpfs.lerobot.video import probe

TINY = dict(episodes=4, cameras=2, frames_per_episode=(6, 14), resolution=(64, 48),
            state_dim=6, action_dim=7, tasks=3, progress=False)

# Limits small enough that data and video files roll over, with 2 files per chunk folder.
LIMITS = dict(data_file_mb=0.0025, video_file_mb=0.005, chunks_size=2)

V21_INFO_KEYS = {"codebase_version", "robot_type", "total_episodes", "total_frames",
                 "total_tasks", "total_videos", "total_chunks", "chunks_size", "fps", "splits",
                 "data_path", "video_path", "features"}
V30_INFO_KEYS = (V21_INFO_KEYS - {"total_chunks", "total_videos"}) | {
    "data_files_size_in_mb", "video_files_size_in_mb"}


@pytest.fixture(scope="module")
def v21(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gen") / "v21"
    generate(str(root), seed=3, rewards=True, **TINY)
    return root


@pytest.fixture(scope="module")
def v30(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gen") / "v30"
    generate(str(root), format="v3.0", seed=3, rewards=True, workers=1, **LIMITS, **TINY)
    return root


def _info(root: Path) -> dict:
    return json.loads((root / "meta/info.json").read_text())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_v21_layout_and_info(v21: Path):
    info = _info(v21)
    assert set(info) == V21_INFO_KEYS
    n_eps, n_cams = TINY["episodes"], TINY["cameras"]
    lengths = [e["length"] for e in _jsonl(v21 / "meta/episodes.jsonl")]
    assert info["codebase_version"] == "v2.1"
    assert info["total_episodes"] == len(lengths) == n_eps
    assert info["total_frames"] == sum(lengths)
    assert info["total_videos"] == n_eps * n_cams
    assert info["total_chunks"] == 1 and info["chunks_size"] == 1000
    assert info["splits"] == {"train": f"0:{n_eps}"}
    assert info["data_path"] == "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    assert info["video_path"] == (
        "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4")
    video_keys = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    assert len(video_keys) == n_cams
    for key in video_keys:
        ft = info["features"][key]
        assert ft["shape"] == [48, 64, 3]
        assert {"video.fps", "video.height", "video.width", "video.codec",
                "video.pix_fmt"} <= set(ft["info"])
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert info["features"][name]["shape"] == [1]
    expected = {"meta/info.json", "meta/episodes.jsonl", "meta/episodes_stats.jsonl",
                "meta/tasks.jsonl"}
    for ep in range(n_eps):
        expected.add(f"data/chunk-000/episode_{ep:06d}.parquet")
        for key in video_keys:
            expected.add(f"videos/chunk-000/{key}/episode_{ep:06d}.mp4")
    assert set(_files(v21)) == expected


def test_v21_meta_files(v21: Path):
    info = _info(v21)
    episodes = _jsonl(v21 / "meta/episodes.jsonl")
    tasks = _jsonl(v21 / "meta/tasks.jsonl")
    stats = _jsonl(v21 / "meta/episodes_stats.jsonl")
    assert [e["episode_index"] for e in episodes] == list(range(len(episodes)))
    assert all(set(e) == {"episode_index", "tasks", "length"} for e in episodes)
    assert [t["task_index"] for t in tasks] == list(range(len(tasks)))
    assert {t for e in episodes for t in e["tasks"]} == {t["task"] for t in tasks}
    assert info["total_tasks"] == len(tasks)
    for e, s in zip(episodes, stats, strict=True):
        assert s["episode_index"] == e["episode_index"]
        assert set(s["stats"]) == set(info["features"])
        for name, st in s["stats"].items():
            assert set(st) == {"min", "max", "mean", "std", "count"}
            if info["features"][name]["dtype"] == "video":
                assert len(st["mean"]) == 3 and st["mean"][0] == [[st["mean"][0][0][0]]]
                assert all(0.0 <= v[0][0] <= 1.0 for v in st["max"])
            else:
                assert st["count"] == [e["length"]]


def test_v21_parquet_columns_and_values(v21: Path):
    info = _info(v21)
    episodes = _jsonl(v21 / "meta/episodes.jsonl")
    task_of = {t["task"]: t["task_index"] for t in _jsonl(v21 / "meta/tasks.jsonl")}
    fps = info["fps"]
    running = 0
    for e in episodes:
        t = pq.read_table(v21 / layout.v21_data_path(info, e["episode_index"]))
        assert t.column_names == ["action", "observation.state", "next.reward", "next.done",
                                  "timestamp", "frame_index", "episode_index", "index",
                                  "task_index"]
        assert t.schema.field("timestamp").type == pa.float32()
        for name in ("frame_index", "episode_index", "index", "task_index"):
            assert t.schema.field(name).type == pa.int64()
        assert t.schema.field("observation.state").type == pa.list_(pa.float32(), 6)
        assert t.schema.field("action").type == pa.list_(pa.float32(), 7)
        assert t.schema.field("next.done").type == pa.bool_()
        n = e["length"]
        assert t.num_rows == n
        d = t.to_pydict()
        assert d["frame_index"] == list(range(n))
        assert d["timestamp"] == [pytest.approx(i / fps, abs=1e-6) for i in range(n)]
        assert d["index"] == list(range(running, running + n))
        assert set(d["episode_index"]) == {e["episode_index"]}
        assert set(d["task_index"]) == {task_of[e["tasks"][0]]}
        assert d["next.done"] == [False] * (n - 1) + [True]
        running += n


def test_videos_decode_to_episode_length_and_pts(v21: Path):
    meta = load_meta(str(v21))
    for ep in meta.episodes:
        for key, seg in ep.videos.items():
            with av.open(str(v21 / seg.path)) as c:
                s = c.streams.video[0]
                times = [Fraction(f.pts) * s.time_base for f in c.decode(s)]
                assert (s.codec_context.width, s.codec_context.height) == (64, 48)
            assert times == [Fraction(i, meta.fps) for i in range(ep.length)], (key, ep.index)
            assert seg.to_timestamp == pytest.approx(ep.length / meta.fps)


def test_load_meta_v21(v21: Path):
    meta = load_meta(str(v21))
    info = _info(v21)
    assert meta.version == "v2.1" == detect_version(str(v21))
    assert meta.fps == info["fps"]
    assert meta.total_frames == info["total_frames"]
    assert meta.video_keys == tuple(k for k, f in info["features"].items()
                                    if f["dtype"] == "video")
    assert meta.tasks == {t["task_index"]: t["task"] for t in _jsonl(v21 / "meta/tasks.jsonl")}
    assert meta.data_files == tuple(ep.data_file for ep in meta.episodes)
    _check_episodes_against_data(v21, meta)


def _check_episodes_against_data(root: Path, meta) -> None:
    """Every episode's recorded row range holds exactly that episode's frames."""
    tables = {f: pq.read_table(root / f) for f in meta.data_files}
    assert sum(t.num_rows for t in tables.values()) == meta.total_frames
    for ep in meta.episodes:
        rows = tables[ep.data_file].slice(ep.row_start, ep.length).to_pydict()
        assert rows["episode_index"] == [ep.index] * ep.length
        assert rows["frame_index"] == list(range(ep.length))
        assert rows["index"] == list(range(ep.dataset_from, ep.dataset_to))
        assert {meta.tasks[i] for i in rows["task_index"]} == set(ep.tasks)


def test_v30_layout_info_and_meta(v30: Path):
    info = _info(v30)
    assert set(info) == V30_INFO_KEYS
    assert info["codebase_version"] == "v3.0"
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == (
        "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4")
    assert isinstance(info["fps"], int)
    for ft in info["features"].values():
        assert ("fps" in ft) == (ft["dtype"] != "video")
    files = set(_files(v30))
    assert {"meta/info.json", "meta/stats.json", "meta/tasks.parquet",
            "meta/episodes/chunk-000/file-000.parquet"} <= files
    data = sorted(f for f in files if f.startswith("data/"))
    assert len(data) > 2 and any(f.startswith("data/chunk-001/") for f in data)
    n_cams = TINY["cameras"]
    assert len([f for f in files if f.startswith("videos/")]) > n_cams  # video rollover too
    for f in files - {"meta/info.json", "meta/stats.json", "meta/tasks.parquet"}:
        assert f.startswith(("data/chunk-", "videos/observation.images.", "meta/episodes/chunk-"))
    tasks = pd.read_parquet(v30 / "meta/tasks.parquet")
    assert tasks.index.name == "task" and list(tasks.columns) == ["task_index"]
    eps = pq.read_table(v30 / "meta/episodes/chunk-000/file-000.parquet")
    cols = set(eps.column_names)
    assert {"episode_index", "tasks", "length", "data/chunk_index", "data/file_index",
            "dataset_from_index", "dataset_to_index", "meta/episodes/chunk_index",
            "meta/episodes/file_index"} <= cols
    for key in (k for k, f in info["features"].items() if f["dtype"] == "video"):
        for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            assert f"videos/{key}/{c}" in cols
    for name in info["features"]:
        for stat in ("min", "max", "mean", "std", "count"):
            assert f"stats/{name}/{stat}" in cols
    stats = json.loads((v30 / "meta/stats.json").read_text())
    assert set(stats) == set(info["features"])
    assert stats["index"]["count"] == [info["total_frames"]]
    assert stats["index"]["max"] == [info["total_frames"] - 1]


def test_load_meta_v30(v21: Path, v30: Path):
    meta = load_meta(str(v30))
    old = load_meta(str(v21))
    assert meta.version == "v3.0" == detect_version(str(v30))
    assert meta.total_frames == old.total_frames
    assert meta.tasks == old.tasks
    assert [(e.index, e.length, e.tasks, e.dataset_from, e.dataset_to) for e in meta.episodes] \
        == [(e.index, e.length, e.tasks, e.dataset_from, e.dataset_to) for e in old.episodes]
    assert len(meta.data_files) < len(meta.episodes) or len(meta.episodes) == 1
    _check_episodes_against_data(v30, meta)
    # Video segments tile each file: consecutive, starting at 0 in every new file.
    for key in meta.video_keys:
        prev = None
        for ep in meta.episodes:
            seg = ep.videos[key]
            if prev is None or prev.path != seg.path:
                assert seg.from_timestamp == 0.0
            else:
                assert seg.from_timestamp == pytest.approx(prev.to_timestamp)
            assert seg.to_timestamp - seg.from_timestamp == pytest.approx(ep.length / meta.fps)
            prev = seg


def test_v30_is_conversion_of_v21(v21: Path, v30: Path, tmp_path: Path):
    from jpfs.lerobot.convert import convert

    out = tmp_path / "converted"
    convert(str(v21), str(out), workers=1, progress=False, **LIMITS)
    assert _files(out) == _files(v30)


def test_deterministic(tmp_path: Path, v21: Path):
    again = tmp_path / "again"
    generate(str(again), seed=3, rewards=True, **TINY)
    a, b = _files(v21), _files(again)
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(".parquet") or name.startswith("meta/"):
            assert a[name] == b[name], name
    meta = load_meta(str(again))
    for ep in meta.episodes:
        for seg in ep.videos.values():
            assert probe_frames(again / seg.path) == probe_frames(v21 / seg.path) == ep.length
    other = tmp_path / "other"
    generate(str(other), seed=4, rewards=True, **TINY)
    assert _files(other)["data/chunk-000/episode_000000.parquet"] != \
        a["data/chunk-000/episode_000000.parquet"]


def probe_frames(path: Path) -> int:
    import fsspec

    return probe(fsspec.filesystem("file"), str(path)).frames


def test_stub_videos(tmp_path: Path):
    root = tmp_path / "stub"
    figures = generate(str(root), episodes=2, cameras=1, frames_per_episode=5, video="stub",
                       video_bytes=3000, progress=False)
    assert figures["video"].startswith("stub")
    info = _info(root)
    key = layout.camera_keys(1)[0]
    assert info["features"][key]["info"]["video.codec"] == layout.STUB_CODEC
    meta = load_meta(str(root))
    for ep in meta.episodes:
        path = root / ep.videos[key].path
        assert path.stat().st_size == 3000
        assert probe_frames(path) == 5


def test_synth_frames_samples_match_full_episode():
    from jpfs.lerobot.video import synth_frames

    full = synth_frames(40, 12, 16, seed=5)
    pick = [0, 7, 39]
    assert (synth_frames(40, 12, 16, seed=5, indices=pick) == full[pick]).all()
    assert not (full[0] == full[1]).all()  # the frames move


def test_episode_lengths_in_range():
    lengths = episode_lengths(200, (200, 800), seed=1)
    assert all(200 <= n <= 800 for n in lengths)
    assert len(set(lengths)) > 50
    assert lengths == episode_lengths(200, (200, 800), seed=1)


def test_generate_refuses_non_empty(tmp_path: Path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        generate(str(tmp_path), episodes=1, cameras=0, frames_per_episode=2, progress=False)
    assert (tmp_path / "x").read_text() == "keep me"


def test_bench_gen_cli(tmp_path: Path):
    import subprocess
    import sys

    root = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "jpfs.cli.main", "bench", "gen", str(root), "--episodes", "3",
         "--cameras", "1", "--frames-per-episode", "4-6", "--video", "stub", "--video-bytes",
         "2K", "--no-progress", "--json"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    meta = load_meta(str(root))
    assert (figures["episodes"], figures["frames"]) == (len(meta.episodes), meta.total_frames)
    assert figures["files"] == len(_files(root)) and figures["video"].startswith("stub")
    assert "episodes" in proc.stdout and "bytes" in proc.stdout


def test_meta_errors_name_the_file(tmp_path: Path, v21: Path):
    with pytest.raises(DatasetError, match=r"meta/info\.json: missing"):
        detect_version(str(tmp_path))
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta/info.json").write_text(json.dumps({"codebase_version": "v1.6"}))
    with pytest.raises(DatasetError, match=r"info\.json.*v1\.6"):
        load_meta(str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    for name, data in _files(v21).items():
        if name != "meta/episodes.jsonl":
            os.makedirs(broken / os.path.dirname(name), exist_ok=True)
            (broken / name).write_bytes(data)
    with pytest.raises(DatasetError, match=r"meta/episodes\.jsonl: missing"):
        load_meta(str(broken))
