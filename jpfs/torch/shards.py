"""What a ShardDataset reads: the shards of a LeRobot v3.0, LeRobot v2.1 or plain parquet dataset.

A *shard* is one parquet data file: a v3.0 ``data/chunk-*/file-*.parquet`` (many episodes), a v2.1
episode file, or any ``*.parquet`` under a root without ``meta/info.json``. The format is detected
from ``meta/info.json``; LeRobot metadata comes from ``jpfs.lerobot.dataset`` (never re-parsed
here). Shards are listed in canonical order (episode order for LeRobot), so canonical sample ids
(see ``partition``) are the same for a v2.1 and a v3.0 copy of one dataset.

Decoding turns a shard's bytes into numpy columns plus, per row, the row range of its episode
inside the shard: the bounds that ``delta_timestamps`` windows are clamped to.
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

PLAIN = "parquet"
INFO = "meta/info.json"
# Feature dtypes that are not parquet columns of numbers.
_NON_TABULAR = {"video", "image", "string"}


@dataclass(frozen=True)
class Shard:
    """One data file: ``path`` on the source's filesystem, its row count and size in bytes."""

    path: str
    rows: int
    nbytes: int


@dataclass(frozen=True)
class VideoRef:
    """Where an episode's frames of one camera live: file on the filesystem and time offset."""

    path: str
    from_timestamp: float


@dataclass
class Source:
    """A dataset opened for streaming: its shards, columns, fps and per-episode video files."""

    fs: fsspec.AbstractFileSystem
    root: str
    format: str
    shards: tuple[Shard, ...]
    columns: tuple[str, ...]
    fps: float | None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    video_keys: tuple[str, ...] = ()
    videos: dict[int, dict[str, VideoRef]] = field(default_factory=dict)
    tasks: dict[int, str] = field(default_factory=dict)
    video_decodable: bool = False
    meta: Any = None

    @property
    def sizes(self) -> np.ndarray:
        return np.array([s.rows for s in self.shards], dtype=np.int64)

    @property
    def total(self) -> int:
        return int(sum(s.rows for s in self.shards))


@dataclass
class ShardTable:
    """A decoded shard: columns as numpy arrays and each row's episode bounds (shard rows)."""

    columns: dict[str, np.ndarray]
    ep_start: np.ndarray
    ep_end: np.ndarray
    episode: np.ndarray | None
    nbytes: int


def _join(root: str, rel: str) -> str:
    return posixpath.join(root, rel) if root not in ("", "/") else "/" + rel.lstrip("/")


def _sizes(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, int]:
    """File sizes under ``root`` in one listing call (one readdirplus per folder on JPFS)."""
    found = fs.find(root, withdirs=False, detail=True)
    return {fs._strip_protocol(p): int(info.get("size") or 0) for p, info in found.items()}


def open_source(root: str, *, columns: list[str] | tuple[str, ...] | None = None,
                fps: float | None = None, storage_options: dict | None = None) -> Source:
    """Open ``root`` (local, mounted, or an fsspec URL such as ``jpfs://...``) for streaming."""
    fs, path = fsspec.core.url_to_fs(str(root), **(storage_options or {}))
    path = path.rstrip("/") or "/"
    if fs.exists(_join(path, INFO)):
        return _open_lerobot(str(root), fs, path, columns)
    return _open_plain(fs, path, columns, fps)


def _open_lerobot(url: str, fs: fsspec.AbstractFileSystem, path: str,
                  columns: list[str] | tuple[str, ...] | None) -> Source:
    from jpfs.lerobot.dataset import load_meta

    meta = load_meta(url, fs=fs)
    by_file: dict[str, list[Any]] = {}
    for ep in meta.episodes:
        by_file.setdefault(ep.data_file, []).append(ep)
    # Canonical order: by the first global index a file holds, i.e. episode order.
    files = sorted(by_file, key=lambda f: min(e.dataset_from for e in by_file[f]))
    sizes = _sizes(fs, _join(path, "data"))
    shards = []
    for rel in files:
        p = fs._strip_protocol(_join(path, rel))
        rows = sum(e.length for e in by_file[rel])
        shards.append(Shard(p, rows, sizes.get(p, 0)))
    tabular = [k for k, f in meta.features.items() if f.get("dtype") not in _NON_TABULAR]
    cols = _pick(tabular, columns)
    shapes = {k: _feature_shape(meta.features[k]) for k in tabular}
    videos: dict[int, dict[str, VideoRef]] = {}
    for ep in meta.episodes:
        videos[ep.index] = {k: VideoRef(fs._strip_protocol(_join(path, seg.path)),
                                        float(seg.from_timestamp))
                            for k, seg in ep.videos.items()}
    decodable = bool(meta.video_keys) and all(
        meta.features[k].get("info", {}).get("video.codec") != "jpfs-stub"
        for k in meta.video_keys)
    log.debug("opened %s %s: %d shards, %d frames", meta.version, path, len(shards),
              meta.total_frames)
    return Source(fs=fs, root=path, format=meta.version, shards=tuple(shards), columns=cols,
                  fps=float(meta.fps), shapes=shapes, video_keys=tuple(meta.video_keys),
                  videos=videos, tasks=dict(meta.tasks), video_decodable=decodable, meta=meta)


