"""The healer's per-chunk decisions on records as a shard holds them (pure, no daemons)."""

from __future__ import annotations

from jpfs_daemon.meta import heal_plan as P

from jpfs.types import Chunk

A, D, R = P.ACTIVE, P.DRAINING, P.REMOVED
BLOB = bytes(range(16))


def chunk(*nodes: int) -> Chunk:
    return Chunk(0, BLOB, nodes, 100, 100, 7)


def round_(states, *, up=None, bad=None, replicas=2, moves=None) -> P.Round:
    r = P.Round(1, 0.0, tuple(states), replicas, set(range(len(states))) if up is None else up,
                bad or {}, replicas)
    r.moves = moves or []
    return r


def writable(r: P.Round) -> list[int]:
    return [n for n, s in enumerate(r.states) if s == A and n in r.up]


def succeed(job: P.Job) -> P.Job:
    for cp in job.copies:
        cp.ok = True
    return job


def test_healthy_chunks_need_nothing():
    r = round_([A, A, A])
    assert P.plan_chunk(5, chunk(0, 1), r, writable(r)) is None
    assert r.under == 0


def test_a_bad_copy_is_replaced_in_place_from_the_good_one():
    r = round_([A, A, A], bad={1: {BLOB}})
    job = P.plan_chunk(5, chunk(0, 1), r, writable(r))
    assert job is not None and job.kind == "repair"
    assert [(cp.target, cp.sources) for cp in job.copies] == [(1, [0])]
    assert P.new_nodes(succeed(job), r) == (0, 1)
    assert r.under == 1 and r.bad_copies == 1


def test_a_removed_nodes_copy_does_not_count_and_is_replaced():
    r = round_([A, R, A])
    job = P.plan_chunk(5, chunk(0, 1), r, writable(r))
    assert job is not None and [cp.target for cp in job.copies] == [2]
    assert job.copies[0].sources == [0, 1]  # a removed node that answers: the last resort
    assert P.new_nodes(succeed(job), r) == (0, 2)
    assert r.under == 1


def test_a_draining_copy_counts_for_reading_but_moves():
    r = round_([A, D, A])
    job = P.plan_chunk(5, chunk(0, 1), r, writable(r))
    assert job is not None and [cp.target for cp in job.copies] == [2]
    assert r.under == 0  # still two readable copies
    assert P.new_nodes(job, r) == (0, 1)  # the copy failed: the draining copy stays
    assert P.new_nodes(succeed(job), r) == (0, 2)


def test_enough_live_copies_just_drop_the_draining_one():
    r = round_([A, A, D])
    job = P.plan_chunk(5, chunk(0, 1, 2), r, writable(r))
    assert job is not None and job.kind == "tidy" and not job.copies
    assert P.new_nodes(job, r) == (0, 1)


def test_no_copy_left_to_copy_from_is_counted_not_attempted():
    r = round_([R, R, A], up={2})
    assert P.plan_chunk(5, chunk(0, 1), r, writable(r)) is None
    assert r.unrepairable == 1 and r.under == 1


def test_rebalance_moves_a_healthy_copy_to_the_emptier_node_within_its_budget():
    r = round_([A, A, A], moves=[[0, 2, 150]])
    job = P.plan_chunk(5, chunk(0, 1), r, writable(r))
    assert job is not None and job.kind == "move" and job.replace == (0, 2)
    assert P.new_nodes(succeed(job), r) == (2, 1)
    second = P.plan_chunk(6, chunk(0, 1), r, writable(r))
    assert second is not None  # 50 bytes of budget left
    assert P.plan_chunk(7, chunk(0, 1), r, writable(r)) is None  # spent
    assert P.plan_chunk(8, chunk(1, 2), r, writable(r)) is None  # not on the full node


def test_targets_are_writable_nodes_not_holding_the_chunk():
    r = round_([A, R, A, A, D], replicas=3)
    job = P.plan_chunk(5, chunk(0, 1), r, writable(r))
    assert job is not None
    assert sorted(cp.target for cp in job.copies) == [2, 3]
    assert P.new_nodes(succeed(job), r) in ((0, 2, 3), (0, 3, 2))
