"""LeRobot v2.1 and v3.0 layouts: path templates, constants, features and info.json builders.

Everything here follows docs/lerobot.md (read from huggingface/lerobot v0.3.3 and main), so
that datasets JPFS writes are read by LeRobot and datasets LeRobot writes are read by JPFS.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pyarrow as pa

V21 = "v2.1"
V30 = "v3.0"
VERSIONS = (V21, V30)

CHUNKS_SIZE = 1000  # episodes per chunk folder (v2.1), files per chunk folder (v3.0)
DEFAULT_DATA_FILE_MB = 100
DEFAULT_VIDEO_FILE_MB = 200

INFO_PATH = "meta/info.json"

V21_EPISODES_PATH = "meta/episodes.jsonl"
V21_EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
V21_TASKS_PATH = "meta/tasks.jsonl"
V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_EPISODES_GLOB = "meta/episodes/chunk-*/file-*.parquet"
V30_TASKS_PATH = "meta/tasks.parquet"
V30_STATS_PATH = "meta/stats.json"

# Columns every LeRobot frame table has, after the dataset's own features.
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}

STUB_CODEC = "jpfs-stub"  # video.codec of stand-in videos (bytes, not decodable)
CAMERA_NAMES = ("cam_high", "cam_left_wrist", "cam_right_wrist", "cam_low")

_ARROW_TYPES = {
    "float32": pa.float32(),
    "float64": pa.float64(),
    "int64": pa.int64(),
    "int32": pa.int32(),
    "int16": pa.int16(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
    "bool": pa.bool_(),
    "string": pa.string(),
}


def episode_chunk(episode_index: int, chunks_size: int = CHUNKS_SIZE) -> int:
    """The v2.1 chunk folder of an episode."""
    return episode_index // chunks_size


def v21_data_path(info: dict, episode_index: int) -> str:
    """Relative path of a v2.1 episode parquet, from info.json's template."""
    chunk = episode_chunk(episode_index, info.get("chunks_size", CHUNKS_SIZE))
    return info["data_path"].format(episode_chunk=chunk, episode_index=episode_index)


def v21_video_path(info: dict, video_key: str, episode_index: int) -> str:
    """Relative path of a v2.1 episode mp4, from info.json's template."""
    chunk = episode_chunk(episode_index, info.get("chunks_size", CHUNKS_SIZE))
    return info["video_path"].format(
        episode_chunk=chunk, video_key=video_key, episode_index=episode_index
    )


def v30_data_path(chunk_index: int, file_index: int, info: dict | None = None) -> str:
    """Relative path of a v3.0 data file."""
    template = (info or {}).get("data_path") or V30_DATA_PATH
    return template.format(chunk_index=chunk_index, file_index=file_index)


def v30_video_path(video_key: str, chunk_index: int, file_index: int,
                   info: dict | None = None) -> str:
    """Relative path of a v3.0 video file."""
    template = (info or {}).get("video_path") or V30_VIDEO_PATH
    return template.format(video_key=video_key, chunk_index=chunk_index, file_index=file_index)


def next_chunk_file(chunk_index: int, file_index: int, chunks_size: int) -> tuple[int, int]:
    """The (chunk, file) after this one: ``chunks_size`` files per chunk folder."""
    file_index += 1
    if file_index >= chunks_size:
        return chunk_index + 1, 0
    return chunk_index, file_index


def camera_keys(cameras: int) -> list[str]:
    """Feature names of ``cameras`` cameras, ALOHA-style names first."""
    names = [CAMERA_NAMES[i] if i < len(CAMERA_NAMES) else f"cam_{i}" for i in range(cameras)]
    return [f"observation.images.{n}" for n in names]


def video_feature(height: int, width: int, fps: int, codec: str,
                  pix_fmt: str = "yuv420p") -> dict[str, Any]:
    """The features entry of one camera, as LeRobot's encoder records it."""
    return {
        "dtype": "video",
        "shape": [height, width, 3],
        "names": ["height", "width", "channels"],
        "info": {
            "video.height": height,
            "video.width": width,
            "video.codec": codec,
            "video.pix_fmt": pix_fmt,
            "video.is_depth_map": False,
            "video.fps": fps,
            "video.channels": 3,
            "has_audio": False,
        },
    }


