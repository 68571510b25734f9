"""``ShardDataset``: a drop-in PyTorch IterableDataset over LeRobot (v2.1, v3.0) or parquet shards.

Samples are frames as ``LeRobotDataset[i]`` gives them: a dict of tensors keyed by feature name
(and the ``task`` string), ``delta_timestamps`` windows clamped to the frame's episode with
``<key>_is_pad`` masks, camera frames (videos decoded at the sampled timestamps, image features
decoded from the parquet) as LeRobot returns them. Unlike LeRobot's map-style dataset it
streams whole shards (one read per file, in the background, bounded in bytes) in an order that
is a pure function of (seed, epoch, rank, worker) - see ``partition`` - so every sample is seen
exactly once per epoch across all ranks and workers, the order is reproducible, and resuming
mid-epoch costs nothing but arithmetic. The task string is the one non-tensor value (a list of
strings in a batch, as default collate makes).

With ``batch_size`` set, the dataset yields whole batches (use ``DataLoader(ds, batch_size=None)``
or ``jpfs.torch.to_device(ds, device)``), assembled column by column straight into preallocated
host buffers (``assemble``): no per-sample Python objects on the hot path.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from jpfs.uri import is_jpfs, to_path, to_url

from . import partition
from .assemble import Alloc, Assembler, Plan
from .pipeline import Batch, plain_alloc, shared_alloc
from .shards import Source, open_source

log = logging.getLogger(__name__)

STATE_KEY = "jpfs.ShardDataset"
STATE_VERSION = 1
_CHUNK = 512  # samples assembled at a time in per-sample mode
_CHUNK_BYTES = 64 << 20  # ... fewer when camera frames make samples large
_MAX_WORKERS = 1024


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


def _share_as(strategy: str) -> None:
    """Make this DataLoader worker send tensors by ``strategy``, before it allocates anything
    (so all it sends is shared that way; the training process rebuilds either kind whatever
    its own setting). Where shared memory by name does not work here (no torch_shm_manager, a
    /dev/shm that refuses it), the worker keeps the strategy it had, and logs why."""
    mp = torch.multiprocessing
    before = mp.get_sharing_strategy()
    if before == strategy:
        return
    mp.set_sharing_strategy(strategy)
    try:
        torch.empty(1).share_memory_()
    except RuntimeError as e:
        mp.set_sharing_strategy(before)
        log.warning("DataLoader workers keep the %r sharing strategy: %r fails here (%s)",
                    before, strategy, e)


class ShardDataset(IterableDataset):
    """Stream the frames of a dataset at ``root`` (``jpfs://...``, an fsspec URL, or a directory).

    Args:
        root: dataset root. ``jpfs://`` reads through the native client (batched reads, one
            metadata call per directory per batch); a local or mounted directory is read
            directly; other fsspec URLs through fsspec.
        delta_timestamps: ``{feature: [seconds, ...]}`` as in LeRobot, e.g. 16 future actions.
        columns: non-video features to return (default: all; image features included unless
            ``video=False``).
        video: decode camera frames: videos (needs PyAV) and image features (needs Pillow);
            False gives tabular features only (an image feature named in ``columns`` still
            comes).
        shuffle, seed, shuffle_buffer: two-level shuffle (shard order, then blocks of
            ``shuffle_buffer`` samples), decided by (seed, epoch) alone.
        rank, world_size: this process's place; default: torch.distributed's, else 0 and 1.
        batch_size, drop_last: yield batches (dicts of tensors with a leading batch dimension)
            instead of samples; each worker batches its own stream.
        readahead_bytes, readahead_files: read-ahead budget and files per batched read.
        video_dtype: "float32" (C, H, W in [0, 1], LeRobot's: ``uint8 / 255``) or "uint8"
            (C, H, W); for videos and image features alike.
        tolerance_s: how far a decoded frame may lie from its requested timestamp.
        video_lookahead_bytes: decoded frames held ahead of the batch being assembled, so each
            video file is decoded in few forward passes.
        with_task: add the task string (``task``) per sample, as LeRobot always does (batches
            get a list of strings, as default collate makes); False leaves it out.
        fps: frame rate for plain parquet shards (LeRobot datasets carry their own).
        storage_options: passed to fsspec; for ``jpfs://``, ``cluster`` names the cluster file
            (default ``$JPFS_CLUSTER``).
        worker_sharing: how DataLoader workers hand tensors to the training process, set in
            the workers only: "file_system" (default; shared memory by name) or
            "file_descriptor" (torch's default: one descriptor per tensor, each fetched over a
            socket connection, which bounds many workers: 3x fewer samples/s with 8), or None
            to leave torch's setting. torch's shared-memory manager removes named segments a
            dead process leaves.
    """

    def __init__(self, root: str, *, delta_timestamps: Mapping[str, list[float]] | None = None,
                 columns: list[str] | None = None, video: bool = True, shuffle: bool = True,
                 seed: int = 0, shuffle_buffer: int = 4096, rank: int | None = None,
                 world_size: int | None = None, batch_size: int | None = None,
                 drop_last: bool = False, readahead_bytes: int = 256 << 20,
                 readahead_files: int = 32, video_dtype: str = "float32",
                 tolerance_s: float = 1e-4, with_task: bool = True, fps: float | None = None,
                 video_lookahead_bytes: int = 64 << 20, storage_options: dict | None = None,
                 worker_sharing: str | None = "file_system"):
        super().__init__()
        if worker_sharing is not None and \
                worker_sharing not in torch.multiprocessing.get_all_sharing_strategies():
            raise ValueError(f"worker_sharing must be one of "
                             f"{sorted(torch.multiprocessing.get_all_sharing_strategies())} or "
                             f"None, not {worker_sharing!r}")
        self.worker_sharing = worker_sharing
        self.root = to_url(to_path(root)) if is_jpfs(root) else str(root)
        self.source: Source = open_source(self.root, columns=columns, fps=fps,
                                          storage_options=storage_options)
        if fps is not None and self.source.fps is None:
            self.source.fps = float(fps)
        self.delta_timestamps = dict(delta_timestamps or {})
        self.deltas = delta_indices(self.delta_timestamps, self.source.fps, tolerance_s)
        src = self.source
        # Image features are camera frames too: left out with video=False unless asked for.
        if columns is None and not video:
            src.columns = tuple(c for c in src.columns if c not in src.image_keys)
        self.images = tuple(c for c in src.columns if c in src.image_keys)
        if self.images:
            from .images import have_pillow

            if not have_pillow():
                raise ImportError(f"decoding image features {list(self.images)} needs Pillow "
                                  "(pip install 'jpfs[video]'); pass video=False for tabular "
                                  "features only")
        self.video = bool(video) and bool(self.source.video_keys)
        if self.video and not self.source.video_decodable:
            log.warning("%s: videos are stand-ins (not decodable); yielding tabular features only",
                        self.root)
            self.video = False
        if self.video:
            try:
                import av  # noqa: F401
            except ImportError:
                raise ImportError("decoding camera frames needs PyAV (pip install 'jpfs[video]'); "
                                  "pass video=False for tabular features only") from None
        if not self.video:  # camera windows of a policy config mean nothing without frames
            self.deltas = {k: v for k, v in self.deltas.items()
                           if k not in self.source.video_keys}
        if not video:
            self.deltas = {k: v for k, v in self.deltas.items()
                           if k not in src.image_keys or k in self.images}
        known = set(self.source.columns) | (set(self.source.video_keys) if self.video else set())
        unknown = [k for k in self.deltas if k not in known]
        if unknown:
            raise KeyError(f"delta_timestamps names unknown feature(s) {unknown}")
        if video_dtype not in ("float32", "uint8"):
            raise ValueError("video_dtype must be 'float32' or 'uint8'")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be >= 1")
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
        self.video_lookahead_bytes = int(video_lookahead_bytes)
        self.with_task = bool(with_task)
        # Shared memory, so set_epoch() reaches persistent DataLoader workers too.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._pending: dict | None = None
        # Which DataLoader workers already applied a state loaded in the main process: every
        # epoch's workers start from the main process's copy, which still holds that state.
        self._applied = torch.zeros(_MAX_WORKERS, dtype=torch.uint8).share_memory_()
        self._progress: dict[str, int] | None = None
        self.stats: dict[str, int] = {}
        # Resolve now: DataLoader workers are new processes where torch.distributed is not set up.
        _ = self.rank, self.world_size

    # place in the world --------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank: the constructor's, else torch.distributed's, else 0."""
        if self._rank is None and _dist_ready():
            self._rank = dist.get_rank()
        return 0 if self._rank is None else int(self._rank)

    @property
    def world_size(self) -> int:
        """The number of ranks: the constructor's, else torch.distributed's, else 1."""
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
        """The epoch the next iteration reads (shared with DataLoader workers)."""
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
                    epoch: int | None = None, drop_last: bool | None = None) -> dict[str, Any]:
        """The state of a plain ``DataLoader`` that has handed out ``batches`` batches.

        ``batches`` counts from the start of the epoch (across earlier resumes). Pure arithmetic:
        torch's DataLoader takes per-worker batches in a fixed cycle and each worker's sample
        count is known. A resumed plain DataLoader starts its cycle at worker 0 again, so the state
        also records whose turn it was and the workers' roles rotate accordingly: the resumed
        batches are exactly the uninterrupted run's remaining batches, in the same order.
        ``batch_size`` and ``drop_last`` are the DataLoader's (or this dataset's own).
        """
        bs = self.batch_size or batch_size
        if not bs:
            raise ValueError("batch_size is needed")
        nw = max(num_workers, 1)
        counts = partition.worker_counts(self.source.total, self.rank, self.world_size, nw)
        drop = self.drop_last if drop_last is None else bool(drop_last)
        done, turn = partition.loader_progress(counts, bs, batches, drop)
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
        in_worker = get_worker_info() is not None
        self._pending = {"epoch": int(state["epoch"]), "num_workers": int(state["num_workers"]),
                         "consumed": {str(k): int(v) for k, v in state["consumed"].items()},
                         "turn": int(state.get("turn", 0)), "once_per_worker": not in_worker}
        if not in_worker:
            self._applied.zero_()
            self.set_epoch(int(state["epoch"]))

    def _resume(self, workers: int) -> tuple[partition.Slot, int, int]:
        """(slot, epoch, samples to skip) for the iteration starting now; consumes a pending
        state. The slot's worker is the role this process plays (rotated on a plain resume)."""
        slot = self._slot()
        pending, self._pending = self._pending, None
        epoch = self.epoch
        info = get_worker_info()
        if pending is not None and pending["once_per_worker"] and info is not None:
            # Loaded in the main process, applied in workers: the first iteration's workers only.
            self._pending = pending  # the main process's copy keeps it; so does ours
            if info.id >= _MAX_WORKERS or self._applied[info.id]:
                return slot, epoch, 0
            self._applied[info.id] = 1
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
        if info is not None and self.worker_sharing is not None:
            _share_as(self.worker_sharing)
        plan = self._plan(info.num_workers if info is not None else 0)
        if self.batch_size:
            return self._batches(plan, shared_alloc if info is not None else plain_alloc)
        return self._samples(plan)

    def produce_batches(self, alloc: Alloc) -> Iterator[Batch]:
        """Batches of this process's stream written into buffers from ``alloc`` (the ring)."""
        return self._batches(self._plan(0), alloc)

    def _plan(self, workers: int) -> Plan:
        slot, epoch, skip = self._resume(workers)
        ids, bounds = partition.worker_plan(self.source.sizes, slot, seed=self.seed, epoch=epoch,
                                            shuffle=self.shuffle,
                                            shuffle_buffer=self.shuffle_buffer)
        skip = min(skip, len(ids))
        progress = {"epoch": epoch, "worker": slot.worker, "num_workers": workers,
                    "consumed": skip}
        self._progress = progress
        bounds = np.unique(np.clip(bounds - skip, 0, None))
        return Plan(ids[skip:], bounds, progress)

    def _samples(self, plan: Plan) -> Iterator[dict[str, Any]]:
        progress = plan.progress
        with Assembler(self, plan) as asm:
            for start, stop in asm.chunks(self._chunk_samples()):
                chunk = asm.assemble(start, stop, plain_alloc)
                keys = list(chunk)
                for i in range(stop - start):
                    sample = {k: chunk[k][i] for k in keys}
                    progress["consumed"] += 1  # before yield: a state taken now counts it
                    yield sample

    def _chunk_samples(self) -> int:
        """Samples assembled at once in per-sample mode: 512, fewer for large camera frames
        (512 float frames of 640x480 would be 1.9 GB per camera)."""
        src = self.source
        cams = [*(src.video_keys if self.video else ()), *self.images]
        per = 0
        for k in cams:
            shape = (src.meta.features.get(k, {}).get("shape") if src.meta else None) or ()
            steps = len(self.deltas.get(k, ())) or 1
            per += int(np.prod(shape)) * steps * (4 if self.video_dtype == "float32" else 1)
        return int(np.clip(_CHUNK_BYTES // max(per, 1), 8, _CHUNK)) if per else _CHUNK

    def _batches(self, plan: Plan, alloc: Alloc) -> Iterator[Batch]:
        bs = int(self.batch_size or 1)
        n = len(plan.ids)
        stop = n - n % bs if self.drop_last else n
        with Assembler(self, plan) as asm:
            for start in range(0, stop, bs):
                batch = asm.assemble(start, min(start + bs, n), alloc)
                plan.progress["consumed"] += min(bs, n - start)
                yield batch


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()
