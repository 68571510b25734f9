"""``ShardDataset``: a drop-in PyTorch IterableDataset over LeRobot (v2.1, v3.0) or parquet shards.

Samples are frames as ``LeRobotDataset[i]`` gives them: a dict of tensors keyed by feature name,
``delta_timestamps`` windows clamped to the frame's episode with ``<key>_is_pad`` masks, camera
frames decoded at the sampled timestamps. Unlike LeRobot's map-style dataset it streams whole
shards (one read per file, in the background, bounded in bytes) in an order that is a pure
function of (seed, epoch, rank, worker) - see ``partition`` - so every sample is seen exactly once
per epoch across all ranks and workers, the order is reproducible, and resuming mid-epoch costs
nothing but arithmetic.

With ``batch_size`` set, the dataset yields whole batches (use ``DataLoader(ds, batch_size=None)``
or ``jpfs.torch.to_device(ds, device)``), assembled column by column straight into preallocated
host buffers: no per-sample Python objects on the hot path.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from . import partition
from .readahead import ReadAhead, mount_hint
from .shards import ShardTable, Source, decode_shard, open_source

log = logging.getLogger(__name__)

STATE_KEY = "jpfs.ShardDataset"
STATE_VERSION = 1
_CHUNK = 512  # samples assembled at a time in per-sample mode

Alloc = Callable[[Mapping[str, tuple[tuple[int, ...], torch.dtype]], int], dict[str, torch.Tensor]]


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dt)).dtype


def delta_indices(delta_timestamps: Mapping[str, list[float]] | None, fps: float | None,
                  tolerance_s: float = 1e-4) -> dict[str, np.ndarray]:
    """``{key: frame offsets}`` from ``{key: seconds}``: ``round(s * fps)`` as LeRobot does.

    Raises ValueError for an offset that is not a whole number of frames (within tolerance).
    """
    if not delta_timestamps:
        return {}
    if not fps:
        raise ValueError("delta_timestamps needs the dataset's fps (pass fps= for plain parquet)")
    out = {}
    for key, deltas in delta_timestamps.items():
        idx = [round(d * fps) for d in deltas]
        bad = [d for d, i in zip(deltas, idx, strict=True) if abs(d - i / fps) > tolerance_s]
        if bad:
            raise ValueError(f"delta_timestamps[{key!r}] has offsets that are not multiples of "
                             f"1/fps={1 / fps:.6f}s: {bad}")
        out[key] = np.asarray(idx, dtype=np.int64)
    return out


class ShardDataset(IterableDataset):
    """Stream the frames of a dataset at ``root`` (``jpfs://...``, an fsspec URL, or a directory).

    Args:
        root: dataset root. ``jpfs://`` reads through the native client (via its fsspec class); a
            local or mounted directory is read directly.
        delta_timestamps: ``{feature: [seconds, ...]}`` as in LeRobot, e.g. 16 future actions.
        columns: tabular features to return (default: all non-video features).
        video: decode camera frames (needs PyAV); False gives tabular features only.
        shuffle, seed, shuffle_buffer: two-level shuffle (shard order, then blocks of
            ``shuffle_buffer`` samples), decided by (seed, epoch) alone.
        rank, world_size: this process's place; default: torch.distributed's, else 0 and 1.
        batch_size, drop_last: yield batches (dicts of tensors with a leading batch dimension)
            instead of samples; each worker batches its own stream.
        readahead_bytes, readahead_files: read-ahead budget and files per batched read.
        video_dtype: "float32" (C, H, W in [0, 1], LeRobot's) or "uint8" (C, H, W).
        tolerance_s: how far a decoded frame may lie from its requested timestamp.
        with_task: add the task string (``task``) per sample as LeRobot does (not with batches).
        fps: frame rate for plain parquet shards (LeRobot datasets carry their own).
        storage_options: passed to fsspec.
    """

    def __init__(self, root: str, *, delta_timestamps: Mapping[str, list[float]] | None = None,
                 columns: list[str] | None = None, video: bool = True, shuffle: bool = True,
                 seed: int = 0, shuffle_buffer: int = 4096, rank: int | None = None,
                 world_size: int | None = None, batch_size: int | None = None,
                 drop_last: bool = False, readahead_bytes: int = 256 << 20,
                 readahead_files: int = 32, video_dtype: str = "float32",
                 tolerance_s: float = 1e-4, with_task: bool = False, fps: float | None = None,
                 storage_options: dict | None = None):
        super().__init__()
        self.root = str(root)
        self.source: Source = open_source(self.root, columns=columns, fps=fps,
                                          storage_options=storage_options)
        if fps is not None and self.source.fps is None:
            self.source.fps = float(fps)
        self.delta_timestamps = dict(delta_timestamps or {})
        self.deltas = delta_indices(self.delta_timestamps, self.source.fps, tolerance_s)
        self.video = bool(video) and bool(self.source.video_keys)
        if self.video and not self.source.video_decodable:
            log.warning("%s: videos are stand-ins (not decodable); yielding tabular features only",
                        self.root)
            self.video = False
        known = set(self.source.columns) | (set(self.source.video_keys) if self.video else set())
        unknown = [k for k in self.deltas if k not in known]
        if unknown:
            raise KeyError(f"delta_timestamps names unknown feature(s) {unknown}")
        if video_dtype not in ("float32", "uint8"):
            raise ValueError("video_dtype must be 'float32' or 'uint8'")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if with_task and batch_size:
            raise ValueError("with_task gives a string per sample; use task_index with batches")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.shuffle_buffer = int(shuffle_buffer)
        self._rank = rank
        self._world_size = world_size
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.readahead_bytes = int(readahead_bytes)
        self.readahead_files = int(readahead_files)
        self.video_dtype = video_dtype
        self.tolerance_s = float(tolerance_s)
        self.with_task = bool(with_task)
        # Shared memory, so set_epoch() reaches persistent DataLoader workers too.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._pending: dict | None = None
        self._progress: dict[str, int] | None = None
        self.stats: dict[str, int] = {}
        # Resolve now: DataLoader workers are new processes where torch.distributed is not set up.
        _ = self.rank, self.world_size

    # place in the world --------------------------------------------------------------------

    @property
    def rank(self) -> int:
        if self._rank is None and _dist_ready():
            self._rank = dist.get_rank()
        return 0 if self._rank is None else int(self._rank)

    @property
    def world_size(self) -> int:
        if self._world_size is None and _dist_ready():
            self._world_size = dist.get_world_size()
        return 1 if self._world_size is None else int(self._world_size)

    def _slot(self) -> partition.Slot:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return partition.Slot(self.rank, self.world_size, worker, workers)

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (all ranks) per epoch."""
        return self.source.total

    def __len__(self) -> int:
        """Samples this rank yields per epoch (per-sample mode only)."""
        if self.batch_size:
            raise TypeError("a batched ShardDataset has no fixed len(): batches depend on workers")
        bounds = partition.split_even(self.source.total, self.world_size)
        return int(bounds[self.rank + 1] - bounds[self.rank])

    # epochs and resume ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration yields (as DistributedSampler)."""
        self._epoch.fill_(int(epoch))

    def order(self, epoch: int | None = None, worker: int = 0, num_workers: int = 1) -> np.ndarray:
        """The canonical sample ids a worker of this rank yields in ``epoch``, in order."""
        slot = partition.Slot(self.rank, self.world_size, worker, num_workers)
        return partition.worker_ids(self.source.sizes, slot, seed=self.seed,
                                    epoch=self.epoch if epoch is None else epoch,
                                    shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer)

    def _state(self, epoch: int, num_workers: int, consumed: dict[str, int]) -> dict[str, Any]:
        return {STATE_KEY: STATE_VERSION, "seed": self.seed, "epoch": epoch,
                "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer,
                "rank": self.rank, "world_size": self.world_size, "num_workers": num_workers,
                "total": self.source.total, "consumed": consumed}

    def state_dict(self) -> dict[str, Any]:
        """Where this process's iteration stands: samples consumed in the current epoch.

        Called by torchdata's StatefulDataLoader in each worker (or the main process with
        ``num_workers=0``). For a plain DataLoader with workers, see ``state_after``.
        """
        p = self._progress
        if p is None:
            return self._state(self.epoch, 0, {})
        return self._state(p["epoch"], p["num_workers"], {str(p["worker"]): p["consumed"]})

    def state_after(self, batches: int, batch_size: int | None = None, num_workers: int = 0,
                    epoch: int | None = None) -> dict[str, Any]:
        """The state of a plain ``DataLoader`` that has handed out ``batches`` batches.

        ``batches`` counts from the start of the epoch (across earlier resumes). Pure arithmetic:
        torch's DataLoader takes per-worker batches in a fixed cycle and each worker's sample
        count is known. A resumed plain DataLoader starts its cycle at worker 0 again, so the state
        also records whose turn it was and the workers' roles rotate accordingly: the resumed
        batches are exactly the uninterrupted run's remaining batches, in the same order.
        ``batch_size`` is the DataLoader's (or this dataset's own).
        """
        bs = self.batch_size or batch_size
        if not bs:
            raise ValueError("batch_size is needed")
        nw = max(num_workers, 1)
        counts = partition.worker_counts(self.source.total, self.rank, self.world_size, nw)
        done, turn = partition.loader_progress(counts, bs, batches, self.drop_last)
        ep = self.epoch if epoch is None else int(epoch)
        state = self._state(ep, num_workers, {str(w): n for w, n in enumerate(done)})
        state["turn"] = turn
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration skips what ``state`` says was consumed, and nothing else."""
        if state.get(STATE_KEY) != STATE_VERSION:
            raise ValueError("not a ShardDataset state (or from another version)")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle),
                          ("shuffle_buffer", self.shuffle_buffer), ("rank", self.rank),
                          ("world_size", self.world_size), ("total", self.source.total)):
            if state[key] != mine:
                raise ValueError(f"state was saved with {key}={state[key]!r}, dataset has {mine!r}")
        self._pending = {"epoch": int(state["epoch"]), "num_workers": int(state["num_workers"]),
                         "consumed": {str(k): int(v) for k, v in state["consumed"].items()},
                         "turn": int(state.get("turn", 0))}
        if get_worker_info() is None:
            self.set_epoch(int(state["epoch"]))

    def _resume(self, workers: int) -> tuple[partition.Slot, int, int]:
        """(slot, epoch, samples to skip) for the iteration starting now; consumes a pending
        state. The slot's worker is the role this process plays (rotated on a plain resume)."""
        slot = self._slot()
        pending, self._pending = self._pending, None
        epoch = self.epoch
        if pending is None:
            return slot, epoch, 0
        if pending["consumed"] and max(pending["num_workers"], 1) != max(workers, 1):
            raise ValueError(f"state was saved with num_workers={pending['num_workers']}, "
                             f"the DataLoader has {workers}")
        if pending["epoch"] != epoch:
            warnings.warn(f"resuming epoch {pending['epoch']} although set_epoch({epoch}) was "
                          "called; the saved epoch wins", stacklevel=3)
        role = (slot.worker + pending["turn"]) % slot.num_workers
        slot = partition.Slot(slot.rank, slot.world_size, role, slot.num_workers)
        return slot, pending["epoch"], pending["consumed"].get(str(role), 0)

    # iteration -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        slot, epoch, skip = self._resume(info.num_workers if info is not None else 0)
        ids = partition.worker_ids(self.source.sizes, slot, seed=self.seed, epoch=epoch,
                                   shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer)
        progress = {"epoch": epoch, "worker": slot.worker,
                    "num_workers": info.num_workers if info is not None else 0,
                    "consumed": min(skip, len(ids))}
        self._progress = progress
        if self.batch_size:
            alloc = _shared_alloc if info is not None else _plain_alloc
            return self._batches(ids, progress, alloc)
        return self._samples(ids, progress)

    def produce_batches(self, alloc: Alloc) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of this process's stream written into buffers from ``alloc`` (the ring)."""
        slot, epoch, skip = self._resume(0)
        ids = partition.worker_ids(self.source.sizes, slot, seed=self.seed, epoch=epoch,
                                   shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer)
        progress = {"epoch": epoch, "worker": slot.worker, "num_workers": 0,
                    "consumed": min(skip, len(ids))}
        self._progress = progress
        return self._batches(ids, progress, alloc)

    def _samples(self, ids: np.ndarray, progress: dict[str, int]) -> Iterator[dict[str, Any]]:
        with _Assembler(self, ids[progress["consumed"]:]) as asm:
            for start in range(0, asm.n, _CHUNK):
                chunk = asm.assemble(start, min(start + _CHUNK, asm.n), _plain_alloc)
                keys = list(chunk)
                tasks = None
                if self.with_task and "task_index" in chunk:
                    tasks = [self.source.tasks.get(int(t), "") for t in chunk["task_index"]]
                for i in range(len(chunk[keys[0]]) if keys else 0):
                    sample = {k: chunk[k][i] for k in keys}
                    if tasks is not None:
                        sample["task"] = tasks[i]
                    progress["consumed"] += 1  # before yield: a state taken now counts it
                    yield sample

    def _batches(self, ids: np.ndarray, progress: dict[str, int],
                 alloc: Alloc) -> Iterator[dict[str, torch.Tensor]]:
        bs = int(self.batch_size or 1)
        with _Assembler(self, ids[progress["consumed"]:]) as asm:
            stop = asm.n - asm.n % bs if self.drop_last else asm.n
            for start in range(0, stop, bs):
                batch = asm.assemble(start, min(start + bs, asm.n), alloc)
                progress["consumed"] += min(bs, asm.n - start)
                yield batch


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _plain_alloc(spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 n: int) -> dict[str, torch.Tensor]:
    return {k: torch.empty((n, *shape), dtype=dt) for k, (shape, dt) in spec.items()}


def _shared_alloc(spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                  n: int) -> dict[str, torch.Tensor]:
    """In a DataLoader worker: buffers already in shared memory, so sending them is free."""
    return {k: torch.empty((n, *shape), dtype=dt).share_memory_()
            for k, (shape, dt) in spec.items()}


class _Assembler:
    """Gathers rows of resident shards into output buffers, windows and pad masks included."""

    def __init__(self, ds: ShardDataset, ids: np.ndarray):
        src = ds.source
        self.ds = ds
        self.src = src
        self.ids = ids
        self.n = len(ids)
        self.offsets = np.concatenate([[0], np.cumsum(src.sizes)]).astype(np.int64)
        self.shard = np.searchsorted(self.offsets, ids, side="right").astype(np.int64) - 1
        self.row = ids - self.offsets[self.shard]
        # First and last use of each shard along the stream: read-ahead order and release points.
        uniq, first = np.unique(self.shard, return_index=True)
        self.schedule = uniq[np.argsort(first, kind="stable")].tolist()
        last = np.full(len(src.shards), -1, dtype=np.int64)
        last[self.shard] = np.arange(self.n)  # later positions overwrite earlier ones
        self.last = last
        self.extra = ("timestamp",) if ds.video else ()
        self.columns = tuple(dict.fromkeys(src.columns))
        self.tables: dict[int, ShardTable] = {}
        self.readahead: ReadAhead | None = None
        self.frames: Any = None

    def __enter__(self) -> _Assembler:
        src = self.src
        if self.n:
            self.readahead = ReadAhead(
                src.fs, src.shards, self.schedule,
                lambda data: decode_shard(data, self.columns, src.shapes, self.extra),
                budget=self.ds.readahead_bytes, batch_files=self.ds.readahead_files,
                hint=mount_hint(src.root))
        if self.ds.video:
            from .video import FrameReader

            self.frames = FrameReader(src.fs, tolerance_s=self.ds.tolerance_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.readahead is not None:
            ra = self.readahead
            self.ds.stats = {"fetched_files": ra.fetched_files, "fetched_bytes": ra.fetched_bytes,
                             "fetch_calls": ra.fetch_calls}
            ra.close()
        if self.frames is not None:
            self.frames.close()
        self.tables.clear()

    def _table(self, s: int) -> ShardTable:
        t = self.tables.get(s)
        if t is None:
            assert self.readahead is not None
            t = self.tables[s] = self.readahead.get(s)
        return t

    def _spec(self, t: ShardTable) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for c in self.columns:
            a = t.columns[c]
            shape = tuple(a.shape[1:])
            if c in self.ds.deltas:
                spec[c] = ((len(self.ds.deltas[c]), *shape), _torch_dtype(a.dtype))
                spec[f"{c}_is_pad"] = ((len(self.ds.deltas[c]),), torch.bool)
            else:
                spec[c] = (shape, _torch_dtype(a.dtype))
        return spec

    def assemble(self, start: int, stop: int, alloc: Alloc) -> dict[str, torch.Tensor]:
        """Positions ``[start, stop)`` of the stream as one batch of tensors."""
        shard = self.shard[start:stop]
        row = self.row[start:stop]
        order = dict.fromkeys(shard.tolist())  # first-use order within the batch
        tables = {s: self._table(s) for s in order}
        first = tables[next(iter(order))]
        spec = self._spec(first)
        video_spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        n = stop - start
        vids: dict[str, np.ndarray] = {}
        if self.ds.video:
            vids = self._video(shard, row, tables)
            for k, v in vids.items():
                shape = (*v.shape[1:-3], v.shape[-1], *v.shape[-3:-1])  # [T,] C, H, W
                dt = torch.float32 if self.ds.video_dtype == "float32" else torch.uint8
                video_spec[k] = (shape, dt)
                if k in self.ds.deltas:
                    video_spec[f"{k}_is_pad"] = ((len(self.ds.deltas[k]),), torch.bool)
        out = alloc({**spec, **video_spec}, n)
        views = {k: v.numpy() for k, v in out.items()}
        single = len(tables) == 1
        for s, t in tables.items():
            sel = slice(None) if single else np.flatnonzero(shard == s)
            r = row if single else row[sel]
            for c in self.columns:
                src = t.columns[c]
                if c in self.ds.deltas:
                    q, pad = _window(r, t, self.ds.deltas[c])
                    _put(views[c], sel, src, q)
                    _put_value(views[f"{c}_is_pad"], sel, pad)
                else:
                    _put(views[c], sel, src, r)
            for k in vids:
                if k in self.ds.deltas:
                    _, pad = _window(r, t, self.ds.deltas[k])
                    _put_value(views[f"{k}_is_pad"], sel, pad)
        for k, v in vids.items():  # (n, [T,] H, W, 3) uint8 -> (n, [T,] 3, H, W)
            chw = np.moveaxis(v, -1, -3)
            if self.ds.video_dtype == "float32":
                np.multiply(chw, np.float32(1 / 255), out=views[k], casting="unsafe")
            else:
                views[k][...] = chw
        self._release(stop)
        return out

    def _video(self, shard: np.ndarray, row: np.ndarray,
               tables: dict[int, ShardTable]) -> dict[str, np.ndarray]:
        """Decoded frames per camera: (n, H, W, 3) or (n, T, H, W, 3) with a delta window."""
        n = len(row)
        out: dict[str, np.ndarray] = {}
        for key in self.src.video_keys:
            deltas = self.ds.deltas.get(key)
            width = 1 if deltas is None else len(deltas)
            paths = np.empty((n, width), dtype=object)
            times = np.empty((n, width), dtype=np.float64)
            for s, t in tables.items():
                sel = np.flatnonzero(shard == s)
                r = row[sel]
                q = r[:, None] if deltas is None else _window(r, t, deltas)[0]
                ts = t.columns["timestamp"][q].astype(np.float64)
                eps = t.episode[r] if t.episode is not None else np.zeros(len(r), np.int64)
                for e in np.unique(eps):
                    ref = self.src.videos[int(e)][key]
                    m = eps == e
                    paths[sel[m]] = ref.path
                    times[sel[m]] = ts[m] + ref.from_timestamp
            frames: np.ndarray | None = None
            for p in dict.fromkeys(paths.ravel().tolist()):
                m = paths == p
                got = self.frames.read(p, times[m])
                if frames is None:
                    frames = np.empty((n, width, *got.shape[1:]), dtype=np.uint8)
                frames[m] = got
            assert frames is not None
            out[key] = frames[:, 0] if deltas is None else frames
        return out

    def _release(self, stop: int) -> None:
        """Drop shards whose last sample has been assembled; the read-ahead may refill."""
        done = [s for s in self.tables if self.last[s] < stop]
        for s in done:
            del self.tables[s]
            assert self.readahead is not None
            self.readahead.release(s)


def _window(r: np.ndarray, t: ShardTable, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of each delta, clamped to the frame's episode, and the pad mask."""
    q = r[:, None] + deltas[None, :]
    lo = t.ep_start[r][:, None]
    hi = t.ep_end[r][:, None]
    pad = (q < lo) | (q >= hi)
    return np.clip(q, lo, hi - 1), pad


def _put(out: np.ndarray, sel: slice | np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
    if isinstance(sel, slice):
        np.take(src, rows, axis=0, out=out)
    else:
        out[sel] = src[rows]


def _put_value(out: np.ndarray, sel: slice | np.ndarray, value: np.ndarray) -> None:
    out[sel] = value
