"""Directory listings of the directories being read, bounded in entries.

A listing is one readdirplus of a directory (a page per thousand entries) with its entries'
attributes: it gives the prefetcher positions for scans, resolves predicted and hinted paths
without a lookup per component, and lets the VFS answer lookups from memory while it is fresh.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import aclosing

import trio

from ..types import Attr
from .meta import MetaClient


class Listing:
    """One directory's entries in name order (as readdir returns them), with attributes."""

    __slots__ = ("ino", "names", "attrs", "pos", "fetched", "complete", "layouts")

    def __init__(self, ino: int, names: list[bytes], attrs: list[Attr], complete: bool):
        self.ino = ino
        self.names = names
        self.attrs = attrs
        self.pos = {n: i for i, n in enumerate(names)}
        self.fetched = time.monotonic()
        self.complete = complete
        self.layouts = False

    def __len__(self) -> int:
        return len(self.names)


class Listings:
    """Listings of recently read directories, bounded in entries (LRU by directory)."""

    def __init__(self, meta: MetaClient, max_entries: int, page: int = 1000):
        self.meta = meta
        self.max_entries = max_entries
        self.page = page
        self.fetched = 0
        """Listings fetched so far."""
        self.fetched_entries = 0
        self._dirs: OrderedDict[int, Listing] = OrderedDict()
        self._entries = 0
        self._fetching: dict[int, trio.Event] = {}

    def get(self, ino: int, max_age: float = float("inf")) -> Listing | None:
        lst = self._dirs.get(ino)
        if lst is None:
            return None
        if time.monotonic() - lst.fetched > max_age:
            return None
        self._dirs.move_to_end(ino)
        return lst

    def entry(self, parent: int, name: bytes, max_age: float) -> Attr | None | bool:
        """The entry's attributes; False when a complete fresh listing says it does not exist;
        None when unknown."""
        lst = self.get(parent, max_age)
        if lst is None:
            return None
        i = lst.pos.get(name)
        if i is None:
            return False if lst.complete else None
        return lst.attrs[i]

    def drop(self, ino: int) -> None:
        lst = self._dirs.pop(ino, None)
        if lst is not None:
            self._entries -= len(lst)

    def clear(self) -> None:
        self._dirs.clear()
        self._entries = 0

    async def fetch(self, ino: int, max_age: float = float("inf")) -> Listing:
        """The listing, fetched if missing or older than ``max_age`` (one fetch at a time per
        directory; concurrent callers share it)."""
        while True:
            lst = self.get(ino, max_age)
            if lst is not None:
                return lst
            ev = self._fetching.get(ino)
            if ev is None:
                break
            await ev.wait()
            if ino in self._dirs:
                max_age = float("inf")  # the fetch we waited for is fresh enough
        ev = self._fetching[ino] = trio.Event()
        try:
            names: list[bytes] = []
            attrs: list[Attr] = []
            complete = True
            async with aclosing(self.meta.readdir(ino, plus=True, page=self.page)) as it:
                async for e in it:
                    if e.attr is None:
                        continue
                    if len(names) >= self.max_entries:
                        complete = False
                        break
                    names.append(e.name)
                    attrs.append(e.attr)
            lst = Listing(ino, names, attrs, complete)
            self.drop(ino)
            self._dirs[ino] = lst
            self._entries += len(lst)
            while self._entries > self.max_entries and len(self._dirs) > 1:
                _, old = self._dirs.popitem(last=False)
                self._entries -= len(old)
            self.fetched += 1
            self.fetched_entries += len(lst)
            return lst
        finally:
            del self._fetching[ino]
            ev.set()


__all__ = ["Listing", "Listings"]
