"""Whole-file readers shared by ``jpfs bench read`` and ``jpfs bench aggregate``.

A dataset is read as *units*: the files of one LeRobot episode (its parquet and its camera mp4s),
read whole, every byte. The same units, in the same order, are read from the local filesystem
(the baseline), through the native client, or through a FUSE mount (a local path again), so the
figures differ only in the path the bytes take. Readers count every file and byte they get and
check each file's length against the size the dataset listing recorded, so the accounting is
exact and a short read is an error, not a faster run.

Reader processes are spawned fresh for each measurement (no inherited threads, loops or
caches), report that they are ready, wait on a barrier while the parent drops caches, and then
send progress ticks and finally their counters over a queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .harness import stop_like_ctrl_c

log = logging.getLogger(__name__)

MiB = 1 << 20
PIECE = 4 * MiB
"""Read size for files larger than this (large files stream through a reused buffer)."""
_EPISODE = re.compile(r"episode_(\d+)")
DATA_DIRS = ("data", "videos")
"""Where a LeRobot dataset keeps its per-episode files; ``meta/`` is read once, not per epoch."""

TICK_SECONDS = 0.2
"""How often a reader reports progress (bounded traffic on the queue)."""


# ---------------------------------------------------------------------- the dataset


@dataclass(frozen=True)
class Dataset:
    """The files read per epoch, grouped into units (episodes), with their sizes."""

    root: str
    units: tuple[tuple[str, ...], ...]
    sizes: dict[str, int] = field(repr=False)

    @property
    def files(self) -> int:
        """Files per epoch."""
        return sum(len(u) for u in self.units)

    @property
    def bytes(self) -> int:
        """Bytes per epoch."""
        return sum(self.sizes[p] for u in self.units for p in u)

    @property
    def largest(self) -> int:
        """The largest file's size in bytes (0 for none)."""
        return max(self.sizes.values(), default=0)

    def unit_sizes(self, unit: Sequence[str]) -> list[int]:
        """The sizes of a unit's files, in order."""
        return [self.sizes[p] for p in unit]


def scan_dataset(root: str | os.PathLike, only: Sequence[str] | None = DATA_DIRS) -> Dataset:
    """List the regular files under ``root`` (under ``data/`` and ``videos/`` when those exist),
    grouped by episode number (``episode_000042`` in the name); files without one are units of
    their own (a v3.0 dataset: each file is read whole)."""
    root = Path(root)
    tops = [root / d for d in (only or ()) if (root / d).is_dir()] or [root]
    groups: dict[int, list[str]] = {}
    single: list[str] = []
    sizes: dict[str, int] = {}
    for top in tops:
        for dirpath, dirnames, names in os.walk(top):
            dirnames.sort()
            for n in sorted(names):
                full = os.path.join(dirpath, n)
                st = os.lstat(full)
                if not (st.st_mode & 0o170000) == 0o100000:
                    continue
                rel = os.path.relpath(full, root)
                sizes[rel] = st.st_size
                m = _EPISODE.search(n)
                if m:
                    groups.setdefault(int(m.group(1)), []).append(rel)
                else:
                    single.append(rel)
    units = [tuple(sorted(groups[k], key=lambda p: (not p.endswith(".parquet"), p)))
             for k in sorted(groups)]
    units += [(p,) for p in single]
    return Dataset(str(root), tuple(units), sizes)


def epoch_order(n: int, order: str, seed: int, epoch: int) -> list[int]:
    """Unit indices in reading order: name order, or a shuffle seeded by (seed, epoch) as a
    training sampler does; the same for every mode, so modes read the same sequence."""
    idx = list(range(n))
    if order == "shuffled":
        random.Random(f"{seed}:{epoch}").shuffle(idx)
    return idx


def share(order: Sequence[int], index: int, total: int) -> list[int]:
    """Reader ``index`` of ``total`` takes every ``total``-th unit of the epoch's order."""
    return list(order[index::total])


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM ends the run the way Ctrl-C does (KeyboardInterrupt), so every ``finally``
    stops daemons, unmounts and removes namespaces (daemons and mounts run in sessions of
    their own and would otherwise outlive us)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, stop_like_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# ---------------------------------------------------------------------- counters


