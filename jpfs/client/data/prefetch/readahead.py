"""Read-ahead: sequential reads of a large file read several chunks ahead at once (striped: from
several nodes); the window doubles while the reads stay sequential, and a reader that stops
being sequential, or closes the file, cancels what is in flight.
"""

from __future__ import annotations

from ....types import Layout
from .config import PrefetchConfig, PrefetchStats
from .fetch import Batch, Fetcher


class _Seq:
    __slots__ = ("next", "run", "ahead", "window", "batch")

    def __init__(self) -> None:
        self.next = -1
        self.run = 0
        self.ahead = -1
        self.window = 2
        self.batch = Batch()


class ReadAhead:
    """One read-ahead window per reading handle."""

    def __init__(self, config: PrefetchConfig, stats: PrefetchStats, fetcher: Fetcher):
        self.config = config
        self.stats = stats
        self.fetcher = fetcher
        self._seqs: dict[object, _Seq] = {}

    def read(self, key: object, layout: Layout, offset: int, size: int) -> None:
        """A read of a large file through handle ``key``: read ahead while it is sequential."""
        if not self.config.enabled:
            return
        st = self._seqs.get(key)
        if st is None:
            st = self._seqs[key] = _Seq()
        cs = layout.chunk_size
        if offset != st.next:
            if st.run:
                self.fetcher.cancel(st.batch)
            st.run = 0
            st.window = 2
            st.ahead = offset // cs
        else:
            st.run += 1
        st.next = offset + size
        if st.run < 1 and offset != 0:
            return
        idx = offset // cs
        last = (layout.attr.size - 1) // cs if layout.attr.size else -1
        if st.ahead > idx + st.window // 2:
            return
        if st.ahead > idx:
            st.window = min(self.config.readahead_max, st.window * 2)
        first = max(st.ahead, idx) + 1
        end = min(last, idx + st.window)
        if first > end:
            return
        by_index = {c.index: c for c in layout.chunks}
        chunks = [by_index[i] for i in range(first, end + 1) if i in by_index]
        st.ahead = end
        if chunks:
            self.stats.readahead_chunks += len(chunks)
            self.fetcher.launch(st.batch, chunks=chunks)

    def closed(self, key: object) -> None:
        """The file read under ``key`` was closed: its read-ahead still in flight is cancelled."""
        st = self._seqs.pop(key, None)
        if st is not None:
            self.fetcher.cancel(st.batch)


__all__ = ["ReadAhead"]
