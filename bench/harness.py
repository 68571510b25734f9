"""What every JPFS benchmark shares: temporary clusters, timing across client processes, and the
table that prints each figure beside its baseline from the same run."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jpfs import localcluster


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
        self.ops += ops
        self.start = min(self.start, start)
        self.end = max(self.end, end)
        self.bytes += nbytes

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 1e-9)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


def ratio(value: float, baseline: float) -> float | None:
    return value / baseline if baseline else None


def fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:,.0f}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
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
    return time.time()


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
