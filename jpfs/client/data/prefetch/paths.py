"""The directories prefetch lists, and paths resolved through those listings.

Listings (readdirplus, one call per thousand entries) give scans their positions, resolve
predicted and hinted paths without a lookup per component, and let the mount answer lookups
from memory: a directory is listed when it is being read, or when the shard keeps answering
lookups there (``looked_up``). With ``PrefetchConfig.layouts`` the files' layouts come with it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from typing import Literal

from ....errors import JPFSError
from ....types import ROOT_INO, Attr
from ...wire.meta import MetaClient
from ..listings import Listing, Listings
from .config import PrefetchConfig, PrefetchStats
from .fetch import Fetcher

log = logging.getLogger(__name__)

LIST_AT_MOST = 20_000
"""A directory listed for its lookups (``looked_up``) with more entries than this is not kept:
its lookups keep asking the shard."""
TOO_BIG_FOR = 300.0
"""Seconds such a directory is not listed again for its lookups."""
LIST_AFTER = 8
"""Lookups in a row the shard answers in a directory, with no change by this mount between
them, before it is listed for them (``looked_up``)."""


class Paths:
    """Listings to fetch, and resolution through them (see the module docstring)."""

    def __init__(self, meta: MetaClient, config: PrefetchConfig, stats: PrefetchStats,
                 listings: Listings, fetcher: Fetcher):
        self.meta = meta
        self.config = config
        self.stats = stats
        self.listings = listings
        self.fetcher = fetcher
        self._too_big: dict[int, float] = {}
        self._asked: dict[int, list[int]] = {}
        """Directory -> [lookups the shard answered there in a row, lookups wanted before it
        is listed] (``looked_up``)."""

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
            self.fetcher.spawn(self._list_dir, ino, max_age)

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

    async def fetch_listing(self, ino: int) -> None:
        """Fetch a directory's listing in the background (a failure is only logged)."""
        try:
            await self.listing(ino)
        except JPFSError as e:
            log.debug("listing of directory %d failed: %s", ino, e.strerror)

    async def listing(self, ino: int) -> Listing:
        """A directory's listing (fetched if needed), and its files' layouts with it."""
        lst = await self.listings.fetch(ino)
        assert lst is not None  # (no limit asked)
        if self.config.layouts and not lst.layouts:
            lst.layouts = True
            self.fetcher.spawn(self._fetch_layouts, lst)
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
                if lay is not None and not self.fetcher.has_layout(lay.attr.ino):
                    self.fetcher.keep_layout(lay)
                    self.stats.layouts += 1

    def resolve_now(self, path: str) -> tuple[int, bytes, Attr] | None | Literal[False]:
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
        lst = await self.listing(parent)
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


__all__ = ["LIST_AFTER", "LIST_AT_MOST", "Paths", "TOO_BIG_FOR"]
