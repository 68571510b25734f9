"""Hints: paths a reader announces (the native API, ``MOUNTPOINT/.jpfs/prefetch``), fetched in
order, ahead of it, as the budget allows; each hinted file's open lets the next ones go.
"""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Callable, Sequence

import trio

from ....errors import error
from ....types import Attr
from .budget import Budget
from .config import PrefetchConfig, PrefetchStats
from .fetch import Batch, Fetcher
from .paths import Paths

HINTED_KEPT = 1 << 20
"""Hinted files remembered until their open (the oldest are forgotten first)."""


class Hints:
    """The hinted files queued, and those fetched and not opened yet."""

    def __init__(self, config: PrefetchConfig, stats: PrefetchStats, paths: Paths,
                 budget: Budget, fetcher: Fetcher, kernel_has: Callable[[int, int], bool]):
        self.config = config
        self.stats = stats
        self.paths = paths
        self.budget = budget
        self.fetcher = fetcher
        self.kernel_has = kernel_has
        self._queue: deque[tuple[int, Attr]] = deque()
        self._hinted: dict[int, int] = {}
        self._batch = Batch()
        self._wake = trio.Event()

    @property
    def queued(self) -> int:
        """Hinted files not fetched yet."""
        return len(self._queue)

    @property
    def unopened(self) -> int:
        """Hinted files fetched and not opened yet."""
        return len(self._hinted)

    def opened(self, ino: int) -> bool:
        """File ``ino`` was opened: whether it was hinted (then the queue may go on)."""
        hinted = bool(self._hinted) and self._hinted.pop(ino, None) is not None
        if hinted:
            self.stats.hint_opened += 1
            self._wake.set()
        return hinted

    async def hint(self, paths: Sequence[str]) -> int:
        """Fetch these files, in this order, ahead of their reader. Raises ENOENT/EINVAL naming
        the first path that is not a regular file (then nothing is queued)."""
        if not paths:
            return 0
        got = await self.paths.resolve_many(paths)
        items = []
        for p, r in zip(paths, got, strict=True):
            if r is None:
                self.stats.hint_errors += 1
                raise error(errno.ENOENT, f"hint: no such file: {p}", p)
            if not r[2].is_reg:
                self.stats.hint_errors += 1
                raise error(errno.EINVAL, f"hint: not a regular file: {p}", p)
            items.append((r[2].ino, r[2]))
        self.stats.hint_paths += len(items)
        if self.config.enabled:
            self._queue.extend(items)
            self._wake.set()
        return len(items)

    async def work(self) -> None:
        """Fetch the hinted files in order, as the budget allows (runs as long as prefetch)."""
        cfg = self.config
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._queue:
                room = self.budget.room()
                if room <= 0:
                    break
                picks: list[Attr] = []
                size = 0
                while self._queue and len(picks) < cfg.batch_files:
                    ino, attr = self._queue[0]
                    n = min(attr.size, cfg.small_file)
                    if picks and (size + n > room or size + n > cfg.batch_bytes):
                        break
                    self._queue.popleft()
                    if self.kernel_has(ino, attr.version):
                        self.stats.skipped_cached += 1
                        continue
                    picks.append(attr)
                    size += n
                    self._hinted[ino] = n
                    if len(self._hinted) > HINTED_KEPT:
                        del self._hinted[next(iter(self._hinted))]
                if picks:
                    self.stats.hint_files += len(picks)
                    await self.fetcher.batch(self._batch, attrs=picks, reserved=0)


__all__ = ["Hints"]
