"""Dataset metadata of both LeRobot layouts in one shape: where each episode's rows and frames are.

The PyTorch dataset (``jpfs.torch``), the converter and ``jpfs lerobot info`` all read datasets
through :func:`load_meta`, so v2.1 (a file per episode) and v3.0 (many episodes per file) look the
same to them: an episode is a row range of one parquet file plus a time range of one video file per
camera. ``root`` is a local path or an fsspec URL (``jpfs://...``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import fsspec

from . import layout
from .fsutil import DatasetError, get_fs, join, read_json, read_jsonl, read_table

log = logging.getLogger(__name__)

__all__ = ["VideoSegment", "EpisodeInfo", "DatasetMeta", "detect_version", "load_meta"]


@dataclass(frozen=True)
class VideoSegment:
    """An episode's frames of one camera: ``path`` (relative to the root) from/to in seconds."""

    path: str
    from_timestamp: float
    to_timestamp: float


@dataclass(frozen=True)
class EpisodeInfo:
    """One episode: its rows (``length`` rows of ``data_file`` from ``row_start``) and videos."""

    index: int
    length: int
    tasks: tuple[str, ...]
    data_file: str
    row_start: int
    dataset_from: int
    dataset_to: int
    videos: dict[str, VideoSegment] = field(hash=False)


@dataclass(frozen=True)
class DatasetMeta:
    """Everything a reader needs before opening a data file."""

    root: str
    version: str
    fps: int
    info: dict = field(hash=False)
    features: dict = field(hash=False)
    episodes: tuple[EpisodeInfo, ...]
    tasks: dict[int, str] = field(hash=False)
    video_keys: tuple[str, ...]
    data_files: tuple[str, ...]
    total_frames: int

    def episode(self, index: int) -> EpisodeInfo:
        """The episode with this ``episode_index`` (episodes need not start at 0)."""
        ep = self.episodes[index] if 0 <= index < len(self.episodes) else None
        if ep is not None and ep.index == index:
            return ep
        for ep in self.episodes:
            if ep.index == index:
                return ep
        raise KeyError(f"no episode {index} in {self.root}")

    def video_files(self) -> tuple[str, ...]:
        """Every video file, ordered by camera then first use, without repeats."""
        seen: dict[str, None] = {}
        for key in self.video_keys:
            for ep in self.episodes:
                seen.setdefault(ep.videos[key].path, None)
        return tuple(seen)


def detect_version(root: str, fs: fsspec.AbstractFileSystem | None = None) -> str:
    """``"v2.1"`` or ``"v3.0"``, from meta/info.json's ``codebase_version``."""
    fs, base = _resolve(root, fs)
    return _version_of(read_json(fs, join(base, layout.INFO_PATH)), join(base, layout.INFO_PATH))


def load_meta(root: str, fs: fsspec.AbstractFileSystem | None = None) -> DatasetMeta:
    """Read a dataset's metadata (never its data files) into a :class:`DatasetMeta`.

    Raises:
        DatasetError: naming the missing or malformed meta file.
    """
    fs, base = _resolve(root, fs)
    info_path = join(base, layout.INFO_PATH)
    info = read_json(fs, info_path)
    version = _version_of(info, info_path)
    for key in ("fps", "features"):
        if key not in info:
            raise DatasetError(info_path, f"has no {key!r}")
    features = info["features"]
    video_keys = tuple(layout.video_keys_of(features))
    if version == layout.V21:
        tasks, episodes = _load_v21(fs, base, info, video_keys)
    else:
        tasks, episodes = _load_v30(fs, base, info, video_keys)
    data_files = tuple(dict.fromkeys(ep.data_file for ep in episodes))
    total = sum(ep.length for ep in episodes)
    if info.get("total_frames") not in (None, total):
        log.warning("%s: total_frames %s, episodes sum to %d", info_path, info["total_frames"],
                    total)
    return DatasetMeta(
        root=str(root).rstrip("/") or "/",
        version=version,
        fps=int(info["fps"]),
        info=info,
        features=features,
        episodes=tuple(episodes),
        tasks=tasks,
        video_keys=video_keys,
        data_files=data_files,
        total_frames=total,
    )


def _resolve(root: str, fs: fsspec.AbstractFileSystem | None) -> tuple[Any, str]:
    if fs is None:
        return get_fs(root)
    return fs, fs._strip_protocol(str(root)).rstrip("/") or "/"


def _version_of(info: Any, path: str) -> str:
    if not isinstance(info, dict):
        raise DatasetError(path, "is not a JSON object")
    version = info.get("codebase_version")
    if version not in layout.VERSIONS:
        raise DatasetError(path, f"codebase_version {version!r} is not one JPFS reads "
                                 f"({', '.join(layout.VERSIONS)})")
    return version


