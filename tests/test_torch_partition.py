"""jpfs.torch.partition: exactly-once, balance, determinism and resume arithmetic, by property."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpfs.torch import partition as P

sizes_st = st.lists(st.integers(0, 60), min_size=1, max_size=12)
world_st = st.sampled_from([1, 2, 3, 4])
workers_st = st.sampled_from([1, 2, 3])


def all_slots(world: int, workers: int):
    for r in range(world):
        for w in range(workers):
            yield P.Slot(r, world, w, workers)


@settings(max_examples=100, deadline=None)
@given(sizes=sizes_st, world=world_st, workers=workers_st, seed=st.integers(0, 2**31),
       epoch=st.integers(0, 50), buf=st.integers(1, 40), shuffle=st.booleans())
def test_every_sample_exactly_once_across_the_world(sizes, world, workers, seed, epoch, buf,
                                                    shuffle):
    got = np.concatenate([P.worker_ids(sizes, s, seed=seed, epoch=epoch, shuffle=shuffle,
                                       shuffle_buffer=buf) for s in all_slots(world, workers)])
    assert sorted(got.tolist()) == list(range(sum(sizes)))


@settings(max_examples=100, deadline=None)
@given(sizes=sizes_st, world=world_st, workers=workers_st, seed=st.integers(0, 1000))
def test_ranks_balanced_and_counts_predicted(sizes, world, workers, seed):
    total = sum(sizes)
    per_rank = []
    for r in range(world):
        counts = [len(P.worker_ids(sizes, P.Slot(r, world, w, workers), seed=seed))
                  for w in range(workers)]
        assert counts == P.worker_counts(total, r, world, workers).tolist()
        assert max(counts) - min(counts) <= 1
        per_rank.append(sum(counts))
    assert max(per_rank) - min(per_rank) <= 1


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, seed=st.integers(0, 1000), epoch=st.integers(0, 10))
def test_same_seed_and_epoch_same_order(sizes, seed, epoch):
    slot = P.Slot(0, 2, 1, 3)
    a = P.worker_ids(sizes, slot, seed=seed, epoch=epoch)
    b = P.worker_ids(list(sizes), slot, seed=seed, epoch=epoch)
    assert a.tolist() == b.tolist()


def test_epochs_and_seeds_change_the_order():
    sizes = [50] * 20
    slot = P.Slot()
    base = P.worker_ids(sizes, slot, seed=1, epoch=0).tolist()
    assert P.worker_ids(sizes, slot, seed=1, epoch=1).tolist() != base
    assert P.worker_ids(sizes, slot, seed=2, epoch=0).tolist() != base
    assert P.worker_ids(sizes, slot, shuffle=False).tolist() == list(range(1000))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10), seed=st.integers(0, 999))
def test_without_buffer_shards_stay_whole_and_in_row_order(sizes, seed):
    ids = P.worker_ids(sizes, P.Slot(), seed=seed, shuffle_buffer=1)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    shard = np.searchsorted(offsets, ids, side="right") - 1
    runs = [int(s) for i, s in enumerate(shard) if i == 0 or s != shard[i - 1]]
    assert sorted(runs) == list(range(len(sizes)))  # each shard visited once, as one run
    for s in runs:
        rows = ids[shard == s]
        assert rows.tolist() == list(range(offsets[s], offsets[s + 1]))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), block=st.integers(1, 50), seed=st.integers(0, 999))
def test_block_shuffle_moves_items_only_within_a_window(n, block, seed):
    perm = P.block_shuffle(n, block, P.rng(seed, 0))
    assert sorted(perm.tolist()) == list(range(n))
    # Each output position draws from a window of at most `block` consecutive inputs.
    displacement = np.abs(perm - np.arange(n)) if n else np.zeros(0)
    assert (displacement < max(block, 1)).all()


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, buf=st.integers(1, 30), seed=st.integers(0, 999), shuffle=st.booleans())
def test_blocks_hold_contiguous_runs_of_the_sequence(sizes, buf, seed, shuffle):
    # A block's ids are exactly the sequence positions it spans, so a reader can load the
    # block's rows once; blocks tile the stream and are at most `buf` long.
    slot = P.Slot(0, 1, 0, 1)
    ids, bounds = P.worker_plan(sizes, slot, seed=seed, shuffle=shuffle, shuffle_buffer=buf)
    seq = P.worker_plan(sizes, slot, seed=seed, shuffle=shuffle, shuffle_buffer=1)[0]
    assert bounds[0] == 0 and bounds[-1] == len(ids)
    assert (np.diff(bounds) > 0).all() or len(ids) == 0
    assert (np.diff(bounds) <= buf).all()
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        assert sorted(ids[a:z].tolist()) == sorted(seq[a:z].tolist())


@pytest.mark.parametrize("drop_last", [False, True])
@settings(max_examples=80, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=4), bs=st.integers(1, 7),
       data=st.data())
def test_loader_progress_matches_a_round_robin_replay(drop_last, counts, bs, data):
    # Replay: tag each worker's batches, interleave them in DataLoader order, count.
    per_worker = [[min(bs, c - i) for i in range(0, c, bs) if not drop_last or c - i >= bs]
                  for c in counts]
    order = []
    for rnd in range(max((len(b) for b in per_worker), default=0)):
        order += [(w, b[rnd]) for w, b in enumerate(per_worker) if rnd < len(b)]
    k = data.draw(st.integers(0, len(order)))
    expect = [0] * len(counts)
    for w, n in order[:k]:
        expect[w] += n
    done, turn = P.loader_progress(counts, bs, k, drop_last)
    assert done == expect
    assert turn == ((order[k - 1][0] + 1) % len(counts) if k else 0)
    with pytest.raises(ValueError):
        P.loader_progress(counts, bs, len(order) + 1, drop_last)


def test_split_even():
    assert P.split_even(10, 3).tolist() == [0, 4, 7, 10]
    assert P.split_even(2, 4).tolist() == [0, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        P.split_even(3, 0)
