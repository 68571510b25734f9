"""The host-to-device end of the loader: a ring of reusable (pinned) batches and ``to_device``.

Batches are assembled column by column straight into preallocated host buffers (pinned when an
accelerator is present, so the copy to the device can be asynchronous). On CUDA the copy of batch
n + 1 is issued on a dedicated stream before batch n is handed to the training step, and events
order the two streams, so copy and compute overlap. Without CUDA the same code runs and simply
skips the copy.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
Batch = dict[str, Any]


def can_pin() -> bool:
    """Pinned host memory needs an accelerator runtime; a CPU-only torch has none."""
    return torch.cuda.is_available()


class HostBatch:
    """One reusable host batch: a buffer per key with room for ``capacity`` samples."""

    def __init__(self, index: int, capacity: int, pin: bool):
        self.index = index
        self.capacity = capacity
        self.pin = pin
        self.buffers: dict[str, torch.Tensor] = {}

    def views(self, spec: Spec, n: int) -> dict[str, torch.Tensor]:
        """Views of the first ``n`` rows, (re)allocating a buffer whose shape or dtype changed."""
        if n > self.capacity:
            raise ValueError(f"batch of {n} exceeds the ring's capacity {self.capacity}")
        out = {}
        for key, (shape, dtype) in spec.items():
            buf = self.buffers.get(key)
            if buf is None or buf.dtype != dtype or tuple(buf.shape[1:]) != tuple(shape):
                buf = torch.empty((self.capacity, *shape), dtype=dtype, pin_memory=self.pin)
                self.buffers[key] = buf
            out[key] = buf[:n]
        return out


class PinnedRing:
    """A fixed number of host batches that producer and consumer pass back and forth.

    ``acquire`` blocks until a slot is free, so host memory stays bounded at ``depth`` batches and
    a producer can never overwrite a batch whose device copy is still in flight.
    """

    def __init__(self, capacity: int, depth: int = 4, pin: bool | None = None):
        if depth < 2:
            raise ValueError("a ring needs at least 2 slots")
        self.pin = can_pin() if pin is None else (pin and can_pin())
        self.slots = [HostBatch(i, capacity, self.pin) for i in range(depth)]
        self._free: queue.Queue[HostBatch] = queue.Queue()
        for s in self.slots:
            self._free.put(s)

    @property
    def depth(self) -> int:
        """The number of host batches in the ring."""
        return len(self.slots)

    def acquire(self, stop: threading.Event | None = None) -> HostBatch:
        """The next free slot; returns early (raising ``Stopped``) once ``stop`` is set."""
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise Stopped from None

    def release(self, slot: HostBatch) -> None:
        """Give ``slot`` back to the producer (its device copy is done)."""
        self._free.put(slot)


def plain_alloc(spec: Spec, n: int) -> dict[str, torch.Tensor]:
    """Fresh host buffers for a batch of ``n``."""
    return {k: torch.empty((n, *shape), dtype=dt) for k, (shape, dt) in spec.items()}


_ALIGN = 64


def shared_alloc(spec: Spec, n: int) -> dict[str, torch.Tensor]:
    """In a DataLoader worker: one shared-memory block per batch, carved into the tensors.

    Sending the batch to the main process then passes one handle, where default collate
    allocates (and the main process maps) one shared block per key.
    """
    place = {}
    total = 0
    for k, (shape, dt) in spec.items():
        nbytes = math.prod((n, *shape)) * torch.empty(0, dtype=dt).element_size()
        place[k] = (total, nbytes)
        total += -(-nbytes // _ALIGN) * _ALIGN
    block = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
    out = {}
    for k, (shape, dt) in spec.items():
        off, nbytes = place[k]
        out[k] = block[off:off + nbytes].view(dt).view((n, *shape))
    return out


def collate(samples: list[Mapping[str, Any]]) -> Batch:
    """``default_collate`` for dict samples, with every tensor of the batch in one buffer.

    Pass it as the DataLoader's ``collate_fn`` with a per-sample ShardDataset: in workers the
    batch is one shared-memory block (one handle to send instead of one per key), about twice
    the drop-in throughput on small samples. Values that are not tensors (``task`` strings) go
    through ``default_collate``.
    """
    from torch.utils.data import default_collate, get_worker_info

    first = samples[0]
    keys = [k for k, v in first.items() if isinstance(v, torch.Tensor)]
    spec = {k: (tuple(first[k].shape), first[k].dtype) for k in keys}
    alloc = shared_alloc if get_worker_info() is not None else plain_alloc
    out: Batch = dict(alloc(spec, len(samples)))
    for k in keys:
        torch.stack([s[k] for s in samples], out=out[k])
    for k in first:
        if k not in out:
            out[k] = default_collate([s[k] for s in samples])
    return {k: out[k] for k in first}


class Stopped(Exception):
    """The consumer went away; the producer thread unwinds."""


_DONE = object()


Alloc = Callable[[Spec, int], dict[str, torch.Tensor]]


def ring_batches(produce: Callable[[Alloc], Iterable[Batch]], capacity: int, depth: int = 4,
                 pin: bool | None = None) -> Iterator[tuple[Batch, Callable[[], None]]]:
    """Run ``produce(alloc)`` in a background thread, its batches living in a ``PinnedRing``.

    ``produce`` gets an ``alloc(spec, n)`` that returns host views to fill and yields the filled
    batches. This generator yields ``(batch, release)``; a slot is reused only after
    ``release()``.
    pyarrow and numpy release the GIL while decoding and copying, so the thread overlaps the
    training loop even on few cores.
    """
    ring = PinnedRing(capacity, depth, pin)
    ready: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    local = threading.local()

    def alloc(spec: Spec, n: int) -> dict[str, torch.Tensor]:
        slot = ring.acquire(stop)
        local.slots.append(slot)
        return slot.views(spec, n)

    def run() -> None:
        local.slots = []
        try:
            batches = iter(produce(alloc))
            try:
                for batch in batches:
                    slots, local.slots = local.slots, []
                    ready.put((batch, slots))
                    if stop.is_set():
                        return
            finally:
                getattr(batches, "close", _noop)()  # unwinds the producer (read-ahead, files)
            ready.put(_DONE)
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, re-raised there
            ready.put(e)

    thread = threading.Thread(target=run, name="jpfs-batches", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            batch, slots = item

            def release(slots: list[HostBatch] = slots) -> None:
                for s in slots:
                    ring.release(s)
                slots.clear()

            yield batch, release
    finally:
        stop.set()
        # Unblock a producer waiting on a full ring, then let it unwind.
        while thread.is_alive():
            try:
                item = ready.get(timeout=0.05)
                if isinstance(item, tuple):
                    for s in item[1]:
                        ring.release(s)
            except queue.Empty:
                pass


def _host_batches(source: Any, pin: bool, depth: int
                  ) -> Generator[tuple[Batch, Callable[[], None]], None, None]:
    """``(batch, release)`` pairs from a ShardDataset (ring) or any iterable of dict batches."""
    produce = getattr(source, "produce_batches", None)
    if produce is not None and getattr(source, "batch_size", None):
        yield from ring_batches(produce, source.batch_size, depth, pin)
        return
    for batch in source:
        yield batch, _noop


def _noop() -> None:
    return None


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def to_device(source: Any, device: str | torch.device = "cuda", *, depth: int = 4,
              non_blocking: bool = True) -> Iterator[Batch]:
    """Training batches on ``device`` from a batched ShardDataset or a DataLoader of dict batches.

    On CUDA: host batches live in pinned memory (a ring, or the DataLoader's ``pin_memory``; an
    unpinned batch is staged through the ring), the copy runs on a dedicated stream, and the copy
    of batch n + 1 is issued before batch n is yielded, so it overlaps the step on batch n. The
    compute stream waits on the copy's event only. On other devices (CPU) batches are yielded as
    they are: no copy. A host batch from the ring is valid until the next one is requested; clone
    it to keep it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        for batch, release in _host_batches(source, False, depth):
            if device.type != "cpu":
                batch = {k: v.to(device) if _is_tensor(v) else v for k, v in batch.items()}
            try:
                yield batch
            finally:
                release()
        return
    yield from _cuda_batches(source, device, depth, non_blocking)


