"""Prefetch: fetch what readers will open next, driven by evidence, bounded and counted.

A training loop reads millions of small files; each one fetched only when opened costs a metadata
and a storage round trip while the reader waits. The prefetcher watches opens and reads and
fetches ahead, in batches (one ``batch_layout`` per shard and one storage call per node for many
files), into the blob cache:

- a forward scan of a directory (in name order, also with a stride, per reading thread) fetches
  the next entries; the window starts small and doubles while it keeps being right;
- co-access learned across directories: when opening ``A/x_42.parquet`` is followed by opening
  ``B/cam/x_42.mp4`` (the same number in the name), a rule "A/x_N -> B/cam/x_N" is counted; once
  seen twice, opening a file of shape A fetches its partners. Nothing about LeRobot is built in;
- hints: paths a reader announces (``hint``) are fetched in order, ahead of it;
- sequential reads of a large file read ahead several chunks at once (striped: several nodes).

Everything is bounded: bytes in flight, and prefetched-but-unused bytes as a share of the memory
cache. A scan that turns out wrong and a reader that stops being sequential cancel their fetches
in flight (unless a reader already waits for them); a co-access rule whose predictions go unused
is dropped. The blob cache counts hits and wasted bytes; this module counts what it fetched, why,
and what it cancelled.

The prefetcher also keeps directory listings (readdirplus, one call per thousand entries) for the
directories being read: they give positions for scans, resolve predicted and hinted paths without
a lookup per component, and let the mount answer lookups from memory.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import trio

from ...errors import JPFSError, error
from ...types import ROOT_INO, Attr, Chunk, Layout
from ..wire.meta import MetaClient
from .cache import BlobCache, Fetch
from .coaccess import Opened, Rule, apply_rule, pairing, shape_of
from .listings import Listing, Listings

log = logging.getLogger(__name__)

LIST_AT_MOST = 20_000
"""A directory listed for its lookups (``looked_up``) with more entries than this is not kept:
its lookups keep asking the shard."""
TOO_BIG_FOR = 300.0
"""Seconds such a directory is not listed again for its lookups."""
LIST_AFTER = 8
"""Lookups in a row the shard answers in a directory, with no change by this mount between
them, before it is listed for them (``looked_up``)."""


@dataclass
class PrefetchConfig:
    """Limits and switches. Sizes are bytes."""

    enabled: bool = True
    small_file: int = 4 << 20
    """Files up to this size are fetched whole (on open, and when predicted)."""
    inflight_bytes: int = 64 << 20
    """Bytes of prefetch fetches in flight at once."""
    cache_share: float = 0.5
    """Prefetched-but-unused bytes stay below this share of the memory cache."""
    kernel_ahead: int = 1 << 30
    """Bytes of swept files handed to the kernel's page cache (``handoff``) and not reached by
    a reader yet that sweeps may run ahead by. The kernel holds them, not the memory cache,
    so the memory cache's share does not bound them."""
    scan_start: int = 4
    scan_max: int = 64
    """A confirmed directory scan fetches this many entries ahead at most (files)."""
    max_stride: int = 16
    coaccess_min: int = 2
    """Pairings seen this often become rules."""
    coaccess_window: int = 8
    """Opens per reading thread that a later open may be paired with."""
    readahead_max: int = 8
    """Chunks a sequential reader of a large file is read ahead at most."""
    listing_entries: int = 500_000
    """Directory entries kept in listings, over all directories."""
    listing_page: int = 1000
    layouts: bool = False
    """Fetch the layouts of a listed directory's files with its listing (one batch call per
    shard): opens then need no metadata call. For mounts whose files do not change."""
    sweep_after: int = 12
    """A directory with this many distinct files opened that nothing fetched ahead (no scan, no
    hint; a co-access prediction made at the partner's open is not ahead), mostly out of name
    order (an epoch in shuffled order), is fetched whole if it fits within the cache share."""
    sweep_disorder: float = 0.25
    """Share of those opens that went backwards in name order, for a sweep."""
    batch_files: int = 256
    batch_bytes: int = 32 << 20


