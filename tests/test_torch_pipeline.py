"""jpfs.torch.pipeline: the ring of reusable host batches and to_device (CPU; CUDA if present)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from jpfs.torch.pipeline import PinnedRing, Stopped, ring_batches, to_device

SPEC = {"x": ((3,), torch.float32), "i": ((), torch.int64)}


def producer(n: int, bs: int, log: list | None = None):
    def produce(alloc):
        for b in range(n):
            out = alloc(SPEC, bs)
            out["x"].fill_(float(b))
            out["i"].copy_(torch.arange(b * bs, (b + 1) * bs))
            if log is not None:
                log.append(b)
            yield out
    return produce


def test_ring_bounds_outstanding_slots():
    ring = PinnedRing(capacity=4, depth=2)
    a, b = ring.acquire(), ring.acquire()
    stop = threading.Event()
    got = []
    t = threading.Thread(target=lambda: got.append(ring.acquire(stop)))
    t.start()
    time.sleep(0.2)
    assert not got  # both slots are out: the third acquire waits
    ring.release(a)
    t.join(2)
    assert got == [a]
    stop.set()
    with pytest.raises(Stopped):
        ring.acquire(stop)
    ring.release(b)


def test_ring_never_overwrites_a_batch_in_use():
    made: list[int] = []
    seen = []
    for batch, release in ring_batches(producer(20, 4, made), capacity=4, depth=3, pin=False):
        value = float(batch["x"][0, 0])
        time.sleep(0.01)  # the producer runs ahead meanwhile, as far as the ring allows
        assert (batch["x"] == value).all() and int(batch["i"][0]) == int(value) * 4
        assert len(made) - len(seen) <= 3  # at most `depth` batches exist ahead of release
        seen.append(value)
        release()
    assert seen == [float(b) for b in range(20)]


def test_ring_reuses_buffers():
    ptrs = set()
    for batch, release in ring_batches(producer(10, 4), capacity=4, depth=2, pin=False):
        ptrs.add(batch["x"].data_ptr())
        release()
    assert len(ptrs) == 2


def test_ring_raises_producer_errors_and_stops_on_close():
    def bad(alloc):
        yield alloc(SPEC, 2)
        raise RuntimeError("boom")

    it = ring_batches(bad, capacity=2, depth=2, pin=False)
    _, release = next(it)
    release()
    with pytest.raises(RuntimeError, match="boom"):
        next(it)
    # A consumer that stops early does not leave the producer blocked on a full ring.
    it = ring_batches(producer(1000, 4), capacity=4, depth=2, pin=False)
    next(it)
    before = threading.active_count()
    it.close()
    assert threading.active_count() <= before


def test_to_device_cpu_passes_batches_through():
    batches = [{"x": torch.full((2, 3), float(b)), "name": ["a", "b"]} for b in range(5)]
    out = list(to_device(batches, "cpu"))
    assert [o["x"] for o in out] == [b["x"] for b in batches]
    assert out[0]["name"] == ["a", "b"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_cuda_equals_cpu():
    batches = [{"x": torch.randn(64, 32), "i": torch.arange(64) + 64 * b} for b in range(20)]
    out = [{k: v.cpu() for k, v in b.items()} for b in to_device(batches, "cuda")]
    for a, b in zip(batches, out, strict=True):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["i"], b["i"])