def _cuda_batches(source: Any, device: torch.device, depth: int,
                  non_blocking: bool) -> Iterator[Batch]:
    """The CUDA side of ``to_device``: side-stream copies, events, staged release of host slots."""
    copy_stream = torch.cuda.Stream(device)
    hosts = _host_batches(source, True, depth)
    staging: PinnedRing | None = None
    pending: collections.deque[tuple[torch.cuda.Event, Callable[[], None]]] = collections.deque()

    def reap(force_keep: int) -> None:
        # Give back host slots whose copies are done; block only if too many are outstanding.
        while pending and (pending[0][0].query() or len(pending) > force_keep):
            ev, rel = pending.popleft()
            ev.synchronize()
            rel()

    def issue() -> tuple[Batch, torch.cuda.Event] | None:
        nonlocal staging
        reap(max(depth - 2, 0))
        try:
            batch, release = next(hosts)
        except StopIteration:
            return None
        tensors = {k: v for k, v in batch.items() if _is_tensor(v)}
        if any(not t.is_pinned() for t in tensors.values()):
            # Pageable memory: a non_blocking copy would be synchronous. Stage through pinned.
            if staging is None:
                staging = PinnedRing(max(t.shape[0] if t.dim() else 1 for t in tensors.values()),
                                     depth, pin=True)
            slot = staging.acquire()
            n = next(iter(tensors.values())).shape[0]
            spec = {k: (tuple(t.shape[1:]), t.dtype) for k, t in tensors.items()}
            if n > slot.capacity:
                slot.capacity = n
                slot.buffers.clear()
            views = slot.views(spec, n)
            for k, t in tensors.items():
                views[k].copy_(t)
            release()  # the source batch is copied; its own slot (if any) can go back
            tensors = views
            release = functools.partial(staging.release, slot)
        with torch.cuda.stream(copy_stream):
            out = {k: (tensors[k].to(device, non_blocking=non_blocking) if k in tensors else v)
                   for k, v in batch.items()}
            event = torch.cuda.Event()
            event.record(copy_stream)
        pending.append((event, release))
        return out, event

    nxt = issue()
    try:
        while nxt is not None:
            out, event = nxt
            compute = torch.cuda.current_stream(device)
            compute.wait_event(event)
            for v in out.values():
                if _is_tensor(v):
                    v.record_stream(compute)  # the allocator must not reuse it under the step
            nxt = issue()  # the copy of n + 1 goes out before the step on n
            yield out
    finally:
        for ev, rel in pending:
            ev.synchronize()
            rel()
        pending.clear()
        hosts.close()