@dataclass
class PrefetchStats:
    """What prefetch did: listings, scans, co-access rules, hints, read-ahead, batches."""

    scan_streams: int = 0
    scan_misses: int = 0
    scan_files: int = 0
    coaccess_pairs: int = 0
    coaccess_rules: int = 0
    coaccess_rules_dropped: int = 0
    coaccess_predictions: int = 0
    coaccess_hits: int = 0
    coaccess_files: int = 0
    hint_paths: int = 0
    hint_files: int = 0
    hint_opened: int = 0
    hint_errors: int = 0
    readahead_chunks: int = 0
    sweeps: int = 0
    sweep_files: int = 0
    sweep_bytes: int = 0
    layouts: int = 0
    batches: int = 0
    batch_files: int = 0
    batch_bytes: int = 0
    batches_cancelled: int = 0
    batch_errors: int = 0
    skipped_budget: int = 0
    skipped_cached: int = 0


# ---- the prefetcher ----------------------------------------------------------------------------

class _Batch:
    """Prefetch fetches in flight for one reason (a scan, a hint run, a file's readahead)."""

    __slots__ = ("scopes", "blobs")

    def __init__(self) -> None:
        self.scopes: list[tuple[trio.CancelScope, list[bytes]]] = []


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
        self.batch = _Batch()


class _Sweep:
    """Opens seen in one directory (any reader): how many distinct, how many went backwards."""

    __slots__ = ("opened", "last", "back", "done", "swept")

    def __init__(self) -> None:
        self.opened: set[bytes] = set()
        self.last = -1
        self.back = 0
        self.done = False
        self.swept = False


