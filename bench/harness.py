"""What every JPFS benchmark shares: temporary clusters, timing across client processes, and the
table that prints each figure beside its baseline from the same run."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from jpfs import localcluster
from jpfs.config import parse_size

log = logging.getLogger(__name__)

T = TypeVar("T")


@contextlib.contextmanager
def temporary_cluster(meta_shards: int, storage_nodes: int = 0, *, directory: str | None = None,
                      keep: bool = False, **options) -> Iterator[Path]:
    """A fresh local cluster for one measurement, stopped (and deleted) afterwards."""
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="jpfs-bench-"))
    try:
        localcluster.up(d, meta_shards=meta_shards, storage_nodes=storage_nodes, **options)
        yield d
    finally:
        localcluster.down(d, timeout=10)
        if not keep:
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class Phase:
    """Ops done by several processes between their own start and end times."""

    ops: int = 0
    start: float = float("inf")
    end: float = 0.0
    bytes: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, ops: int, start: float, end: float, nbytes: int = 0) -> None:
        """Count ``ops`` (and ``nbytes``) done by one process between ``start`` and ``end``."""
        self.ops += ops
        self.start = min(self.start, start)
        self.end = max(self.end, end)
        self.bytes += nbytes

    @property
    def seconds(self) -> float:
        """Seconds from the first start to the last end (never 0)."""
        return max(self.end - self.start, 1e-9)

    @property
    def rate(self) -> float:
        """Ops per second over ``seconds``."""
        return self.ops / self.seconds


def ratio(value: float, baseline: float) -> float | None:
    """``value / baseline``, or None without a baseline."""
    return value / baseline if baseline else None


def fmt_rate(x: float) -> str:
    """A rate for a table: ``1.23M``, ``45.6k`` or ``789``."""
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:,.0f}"


def fmt_ratio(x: float | None) -> str:
    """A ratio for a table: ``1.23x``, or ``-`` for None."""
    return "-" if x is None else f"{x:.2f}x"


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    """Print ``rows`` as a plain text table under ``headers`` (columns padded to fit)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    print()


def now() -> float:
    """Wall-clock time in seconds (``time.time``: comparable across processes)."""
    return time.time()


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def wait_port(host: str, port: int, proc: subprocess.Popen | None = None,
              timeout: float = 30.0) -> None:
    """Wait until something accepts on ``host:port``; fails early if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {host}:{port} exited with {proc.returncode}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for a server started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def drop_caches(files: list[Path] | None = None) -> dict:
    """Empty the page cache (``sync``, then ``drop_caches``); where that is not permitted,
    evict the given files' pages with posix_fadvise (their own pages only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return {"method": "drop_caches", "cold": True}
    except OSError as e:
        why = e.strerror
    evicted = 0
    for p in files or []:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted += 1
        finally:
            os.close(fd)
    return {"method": f"fadvise ({evicted} files; drop_caches: {why})", "cold": evicted > 0}


def arg_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from a parser that raises ValueError (argparse then says why)."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


size_arg = arg_type(parse_size)
"""``--x 4MiB``: a size in bytes."""


def stop_like_ctrl_c(signum, frame) -> None:
    """A signal handler that ends a run the way Ctrl-C does, so every ``finally`` cleans up.

    It raises SIGINT rather than a KeyboardInterrupt: inside ``trio.run`` an exception raised
    in a handler lands wherever the main thread happens to be, trio's scheduler included
    ("Nursery stack corrupted", exit 1), while trio's own SIGINT handler delivers it to the
    main task at a checkpoint (and outside trio Python's default handler raises it)."""
    if callable(signal.getsignal(signal.SIGINT)):
        signal.raise_signal(signal.SIGINT)
    else:  # SIGINT ignored: nothing else would stop the run
        raise KeyboardInterrupt(f"signal {signum}")


class Mount:
    """A JPFS mount set up the way one benchmark column (``via``) reads: read-only or
    read-write, prefetch, opens, short-circuit reads and write-behind on or off."""

    def __init__(self, cluster_file: str, work: Path, via: str, generation: int):
        from jpfs.fuse import mount as fm

        self.mp = work / f"mnt-{via}"
        self.mp.mkdir(parents=True, exist_ok=True)
        self.cache = work / f"cache-{via}-{generation}"
        opts = fm.MountOptions(mountpoint=str(self.mp), cluster=cluster_file,
                               cache_dir=str(self.cache), prefetch="noprefetch" not in via,
                               read_only=not via.startswith("fuse-rw"),
                               open_requests=via == "fuse-open",
                               short_circuit=via != "fuse-socket",
                               write_behind=via == "fuse-rw-write-behind",
                               engine="jpfs" if via.startswith("fuse-jpfs") else "pyfuse3",
                               workers=1 if via == "fuse-jpfs1" else 0,  # 0: one per core
                               log_file=str(work / f"mount-{via}.log"))
        self.pid = fm.start_background(opts)

    def stats(self) -> dict:
        """The mount's ``.jpfs/stats`` counters."""
        return json.loads((self.mp / ".jpfs" / "stats").read_text())

    def hint(self, paths: list[str], timeout: float = 60.0) -> int:
        """Announce ``paths`` (absolute, under the mount point), in the order they will be
        read, on the hint socket (a read-only mount takes no writes to ``.jpfs/prefetch``);
        return once the mount has taken them, with how many it took."""
        before = self.stats()["prefetch"]["hint_paths"]
        where = (self.mp / ".jpfs" / "socket").read_text().strip()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(where)
            s.sendall("".join(p + "\n" for p in paths).encode())
        deadline = time.monotonic() + timeout
        while (took := self.stats()["prefetch"]["hint_paths"] - before) < len(paths):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the mount took {took} of {len(paths)} hinted paths "
                                   f"in {timeout:.0f} s")
            time.sleep(0.01)
        return took

    def close(self) -> None:
        """Unmount (forcing a mount that will not go) and drop its cache."""
        from jpfs.fuse import mount as fm

        try:
            fm.unmount(str(self.mp))
        except OSError as e:
            log.warning("unmounting %s: %s; forcing", self.mp, e)
            with contextlib.suppress(OSError):
                fm.unmount(str(self.mp), lazy=True, force=True)
        shutil.rmtree(self.cache, ignore_errors=True)
