"""Who reads which sample, in what order: pure functions of (shard sizes, seed, epoch, slot).

Everything a ShardDataset worker streams is decided here with integer arithmetic only, so the
order can be tested exhaustively, recomputed on resume without touching data, and handed ahead to
the read-ahead (the future is known exactly). The style follows MosaicML Streaming:

1. Shard order: the shards are permuted by ``rng(seed, epoch)`` (level one of the shuffle).
2. Concatenating the shards in that order gives the epoch's sample sequence; it is cut into
   contiguous, balanced spans, first per rank, then per DataLoader worker. Contiguous spans keep
   reads shard-sized; balance (sizes differ by at most one) keeps DDP ranks in step. Every sample
   lands in exactly one span.
3. Each worker permutes its span inside blocks of ``shuffle_buffer`` samples (level two): a
   bounded shuffle buffer whose contents are decided in advance, so resume is ``ids[k:]``.

Sample ids are canonical: shard ``i``'s rows are ``offsets[i] .. offsets[i+1]`` with shards in
their sorted (on-disk) order. For a LeRobot dataset stored in episode order that is the ``index``
column, whatever the format.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

# Salts keep the two shuffle levels' random streams independent of each other.
_SHARD_SALT = 0x5A4D
_BLOCK_SALT = 0xB10C


def rng(seed: int, epoch: int, *salt: int) -> np.random.Generator:
    """A generator that depends only on its arguments (PCG64 over a SeedSequence)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), *map(int, salt)])


def split_even(total: int, parts: int) -> np.ndarray:
    """``parts + 1`` boundaries cutting ``total`` into spans whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    base, extra = divmod(int(total), parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclass(frozen=True)
class Slot:
    """One reader in the world: a DataLoader worker (or the main process) of one rank."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1  # 1 for the main process (DataLoader num_workers=0)

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size and 0 <= self.worker < self.num_workers):
            raise ValueError(f"bad slot {self}")


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Level one: the order in which the epoch visits the shards."""
    if not shuffle:
        return np.arange(num_shards, dtype=np.int64)
    return rng(seed, epoch, _SHARD_SALT).permutation(num_shards).astype(np.int64)


def span(total: int, slot: Slot) -> tuple[int, int]:
    """The slot's ``[start, stop)`` in the epoch's sample sequence: rank first, then worker."""
    ranks = split_even(total, slot.world_size)
    r0, r1 = int(ranks[slot.rank]), int(ranks[slot.rank + 1])
    workers = split_even(r1 - r0, slot.num_workers)
    return r0 + int(workers[slot.worker]), r0 + int(workers[slot.worker + 1])


def sequence_ids(sizes: np.ndarray, order: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Canonical ids at positions ``[start, stop)`` of the sequence "shards in ``order``"."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    ordered = sizes[order]
    ends = np.cumsum(ordered)
    begins = ends - ordered
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(begins, stop, side="left"))  # shards first..last-1 overlap
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    parts = []
    for j in range(first, last):
        lo = max(start, int(begins[j])) - int(begins[j])
        hi = min(stop, int(ends[j])) - int(begins[j])
        if hi > lo:
            base = int(offsets[order[j]])
            parts.append(np.arange(base + lo, base + hi, dtype=np.int64))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def block_layout(n: int, block: int, gen: np.random.Generator | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Level two: a permutation of ``range(n)`` that moves items only within blocks, and the
    blocks' boundaries (``k + 1`` positions from 0 to ``n``).

    A block occupies the same positions before and after the permutation, so a reader can load
    a block's rows once and serve them in permuted order. With a generator, the first boundary
    sits at a random offset (boundaries differ from epoch to epoch); without one (no shuffle) the
    permutation is the identity. ``block <= 1`` with a generator also gives the identity.
    """
    block = max(int(block), 1)
    offset = int(gen.integers(block)) if gen is not None and block > 1 else 0
    cuts = np.arange(block - offset if offset else block, n, block, dtype=np.int64)
    bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64) if n else np.zeros(1, np.int64)
    if gen is None or block <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64), bounds
    blocks = (np.arange(n, dtype=np.int64) + offset) // block
    return np.lexsort((gen.random(n), blocks)).astype(np.int64), bounds


def block_shuffle(n: int, block: int, gen: np.random.Generator) -> np.ndarray:
    """The permutation of :func:`block_layout`."""
    return block_layout(n, block, gen)[0]


def worker_plan(
    sizes: Sequence[int] | np.ndarray,
    slot: Slot,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    shuffle_buffer: int = 4096,
) -> tuple[np.ndarray, np.ndarray]:
    """Every canonical sample id this slot yields in this epoch, in yield order, and the
    boundaries of the shuffle blocks (positions in that order)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = shard_order(len(sizes), seed, epoch, shuffle)
    start, stop = span(int(sizes.sum()), slot)
    ids = sequence_ids(sizes, order, start, stop)
    gen = rng(seed, epoch, _BLOCK_SALT, slot.rank, slot.world_size, slot.worker,
              slot.num_workers) if shuffle else None
    perm, bounds = block_layout(len(ids), shuffle_buffer, gen)
    return ids[perm], bounds


def worker_ids(
    sizes: Sequence[int] | np.ndarray,
    slot: Slot,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    shuffle_buffer: int = 4096,
) -> np.ndarray:
    """Every canonical sample id this slot yields in this epoch, in yield order."""
    return worker_plan(sizes, slot, seed=seed, epoch=epoch, shuffle=shuffle,
                       shuffle_buffer=shuffle_buffer)[0]


def worker_counts(total: int, rank: int, world_size: int, num_workers: int) -> np.ndarray:
    """How many samples each worker of ``rank`` yields in an epoch (same for every epoch)."""
    ranks = split_even(total, world_size)
    return np.diff(split_even(int(ranks[rank + 1] - ranks[rank]), num_workers))


def loader_progress(counts: Sequence[int] | np.ndarray, batch_size: int, batches: int,
                    drop_last: bool = False) -> tuple[list[int], int]:
    """Samples each worker had produced when a DataLoader handed out ``batches`` batches, and
    the worker whose turn is next.

    Models torch's in-order DataLoader over an IterableDataset with per-worker batching: workers
    take turns in a fixed cycle, batch r of every worker that still has one comes before batch
    r + 1 of any, and an exhausted worker drops out of the cycle. ``counts`` are per-worker sample
    counts (one entry for ``num_workers=0``). A fresh DataLoader always starts its cycle at worker
    0, so a resumed run rotates roles by the returned turn to continue the same interleaving.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    counts = [int(c) for c in counts]
    nbatches = [c // batch_size if drop_last else -(-c // batch_size) for c in counts]
    if batches > sum(nbatches):
        raise ValueError(f"only {sum(nbatches)} batches in the epoch, {batches} asked")
    taken = [0] * len(counts)
    left = int(batches)
    turn = 0
    rnd = 0
    while left > 0:
        for w, nb in enumerate(nbatches):
            if left == 0:
                break
            if rnd < nb:
                taken[w] += 1
                left -= 1
                turn = (w + 1) % len(counts)
        rnd += 1
    return [min(t * batch_size, c) for t, c in zip(taken, counts, strict=True)], turn
