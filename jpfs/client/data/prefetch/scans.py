"""Directory scans: a reader opening a directory's files in name order (also with a stride, per
reading thread) has the next entries fetched ahead; the window starts small and doubles while it
keeps being right, and a scan found wrong cancels its fetches in flight (unless a reader already
waits for them). Where the kernel takes files ahead (``handoff.py``), what a scan fetched goes on
to it, and a reader's jump past those files counts as the scan's progress.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

from ....types import Attr
from ..listings import Listing, Listings
from .config import PrefetchConfig, PrefetchStats
from .fetch import Batch, Fetcher
from .handoff import KernelAhead
from .paths import Paths

SCANS_KEPT = 4096
"""(reader, directory) scans followed at once (the oldest go first)."""


class _Scan:
    __slots__ = ("last", "last_name", "stride", "run", "ahead", "given", "window", "batch")

    def __init__(self, start: int):
        self.last: int | None = None
        self.last_name: bytes | None = None
        self.stride = 0
        self.run = 0
        self.ahead = -1
        self.given = -1
        """The furthest position whose file this scan is giving or gave the kernel."""
        self.window = start
        self.batch = Batch()



class Scans:
    """Every reader's scan of every directory it opens files in (see the module docstring)."""

    def __init__(self, config: PrefetchConfig, stats: PrefetchStats, listings: Listings,
                 paths: Paths, fetcher: Fetcher, kernel: KernelAhead):
        self.config = config
        self.stats = stats
        self.listings = listings
        self.paths = paths
        self.fetcher = fetcher
        self.kernel = kernel
        self._scans: OrderedDict[tuple[int, int], _Scan] = OrderedDict()

    def opened(self, stream: int, parent: int, name: bytes) -> None:
        """Reader ``stream`` opened ``name`` in ``parent``: follow its scan there, and fetch
        ahead of a confirmed one."""
        key = (stream, parent)
        st = self._scans.get(key)
        if st is None:
            st = self._scans[key] = _Scan(self.config.scan_start)
            while len(self._scans) > SCANS_KEPT:
                _, old = self._scans.popitem(last=False)
                self.fetcher.cancel(old.batch)
        else:
            self._scans.move_to_end(key)
        lst = self.listings.get(parent)
        if lst is None:
            if st.last_name is None:
                self.fetcher.spawn(self.paths.fetch_listing, parent)
            st.last_name = name
            return
        pos = lst.pos.get(name)
        if pos is None:
            st.last_name, st.last = None, None
            return
        if st.last is None and st.last_name is not None:
            st.last = lst.pos.get(st.last_name)
        prev, st.last, st.last_name = st.last, pos, name
        if prev is None:
            return
        s = pos - prev
        cfg = self.config
        if s > 0 and (s == st.stride or st.stride and s % st.stride == 0 and
                      pos - st.stride <= st.given):
            st.run += 1  # (past files it gave the kernel, which served them unseen here)
        elif 0 < s <= cfg.max_stride:
            if st.stride:
                self.fetcher.cancel(st.batch)
            st.stride, st.run, st.window, st.ahead, st.given = s, 1, cfg.scan_start, pos, -1
            self.stats.scan_streams += 1
        else:
            if st.stride:
                self.stats.scan_misses += 1
                self.fetcher.cancel(st.batch)
            st.stride, st.run, st.window, st.ahead, st.given = 0, 0, cfg.scan_start, pos, -1
            return
        if st.run < 2:  # three opens at one stride before anything is fetched
            return
        if st.ahead >= pos and st.run > 2:
            st.window = min(cfg.scan_max, st.window * 2)
        stride = st.stride
        have = max(0, (st.ahead - pos) // stride)
        if have > st.window // 2:
            return
        start = max(st.ahead, pos) + stride
        end = min(len(lst) - 1, pos + stride * st.window)
        where = [i for i in range(start, end + 1, stride) if lst.attrs[i].is_reg]
        then = None
        if self.kernel.enabled:
            then = functools.partial(self._hand_scanned, key, st, stride, lst, where)
        done = self.fetcher.launch(st.batch, attrs=[lst.attrs[i] for i in where], then=then)
        if done:
            self.stats.scan_files += done
            st.ahead = where[done - 1]
        elif not where:
            st.ahead = max(st.ahead, end)

    async def _hand_scanned(self, key: tuple[int, int], st: _Scan, stride: int, lst: Listing,
                            where: list[int], attrs: list[Attr]) -> None:
        """Offer the kernel a scan's fetched files (``attrs``, of those at positions ``where``,
        fetched at ``stride``), unless the scan was found wrong meanwhile (nobody would read
        them, and their bytes would count against ``kernel_ahead``)."""
        if not self.kernel.enabled or self._scans.get(key) is not st or st.stride != stride:
            return
        inos = {a.ino for a in attrs}
        st.given = max([st.given, *(i for i in where if lst.attrs[i].ino in inos)])
        self.kernel.give(lst.ino, attrs, 0)


__all__ = ["Scans"]
