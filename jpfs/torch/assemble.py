"""Assembling a worker's stream of samples into batches of tensors, apart from ``ShardDataset``.

The dataset decides *which* samples a worker yields and in what order (``partition``, resume);
this module does the work of turning that order into tensors: read-ahead of the shards, shuffle
blocks laid out as one arena each, delta windows clamped to their episodes with pad masks, camera
frames decoded from videos and image features, all written column by column into buffers the
caller allocates. It is the hot path, kept apart so the dataset reads as its API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from .pipeline import Batch
from .readahead import ReadAhead, mount_hint
from .shards import ShardDecoder, ShardTable

if TYPE_CHECKING:
    from .dataset import ShardDataset

Alloc = Callable[[Mapping[str, tuple[tuple[int, ...], torch.dtype]], int], dict[str, torch.Tensor]]
"""Output buffers: ``alloc(spec, n)`` gives a tensor per name of ``spec`` ({name: (shape,
dtype)}), each with a leading dimension of ``n`` samples."""


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dt)).dtype


class Plan:
    """A worker's remaining stream: sample ids, shuffle-block boundaries, live progress."""

    def __init__(self, ids: np.ndarray, bounds: np.ndarray, progress: dict[str, int]):
        self.ids = ids
        self.bounds = bounds
        self.progress = progress


class _Arena:
    """The rows one shuffle block reads: slices of its shards, extended to whole episodes, laid
    end to end, so a batch is one gather per column whatever the number of shards."""

    def __init__(self, columns: dict[str, np.ndarray], ep_start: np.ndarray, ep_end: np.ndarray,
                 episode: np.ndarray | None, rows: np.ndarray):
        self.columns = columns
        self.ep_start = ep_start
        self.ep_end = ep_end
        self.episode = episode
        self.rows = rows  # arena row of each position of the block


