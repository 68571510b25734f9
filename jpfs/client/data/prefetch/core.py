"""The prefetcher: what the mount and the native client tell prefetch, and what they ask of it.

One object over the parts (``__init__.py`` says what each does): it routes each observation
(an open, a read, a lookup, a hint) to the parts that learn from it, and answers for them (a
prefetched layout, a path resolved, the counters).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict

import trio

from ....types import Attr, Layout
from ...wire.meta import MetaClient
from ..cache import BlobCache, Fetch
from ..listings import Listings
from .budget import Budget
from .config import PrefetchConfig, PrefetchStats
from .fetch import Fetcher
from .handoff import KernelAhead, KernelBatch
from .hints import Hints
from .partners import Partners
from .paths import Paths
from .readahead import ReadAhead
from .scans import Scans
from .sweeps import Sweeps


class Prefetcher:
    """Watches opens and reads, and fetches ahead into ``cache``.

    Args:
        meta: metadata calls (listings, layouts).
        fetch: the storage read (``StorageClient.get``).
        cache: where prefetched blobs go.
        config: limits and switches.
        kernel_has: ``(ino, version) -> bool``, whether the reader's side already holds that
            version of the file (the mount's page cache); such files are not fetched again.
    """

    def __init__(self, meta: MetaClient, fetch: Fetch, cache: BlobCache,
                 config: PrefetchConfig | None = None,
                 kernel_has: Callable[[int, int], bool] | None = None):
        self.meta = meta
        self.fetch = fetch
        self.cache = cache
        self.config = cfg = config or PrefetchConfig()
        self.kernel_has = has = kernel_has or (lambda ino, version: False)
        self.stats = stats = PrefetchStats()
        self.listings = Listings(meta, cfg.listing_entries, cfg.listing_page)
        self.budget = Budget(cfg, cache)
        self.kernel = KernelAhead(cfg, self.budget, stats)
        self.fetcher = Fetcher(meta, fetch, cache, cfg, stats, self.budget, has)
        self.paths = Paths(meta, cfg, stats, self.listings, self.fetcher)
        self.readahead = ReadAhead(cfg, stats, self.fetcher)
        self.scans = Scans(cfg, stats, self.listings, self.paths, self.fetcher, self.kernel)
        self.sweeps = Sweeps(cfg, stats, self.listings, cache, self.budget, self.fetcher,
                             self.kernel, has)
        self.partners = Partners(cfg, stats, self.paths, self.sweeps, self.fetcher, has)
        self.hints = Hints(cfg, stats, self.paths, self.budget, self.fetcher, has)
        self.hint_errors: deque[str] = deque(maxlen=20)

    @property
    def enabled(self) -> bool:
        """Whether prefetching learns from opens here (``config.enabled`` and ``ahead``)."""
        return self.config.enabled and self.config.ahead

    @property
    def handoffs(self) -> trio.MemoryReceiveChannel[KernelBatch]:
        """The batches fetched for the kernel's page cache (``PrefetchConfig.handoff``): the
        taker hands each, then says so with ``handed``."""
        return self.kernel.batches

    @property
    def handed_bytes(self) -> int:
        """Bytes handed to the kernel that no reader has reached yet (``kernel_ahead``)."""
        return self.kernel.handed_bytes

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run prefetch tasks until cancelled (start it with ``nursery.start``)."""
        await self.fetcher.run(self.hints.work, task_status=task_status)

    # ------------------------------------------------------------------ what the mount asks

    def layout(self, ino: int) -> Layout | None:
        """A layout fetched by prefetch (it is taken: the mount keeps its own from then on)."""
        return self.fetcher.layout(ino)

    def looked_up(self, ino: int, max_age: float) -> None:
        """A lookup in directory ``ino`` was answered by its shard (``Paths.looked_up``)."""
        self.paths.looked_up(ino, max_age)

    def forget_dir(self, ino: int) -> None:
        """A directory changed: its listing is stale."""
        self.paths.forget_dir(ino)

    def handed(self, batch: KernelBatch, nbytes: int, *, failed: bool = False) -> None:
        """The taker of ``batch`` gave the kernel ``nbytes`` of it (``KernelAhead.handed``)."""
        self.kernel.handed(batch, nbytes, failed=failed)

    def reached(self, nbytes: int) -> None:
        """A reader got to ``nbytes`` handed to the kernel: there may be room for more."""
        self.kernel.reached(nbytes)

    # ------------------------------------------------------------------ observations

    def opened(self, stream: int, ino: int, parent: int, name: bytes, path: str, attr: Attr,
               ready: bool = False) -> None:
        """A reader (``stream``: its thread id) opened ``path`` (file ``ino`` in ``parent``);
        ``ready``: its bytes were prefetched already (or are on their way)."""
        if not self.enabled:
            return
        hinted = self.hints.opened(ino)
        rule = self.partners.hit(ino)
        self.scans.opened(stream, parent, name)
        # What scans and hints fetched ahead needs no sweep. A co-access prediction is made at
        # the partner's open, just before this one: the reader mostly waits for it, so in a
        # shuffled epoch such opens count as unpredicted (unless hints had them too).
        if not ready or (rule is not None and not hinted):
            self.sweeps.opened(parent, name)
        self.partners.opened(stream, path)
        self.budget.notify()

    def predicts_from(self, path: str) -> bool:
        """Whether a co-access rule predicts, at opens of ``path``, a partner whose directory
        is not being swept (``Partners.predicts_from``)."""
        return self.partners.predicts_from(path)

    def read(self, key: object, layout: Layout, offset: int, size: int) -> None:
        """A read of a large file through handle ``key``: read ahead while it is sequential."""
        self.readahead.read(key, layout, offset, size)

    def closed(self, key: object) -> None:
        """The file read under ``key`` was closed: its read-ahead still in flight is cancelled."""
        self.readahead.closed(key)

    def rules(self) -> list[dict]:
        """Learned co-access rules (for stats)."""
        return self.partners.rules()

    # ------------------------------------------------------------------ hints and paths

    async def hint(self, paths: Sequence[str]) -> int:
        """Fetch these files, in this order, ahead of their reader (``Hints.hint``)."""
        return await self.hints.hint(paths)

    async def resolve(self, path: str) -> tuple[int, bytes, Attr] | None:
        """(parent, name, attributes) of a path from the root, through listings (symlinks are
        not followed); None if it does not exist."""
        return await self.paths.resolve(path)

    async def resolve_many(self, paths: Sequence[str]) -> list[tuple[int, bytes, Attr] | None]:
        """``resolve`` for many paths, each directory resolved once."""
        return await self.paths.resolve_many(paths)

    def as_dict(self) -> dict:
        """The prefetch counters and queues, as one JSON-able object (the mount's stats)."""
        d = asdict(self.stats)
        d.update(enabled=self.config.enabled, inflight_bytes=self.budget.inflight,
                 handed_bytes=self.kernel.handed_bytes,
                 hints_queued=self.hints.queued, hinted_unopened=self.hints.unopened,
                 listings=self.listings.fetched,
                 listing_entries=self.listings.fetched_entries,
                 listing_dirs=len(self.listings._dirs),
                 listing_entries_kept=self.listings._entries, rules=self.rules())
        return d


__all__ = ["Prefetcher"]
