"""The VFS's side of its directory write leases (``leases.py``): the leases built with the
callbacks that keep the VFS's names right as they are granted, end or see a change refused, and
the three things every other part asks of them: wait for what a lease answered to reach the shard
before the shard is asked (``settle``), give a lease back before changing its names through the
shard (``give_back``), and hold off asking for one while a change is on its way (``changing``).
None of these does anything where there are no leases (read-only mounts, ``dir_leases`` off).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from ...types import Attr
from .leases import DirLeases
from .shared import SharedState

log = logging.getLogger(__name__)


class Leasing:
    """The leases (None without them) and what the VFS's parts ask of them."""

    def __init__(self, shared: SharedState):
        self.shared = shared
        self.inodes = shared.inodes
        self.known = shared.known
        config = shared.config
        self.leases: DirLeases | None = None
        """Directories whose creates and unlinks this VFS answers from memory (``leases.py``)."""
        if self.known is not None and config.dir_leases:
            # on a write-behind mount, a close that finds its create held goes behind it
            self.leases = DirLeases(shared.meta, shared.client.nursery, self._lease_granted,
                                    self._lease_ended, self._lease_failed,
                                    writing=self._writing if config.write_behind else None)

    async def settle(self, *inos: int) -> None:
        """Files this VFS answered from a lease and directories holding them: known to the
        shard before it is asked about them."""
        leases = self.leases
        if leases is not None and leases.dirs:
            await leases.book.settle(*inos)

    async def ready(self, *dirs: int) -> None:
        """Before the shard is asked to look up or change names in these directories: ENOTDIR
        where one is known not to be a directory, and a directory this VFS made from a lease
        and has not sent yet is sent first (the shard must know it)."""
        self.shared.directories(*dirs)
        leases = self.leases
        if leases is not None and leases.book.unsent:
            made = [d for d in dirs if d in leases.book.unsent]
            if made:
                await leases.book.settle(*made)

    async def give_back(self, *dirs: int) -> None:
        """Before this VFS changes these directories' names through the shard."""
        leases = self.leases
        if leases is not None and leases.dirs:
            for d in dirs:
                if d in leases.dirs:
                    await leases.give_back(d)

    @contextmanager
    def changing(self, parent: int) -> Iterator[None]:
        """Around a create or unlink sent to the shard: a lease is not asked for meanwhile (the
        change would meet it and recall it)."""
        leases = self.leases
        if leases is None:
            yield
            return
        leases.begin(parent)
        try:
            yield
        finally:
            leases.end(parent)

    def _writing(self, ino: int) -> bool:
        node = self.inodes.get(ino)
        return node is not None and node.writer is not None and node.writer.refs > 0

    def _lease_granted(self, parent: int, names: list[bytes]) -> None:
        assert self.known is not None
        self.known.pin(parent, names)

    def _lease_ended(self, parent: int, lost: bool) -> None:
        assert self.known is not None
        if lost:
            self.known.drop(parent)
        else:
            self.known.unpin(parent)

    def _lease_failed(self, parent: int, name: bytes, attr: Attr | None, err: OSError,
                      change: str) -> None:
        node = self.inodes.get(attr.ino) if attr is not None else None
        what = self.shared.name_of(node) if node is not None else \
            f"{name!r} in directory {parent:#x}"
        if attr is None:
            log.error("%s: the metadata shard refused its %s (%s); the names may be as they "
                      "were before it", what, change, err.strerror or err)
        else:
            log.error("%s: the metadata shard refused the new %s (%s); it is lost", what,
                      "directory" if attr.is_dir else "file", err.strerror or err)
            self.inodes.stale(attr.ino)
        if self.known is not None:
            self.known.drop(parent)
        self.shared.changed_dir(parent)


__all__ = ["Leasing"]