def _open_plain(fs: fsspec.AbstractFileSystem, path: str,
                columns: list[str] | tuple[str, ...] | None, fps: float | None) -> Source:
    sizes = _sizes(fs, path)
    files = sorted(p for p in sizes if p.endswith(".parquet"))
    if not files:
        raise FileNotFoundError(f"{path}: no meta/info.json and no *.parquet shards")
    shards = []
    schema = None
    for p in files:
        with fs.open(p, "rb") as f:
            md = pq.read_metadata(f)
        if schema is None:
            schema = md.schema.to_arrow_schema()
        shards.append(Shard(p, md.num_rows, sizes[p]))
    numeric = [f.name for f in schema if _is_numeric(f.type)]
    return Source(fs=fs, root=path, format=PLAIN, shards=tuple(shards),
                  columns=_pick(numeric, columns), fps=fps)


def _pick(available: list[str], wanted: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if wanted is None:
        return tuple(available)
    missing = [c for c in wanted if c not in available]
    if missing:
        raise KeyError(f"no such tabular feature(s): {missing} (have {available})")
    return tuple(wanted)


def _feature_shape(feature: dict) -> tuple[int, ...]:
    shape = tuple(int(x) for x in feature.get("shape") or ())
    return () if shape in ((), (1,)) else shape


def _is_numeric(t: pa.DataType) -> bool:
    while pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def column_to_numpy(col: pa.ChunkedArray | pa.Array, shape: tuple[int, ...] | None) -> np.ndarray:
    """A parquet column as one numpy array of shape ``(rows, *shape)``; list columns flattened."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    rows = len(arr)
    t = arr.type
    depth = 0
    while pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t):
        arr = pc.list_flatten(arr)
        t = t.value_type
        depth += 1
    values = arr.to_numpy(zero_copy_only=False)
    if depth == 0:
        return values
    if shape:
        return values.reshape(rows, *shape)
    return values.reshape(rows, -1) if rows else values.reshape(0, 0)


def decode_shard(data: bytes | memoryview, columns: tuple[str, ...],
                 shapes: dict[str, tuple[int, ...]], extra: tuple[str, ...] = ()) -> ShardTable:
    """Parse one shard's bytes: the wanted columns (and ``extra`` ones), and episode bounds."""
    reader = pq.ParquetFile(pa.BufferReader(data))
    names = set(reader.schema_arrow.names)
    want = list(dict.fromkeys([*columns, *(c for c in extra if c in names)]))
    if "episode_index" in names and "episode_index" not in want:
        want.append("episode_index")
    table = reader.read(columns=want, use_threads=False)
    cols = {c: column_to_numpy(table.column(c), shapes.get(c)) for c in want}
    n = table.num_rows
    episode = cols.get("episode_index")
    if episode is not None and n:
        cut = np.flatnonzero(episode[1:] != episode[:-1]) + 1
        starts = np.concatenate([[0], cut]).astype(np.int64)
        ends = np.concatenate([cut, [n]]).astype(np.int64)
        run = np.repeat(np.arange(len(starts)), ends - starts)
        ep_start, ep_end = starts[run], ends[run]
    else:  # no episode column: the whole shard is one episode
        ep_start = np.zeros(n, dtype=np.int64)
        ep_end = np.full(n, n, dtype=np.int64)
    nbytes = sum(a.nbytes for a in cols.values()) + ep_start.nbytes * 2
    return ShardTable(columns=cols, ep_start=ep_start, ep_end=ep_end, episode=episode,
                      nbytes=nbytes)