@dataclass
class Counters:
    """What one reader did between its start and end (seconds on the host's monotonic clock)."""

    files: int = 0
    bytes: int = 0
    start: float = 0.0
    end: float = 0.0
    cpu_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timed_out: bool = False

    def as_dict(self) -> dict:
        """The counters as one picklable object (the first 20 errors in full, all counted)."""
        return {"files": self.files, "bytes": self.bytes, "start": self.start, "end": self.end,
                "cpu_s": self.cpu_s, "latencies": self.latencies, "errors": self.errors[:20],
                "n_errors": len(self.errors), "timed_out": self.timed_out}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu(pid: int) -> float:
    """CPU seconds used so far by another process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds used so far by a process and its live children (a mount's workers)."""
    total = proc_cpu(pid)
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    return total + sum(proc_cpu(c) for c in children)


def page_cache_drops() -> int:
    """How many times anyone on this machine dropped the page cache (``/proc/vmstat``): a
    change during a warm measurement means another process made it (partly) cold."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("drop_pagecache "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class Ticker:
    """Reports (files, bytes) done since the last report, at most every TICK_SECONDS."""

    def __init__(self, send: Callable[[int, int], None] | None):
        self.send = send
        self.files = self.bytes = 0
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, files: int, nbytes: int) -> None:
        """Count ``files`` and ``nbytes`` done; sends a tick when ``TICK_SECONDS`` have passed
        (thread-safe; nothing without a queue)."""
        if self.send is None:
            return
        with self.lock:
            self.files += files
            self.bytes += nbytes
            now = time.monotonic()
            if now - self.last >= TICK_SECONDS:
                self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Send what is counted and not sent yet."""
        if self.send is not None and (self.files or self.bytes):
            self.send(self.files, self.bytes)
            self.files = self.bytes = 0
            self.last = now or time.monotonic()


# ---------------------------------------------------------------------- local (and FUSE) reads


