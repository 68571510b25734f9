"""Directory listings of the directories being read, bounded in entries; and the names of the
directories being written.

A listing is one readdirplus of a directory (a page per thousand entries) with its entries'
attributes: it gives the prefetcher positions for scans, resolves predicted and hinted paths
without a lookup per component, and lets the VFS answer lookups from memory while it is fresh.

``KnownDirs`` keeps, for directories being written through a read-write mount, the complete set
of their names (no attributes): a directory this VFS made starts empty, one where lookups keep
missing is listed once (names only). Every change this VFS makes updates the set, so the kernel's
LOOKUP before each create, mkdir or rename target is answered "no such entry" from memory, which
was one metadata call of the two per create. Other nodes' new names are seen within the entry
timeout, as with the kernel's own caches: a set is trusted for ``max_age`` after it was known
complete, then dropped (and listed again if lookups keep missing).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from contextlib import aclosing

import trio

from ...errors import JPFSError
from ...types import Attr
from ..wire.meta import MetaClient


class Listing:
    """One directory's entries in name order (as readdir returns them), with attributes."""

    __slots__ = ("ino", "names", "attrs", "pos", "fetched", "complete", "layouts")

    def __init__(self, ino: int, names: list[bytes], attrs: list[Attr], complete: bool,
                 fetched: float | None = None):
        self.ino = ino
        self.names = names
        self.attrs = attrs
        self.pos = {n: i for i, n in enumerate(names)}
        self.fetched = time.monotonic() if fetched is None else fetched
        """When the listing was asked for: its names and attributes are as old as that."""
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
        self._changed: set[int] = set()
        """Directories dropped while their listing was being fetched: not kept."""
        self._sizes: dict[int, int] = {}
        """Entries in each directory's last listing, kept after the listing is dropped."""

    def get(self, ino: int, max_age: float = float("inf")) -> Listing | None:
        """The listing of directory ``ino``, if it is kept and fetched at most ``max_age`` seconds
        ago (None otherwise); marks it recently used."""
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
        """``ino`` changed: its listing (and one being fetched) is stale."""
        if ino in self._fetching:
            self._changed.add(ino)
        lst = self._dirs.pop(ino, None)
        if lst is not None:
            self._entries -= len(lst)

    def clear(self) -> None:
        """Drop every listing (the sizes of the last ones are kept)."""
        self._dirs.clear()
        self._entries = 0

    def size_of(self, ino: int) -> int:
        """Entries in ``ino``'s last listing, however old or dropped (0: never listed)."""
        return self._sizes.get(ino, 0)

    async def fetch(self, ino: int, max_age: float = float("inf"), most: int = 0
                    ) -> Listing | None:
        """The listing, fetched if missing or older than ``max_age`` (one fetch at a time per
        directory; concurrent callers share it). ``most``: give up (None) on a directory with
        more entries than that."""
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
        self._changed.discard(ino)
        try:
            started = time.monotonic()
            names: list[bytes] = []
            attrs: list[Attr] = []
            complete = True
            async with aclosing(self.meta.readdir(ino, plus=True, page=self.page)) as it:
                async for e in it:
                    if e.attr is None:
                        continue
                    if most and len(names) >= most:
                        return None
                    if len(names) >= self.max_entries:
                        complete = False
                        break
                    names.append(e.name)
                    attrs.append(e.attr)
            lst = Listing(ino, names, attrs, complete, started)
            if ino in self._changed:
                return lst  # this VFS changed the directory meanwhile: not kept
            self.drop(ino)
            self._dirs[ino] = lst
            if len(self._sizes) > 4096:
                self._sizes.clear()
            self._sizes[ino] = len(lst)
            self._entries += len(lst)
            while self._entries > self.max_entries and len(self._dirs) > 1:
                _, old = self._dirs.popitem(last=False)
                self._entries -= len(old)
            self.fetched += 1
            self.fetched_entries += len(lst)
            return lst
        finally:
            del self._fetching[ino]
            self._changed.discard(ino)
            ev.set()


class Names:
    """A directory's complete set of names as of ``since`` (time.monotonic())."""

    __slots__ = ("names", "since")

    def __init__(self, names: set[bytes], since: float):
        self.names = names
        self.since = since


