"""Synthetic LeRobot datasets: structurally faithful, seeded, any size.

Benchmarks and tests need datasets shaped like real robot data (hundreds of frames per episode, a
few cameras, a parquet and an mp4 per camera per episode) without downloading any. The generator
writes the real meta files, real parquet columns and dtypes, and per camera either a real tiny
encoded video (PyAV) or a sized stand-in ("stub"). The same arguments give byte-identical parquet
and meta files; encoded videos may differ by encoder build, but never in frames or timestamps.

v3.0 datasets are generated as v2.1 into a temporary folder and converted, so they are exactly
what :func:`jpfs.lerobot.convert.convert` makes of the v2.1 dataset of the same seed.
"""

from __future__ import annotations

import logging
import posixpath
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from . import layout, stats
from . import video as vio
from .fsutil import (
    get_fs,
    is_local,
    join,
    jsonl_bytes,
    write_bytes,
    write_json,
    write_parquet_table,
)
from .workers import default_workers, worker_pool

log = logging.getLogger(__name__)

__all__ = ["generate", "episode_lengths", "DEFAULT_TASKS"]

DEFAULT_TASKS = (
    "pick up the red cube and place it in the bin",
    "open the top drawer",
    "fold the towel in half",
    "insert the peg into the hole",
    "stack the blue block on the green block",
    "pour the beans into the bowl",
    "hang the mug on the rack",
    "wipe the table with the sponge",
)
IMAGE_STAT_SAMPLES = 100  # frames per episode that camera stats are computed from, as LeRobot


def episode_lengths(episodes: int, frames_per_episode: int | tuple[int, int] | list[int],
                    seed: int) -> list[int]:
    """Each episode's frame count: fixed, uniform in [lo, hi] from the seed, or a list of one
    count per episode."""
    if isinstance(frames_per_episode, list):
        if len(frames_per_episode) != episodes or min(frames_per_episode, default=1) < 1:
            raise ValueError(f"frames_per_episode lists {len(frames_per_episode)} counts for "
                             f"{episodes} episodes (each at least 1)")
        return [int(n) for n in frames_per_episode]
    if isinstance(frames_per_episode, int):
        if frames_per_episode < 1:
            raise ValueError("frames_per_episode must be at least 1")
        return [frames_per_episode] * episodes
    lo, hi = frames_per_episode
    if not 1 <= lo <= hi:
        raise ValueError(f"bad frames_per_episode range {lo}-{hi}")
    rng = np.random.default_rng([seed, 0])
    return [int(x) for x in rng.integers(lo, hi + 1, size=episodes)]


def _task_strings(tasks: int | Sequence[str]) -> list[str]:
    if isinstance(tasks, int):
        if tasks < 1:
            raise ValueError("tasks must be at least 1")
        out = list(DEFAULT_TASKS[:tasks])
        for k in range(len(out), tasks):
            out.append(f"{DEFAULT_TASKS[k % len(DEFAULT_TASKS)]} (variant {k})")
        return out
    out = [str(t) for t in tasks]
    if not out:
        raise ValueError("tasks must not be empty")
    return out


