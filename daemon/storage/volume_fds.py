"""The read-only descriptors of a storage node's volumes, kept open for ``sendfile``.

An answer being sent pins the volumes it sends from: compaction retires a volume, but its
descriptor is closed (and the unlinked file's space freed) only after the last send. Volume ids
are never reused, so a stale descriptor can never be mistaken for a new volume. Unpinned
descriptors are kept in LRU order up to a bound, so a node with thousands of volumes does not
run out of file descriptors.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import Store


class VolumeFds:
    """Read-only descriptors of volumes, pinned while an answer that uses them is sent.

    At most ``keep`` unpinned descriptors stay open (least recently used go first).
    """

    def __init__(self, store: Store, keep: int = 256):
        self.store = store
        self.keep = keep
        self._fds: OrderedDict[int, list] = OrderedDict()  # vol -> [fd, pins, retired]

    def pin(self, vol: int) -> int:
        """A descriptor of volume ``vol``, pinned until ``unpin``; OSError if it cannot open."""
        slot = self._fds.get(vol)
        if slot is None:
            slot = self._fds[vol] = [os.open(self.store.vol_path(vol), os.O_RDONLY), 1, False]
            if len(self._fds) > self.keep:
                self._trim()
        else:
            self._fds.move_to_end(vol)
            slot[1] += 1
        return slot[0]

    def _trim(self) -> None:
        for vol in [v for v, slot in self._fds.items() if not slot[1]]:
            if len(self._fds) <= self.keep:
                break
            os.close(self._fds.pop(vol)[0])

    def unpin(self, vols: Sequence[int]) -> None:
        """An answer that pinned ``vols`` (once each) was sent."""
        for vol in vols:
            slot = self._fds[vol]
            slot[1] -= 1
            if slot[2] and not slot[1]:
                os.close(slot[0])
                del self._fds[vol]

    def retire(self, vol: int) -> None:
        """The volume is leaving: close its descriptor once nothing sends from it."""
        slot = self._fds.get(vol)
        if slot is None:
            return
        slot[2] = True
        if not slot[1]:
            os.close(slot[0])
            del self._fds[vol]

    def close(self) -> None:
        """Close every descriptor."""
        for fd, _, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