def _load_v21(fs: Any, base: str, info: dict, video_keys: tuple[str, ...]
              ) -> tuple[dict[int, str], list[EpisodeInfo]]:
    tasks_path = join(base, layout.V21_TASKS_PATH)
    tasks: dict[int, str] = {}
    for row in read_jsonl(fs, tasks_path):
        try:
            tasks[int(row["task_index"])] = str(row["task"])
        except (KeyError, TypeError, ValueError):
            raise DatasetError(tasks_path, f"bad task line {row!r}") from None
    eps_path = join(base, layout.V21_EPISODES_PATH)
    rows = read_jsonl(fs, eps_path)
    try:
        rows.sort(key=lambda r: int(r["episode_index"]))
    except (KeyError, TypeError, ValueError):
        raise DatasetError(eps_path, "every line needs an integer episode_index") from None
    if video_keys and not info.get("video_path"):
        raise DatasetError(join(base, layout.INFO_PATH), "has video features but no video_path")
    fps = int(info["fps"])
    episodes = []
    start = 0
    for row in rows:
        try:
            index, length = int(row["episode_index"]), int(row["length"])
            ep_tasks = tuple(str(t) for t in row.get("tasks", ()))
        except (KeyError, TypeError, ValueError):
            raise DatasetError(eps_path, f"bad episode line {row!r}") from None
        videos = {
            key: VideoSegment(layout.v21_video_path(info, key, index), 0.0, length / fps)
            for key in video_keys
        }
        episodes.append(EpisodeInfo(index, length, ep_tasks, layout.v21_data_path(info, index), 0,
                                    start, start + length, videos))
        start += length
    return tasks, episodes


def _load_v30(fs: Any, base: str, info: dict, video_keys: tuple[str, ...]
              ) -> tuple[dict[int, str], list[EpisodeInfo]]:
    tasks_path = join(base, layout.V30_TASKS_PATH)
    table = _read_parquet(fs, tasks_path)
    if "task_index" not in table.column_names:
        raise DatasetError(tasks_path, "has no task_index column")
    text_col = "task" if "task" in table.column_names else "__index_level_0__"
    if text_col not in table.column_names:
        raise DatasetError(tasks_path, "has no task column (the index named 'task')")
    tasks = {int(i): str(t) for i, t in zip(table.column("task_index").to_pylist(),
                                            table.column(text_col).to_pylist(), strict=True)}
    ep_files = sorted(fs.glob(join(base, layout.V30_EPISODES_GLOB)))
    if not ep_files:
        raise DatasetError(join(base, "meta/episodes"), "missing (no chunk-*/file-*.parquet)")
    needed = ["episode_index", "tasks", "length", "data/chunk_index", "data/file_index",
              "dataset_from_index", "dataset_to_index"]
    for key in video_keys:
        needed += [f"videos/{key}/{c}" for c in
                   ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
    rows: list[dict[str, Any]] = []
    for path in ep_files:
        t = _read_parquet(fs, path, columns=None)
        missing = [c for c in needed if c not in t.column_names]
        if missing:
            raise DatasetError(path, f"missing columns {missing}")
        rows.extend(t.select(needed).to_pylist())
    rows.sort(key=lambda r: r["episode_index"])
    # Row offsets: an episode's rows start where its global index range starts, counted from
    # the first episode stored in the same file (files hold episodes back to back in order).
    file_first: dict[tuple[int, int], int] = {}
    for r in rows:
        k = (r["data/chunk_index"], r["data/file_index"])
        file_first[k] = min(file_first.get(k, r["dataset_from_index"]), r["dataset_from_index"])
    episodes = []
    for r in rows:
        k = (r["data/chunk_index"], r["data/file_index"])
        videos = {
            key: VideoSegment(
                layout.v30_video_path(key, r[f"videos/{key}/chunk_index"],
                                      r[f"videos/{key}/file_index"], info),
                float(r[f"videos/{key}/from_timestamp"]), float(r[f"videos/{key}/to_timestamp"]))
            for key in video_keys
        }
        episodes.append(EpisodeInfo(
            index=int(r["episode_index"]),
            length=int(r["length"]),
            tasks=tuple(r["tasks"] or ()),
            data_file=layout.v30_data_path(k[0], k[1], info),
            row_start=int(r["dataset_from_index"] - file_first[k]),
            dataset_from=int(r["dataset_from_index"]),
            dataset_to=int(r["dataset_to_index"]),
            videos=videos,
        ))
    return tasks, episodes


def _read_parquet(fs: Any, path: str, columns: list[str] | None = None) -> Any:
    try:
        return read_table(fs, path, columns)
    except FileNotFoundError:
        raise DatasetError(path, "missing") from None
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise DatasetError(path, f"not a readable parquet file ({e})") from None
