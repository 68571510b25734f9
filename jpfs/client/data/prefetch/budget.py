"""The bound every prefetch fetch is taken under, and the event waiting for room waits on.

Prefetch is a guess, so it never takes more than it was given: bytes of its fetches in flight
(``inflight_bytes``), and prefetched-but-unused bytes as a share of the memory cache
(``cache_share``). Fetches reserve their bytes before they start; whatever frees room (a batch
ended, a reader opened something, a handed file was read) wakes the tasks waiting for it.
"""

from __future__ import annotations

import trio

from ..cache import BlobCache
from .config import PrefetchConfig


class Budget:
    """Bytes in flight and the room left under the two bounds."""

    def __init__(self, config: PrefetchConfig, cache: BlobCache):
        self.config = config
        self.cache = cache
        self.inflight = 0
        """Bytes of prefetch fetches reserved and not ended."""
        self._progress = trio.Event()

    def room(self) -> int:
        """Bytes prefetch may add now: the in-flight bound and the cache-share bound."""
        cfg = self.config
        share = int(self.cache.memory_bytes * cfg.cache_share)
        return min(cfg.inflight_bytes - self.inflight,
                   share - self.cache.prefetched_unused_bytes - self.inflight)

    def notify(self) -> None:
        """Wake tasks waiting for room (a batch ended, a reader opened something, a handed file
        was read)."""
        ev, self._progress = self._progress, trio.Event()
        ev.set()

    async def progressed(self) -> None:
        """Return at the next ``notify``."""
        await self._progress.wait()


__all__ = ["Budget"]