def make_features(state_dim: int, action_dim: int, video_keys: list[str], height: int, width: int,
                  fps: int, codec: str, rewards: bool = False) -> dict[str, dict[str, Any]]:
    """The ``features`` block of a robot dataset: action, state, cameras, then the defaults."""
    features: dict[str, dict[str, Any]] = {
        "action": {"dtype": "float32", "shape": [action_dim],
                   "names": [f"motor_{i}" for i in range(action_dim)]},
        "observation.state": {"dtype": "float32", "shape": [state_dim],
                              "names": [f"motor_{i}" for i in range(state_dim)]},
    }
    for key in video_keys:
        features[key] = video_feature(height, width, fps, codec)
    if rewards:
        features["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
        features["next.done"] = {"dtype": "bool", "shape": [1], "names": None}
    features.update(copy.deepcopy(DEFAULT_FEATURES))
    return features


def info_v21(features: dict, fps: int, total_episodes: int, total_frames: int, total_tasks: int,
             robot_type: str = "aloha", chunks_size: int = CHUNKS_SIZE) -> dict[str, Any]:
    """A v2.1 meta/info.json, keys in LeRobot's order."""
    n_video = sum(1 for ft in features.values() if ft["dtype"] == "video")
    return {
        "codebase_version": V21,
        "robot_type": robot_type,
        "total_episodes": total_episodes,
        "total_frames": total_frames,
        "total_tasks": total_tasks,
        "total_videos": total_episodes * n_video,
        "total_chunks": max(1, -(-total_episodes // chunks_size)),
        "chunks_size": chunks_size,
        "fps": fps,
        "splits": {"train": f"0:{total_episodes}"},
        "data_path": V21_DATA_PATH,
        "video_path": V21_VIDEO_PATH if n_video else None,
        "features": copy.deepcopy(features),
    }


def info_v30_from_v21(info: dict, data_mb: float, video_mb: float,
                      chunks_size: int = CHUNKS_SIZE) -> dict[str, Any]:
    """The v3.0 info.json the official converter writes from a v2.1 one."""
    out = copy.deepcopy(info)
    out["codebase_version"] = V30
    out.pop("total_chunks", None)
    out.pop("total_videos", None)
    out["chunks_size"] = chunks_size
    out["data_files_size_in_mb"] = _number(data_mb)
    out["video_files_size_in_mb"] = _number(video_mb)
    out["data_path"] = V30_DATA_PATH
    has_video = any(ft["dtype"] == "video" for ft in out["features"].values())
    out["video_path"] = V30_VIDEO_PATH if has_video else None
    out["fps"] = int(out["fps"])
    for ft in out["features"].values():
        if ft["dtype"] != "video":
            ft["fps"] = out["fps"]
    return out


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def video_keys_of(features: dict) -> list[str]:
    """Camera keys in features order (LeRobot's ``video_keys``)."""
    return [k for k, ft in features.items() if ft.get("dtype") == "video"]


def frame_columns(features: dict) -> list[str]:
    """The parquet columns of frame tables: every feature but videos (images live in parquet)."""
    return [k for k, ft in features.items() if ft.get("dtype") != "video"]


def arrow_type(feature: dict) -> pa.DataType:
    """The Arrow type LeRobot (via HF datasets) stores a feature as."""
    try:
        base = _ARROW_TYPES[feature["dtype"]]
    except KeyError:
        raise ValueError(f"unsupported feature dtype {feature['dtype']!r}") from None
    shape = list(feature.get("shape") or [1])
    if shape == [1]:
        return base
    if len(shape) == 1:
        return pa.list_(base, shape[0])
    raise ValueError(f"unsupported feature shape {shape} (only scalars and vectors)")


def arrow_schema(features: dict) -> pa.Schema:
    """The schema of frame parquet files, with HF datasets' feature metadata."""
    cols = frame_columns(features)
    fields = [pa.field(k, arrow_type(features[k])) for k in cols]
    hf = {"info": {"features": {k: _hf_feature(features[k]) for k in cols}}}
    return pa.schema(fields, metadata={b"huggingface": json.dumps(hf).encode()})


def _hf_feature(feature: dict) -> dict[str, Any]:
    value = {"dtype": feature["dtype"], "_type": "Value"}
    shape = list(feature.get("shape") or [1])
    if shape == [1]:
        return value
    return {"feature": value, "length": shape[0], "_type": "Sequence"}
