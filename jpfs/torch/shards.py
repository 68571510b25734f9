"""What a ShardDataset reads: the shards of a LeRobot v3.0, LeRobot v2.1 or plain parquet dataset.

A *shard* is the unit of shard-order shuffling and of reading: a v2.1 episode file; in a v3.0
``data/chunk-*/file-*.parquet`` (many episodes), each run of row groups that holds whole episodes
(JPFS's converter writes one episode per row group, so v3.0 shuffles and reads episode by episode
as v2.1 does; a file of one row group, as pandas writes them, is one shard); any ``*.parquet``
under a root without ``meta/info.json``. The format is detected
from ``meta/info.json``; LeRobot metadata comes from ``jpfs.lerobot.dataset`` (never re-parsed
here). Shards are listed in canonical order (episode order for LeRobot), so canonical sample ids
(see ``partition``) are the same for a v2.1 and a v3.0 copy of one dataset.

Decoding turns a shard's bytes into numpy columns plus, per row, the row range of its episode
inside the shard: the bounds that ``delta_timestamps`` windows are clamped to.
"""

from __future__ import annotations

import io
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .images import image_bytes
from .store import BytesLike, Store, open_store

log = logging.getLogger(__name__)

PLAIN = "parquet"
INFO = "meta/info.json"
# Feature dtypes that are not parquet columns of numbers (images are, decoded: see images.py).
_NON_TABULAR = {"video", "image", "string"}


@dataclass(frozen=True)
class Shard:
    """Rows of one data file: ``path`` on the source's filesystem, row count, bytes to read.

    ``row_groups`` None means the whole file; otherwise those row groups, whose column chunks lie
    in bytes ``[start, stop)`` of a file of ``file_bytes`` (one ranged read).
    """

    path: str
    rows: int
    nbytes: int
    row_groups: tuple[int, ...] | None = None
    start: int = 0
    stop: int = 0
    file_bytes: int = 0


@dataclass(frozen=True)
class VideoRef:
    """Where an episode's frames of one camera live: file on the filesystem and time offset."""

    path: str
    from_timestamp: float


@dataclass
class Source:
    """A dataset opened for streaming: its shards, columns, fps and per-episode video files.

    ``fs`` opened it (metadata, listings, footers); ``store`` reads its shards and videos.
    """

    fs: fsspec.AbstractFileSystem
    store: Store
    root: str
    format: str
    shards: tuple[Shard, ...]
    columns: tuple[str, ...]
    fps: float | None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    video_keys: tuple[str, ...] = ()
    image_keys: tuple[str, ...] = ()  # columns holding encoded images (dtype "image")
    videos: dict[int, dict[str, VideoRef]] = field(default_factory=dict)
    tasks: dict[int, str] = field(default_factory=dict)
    video_decodable: bool = False
    meta: Any = None
    footers: dict[str, Any] = field(default_factory=dict)  # path -> pq.FileMetaData

    @property
    def sizes(self) -> np.ndarray:
        """Rows per shard, in canonical order."""
        return np.array([s.rows for s in self.shards], dtype=np.int64)

    @property
    def total(self) -> int:
        """Rows (samples) in the whole dataset."""
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
    """Open ``root`` (local, mounted, ``jpfs://...`` or another fsspec URL) for streaming."""
    fs, path, store = open_store(str(root), storage_options)
    path = path.rstrip("/") or "/"
    if fs.exists(_join(path, INFO)):
        return _open_lerobot(str(root), fs, store, path, columns)
    return _open_plain(fs, store, path, columns, fps)


def _open_lerobot(url: str, fs: fsspec.AbstractFileSystem, store: Store, path: str,
                  columns: list[str] | tuple[str, ...] | None) -> Source:
    from jpfs.lerobot.dataset import load_meta

    meta = load_meta(url, fs=fs)
    by_file: dict[str, list[Any]] = {}
    for ep in meta.episodes:
        by_file.setdefault(ep.data_file, []).append(ep)
    # Canonical order: by the first global index a file holds, i.e. episode order.
    files = sorted(by_file, key=lambda f: min(e.dataset_from for e in by_file[f]))
    sizes = _sizes(fs, _join(path, "data"))
    shards: list[Shard] = []
    footers: dict[str, Any] = {}
    for rel in files:
        p = fs._strip_protocol(_join(path, rel))
        eps = by_file[rel]
        rows = sum(e.length for e in eps)
        if len(eps) == 1:  # v2.1, or a v3.0 file of one episode: read whole
            shards.append(Shard(p, rows, sizes.get(p, 0)))
            continue
        with fs.open(p, "rb") as f:
            md = pq.read_metadata(f)
        if md.num_rows != rows:
            raise ValueError(f"{p}: {md.num_rows} rows, its episodes say {rows}")
        pieces = _episode_pieces(p, md, {e.row_start + e.length for e in eps}, sizes.get(p, 0))
        if len(pieces) > 1:
            footers[p] = md
            shards.extend(pieces)
        else:
            shards.append(Shard(p, rows, sizes.get(p, 0)))
    tabular = [k for k, f in meta.features.items() if f.get("dtype") not in _NON_TABULAR]
    images = [k for k, f in meta.features.items() if f.get("dtype") == "image"]
    cols = _pick(tabular + images, columns)
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
    return Source(fs=fs, store=store, root=path, format=meta.version, shards=tuple(shards),
                  columns=cols, fps=float(meta.fps), shapes=shapes,
                  video_keys=tuple(meta.video_keys), image_keys=tuple(images), videos=videos,
                  tasks=dict(meta.tasks),
                  video_decodable=decodable, meta=meta, footers=footers)


