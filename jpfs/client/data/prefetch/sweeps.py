"""Directory sweeps: a directory read whole in shuffled order (an epoch) is fetched whole.

Scans and hints fetch ahead of readers that follow an order; a shuffled epoch follows none. A
directory with ``sweep_after`` distinct files opened that nothing fetched ahead, mostly out of
name order, is fetched whole in name order (the order of its files in the storage volumes), a
batch at a time, if it fits within the cache share; where the kernel takes files ahead
(``handoff.py``), each batch goes on to it, under ``kernel_ahead``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import trio

from ....types import Attr
from ..cache import BlobCache
from ..listings import Listings
from .budget import Budget
from .config import PrefetchConfig, PrefetchStats
from .fetch import Fetcher
from .handoff import KernelAhead

log = logging.getLogger(__name__)

SWEEPS_KEPT = 4096
"""Directories whose opens are counted at once (the oldest go first)."""


class _Sweep:
    """Opens seen in one directory (any reader): how many distinct, how many went backwards."""

    __slots__ = ("opened", "last", "back", "done", "swept")

    def __init__(self) -> None:
        self.opened: set[bytes] = set()
        self.last = -1
        self.back = 0
        self.done = False
        self.swept = False


class Sweeps:
    """The opens counted per directory and the sweeps they started (see the module
    docstring)."""

    def __init__(self, config: PrefetchConfig, stats: PrefetchStats, listings: Listings,
                 cache: BlobCache, budget: Budget, fetcher: Fetcher, kernel: KernelAhead,
                 kernel_has: Callable[[int, int], bool]):
        self.config = config
        self.stats = stats
        self.listings = listings
        self.cache = cache
        self.budget = budget
        self.fetcher = fetcher
        self.kernel = kernel
        self.kernel_has = kernel_has
        self._sweeps: OrderedDict[int, _Sweep] = OrderedDict()

    def swept(self, parent: int) -> bool:
        """Whether directory ``parent`` is being (or was) fetched whole."""
        sw = self._sweeps.get(parent)
        return sw is not None and sw.swept

    def opened(self, parent: int, name: bytes) -> None:
        """A file of ``parent`` was opened that nothing fetched ahead: count it, and sweep the
        directory once such opens say an epoch reads it whole out of order."""
        cfg = self.config
        sw = self._sweeps.get(parent)
        if sw is None:
            sw = self._sweeps[parent] = _Sweep()
            while len(self._sweeps) > SWEEPS_KEPT:
                self._sweeps.popitem(last=False)
        if sw.done:
            return
        lst = self.listings.get(parent)
        if lst is None or not lst.complete:
            return
        pos = lst.pos.get(name)
        if pos is None or name in sw.opened:
            return
        sw.opened.add(name)
        if pos < sw.last:
            sw.back += 1
        sw.last = pos
        n = len(sw.opened)
        if n < cfg.sweep_after or sw.back < n * cfg.sweep_disorder:
            return
        sw.done = True  # decided once per directory
        small = cfg.small_file
        todo = [a for i, a in enumerate(lst.attrs) if a.is_reg and 0 < a.size <= small
                and lst.names[i] not in sw.opened and not self.kernel_has(a.ino, a.version)]
        total = sum(a.size for a in todo)
        # The directory must fit in the share on its own; it need not fit beside what other
        # sweeps hold now (the sweep waits for room, which reading them makes).
        if not todo or total > self.cache.memory_bytes * cfg.cache_share:
            return
        sw.swept = True
        self.stats.sweeps += 1
        self.stats.sweep_files += len(todo)
        self.stats.sweep_bytes += total
        log.debug("sweeping directory %d: %d files, %d bytes", parent, len(todo), total)
        self.fetcher.spawn(self._run_sweep, parent, todo)

    async def _run_sweep(self, parent: int, todo: list[Attr]) -> None:
        """Fetch the files in name order (their order in the storage volumes), a batch at a
        time, while there is room; each fetched batch goes on to the kernel where it takes them
        (the kernel's page cache takes it, and this directory's readers ask for nothing)."""
        cfg = self.config
        most = min(cfg.batch_bytes, cfg.kernel_ahead) if self.kernel.enabled \
            else cfg.batch_bytes
        k = 0
        while k < len(todo):
            picks: list[Attr] = []
            size = 0
            while k < len(todo) and len(picks) < cfg.batch_files and \
                    (not picks or size + todo[k].size <= most):
                a = todo[k]
                k += 1
                if not self.kernel_has(a.ino, a.version):
                    picks.append(a)
                    size += a.size
            if not picks:
                continue
            while self.budget.room() < size or (self.kernel.room() < size and (
                    self.kernel.holds() or self.budget.inflight)):  # a file may exceed the
                # bound alone
                with trio.move_on_after(30) as idle:
                    await self.budget.progressed()
                if idle.cancelled_caught:
                    return  # nothing read or fetched for a while: the sweep is not wanted
            self.budget.inflight += size
            await self.fetcher.batch(None, attrs=picks, reserved=size)
            if self.kernel.enabled:
                self.kernel.give(parent, picks, size)


__all__ = ["Sweeps"]