class Assembler:
    """Gathers a worker's stream into output buffers, block by block: windows, pads, frames."""

    def __init__(self, ds: ShardDataset, plan: Plan):
        src = ds.source
        self.ds = ds
        self.src = src
        self.n = len(plan.ids)
        self.bounds = plan.bounds
        self.offsets = np.concatenate([[0], np.cumsum(src.sizes)]).astype(np.int64)
        self.shard = np.searchsorted(self.offsets, plan.ids, side="right").astype(np.int64) - 1
        self.row = plan.ids - self.offsets[self.shard]
        # First and last use of each shard along the stream: read-ahead order and release points.
        uniq, first = np.unique(self.shard, return_index=True)
        self.schedule = uniq[np.argsort(first, kind="stable")].tolist()
        last = np.full(len(src.shards), -1, dtype=np.int64)
        np.maximum.at(last, self.shard, np.arange(self.n, dtype=np.int64))
        self.last = last
        self.images = ds.images
        self.columns = tuple(c for c in dict.fromkeys(src.columns) if c not in self.images)
        self.tasks = src.tasks if ds.with_task else {}
        extra = ["timestamp"] if ds.video else []
        if self.tasks and "task_index" not in self.columns:
            extra.append("task_index")
        self.extra = tuple(extra)
        self.readahead: ReadAhead | None = None
        self.frames: Any = None
        self.vcache: tuple[int, int, int, dict[str, np.ndarray]] | None = None
        self.vsample_bytes = 0  # decoded bytes per sample, known after the first decode
        self.arenas: dict[int, _Arena] = {}
        self.spec: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    def __enter__(self) -> Assembler:
        src = self.src
        if self.n:
            self.readahead = ReadAhead(
                src.store.session(), src.shards, self.schedule,
                ShardDecoder(src, (*self.columns, *self.images), self.extra),
                budget=self.ds.readahead_bytes, batch_files=self.ds.readahead_files,
                hint=mount_hint(src.root))
        if self.ds.video:
            from .video import FrameReader

            self.frames = FrameReader(src.store, tolerance_s=self.ds.tolerance_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.readahead is not None:
            ra = self.readahead
            self.ds.stats = {"fetched_files": ra.fetched_files, "fetched_bytes": ra.fetched_bytes,
                             "fetch_calls": ra.fetch_calls}
            ra.close()
        if self.frames is not None:
            self.frames.close()
        self.arenas.clear()

    def chunks(self, size: int) -> Iterator[tuple[int, int]]:
        """``[start, stop)`` pieces of the stream of at most ``size``, not crossing blocks."""
        for b in range(len(self.bounds) - 1):
            lo, hi = int(self.bounds[b]), int(self.bounds[b + 1])
            for start in range(lo, hi, size):
                yield start, min(start + size, hi)

    def _arena_for(self, b: int) -> _Arena:
        arena = self.arenas.get(b)
        if arena is not None:
            return arena
        assert self.readahead is not None
        p, q = int(self.bounds[b]), int(self.bounds[b + 1])
        shard, row = self.shard[p:q], self.row[p:q]
        parts = []
        adjust = {}
        base = 0
        for s in dict.fromkeys(shard.tolist()):  # first-use order, as the read-ahead fetches
            t = self.readahead.get(s)
            r = row[shard == s]
            lo, hi = int(t.ep_start[r.min()]), int(t.ep_end[r.max()])
            parts.append((t, lo, hi, base))
            adjust[s] = base - lo
            base += hi - lo
        one = len(parts) == 1

        def cat(get: Callable[[ShardTable], np.ndarray], shift: bool = False) -> np.ndarray:
            pieces = [get(t)[lo:hi] + (b0 - lo) if shift else get(t)[lo:hi]
                      for t, lo, hi, b0 in parts]
            return pieces[0] if one else np.concatenate(pieces)

        def column(name: str) -> Callable[[ShardTable], np.ndarray]:
            return lambda t: t.columns[name]

        cols = {c: cat(column(c))
                for c in (*self.columns, *self.images, *self.extra) if c in parts[0][0].columns}
        # A dataset's shards share one schema: when the first has the episode column, all do.
        episode = (cat(lambda t: cast(np.ndarray, t.episode))
                   if parts[0][0].episode is not None else None)
        lookup = np.zeros(len(self.src.shards), dtype=np.int64)
        for s, a in adjust.items():
            lookup[s] = a
        arena = _Arena(cols, cat(lambda t: t.ep_start, True), cat(lambda t: t.ep_end, True),
                       episode, row + lookup[shard])
        self.arenas[b] = arena
        for s in adjust:  # the arena holds what it needs; shards not used later can go
            if self.last[s] < q:
                self.readahead.release(s)
        return arena

    def _spec(self, arena: _Arena) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for c in self.columns:
            a = arena.columns[c]
            shape = tuple(a.shape[1:])
            if c in self.ds.deltas:
                spec[c] = ((len(self.ds.deltas[c]), *shape), _torch_dtype(a.dtype))
                spec[f"{c}_is_pad"] = ((len(self.ds.deltas[c]),), torch.bool)
            else:
                spec[c] = (shape, _torch_dtype(a.dtype))
        return spec

    def _segments(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(block, from, to) pieces of positions ``[start, stop)``."""
        b = int(np.searchsorted(self.bounds, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.bounds[b + 1]))
            yield b, start, end
            start, b = end, b + 1

    def assemble(self, start: int, stop: int, alloc: Alloc) -> Batch:
        """Positions ``[start, stop)`` of the stream as one batch of tensors."""
        segments = list(self._segments(start, stop))
        for old in [k for k in self.arenas if k < segments[0][0]]:
            del self.arenas[old]
        arena = self._arena_for(segments[0][0])
        spec = dict(self._spec(arena))
        vids: list[tuple[int, int, dict[str, np.ndarray]]] = []
        if self.ds.video or self.images:
            for b, a, z in segments:
                got = self._frames(b, a, z) if self.ds.video else {}
                got.update(self._images(b, a, z))
                vids.append((a, z, got))
            for k, v in vids[0][2].items():
                shape = (*v.shape[1:-3], v.shape[-1], *v.shape[-3:-1])  # [T,] C, H, W
                dt = torch.float32 if self.ds.video_dtype == "float32" else torch.uint8
                spec[k] = (shape, dt)
                if k in self.ds.deltas:
                    spec[f"{k}_is_pad"] = ((len(self.ds.deltas[k]),), torch.bool)
        out = alloc(spec, stop - start)
        views = {k: v.numpy() for k, v in out.items()}
        for b, a, z in segments:
            arena = self._arena_for(b)
            rows = arena.rows[a - self.bounds[b]:z - self.bounds[b]]
            sl = slice(a - start, z - start)
            for c in self.columns:
                src = arena.columns[c]
                if c in self.ds.deltas:
                    q, pad = _window(rows, arena, self.ds.deltas[c])
                    np.take(src, q, axis=0, out=views[c][sl])
                    views[f"{c}_is_pad"][sl] = pad
                else:
                    np.take(src, rows, axis=0, out=views[c][sl])
            for k in (*(self.src.video_keys if self.ds.video else ()), *self.images):
                if k in self.ds.deltas:
                    views[f"{k}_is_pad"][sl] = _window(rows, arena, self.ds.deltas[k])[1]
        for a, z, frames in vids:
            sl = slice(a - start, z - start)
            for k, v in frames.items():  # (n, [T,] H, W, C) uint8 -> (n, [T,] C, H, W)
                chw = np.moveaxis(v, -1, -3)
                if self.ds.video_dtype == "float32":
                    to_float(chw, views[k][sl])
                else:
                    views[k][sl] = chw
        batch: Batch = dict(out)
        if self.tasks:
            batch["task"] = self._tasks(segments)
        return batch

    def _tasks(self, segments: list[tuple[int, int, int]]) -> list[str]:
        """The task string of each position, as LeRobotDataset gives it."""
        names = []
        for b, a, z in segments:
            arena = self._arena_for(b)
            col = arena.columns.get("task_index")
            if col is None:
                raise KeyError(f"{self.src.root}: no task_index column to look tasks up by "
                               "(pass with_task=False)")
            rows = arena.rows[a - self.bounds[b]:z - self.bounds[b]]
            names += [self.tasks.get(int(t), "") for t in col[rows].tolist()]
        return names

    def _images(self, b: int, a: int, z: int) -> dict[str, np.ndarray]:
        """Image features of positions ``[a, z)`` of block ``b``, decoded: (n, [T,] H, W, C)."""
        from .images import decode_many

        if not self.images:
            return {}
        arena = self._arena_for(b)
        rows = arena.rows[a - self.bounds[b]:z - self.bounds[b]]
        out = {}
        for key in self.images:
            deltas = self.ds.deltas.get(key)
            q = rows if deltas is None else _window(rows, arena, deltas)[0]
            out[key] = decode_many(arena.columns[key][q], key)
        return out

    def _frames(self, b: int, a: int, z: int) -> dict[str, np.ndarray]:
        """Frames for positions ``[a, z)`` of block ``b``, decoded ahead within the block as far
        as ``video_lookahead_bytes`` allows: one sorted pass per file serves many batches."""
        c = self.vcache
        if c is None or c[0] != b or not (c[1] <= a and z <= c[2]):
            ahead = z - a
            if self.vsample_bytes:
                ahead = max(ahead, self.ds.video_lookahead_bytes // self.vsample_bytes)
            end = min(int(self.bounds[b + 1]), a + ahead)
            frames = self._video(b, a, end)
            self.vsample_bytes = max(1, sum(v[0].nbytes for v in frames.values()))
            c = self.vcache = (b, a, end, frames)
        return {k: v[a - c[1]:z - c[1]] for k, v in c[3].items()}

    def _video(self, b: int, a: int, z: int) -> dict[str, np.ndarray]:
        """Decoded frames per camera: (n, H, W, 3) or (n, T, H, W, 3) with a delta window."""
        arena = self._arena_for(b)
        rows = arena.rows[a - self.bounds[b]:z - self.bounds[b]]
        out: dict[str, np.ndarray] = {}
        ts_col = arena.columns["timestamp"]
        for key in self.src.video_keys:
            deltas = self.ds.deltas.get(key)
            q = rows[:, None] if deltas is None else _window(rows, arena, deltas)[0]
            eps = arena.episode[q] if arena.episode is not None else np.zeros(q.shape, np.int64)
            times = ts_col[q].astype(np.float64)
            paths = np.empty(q.shape, dtype=object)
            for e in np.unique(eps):
                ref = self.src.videos[int(e)][key]
                m = eps == e
                paths[m] = ref.path
                times[m] += ref.from_timestamp
            frames: np.ndarray | None = None
            for p in dict.fromkeys(paths.ravel().tolist()):
                m = paths == p
                got = self.frames.read(p, times[m])
                if frames is None:
                    frames = np.empty((*q.shape, *got.shape[1:]), dtype=np.uint8)
                frames[m] = got
            assert frames is not None
            out[key] = frames[:, 0] if deltas is None else frames
        return out


def to_float(u8: np.ndarray, out: np.ndarray) -> None:
    """uint8 pixels to float32 in [0, 1] as LeRobot does (``x.to(float32) / 255``): a true
    division, which ``x * (1 / 255)`` is not (it differs by 1 ulp for many values)."""
    np.divide(u8, np.float32(255), out=out, casting="unsafe")


def _window(rows: np.ndarray, arena: _Arena, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of each delta, clamped to the frame's episode, and the pad mask."""
    q = rows[:, None] + deltas[None, :]
    lo = arena.ep_start[rows][:, None]
    hi = arena.ep_end[rows][:, None]
    pad = (q < lo) | (q >= hi)
    return np.clip(q, lo, hi - 1), pad
