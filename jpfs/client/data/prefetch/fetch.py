"""Prefetch's fetching: files and chunks fetched in batches, as the budget allows, in the
prefetcher's nursery, cancelled when their reason proves wrong.

A batch asks for the files' layouts (one ``batch_layout`` per shard, unless prefetch holds them
already) and then their blobs (one storage call per node), into the blob cache. The layouts are
kept (``layout``): an open of a prefetched file then needs no metadata call.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

from ....errors import JPFSError
from ....types import Attr, Chunk, Layout
from ...wire.meta import MetaClient
from ..cache import BlobCache, Fetch
from .budget import Budget
from .config import PrefetchConfig, PrefetchStats

log = logging.getLogger(__name__)

LAYOUTS_KEPT = 65536
"""Prefetched layouts kept for the opens they save (the oldest go first)."""


class Batch:
    """Prefetch fetches in flight for one reason (a scan, a hint run, a file's readahead)."""

    __slots__ = ("scopes", "blobs")

    def __init__(self) -> None:
        self.scopes: list[tuple[trio.CancelScope, list[bytes]]] = []


class Fetcher:
    """Runs prefetch's tasks and fetches (see the module docstring).

    Args:
        kernel_has: ``(ino, version) -> bool``, whether the reader's side already holds that
            version of the file; such files are not fetched again.
    """

    def __init__(self, meta: MetaClient, fetch: Fetch, cache: BlobCache, config: PrefetchConfig,
                 stats: PrefetchStats, budget: Budget, kernel_has: Callable[[int, int], bool]):
        self.meta = meta
        self.fetch = fetch
        self.cache = cache
        self.config = config
        self.stats = stats
        self.budget = budget
        self.kernel_has = kernel_has
        self._nursery: trio.Nursery | None = None
        self._layouts: OrderedDict[int, Layout] = OrderedDict()

    async def run(self, *forever: Callable[[], Awaitable[None]],
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run prefetch tasks (``forever``: started again should one fail) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for fn in forever:
                nursery.start_soon(self._guarded, fn, True)
            task_status.started()
            await trio.sleep_forever()

    def layout(self, ino: int) -> Layout | None:
        """A layout fetched by prefetch (it is taken: the mount keeps its own from then on)."""
        return self._layouts.pop(ino, None)

    def has_layout(self, ino: int) -> bool:
        """Whether prefetch holds the file's layout."""
        return ino in self._layouts

    def keep_layout(self, lay: Layout) -> None:
        """Keep a fetched layout for the file's open."""
        self._layouts[lay.attr.ino] = lay
        self._layouts.move_to_end(lay.attr.ino)
        while len(self._layouts) > LAYOUTS_KEPT:
            self._layouts.popitem(last=False)

    def spawn(self, fn, *args) -> None:
        """Run ``fn(*args)`` as a prefetch task (guarded: its failure is logged and counted)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._guarded, functools.partial(fn, *args), False)

    async def _guarded(self, fn, forever: bool) -> None:
        """Run a prefetch task so that no failure of it ends its nursery (and with it the
        mount): prefetch is a hint, and a reader fetches for itself what a failed prefetch
        missed. A ``forever`` task is started again after logging."""
        while True:
            try:
                await fn()
            except Exception:
                self.stats.batch_errors += 1
                log.exception("a prefetch task failed%s", "; starting it again" if forever
                              else "")
                if forever:
                    await trio.sleep(1)
                    continue
            return

    def launch(self, batch: Batch | None, *, attrs: list[Attr] | None = None,
                chunks: list[Chunk] | None = None,
                then: Callable[[list[Attr]], Awaitable[None]] | None = None) -> int:
        """Start fetching files (whole when small, else their first chunk) or chunks, as many
        from the front as the budget allows (their bytes are reserved now); returns how many
        were taken care of (fetched, or not needed). ``then`` is called with the files once
        their fetch ends (some may be missing from the cache: cancelled, failed)."""
        if self._nursery is None:
            return 0
        room = self.budget.room()
        small = self.config.small_file
        done = size = 0
        if attrs is not None:
            keep = []
            for a in attrs:
                if self.kernel_has(a.ino, a.version):
                    self.stats.skipped_cached += 1
                    done += 1
                    continue
                n = min(a.size, small)
                if size + n > room:
                    self.stats.skipped_budget += 1
                    break
                keep.append(a)
                size += n
                done += 1
            attrs = keep
            if not keep:
                return done
        else:
            assert chunks is not None
            keep_c = []
            for c in chunks:
                if not self.cache.needs(c.blob):
                    done += 1
                    continue
                if size + c.blob_len > room:
                    self.stats.skipped_budget += 1
                    break
                keep_c.append(c)
                size += c.blob_len
                done += 1
            chunks = keep_c
            if not keep_c:
                return done
        self.budget.inflight += size
        self._nursery.start_soon(self._guarded, functools.partial(
            self._run_batch, batch, attrs, chunks, size, then), False)
        return done

    async def _run_batch(self, batch, attrs, chunks, reserved, then=None) -> None:
        await self.batch(batch, attrs=attrs, chunks=chunks, reserved=reserved)
        if then is not None and attrs:
            await then(attrs)

    async def batch(self, batch: Batch | None, *, attrs: list[Attr] | None = None,
                     chunks: list[Chunk] | None = None, reserved: int) -> None:
        """Fetch layouts (for ``attrs``) then blobs, in one call per shard and per node."""
        scope = trio.CancelScope()
        entry: tuple[trio.CancelScope, list[bytes]] = (scope, [])
        if batch is not None:
            batch.scopes.append(entry)
        extra = 0
        try:
            with scope:
                if attrs is not None:
                    known = self._layouts
                    layouts = [known.get(a.ino) for a in attrs]
                    missing = [a.ino for a, lay in zip(attrs, layouts, strict=True)
                               if lay is None]
                    if missing:
                        got = iter(await self.meta.batch_layout(missing))
                        layouts = [lay if lay is not None else next(got) for lay in layouts]
                    chunks = []
                    small = self.config.small_file
                    for lay in layouts:
                        if lay is None:
                            continue
                        self.keep_layout(lay)
                        if lay.attr.size <= small:
                            chunks.extend(lay.chunks)
                        else:
                            chunks.extend(c for c in lay.chunks if c.index == 0)
                assert chunks is not None
                chunks = [c for c in chunks if self.cache.needs(c.blob)]
                entry[1].extend(c.blob for c in chunks)
                if not chunks:
                    return
                if not reserved:
                    extra = sum(c.blob_len for c in chunks)
                    self.budget.inflight += extra
                n = await self.cache.prefetch(chunks, self.fetch)
                self.stats.batches += 1
                self.stats.batch_files += len(attrs) if attrs is not None else len(chunks)
                self.stats.batch_bytes += n
            if scope.cancelled_caught:
                self.stats.batches_cancelled += 1
        except JPFSError as e:
            self.stats.batch_errors += 1
            log.debug("prefetch failed: %s", e.strerror)
        finally:
            self.budget.inflight -= reserved + extra
            self.budget.notify()
            if batch is not None:
                try:
                    batch.scopes.remove(entry)
                except ValueError:
                    pass

    def cancel(self, batch: Batch) -> None:
        """The reason for these fetches proved wrong: cancel those no reader waits for."""
        for scope, blobs in list(batch.scopes):
            if not self.cache.waiting_on(blobs):
                scope.cancel()


__all__ = ["Batch", "Fetcher"]