def _episode_pieces(path: str, md: Any, episode_ends: set[int], file_bytes: int) -> list[Shard]:
    """Runs of consecutive row groups that end where an episode ends (so hold whole episodes)."""
    pieces = []
    first = 0
    row = 0
    for rg in range(md.num_row_groups):
        row += md.row_group(rg).num_rows
        if row in episode_ends or rg == md.num_row_groups - 1:
            groups = tuple(range(first, rg + 1))
            start, stop = _byte_span(md, groups)
            rows = sum(md.row_group(g).num_rows for g in groups)
            pieces.append(Shard(path, rows, stop - start, groups, start, stop, file_bytes))
            first = rg + 1
    return pieces


def _byte_span(md: Any, groups: tuple[int, ...]) -> tuple[int, int]:
    """Bytes ``[start, stop)`` of the file holding every column chunk of ``groups``."""
    lo, hi = None, 0
    for g in groups:
        rg = md.row_group(g)
        for j in range(rg.num_columns):
            c = rg.column(j)
            start = c.data_page_offset
            if c.has_dictionary_page and c.dictionary_page_offset:
                start = min(start, c.dictionary_page_offset)
            lo = start if lo is None else min(lo, start)
            hi = max(hi, start + c.total_compressed_size)
    return int(lo or 0), int(hi)


def _open_plain(fs: fsspec.AbstractFileSystem, store: Store, path: str,
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
    assert schema is not None  # files is not empty
    numeric = [f.name for f in schema if _is_numeric(f.type)]
    return Source(fs=fs, store=store, root=path, format=PLAIN, shards=tuple(shards),
                  columns=_pick(numeric, columns), fps=fps)


def _pick(available: list[str], wanted: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if wanted is None:
        return tuple(available)
    missing = [c for c in wanted if c not in available]
    if missing:
        raise KeyError(f"no such feature(s): {missing} (have {available}; videos are "
                       "decoded unless video=False)")
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


class _Span(io.RawIOBase):
    """A file of which only bytes ``[start, start + len(data))`` are at hand (a ranged read);
    pyarrow, given the footer separately, reads nothing else."""

    def __init__(self, size: int, start: int, data: BytesLike):
        super().__init__()
        self.size = size
        self.start = start
        self.data = memoryview(data)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.size)[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buf: Any) -> int:
        a = self.pos - self.start
        if a < 0 or a > len(self.data):
            raise OSError(f"read at {self.pos} outside the fetched range")
        n = min(len(buf), len(self.data) - a)
        buf[:n] = self.data[a:a + n]
        self.pos += n
        return n


class ShardDecoder:
    """Turns fetched shard bytes into ``ShardTable``s for one reader (thread) of a source.

    Keeps one parquet reader per file split into row-group shards: building a reader from a
    footer costs more than decoding a row group. On a local or mounted path such a file is
    memory-mapped (read natively, in the read-ahead thread); elsewhere the reader reads the
    fetched byte span, which is swapped in before each decode.
    """

    def __init__(self, source: Source, columns: tuple[str, ...], extra: tuple[str, ...] = ()):
        self.source = source
        self.columns = columns
        self.extra = extra
        self.local = source.store.local
        self._readers: dict[str, tuple[Any, _Span | None]] = {}

    def wants_bytes(self, shard: Shard) -> bool:
        """False where the decoder reads the shard itself (row groups of a local file)."""
        return shard.row_groups is None or not self.local

    def __call__(self, index: int, data: BytesLike | None) -> ShardTable:
        """Decode shard ``index`` from its bytes (None where the decoder reads it itself)."""
        shard = self.source.shards[index]
        if shard.row_groups is None:
            assert data is not None
            return decode_table(pq.ParquetFile(pa.BufferReader(data)), None, self.columns,
                                self.source.shapes, self.extra, self.source.image_keys)
        entry = self._readers.get(shard.path)
        if entry is None:
            footer = self.source.footers[shard.path]
            if self.local:
                entry = (pq.ParquetFile(pa.memory_map(shard.path), metadata=footer), None)
            else:
                fresh = _Span(max(shard.file_bytes, shard.stop), 0, b"")
                entry = (pq.ParquetFile(pa.PythonFile(fresh, mode="r"), metadata=footer), fresh)
            self._readers[shard.path] = entry
        reader, span = entry
        if span is not None:
            assert data is not None
            span.start, span.data = shard.start, memoryview(data)
        return decode_table(reader, shard.row_groups, self.columns, self.source.shapes,
                            self.extra, self.source.image_keys)

    def close(self) -> None:
        """Drop the kept parquet readers."""
        self._readers.clear()


def decode_table(reader: Any, row_groups: tuple[int, ...] | None, columns: tuple[str, ...],
                 shapes: dict[str, tuple[int, ...]], extra: tuple[str, ...] = (),
                 images: tuple[str, ...] = ()) -> ShardTable:
    """The wanted columns (and ``extra`` ones, where present) and each row's episode bounds.

    Image columns stay encoded (an object array of bytes): they are decoded per batch, only the
    frames sampled, and in the DataLoader worker that assembles the batch.
    """
    names = set(reader.schema_arrow.names)
    want = list(dict.fromkeys([*columns, *(c for c in extra if c in names)]))
    if "episode_index" in names and "episode_index" not in want:
        want.append("episode_index")
    if row_groups is not None:
        table = reader.read_row_groups(list(row_groups), columns=want, use_threads=False)
    else:
        table = reader.read(columns=want, use_threads=False)
    cols = {c: (image_bytes(table.column(c), c) if c in images
                else column_to_numpy(table.column(c), shapes.get(c))) for c in want}
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
    nbytes = sum(table.column(c).nbytes if c in images else a.nbytes for c, a in cols.items())
    nbytes += ep_start.nbytes * 2
    return ShardTable(columns=cols, ep_start=ep_start, ep_end=ep_end, episode=episode,
                      nbytes=nbytes)