def read_local(root: str, units: Sequence[Sequence[str]], sizes: Sequence[Sequence[int]], *,
               threads: int = 1, deadline: float = float("inf"),
               tick: Ticker | None = None) -> Counters:
    """Read every file of ``units`` under ``root`` whole with plain ``open`` and ``readv`` into
    a reused buffer (the best a Python reader does: no allocation per file; files larger than
    PIECE are read PIECE at a time). ``threads`` readers share the units. Works on any local
    path: a FUSE mount is read the same way."""
    c = Counters()
    largest = max((s for u in sizes for s in u), default=0)
    work: Iterator[int] = iter(range(len(units)))
    lock = threading.Lock()
    # +1: a small file read in one call, and EOF seen by the second
    buffers = [memoryview(bytearray(min(largest + 1, PIECE))) for _ in range(max(1, threads))]

    def next_unit() -> int | None:
        with lock:
            return next(work, None)

    def reader(view: memoryview) -> None:
        lat: list[float] = []
        files = nbytes = 0
        errors: list[str] = []
        while (k := next_unit()) is not None:
            if time.monotonic() > deadline:
                c.timed_out = True
                break
            got = 0
            for rel, want in zip(units[k], sizes[k], strict=True):
                t = time.perf_counter()
                try:
                    n = _read_whole(os.path.join(root, rel), view)
                except OSError as e:
                    errors.append(f"{rel}: {e}")
                    continue
                lat.append(time.perf_counter() - t)
                if n != want:
                    errors.append(f"{rel}: read {n} bytes, expected {want}")
                files += 1
                nbytes += n
                got += n
            if tick:
                tick.add(len(units[k]), got)
        with lock:
            c.latencies += lat
            c.files += files
            c.bytes += nbytes
            c.errors += errors

    c.start, cpu = time.monotonic(), cpu_seconds()
    if threads <= 1:
        reader(buffers[0])
    else:
        ts = [threading.Thread(target=reader, args=(b,), name=f"reader-{i}")
              for i, b in enumerate(buffers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    c.end, c.cpu_s = time.monotonic(), cpu_seconds() - cpu
    if tick:
        tick.flush()
    return c


def _read_whole(path: str, view: memoryview) -> int:
    """Bytes in ``path``, read to EOF, each read into ``view`` (reused: only counted)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        n = 0
        while got := os.readv(fd, [view]):
            n += got
        return n
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- native reads


async def read_native(client, root: str, units: Sequence[Sequence[str]],
                      sizes: Sequence[Sequence[int]], *, inflight: int = 4, api: str = "read_many",
                      batch: int = 1, deadline: float = float("inf"),
                      tick: Ticker | None = None) -> Counters:
    """Read ``units`` through an AsyncClient, ``batch`` units per call, ``inflight`` calls at
    once. Every file of a call gets the call's latency (its bytes arrive together).

    ``api``:
      - ``read_many``: ``client.read_many(paths)``, what applications call (fresh buffers).
      - ``into``: the same round trips spelled out (``stat_many``, ``meta.batch_layout``,
        ``storage.get(chunks, into=...)``) into buffers reused call after call: what the read
        path costs without allocating per file.
      - ``open``: ``client.open(path)`` and ``readinto`` a reused 4 MiB buffer (large files).
      - ``chunks``: the file's layout, then ``storage.get`` of WINDOW chunks per call into
        reused buffers, ``inflight`` calls at once, one file at a time (large files: what
        ``open`` could cost without its copy).
    """
    import trio

    c = Counters()
    calls = [list(range(k, min(k + batch, len(units)))) for k in range(0, len(units), batch)]
    it = iter(calls)
    prefix = root.rstrip("/") + "/"

    async def worker() -> None:
        arena = bytearray(0)
        arenas = [bytearray(0) for _ in range(max(1, inflight))]
        big = memoryview(bytearray(4 * MiB)) if api == "open" else None
        for ks in it:
            if time.monotonic() > deadline:
                c.timed_out = True
                return
            rels = [r for k in ks for r in units[k]]
            want = [s for k in ks for s in sizes[k]]
            paths = [prefix + r for r in rels]
            t = time.perf_counter()
            try:
                if api == "read_many":
                    got = [len(v) for v in await client.read_many(paths)]
                elif api == "into":
                    got, arena = await _read_into(client, paths, arena)
                elif api == "open":
                    got = [await _read_open(client, p, big) for p in paths]
                elif api == "chunks":
                    got = [await _read_chunks(client, p, arenas) for p in paths]
                else:
                    raise ValueError(f"unknown api {api!r}")
            except OSError as e:
                c.errors.append(f"{rels[0]}..: {e}")
                continue
            dt = time.perf_counter() - t
            c.latencies += [dt] * len(paths)
            for rel, n, w in zip(rels, got, want, strict=True):
                if n != w:
                    c.errors.append(f"{rel}: read {n} bytes, expected {w}")
            c.files += len(paths)
            c.bytes += sum(got)
            if tick:
                tick.add(len(paths), sum(got))

    c.start, cpu = time.monotonic(), cpu_seconds()
    async with trio.open_nursery() as nursery:
        # chunks: one file at a time, ``inflight`` windows of it at once
        for _ in range(1 if api == "chunks" else max(1, inflight)):
            nursery.start_soon(worker)
    c.end, c.cpu_s = time.monotonic(), cpu_seconds() - cpu
    if tick:
        tick.flush()
    return c


async def _read_into(client, paths: list[str], arena: bytearray) -> tuple[list[int], bytearray]:
    """read_many's round trips, with blobs received into ``arena`` (grown, then reused)."""
    attrs = await client.stat_many(paths)
    for p, a in zip(paths, attrs, strict=True):
        if isinstance(a, OSError):
            raise a
        if not a.is_reg:
            raise IsADirectoryError(f"{p}: not a regular file")
    layouts = await client.meta.batch_layout([a.ino for a in attrs])
    chunks = []
    for p, lay in zip(paths, layouts, strict=True):
        if lay is None:
            raise FileNotFoundError(f"{p}: vanished while being read")
        chunks += lay.chunks
    need = sum(c.blob_len for c in chunks)
    if len(arena) < need:
        arena = bytearray(need + need // 4)
    view = memoryview(arena)
    bufs, off = [], 0
    for c in chunks:
        bufs.append(view[off:off + c.blob_len])
        off += c.blob_len
    if chunks:
        await client.storage.get(chunks, into=bufs)
    del bufs, view
    return [lay.attr.size for lay in layouts], arena


WINDOW = 8
"""Chunks per storage call for the ``chunks`` api (spread over the nodes)."""


async def _read_chunks(client, path: str, arenas: list[bytearray]) -> int:
    """The file's chunks, WINDOW per storage call, one call in flight per arena."""
    import trio

    lay = await client.layout(path)
    chunks = sorted(lay.chunks, key=lambda c: c.index)
    windows = iter(range(0, len(chunks), WINDOW))

    async def one(slot: int) -> None:
        for k in windows:
            part = chunks[k:k + WINDOW]
            need = sum(c.blob_len for c in part)
            if len(arenas[slot]) < need:
                arenas[slot] = bytearray(need)
            view = memoryview(arenas[slot])
            bufs, off = [], 0
            for c in part:
                bufs.append(view[off:off + c.blob_len])
                off += c.blob_len
            await client.storage.get(part, into=bufs)
            del bufs, view

    async with trio.open_nursery() as nursery:
        for slot in range(len(arenas)):
            nursery.start_soon(one, slot)
    return lay.attr.size


async def _read_open(client, path: str, buf: memoryview) -> int:
    f = await client.open(path, "rb")
    try:
        n = 0
        while got := await f.readinto(buf):
            n += got
        return n
    finally:
        await f.close()


# ---------------------------------------------------------------------- reader processes


def worker_main(spec: dict, go, out) -> None:
    """One reader process: set up, report ready, wait for ``go`` (the parent drops caches
    meanwhile), read its units, report its counters. Messages on ``out``: ("ready", i),
    ("tick", i, files, bytes), ("done", i, counters), ("error", i, text)."""
    idx = spec["index"]
    try:
        tick = Ticker(lambda f, b: out.put(("tick", idx, f, b)))
        if spec["via"] == "native":
            import trio

            c = trio.run(_native_worker, spec, go, out, tick)
        else:
            out.put(("ready", idx))
            if not go.wait(spec["start_timeout"]):
                raise TimeoutError("never told to start")
            c = read_local(spec["root"], spec["units"], spec["sizes"], threads=spec["threads"],
                           deadline=time.monotonic() + spec["timeout"], tick=tick)
        out.put(("done", idx, c.as_dict()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        import traceback

        out.put(("error", idx, "".join(traceback.format_exception(e))[-4000:]))


async def _native_worker(spec: dict, go, out, tick: Ticker) -> Counters:
    import trio

    import jpfs

    async with jpfs.aconnect(spec["cluster"], dir_cache_ttl=3600) as client:
        # connections and directory lookups before the clock starts, as in a running loader
        root = spec["root"].rstrip("/")
        dirs = {}
        for u in spec["units"]:
            for rel in u:
                dirs.setdefault(os.path.dirname(rel), f"{root}/{rel}")
        for k in range(0, len(dirs), 256):
            await client.stat_many(list(dirs.values())[k:k + 256])
        if client.storage is not None:
            for node in range(client.cluster.n_nodes):
                await client.storage.stats(node)
        out.put(("ready", spec["index"]))
        if not await trio.to_thread.run_sync(go.wait, spec["start_timeout"]):
            raise TimeoutError("never told to start")
        return await read_native(client, root, spec["units"], spec["sizes"],
                                 inflight=spec["inflight"], api=spec.get("api", "read_many"),
                                 batch=spec.get("batch", 1),
                                 deadline=time.monotonic() + spec["timeout"], tick=tick)


def run_readers(specs: list[dict], *, before_go: Callable[[], None] | None = None,
                progress: Callable[[int, int], None] | None = None,
                start_timeout: float = 120.0, timeout: float = 600.0) -> list[dict]:
    """Run one fresh reader process per spec (spawned: nothing inherited) and return their
    counters in spec order. ``before_go`` runs once all are ready and before any reads (drop
    caches there; a multi-host run waits on its peers there). Bounded: a reader that is not
    ready in ``start_timeout`` or not done ``timeout`` seconds after the start fails the run."""
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("spawn")
    go = ctx.Event()
    out = ctx.Queue()
    for i, s in enumerate(specs):
        s.update(index=i, start_timeout=start_timeout, timeout=timeout)
    procs = [ctx.Process(target=worker_main, args=(s, go, out), daemon=True,
                         name=f"jpfs-bench-reader-{i}") for i, s in enumerate(specs)]
    results: list[dict | None] = [None] * len(specs)

    def receive(until: float, what: str) -> tuple:
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"reader processes: no {what} within the time limit")
            try:
                msg = out.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"reader processes died: {', '.join(dead)}") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"reader {msg[1]} failed:\n{msg[2]}")
            if msg[0] == "tick":
                if progress:
                    progress(msg[2], msg[3])
                continue
            return msg

    try:
        for p in procs:
            p.start()
        ready = 0
        until = time.monotonic() + start_timeout
        while ready < len(procs):
            if receive(until, "ready message")[0] == "ready":
                ready += 1
        if before_go:
            before_go()
        go.set()
        until = time.monotonic() + timeout + 30
        while any(r is None for r in results):
            msg = receive(until, "result")
            if msg[0] == "done":
                results[msg[1]] = msg[2]
        return results  # type: ignore[return-value]
    finally:
        for p in procs:
            if p.pid is None:
                continue  # never started (a signal came during the starts): nothing to join
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        out.close()