class KnownDirs:
    """Complete name sets of directories being written (see the module docstring).

    A set is trusted for ``max_age`` from when it was known complete and then dropped; it is
    not renewed, since nothing the metadata service answers proves that no other node changed
    the directory in between (its mtime after this VFS's own change is the same whatever came
    before it). After a set ages out, lookups ask the shard again, and once enough of them miss
    the directory is listed again: ``misses`` lookups, plus one per 500 names the last set held,
    so a large directory is listed only when that costs less than the lookups it saves.

    Args:
        meta: for the listing that builds a set.
        max_age: how long a set is trusted after it was known complete (the entry timeout).
        max_names: names kept over all directories (least recently used directories go first);
            a directory with more than ``max_names // 4`` names is not listed.
        misses: lookups that miss in a directory with no set before it is listed.
    """

    def __init__(self, meta: MetaClient, max_age: float, max_names: int = 200_000,
                 misses: int = 8):
        self.meta = meta
        self.max_age = max_age
        self.max_names = max_names
        self.list_limit = max(1, max_names // 4)
        self.misses_to_list = misses
        self._dirs: OrderedDict[int, Names] = OrderedDict()
        self._count = 0
        self._misses: dict[int, list[int]] = {}
        """Directory -> [lookups that missed since its set went, misses wanted to list it]."""
        self._listing: dict[int, bool] = {}
        """Directories being listed -> whether this VFS changed them meanwhile."""
        self._too_big: dict[int, float] = {}
        self.stats = {"absent": 0, "listed": 0, "aged": 0, "dropped": 0}

    def __len__(self) -> int:
        return len(self._dirs)

    def as_dict(self) -> dict:
        """The name-set counters, with the directories and names held."""
        return {**self.stats, "dirs": len(self._dirs), "names": self._count}

    def absent(self, ino: int, name: bytes) -> bool:
        """True when ``name`` is known not to be in directory ``ino`` (and the set is fresh)."""
        k = self._dirs.get(ino)
        if k is None or name in k.names:
            return False
        if time.monotonic() - k.since >= self.max_age:
            self._forget(ino)
            self.stats["aged"] += 1
            self._misses[ino] = [0, self.misses_to_list + len(k.names) // 500]
            return False
        self._dirs.move_to_end(ino)
        self.stats["absent"] += 1
        return True

    async def missed(self, ino: int) -> None:
        """A lookup in ``ino`` found nothing (asked the shard): after enough, list it."""
        if ino in self._dirs or ino in self._listing:
            return
        m = self._misses.get(ino)
        if m is None:
            if len(self._misses) > 4096:
                self._misses.clear()
            m = self._misses[ino] = [0, self.misses_to_list]
        m[0] += 1
        if m[0] < m[1]:
            return
        del self._misses[ino]
        big = self._too_big.get(ino)
        if big is not None and time.monotonic() - big < 30 * self.max_age:
            return
        self._listing[ino] = False
        try:
            since = time.monotonic()  # names made elsewhere after this show once the set ages
            names: set[bytes] = set()
            async with aclosing(self.meta.readdir(ino, plus=False, page=1000)) as it:
                async for e in it:
                    names.add(e.name)
                    if len(names) > self.list_limit:
                        self._too_big[ino] = time.monotonic()
                        if len(self._too_big) > 1024:
                            self._too_big.clear()
                        return
            if not self._listing.get(ino, True):
                self._add(ino, Names(names, since))
                self.stats["listed"] += 1
        except JPFSError:
            return
        finally:
            self._listing.pop(ino, None)

    def made(self, ino: int, since: float) -> None:
        """This VFS made directory ``ino`` (``since``: the time the request left): empty."""
        self._add(ino, Names(set(), since))

    def pin(self, ino: int, names: list[bytes]) -> None:
        """This VFS holds ``ino``'s lease: ``names`` are its names (as the shard granted it)
        until ``unpin``, whatever their age (nobody else changes them meanwhile)."""
        self._misses.pop(ino, None)
        self._add(ino, Names(set(names), math.inf))

    def unpin(self, ino: int) -> None:
        """The lease is given back: the names age from now as any set does."""
        k = self._dirs.get(ino)
        if k is not None and k.since == math.inf:
            k.since = time.monotonic()

    def changed(self, ino: int, added: bytes | None = None, removed: bytes | None = None
                ) -> None:
        """This VFS changed directory ``ino``'s names."""
        if ino in self._listing:
            self._listing[ino] = True
        k = self._dirs.get(ino)
        if k is None:
            return
        if removed is not None and removed in k.names:
            k.names.discard(removed)
            self._count -= 1
        if added is not None and added not in k.names:
            k.names.add(added)
            self._count += 1
            self._trim()

    def drop(self, ino: int) -> None:
        """Nothing is known of ``ino``'s names any more (removed, or a surprise)."""
        if ino in self._listing:
            self._listing[ino] = True
        if self._forget(ino):
            self.stats["dropped"] += 1

    def _forget(self, ino: int) -> bool:
        k = self._dirs.pop(ino, None)
        if k is None:
            return False
        self._count -= len(k.names)
        return True

    def _add(self, ino: int, k: Names) -> None:
        self._forget(ino)
        self._dirs[ino] = k
        self._count += len(k.names)
        self._trim()

    def _trim(self) -> None:
        while self._count > self.max_names and len(self._dirs) > 1:
            _, old = self._dirs.popitem(last=False)
            self._count -= len(old.names)


__all__ = ["KnownDirs", "Listing", "Listings", "Names"]