class _Seq:
    __slots__ = ("next", "run", "ahead", "window", "batch")

    def __init__(self) -> None:
        self.next = -1
        self.run = 0
        self.ahead = -1
        self.window = 2
        self.batch = _Batch()


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
        self.config = config or PrefetchConfig()
        self.kernel_has = kernel_has or (lambda ino, version: False)
        self.handoff: Callable[[int, list[Attr]], Awaitable[None]] | None = None
        """Set by a mount whose kernel can take files before they are read: called with each
        batch of a directory sweep or scan once its blobs are in the cache (``_run_sweep``,
        ``_scan``)."""
        self.handed_bytes = 0
        """Bytes ``handoff`` gave away that no reader has read yet (``kernel_ahead`` bounds
        them)."""
        self._handing = 0
        """Bytes of fetched sweep batches on their way to ``handoff``."""
        self.stats = PrefetchStats()
        self.listings = Listings(meta, self.config.listing_entries, self.config.listing_page)
        self._nursery: trio.Nursery | None = None
        self._too_big: dict[int, float] = {}
        self._asked: dict[int, list[int]] = {}
        """Directory -> [lookups the shard answered there in a row, lookups wanted before it
        is listed] (``looked_up``)."""
        self._inflight = 0
        self._layouts: OrderedDict[int, Layout] = OrderedDict()
        self._scans: OrderedDict[tuple[int, int], _Scan] = OrderedDict()
        self._sweeps: OrderedDict[int, _Sweep] = OrderedDict()
        self._progress = trio.Event()
        self._seqs: dict[object, _Seq] = {}
        self._recent: OrderedDict[int, deque[Opened]] = OrderedDict()
        self._rules: dict[str, dict[tuple, Rule]] = {}
        self._predicted: OrderedDict[int, Rule] = OrderedDict()
        self._hints: deque[tuple[int, Attr]] = deque()
        self._hinted: dict[int, int] = {}
        self._hint_batch = _Batch()
        self._hint_wake = trio.Event()
        self.hint_errors: deque[str] = deque(maxlen=20)

    @property
    def enabled(self) -> bool:
        """Whether prefetching is on (``config.enabled``)."""
        return self.config.enabled

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run prefetch tasks until cancelled (start it with ``nursery.start``)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._guarded, self._hint_worker, True)
            task_status.started()
            await trio.sleep_forever()

    # ------------------------------------------------------------------ what the mount asks

    def layout(self, ino: int) -> Layout | None:
        """A layout fetched by prefetch (it is taken: the mount keeps its own from then on)."""
        return self._layouts.pop(ino, None)

    def _keep_layout(self, lay: Layout) -> None:
        self._layouts[lay.attr.ino] = lay
        self._layouts.move_to_end(lay.attr.ino)
        while len(self._layouts) > 65536:
            self._layouts.popitem(last=False)

    def looked_up(self, ino: int, max_age: float) -> None:
        """A lookup in directory ``ino`` was answered by its shard. After ``LIST_AFTER`` of them
        in a row (plus one per 100 entries its last listing held, so a large directory is
        listed only when that costs less than the lookups it saves), with no change by this
        mount between them (each would drop the listing: a directory being emptied is not
        listed between its removes), the directory is listed with attributes in the
        background, and lookups there are answered from the listing while it is younger than
        ``max_age``: a stat of every file of a directory (``du``, an indexer, a loader
        checking sizes) costs a call per 1,000 files, not one per file. A prefetch of names
        and attributes: off with the rest."""
        if not self.config.enabled:
            return
        m = self._asked.get(ino)
        if m is None:
            if len(self._asked) > 4096:
                self._asked.clear()
            m = self._asked[ino] = [0, LIST_AFTER + self.listings.size_of(ino) // 100]
        m[0] += 1
        if m[0] < m[1]:
            return
        del self._asked[ino]
        big = self._too_big.get(ino)
        if big is not None and time.monotonic() - big < TOO_BIG_FOR:
            return
        if self.listings.get(ino, max_age) is None:
            self._spawn(self._list_dir, ino, max_age)

    async def _list_dir(self, ino: int, max_age: float) -> None:
        try:
            if await self.listings.fetch(ino, max_age, LIST_AT_MOST) is None:
                if len(self._too_big) > 1024:
                    self._too_big.clear()
                self._too_big[ino] = time.monotonic()
        except JPFSError as e:
            log.debug("listing of directory %d failed: %s", ino, e.strerror)

    def forget_dir(self, ino: int) -> None:
        """A directory changed: its listing is stale."""
        self.listings.drop(ino)
        self._asked.pop(ino, None)

    # ------------------------------------------------------------------ observations

    def opened(self, stream: int, ino: int, parent: int, name: bytes, path: str, attr: Attr,
               ready: bool = False) -> None:
        """A reader (``stream``: its thread id) opened ``path`` (file ``ino`` in ``parent``);
        ``ready``: its bytes were prefetched already (or are on their way)."""
        if not self.config.enabled:
            return
        hinted = bool(self._hinted) and self._hinted.pop(ino, None) is not None
        if hinted:
            self.stats.hint_opened += 1
            self._hint_wake.set()
        rule = self._predicted.pop(ino, None)
        if rule is not None:
            rule.hits += 1
            self.stats.coaccess_hits += 1
        self._scan(stream, parent, name)
        # What scans and hints fetched ahead needs no sweep. A co-access prediction is made at
        # the partner's open, just before this one: the reader mostly waits for it, so in a
        # shuffled epoch such opens count as unpredicted (unless hints had them too).
        if not ready or (rule is not None and not hinted):
            self._sweep(parent, name)
        self._coaccess(stream, path)
        self._notify()

    def predicts_from(self, path: str) -> bool:
        """Whether a co-access rule predicts, at opens of ``path``, a partner whose directory
        is not being swept (such opens must keep reaching ``opened``; a swept partner is
        fetched anyway)."""
        cur = shape_of(path)
        for rule in (self._rules.get(cur.shape) or {}).values():
            if rule.dropped or rule.seen < self.config.coaccess_min:
                continue
            p = apply_rule(rule.parts, cur.runs)
            got = self._resolve_now(p) if p is not None and p != path else None
            if got is False:
                return True
            if got is not None:
                sw = self._sweeps.get(got[0])
                if sw is None or not sw.swept:
                    return True
        return False

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
                self._cancel(st.batch)
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
            self._launch(st.batch, chunks=chunks)

    def closed(self, key: object) -> None:
        """The file read under ``key`` was closed: its read-ahead still in flight is cancelled."""
        st = self._seqs.pop(key, None)
        if st is not None:
            self._cancel(st.batch)

    # ------------------------------------------------------------------ directory scans

    def _scan(self, stream: int, parent: int, name: bytes) -> None:
        key = (stream, parent)
        st = self._scans.get(key)
        if st is None:
            st = self._scans[key] = _Scan(self.config.scan_start)
            while len(self._scans) > 4096:
                _, old = self._scans.popitem(last=False)
                self._cancel(old.batch)
        else:
            self._scans.move_to_end(key)
        lst = self.listings.get(parent)
        if lst is None:
            if st.last_name is None:
                self._spawn(self._fetch_listing, parent)
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
                self._cancel(st.batch)
            st.stride, st.run, st.window, st.ahead, st.given = s, 1, cfg.scan_start, pos, -1
            self.stats.scan_streams += 1
        else:
            if st.stride:
                self.stats.scan_misses += 1
                self._cancel(st.batch)
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
        if self.handoff is not None:
            then = functools.partial(self._hand_scanned, key, st, stride, lst, where)
        done = self._launch(st.batch, attrs=[lst.attrs[i] for i in where], then=then)
        if done:
            self.stats.scan_files += done
            st.ahead = where[done - 1]
        elif not where:
            st.ahead = max(st.ahead, end)

    async def _hand_scanned(self, key: tuple[int, int], st: _Scan, stride: int, lst: Listing,
                            where: list[int], attrs: list[Attr]) -> None:
        """``handoff`` of a scan's fetched files (``attrs``, of those at positions ``where``,
        fetched at ``stride``), unless the scan was found wrong meanwhile (nobody would read
        them, and their bytes would count against ``kernel_ahead``)."""
        if self.handoff is None or self._scans.get(key) is not st or st.stride != stride:
            return
        inos = {a.ino for a in attrs}
        st.given = max([st.given, *(i for i in where if lst.attrs[i].ino in inos)])
        await self.handoff(lst.ino, attrs)

    async def _fetch_listing(self, ino: int) -> None:
        try:
            await self._listing(ino)
        except JPFSError as e:
            log.debug("listing of directory %d failed: %s", ino, e.strerror)

    async def _listing(self, ino: int) -> Listing:
        """A directory's listing (fetched if needed), and its files' layouts with it."""
        lst = await self.listings.fetch(ino)
        assert lst is not None  # (no limit asked)
        if self.config.layouts and not lst.layouts:
            lst.layouts = True
            self._spawn(self._fetch_layouts, lst)
        return lst

    async def _fetch_layouts(self, lst: Listing) -> None:
        inos = [a.ino for a in lst.attrs if a.is_reg]
        for k in range(0, len(inos), 1000):
            try:
                got = await self.meta.batch_layout(inos[k:k + 1000])
            except JPFSError as e:
                log.debug("layouts of directory %d failed: %s", lst.ino, e.strerror)
                return
            for lay in got:
                if lay is not None and lay.attr.ino not in self._layouts:
                    self._keep_layout(lay)
                    self.stats.layouts += 1

    # ------------------------------------------------------------------ directory sweeps

    def _sweep(self, parent: int, name: bytes) -> None:
        cfg = self.config
        sw = self._sweeps.get(parent)
        if sw is None:
            sw = self._sweeps[parent] = _Sweep()
            while len(self._sweeps) > 4096:
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
        self._spawn(self._run_sweep, parent, todo)

    async def _run_sweep(self, parent: int, todo: list[Attr]) -> None:
        """Fetch the files in name order (their order in the storage volumes), a batch at a
        time, while there is room; each fetched batch goes on to ``handoff`` where one is set
        (the kernel's page cache takes it, and this directory's readers ask for nothing)."""
        cfg = self.config
        most = min(cfg.batch_bytes, cfg.kernel_ahead) if self.handoff else cfg.batch_bytes
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
            while self._room() < size or (self._kernel_room() < size and (
                    self.handed_bytes or self._handing or self._inflight)):  # a file may
                # exceed the bound alone
                with trio.move_on_after(30) as idle:
                    await self._progress.wait()
                if idle.cancelled_caught:
                    return  # nothing read or fetched for a while: the sweep is not wanted
            self._inflight += size
            await self._batch(None, attrs=picks, reserved=size)
            if self.handoff is not None:
                self._handing += size
                self._spawn(self._hand, parent, picks, size)

    async def _hand(self, parent: int, picks: list[Attr], size: int) -> None:
        """``handoff`` of a fetched batch; its bytes count against ``kernel_ahead`` meanwhile
        (``handed_bytes`` takes those it gave the kernel once it has)."""
        assert self.handoff is not None
        try:
            await self.handoff(parent, picks)
        finally:
            self._handing -= size
            self._notify()

    # ------------------------------------------------------------------ co-access

    def _coaccess(self, stream: int, path: str) -> None:
        cfg = self.config
        cur = shape_of(path)
        recent = self._recent.get(stream)
        if recent is None:
            recent = self._recent[stream] = deque(maxlen=cfg.coaccess_window)
            while len(self._recent) > 1024:
                self._recent.popitem(last=False)
        else:
            self._recent.move_to_end(stream)
        # learn: which earlier opens of this thread name the same number as this one?
        seen_rules = set()
        key = cur.runs[cur.base_run] if cur.base_run >= 0 else None
        for prev in recent:
            if key is None or key not in prev.runs:
                continue  # the usual case, cheaply: no number in common
            parts = pairing(prev, cur)
            if parts is None or (prev.shape, parts) in seen_rules:
                continue
            seen_rules.add((prev.shape, parts))
            rules = self._rules.setdefault(prev.shape, {})
            rule = rules.get(parts)
            if rule is None:
                if len(rules) >= 64 or len(self._rules) > 4096:
                    continue
                rule = rules[parts] = Rule(parts)
            rule.seen += 1
            self.stats.coaccess_pairs += 1
            if rule.seen == cfg.coaccess_min:
                self.stats.coaccess_rules += 1
        recent.appendleft(cur)
        # predict: this file's partners by the rules learned for its shape
        shape_rules = self._rules.get(cur.shape)
        if not shape_rules:
            return
        targets = []
        for rule in shape_rules.values():
            if rule.dropped or rule.seen < cfg.coaccess_min:
                continue
            p = apply_rule(rule.parts, cur.runs)
            if p is not None and p != path:
                targets.append((p, rule))
        if not targets:
            return
        self.stats.coaccess_predictions += len(targets)
        found: list[Attr] = []
        later: list[tuple[str, Rule]] = []
        for p, rule in targets:  # resolved from listings at once when they are all here
            got = self._resolve_now(p)
            if got is False:
                later.append((p, rule))
            else:
                self._predicted_file(rule, got[2] if got is not None else None, found)
        if found:
            self.stats.coaccess_files += len(found)
            self._launch(None, attrs=found)
        if later:
            self._spawn(self._predict, later)

    async def _predict(self, targets: list[tuple[str, Rule]]) -> None:
        found: list[Attr] = []
        for path, rule in targets:
            try:
                got = await self.resolve(path)
            except JPFSError:
                got = None
            self._predicted_file(rule, got[2] if got is not None else None, found)
        if found:
            self.stats.coaccess_files += len(found)
            self._launch(None, attrs=found)

    def _predicted_file(self, rule: Rule, attr: Attr | None, found: list[Attr]) -> None:
        if attr is None or not attr.is_reg:
            self._miss(rule)
            return
        if attr.ino in self._predicted or self.kernel_has(attr.ino, attr.version):
            return
        rule.predicted += 1
        self._predicted[attr.ino] = rule
        while len(self._predicted) > 4096:
            _, old = self._predicted.popitem(last=False)
            self._miss(old)
        found.append(attr)

    def _resolve_now(self, path: str) -> tuple[int, bytes, Attr] | None | Literal[False]:
        """Like ``resolve`` from listings already held; False when one is missing."""
        ino = ROOT_INO
        comps = path.strip("/").split("/")
        last = len(comps) - 1
        for i, comp in enumerate(comps):
            lst = self.listings.get(ino)
            if lst is None:
                return False
            name = os.fsencode(comp)
            k = lst.pos.get(name)
            if k is None:
                return None if lst.complete else False
            attr = lst.attrs[k]
            if i == last:
                return ino, name, attr
            if not attr.is_dir:
                return None
            ino = attr.ino
        return None

    def _miss(self, rule: Rule) -> None:
        rule.misses += 1
        if not rule.dropped and rule.misses >= 8 and rule.misses > rule.hits:
            rule.dropped = True
            self.stats.coaccess_rules_dropped += 1
            log.info("co-access rule %r dropped: %d hits, %d misses", rule.parts, rule.hits,
                     rule.misses)

    def rules(self) -> list[dict]:
        """Learned co-access rules (for stats)."""
        out = []
        for shape, rules in self._rules.items():
            for r in rules.values():
                if r.seen >= self.config.coaccess_min:
                    out.append({"from": shape.replace("\0", "#"),
                                "to": "".join(p if isinstance(p, str) else f"{{{p}}}"
                                              for p in r.parts),
                                "seen": r.seen, "predicted": r.predicted, "hits": r.hits,
                                "misses": r.misses, "dropped": r.dropped})
        return out[:100]

    # ------------------------------------------------------------------ hints

    async def hint(self, paths: Sequence[str]) -> int:
        """Fetch these files, in this order, ahead of their reader. Raises ENOENT/EINVAL naming
        the first path that is not a regular file (then nothing is queued)."""
        if not paths:
            return 0
        got = await self.resolve_many(paths)
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
            self._hints.extend(items)
            self._hint_wake.set()
        return len(items)

    async def _hint_worker(self) -> None:
        cfg = self.config
        while True:
            await self._hint_wake.wait()
            self._hint_wake = trio.Event()
            while self._hints:
                room = self._room()
                if room <= 0:
                    break
                picks: list[Attr] = []
                size = 0
                while self._hints and len(picks) < cfg.batch_files:
                    ino, attr = self._hints[0]
                    n = min(attr.size, cfg.small_file)
                    if picks and (size + n > room or size + n > cfg.batch_bytes):
                        break
                    self._hints.popleft()
                    if self.kernel_has(ino, attr.version):
                        self.stats.skipped_cached += 1
                        continue
                    picks.append(attr)
                    size += n
                    self._hinted[ino] = n
                    if len(self._hinted) > 1 << 20:
                        del self._hinted[next(iter(self._hinted))]
                if picks:
                    self.stats.hint_files += len(picks)
                    await self._batch(self._hint_batch, attrs=picks, reserved=0)

    # ------------------------------------------------------------------ path resolution

    async def resolve(self, path: str) -> tuple[int, bytes, Attr] | None:
        """(parent, name, attributes) of a path from the root, through listings (symlinks are
        not followed); None if it does not exist."""
        (got,) = await self.resolve_many([path])
        return got

    async def resolve_many(self, paths: Sequence[str]) -> list[tuple[int, bytes, Attr] | None]:
        """``resolve`` for many paths, each directory resolved once; None for each path that does
        not exist."""
        out: list = [None] * len(paths)
        dirs: dict[str, int | None] = {"": ROOT_INO}
        for i, p in enumerate(paths):
            head, _, name = p.strip("/").rpartition("/")
            if not name:
                continue
            parent = dirs.get(head, -1)
            if parent == -1:
                parent = dirs[head] = await self._resolve_dir(head)
            if parent is None:
                continue
            attr = await self._entry(parent, os.fsencode(name))
            if attr is not None:
                out[i] = (parent, os.fsencode(name), attr)
        return out

    async def _resolve_dir(self, head: str) -> int | None:
        ino = ROOT_INO
        for comp in head.split("/") if head else []:
            if comp in ("", "."):
                continue
            attr = await self._entry(ino, os.fsencode(comp))
            if attr is None or not attr.is_dir:
                return None
            ino = attr.ino
        return ino

    async def _entry(self, parent: int, name: bytes) -> Attr | None:
        lst = await self._listing(parent)
        i = lst.pos.get(name)
        if i is not None:
            return lst.attrs[i]
        if lst.complete:
            return None
        try:
            return await self.meta.lookup(parent, name)
        except JPFSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            raise

    # ------------------------------------------------------------------ fetching

    def progress(self) -> None:
        """Something prefetched was used elsewhere (a handed file read): there may be room."""
        self._notify()

    def _notify(self) -> None:
        """Wake tasks waiting for room (a batch ended, a reader opened something, a handed file
        was read)."""
        ev, self._progress = self._progress, trio.Event()
        ev.set()

    def _room(self) -> int:
        """Bytes prefetch may add now: the in-flight bound and the cache-share bound."""
        cfg = self.config
        share = int(self.cache.memory_bytes * cfg.cache_share)
        return min(cfg.inflight_bytes - self._inflight,
                   share - self.cache.prefetched_unused_bytes - self._inflight)

    def _kernel_room(self) -> int:
        """Bytes a sweep may fetch now for the kernel's page cache (``kernel_ahead``), counting
        what is in flight as bound there."""
        if self.handoff is None:
            return self.config.kernel_ahead
        return self.config.kernel_ahead - self.handed_bytes - self._handing - self._inflight

    def _spawn(self, fn, *args) -> None:
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

    def _launch(self, batch: _Batch | None, *, attrs: list[Attr] | None = None,
                chunks: list[Chunk] | None = None,
                then: Callable[[list[Attr]], Awaitable[None]] | None = None) -> int:
        """Start fetching files (whole when small, else their first chunk) or chunks, as many
        from the front as the budget allows (their bytes are reserved now); returns how many
        were taken care of (fetched, or not needed). ``then`` is called with the files once
        their fetch ends (some may be missing from the cache: cancelled, failed)."""
        if self._nursery is None:
            return 0
        room = self._room()
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
        self._inflight += size
        self._nursery.start_soon(self._guarded, functools.partial(
            self._run_batch, batch, attrs, chunks, size, then), False)
        return done

    async def _run_batch(self, batch, attrs, chunks, reserved, then=None) -> None:
        await self._batch(batch, attrs=attrs, chunks=chunks, reserved=reserved)
        if then is not None and attrs:
            await then(attrs)

    async def _batch(self, batch: _Batch | None, *, attrs: list[Attr] | None = None,
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
                        self._keep_layout(lay)
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
                    self._inflight += extra
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
            self._inflight -= reserved + extra
            self._notify()
            if batch is not None:
                try:
                    batch.scopes.remove(entry)
                except ValueError:
                    pass

    def _cancel(self, batch: _Batch) -> None:
        """The reason for these fetches proved wrong: cancel those no reader waits for."""
        for scope, blobs in list(batch.scopes):
            if not self.cache.waiting_on(blobs):
                scope.cancel()

    def as_dict(self) -> dict:
        """The prefetch counters and queues, as one JSON-able object (the mount's stats)."""
        d = asdict(self.stats)
        d.update(enabled=self.config.enabled, inflight_bytes=self._inflight,
                 handed_bytes=self.handed_bytes,
                 hints_queued=len(self._hints), hinted_unopened=len(self._hinted),
                 listings=self.listings.fetched,
                 listing_entries=self.listings.fetched_entries,
                 listing_dirs=len(self.listings._dirs),
                 listing_entries_kept=self.listings._entries, rules=self.rules())
        return d


__all__ = ["PrefetchConfig", "PrefetchStats", "Prefetcher"]