def _walk(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    start = rng.uniform(-1.0, 1.0, size=dim)
    steps = rng.normal(0.0, 0.02, size=(n, dim))
    return (start + np.cumsum(steps, axis=0)).astype(np.float32)


def _fixed_list(values: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def episode_table(schema: pa.Schema, features: dict, index: int, length: int, start: int,
                  task_index: int, fps: int, seed: int) -> pa.Table:
    """The frame table of one episode, columns in ``schema`` order."""
    rng = np.random.default_rng([seed, 1, index])
    frame_index = np.arange(length, dtype=np.int64)
    cols: dict[str, Any] = {
        "timestamp": pa.array((frame_index / fps).astype(np.float32)),
        "frame_index": pa.array(frame_index),
        "episode_index": pa.array(np.full(length, index, np.int64)),
        "index": pa.array(np.arange(start, start + length, dtype=np.int64)),
        "task_index": pa.array(np.full(length, task_index, np.int64)),
    }
    state = _walk(rng, length, features["observation.state"]["shape"][0])
    action_dim = features["action"]["shape"][0]
    action = _walk(rng, length, action_dim)
    shared = min(action_dim, state.shape[1])
    action[:-1, :shared] = state[1:, :shared]  # actions lead the state by one frame
    cols["observation.state"] = _fixed_list(state)
    cols["action"] = _fixed_list(action)
    if "next.reward" in features:
        reward = np.zeros(length, np.float32)
        reward[-1] = 1.0
        done = np.zeros(length, np.bool_)
        done[-1] = True
        cols["next.reward"] = pa.array(reward)
        cols["next.done"] = pa.array(done)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def generate(
    root: str,
    episodes: int = 50,
    cameras: int = 2,
    frames_per_episode: int | tuple[int, int] | list[int] = (200, 800),
    fps: int = 30,
    video: str = "auto",
    video_bytes: int = 256 * 1024,
    format: str = layout.V21,  # noqa: A002 - the name users know from LeRobot
    seed: int = 0,
    state_dim: int = 14,
    action_dim: int = 14,
    tasks: int | Sequence[str] = 4,
    rewards: bool = False,
    resolution: tuple[int, int] = (96, 72),
    codec: str | None = None,
    robot_type: str = "aloha",
    data_file_mb: float = layout.DEFAULT_DATA_FILE_MB,
    video_file_mb: float = layout.DEFAULT_VIDEO_FILE_MB,
    chunks_size: int = layout.CHUNKS_SIZE,
    workers: int | None = None,
    progress: bool = True,
    video_options: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write a synthetic LeRobot dataset at ``root`` (a local path or an fsspec URL).

    Args:
        episodes, cameras: dataset shape; episodes get ``frames_per_episode`` frames (an int, or
            a (lo, hi) range drawn from the seed).
        video: "encoded" (real mp4s via PyAV), "stub" (stand-ins of ``video_bytes`` each), or
            "auto" (encoded when PyAV is installed).
        format: "v2.1", or "v3.0" (generated as v2.1 and converted with the file size limits
            ``data_file_mb``/``video_file_mb`` and ``chunks_size`` files per chunk folder).
        resolution: (width, height) of the cameras; real cameras are 640x480, tests want tiny.
        codec: PyAV encoder or alias (av1, h264, hevc, vp9); default AV1 as LeRobot, else
            H.264.
        video_options: encoder options over the codec's defaults (a keyframe every 2 frames,
            no B-frames), e.g. ``{"g": "30", "bf": "2"}`` for H.264 with B-frames.
        workers: processes writing episodes, and converter workers for v3.0 (default: inline
            for small datasets, one per core for large ones).

    Returns:
        Figures: root, format, episodes, frames, cameras, video kind, files, bytes, seconds.
    """
    if format not in layout.VERSIONS:
        raise ValueError(f"unknown format {format!r} (choose from {', '.join(layout.VERSIONS)})")
    if episodes < 1:
        raise ValueError("episodes must be at least 1")
    if cameras < 0:
        raise ValueError("cameras must be >= 0")
    if video not in ("auto", "encoded", "stub"):
        raise ValueError(f"unknown video kind {video!r} (auto, encoded or stub)")
    t0 = time.perf_counter()
    fs, base = get_fs(root)
    if fs.exists(base) and fs.ls(base):
        raise ValueError(f"{root}: not empty; generate into a new or empty folder")
    if format == layout.V30:
        from .convert import convert

        tmp_parent = posixpath.dirname(base) if is_local(fs) else None
        if tmp_parent:
            fs.makedirs(tmp_parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".jpfs-gen-v21-", dir=tmp_parent)
        try:
            figures = generate(tmp, episodes, cameras, frames_per_episode, fps, video,
                               video_bytes, layout.V21, seed, state_dim, action_dim, tasks,
                               rewards, resolution, codec, robot_type, workers=workers,
                               progress=progress, video_options=video_options)
            convert(tmp, root, data_file_mb, video_file_mb, workers=workers,
                    chunks_size=chunks_size, progress=progress)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return _summary(fs, base, root, layout.V30, figures, t0)

    if video == "auto":
        video = "encoded" if vio.have_av() else "stub"
    return _generate_v21(fs, base, root, episodes, cameras, frames_per_episode, fps, video,
                         video_bytes, seed, state_dim, action_dim, tasks, rewards, resolution,
                         codec, robot_type, progress, t0, workers, video_options or {})


def _generate_v21(fs: Any, base: str, root: str, episodes: int, cameras: int,
                  frames_per_episode: int | tuple[int, int] | list[int], fps: int,
                  video_kind: str, video_bytes: int, seed: int, state_dim: int, action_dim: int,
                  tasks: int | Sequence[str], rewards: bool, resolution: tuple[int, int],
                  codec: str | None, robot_type: str, progress: bool, t0: float,
                  workers: int | None, video_options: dict[str, str]) -> dict[str, Any]:
    width, height = resolution
    encoder = vio.pick_encoder(codec) if video_kind == "encoded" and cameras else None
    codec_name = vio.ENCODERS[encoder][0] if encoder else layout.STUB_CODEC
    keys = layout.camera_keys(cameras)
    features = layout.make_features(state_dim, action_dim, keys, height, width, fps, codec_name,
                                    rewards)
    schema = layout.arrow_schema(features)
    lengths = episode_lengths(episodes, frames_per_episode, seed)
    task_list = _task_strings(tasks)
    rng = np.random.default_rng([seed, 2])
    drawn = [int(x) for x in rng.integers(0, len(task_list), size=episodes)]
    # LeRobot numbers tasks in order of first use.
    task_index: dict[str, int] = {}
    for d in drawn:
        task_index.setdefault(task_list[d], len(task_index))
    info = layout.info_v21(features, fps, episodes, sum(lengths), len(task_index), robot_type)
    job = _EpisodeJob(root, info, schema, encoder, keys, width, height, fps, video_bytes, seed,
                      video_options)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    args = [(ep, length, int(starts[ep]), task_index[task_list[drawn[ep]]])
            for ep, length in enumerate(lengths)]
    if workers is None:  # a pool pays off only once the work outweighs its ~2 s start-up
        frames = sum(lengths) * max(1, cameras)
        workers = 1 if frames < (40_000 if encoder else 400_000) else default_workers()
    bar = tqdm(total=episodes, desc=f"generate {root}", unit="ep", disable=not progress)
    stat_rows = []
    with worker_pool(min(workers, episodes), "process") as pool:  # see workers.py: not threads
        results = (pool.map(job, args, chunksize=max(1, episodes // (8 * workers)))
                   if pool else map(job, args))
        for ep, ordered in enumerate(results):
            stat_rows.append({"episode_index": ep, "stats": ordered})
            bar.update(1)
    bar.close()
    ep_rows = [{"episode_index": ep, "tasks": [task_list[drawn[ep]]], "length": length}
               for ep, length in enumerate(lengths)]
    write_bytes(fs, join(base, layout.V21_TASKS_PATH),
                jsonl_bytes([{"task_index": i, "task": t} for t, i in task_index.items()]))
    write_bytes(fs, join(base, layout.V21_EPISODES_PATH), jsonl_bytes(ep_rows))
    write_bytes(fs, join(base, layout.V21_EPISODES_STATS_PATH), jsonl_bytes(stat_rows))
    write_json(fs, join(base, layout.INFO_PATH), info)  # last: the dataset is valid from here
    kind = "none" if not cameras else (
        f"encoded ({codec_name} {width}x{height}, {encoder})" if encoder else
        f"stub ({video_bytes} B stand-ins)")
    figures = {"video": kind, "cameras": cameras}
    return _summary(fs, base, root, layout.V21, figures, t0)


@dataclass(frozen=True)
class _EpisodeJob:
    """Writes one episode's parquet and videos; returns its stats (picklable for workers)."""

    root: str
    info: dict
    schema: pa.Schema
    encoder: str | None
    keys: list[str]
    width: int
    height: int
    fps: int
    video_bytes: int
    seed: int
    video_options: dict[str, str]

    def __call__(self, arg: tuple[int, int, int, int]) -> dict[str, Any]:
        ep, length, start, task_index = arg
        fs, base = get_fs(self.root)
        features = self.info["features"]
        table = episode_table(self.schema, features, ep, length, start, task_index, self.fps,
                              self.seed)
        ep_stats = stats.table_stats(table, list(self.schema.names))
        write_parquet_table(fs, _mk(fs, join(base, layout.v21_data_path(self.info, ep))), table)
        for cam, key in enumerate(self.keys):
            sample = np.arange(0, length, max(1, length // IMAGE_STAT_SAMPLES))
            cam_seed = hash_seed(self.seed, ep, cam)
            if self.encoder:
                frames = vio.synth_frames(length, self.height, self.width, seed=cam_seed)
                ep_stats[key] = stats.feature_stats(frames[sample], image=True)
                data = vio.encode(frames, self.fps, self.encoder, self.video_options)
            else:
                ep_stats[key] = stats.feature_stats(
                    vio.synth_frames(length, self.height, self.width, cam_seed, sample),
                    image=True)
                data = vio.make_stub(length, self.fps, self.width, self.height,
                                     self.video_bytes, seed=hash_seed(self.seed, ep, cam))
            write_bytes(fs, join(base, layout.v21_video_path(self.info, key, ep)), data)
        return stats.to_json({k: ep_stats[k] for k in features if k in ep_stats})


def hash_seed(*parts: int) -> int:
    """A stable seed from integers (Python's ``hash`` of tuples is not stable across runs)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def _mk(fs: Any, path: str) -> str:
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    return path


def _summary(fs: Any, base: str, root: str, fmt: str, figures: dict[str, Any], t0: float
             ) -> dict[str, Any]:
    info = _read_info(fs, base)
    files = [(p, s) for p, s in _tree(fs, base)]
    return {
        "root": root,
        "format": fmt,
        "episodes": info["total_episodes"],
        "frames": info["total_frames"],
        "cameras": figures.get("cameras"),
        "video": figures.get("video"),
        "files": len(files),
        "bytes": sum(s for _, s in files),
        "data_files": sum(1 for p, _ in files if p.startswith("data/")),
        "video_files": sum(1 for p, _ in files if p.startswith("videos/")),
        "seconds": time.perf_counter() - t0,
    }


def _read_info(fs: Any, base: str) -> dict[str, Any]:
    from .fsutil import read_json

    return read_json(fs, join(base, layout.INFO_PATH))


def _tree(fs: Any, base: str) -> list[tuple[str, int]]:
    """(relative path, size) of every file under ``base``."""
    found = fs.find(base, detail=True)
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    out = []
    for name, entry in found.items():
        rel = fs._strip_protocol(name)[len(prefix):]
        out.append((rel, int(entry.get("size") or 0)))
    return sorted(out)
