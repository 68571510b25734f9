"""What the VFS answers and is configured with: its config, open results, counters, and the
``Notifier`` through which it reaches the kernel's caches (the FUSE mount passes its own)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

from ...types import Attr


class Notifier(Protocol):
    """How the VFS reaches the kernel's caches (the FUSE mount passes its own)."""

    def store(self, ino: int, data: memoryview) -> bool:
        """Put a file's whole contents into the kernel's page cache; False if it cannot."""
        ...

    async def store_many(self, files: list[tuple[int, memoryview]]) -> list[bool]:
        """``store`` for each of ``files``, off the loop that answers the kernel's requests."""
        ...

    async def introduce(self, path: str) -> bool:
        """Make the kernel hold an inode for every entry of the directory at ``path``."""
        ...

    def invalidate_attr(self, ino: int) -> None:
        """Make the kernel ask for the inode's attributes again."""
        ...

    async def close(self) -> None:
        """No more notifications (the mount is ending); waits for any under way."""
        ...


class PrefetchOwner(Protocol):
    """Where prefetch runs when a mount is served by several processes (the jpfs engine's
    worker 0): another worker tells it the entries it hands the kernel and the files its READs
    open, and asks it for the page a hand-off held back (``VFS.attach_owner``)."""

    def named(self, attr: Attr, parent: int, name: bytes) -> None:
        """An entry was handed to the kernel (a lookup it counts): queued, never blocks."""
        ...

    async def first_read(self, ino: int, off: int, size: int, stream: int) -> bytes | None:
        """The first READ of a file the kernel opened itself: the held-back page the owner
        answers (None when it holds none; the owner counts the read as the file's open)."""
        ...


class NullNotifier:
    """For a VFS that no kernel caches (tests, tools)."""

    def store(self, ino: int, data: memoryview) -> bool:
        """Nothing to store into: False."""
        return False

    async def store_many(self, files: list[tuple[int, memoryview]]) -> list[bool]:
        """Nothing to store into: False for each file."""
        return [False] * len(files)

    async def introduce(self, path: str) -> bool:
        """No kernel to introduce entries to: False."""
        return False

    def invalidate_attr(self, ino: int) -> None:
        """No kernel cache to invalidate: nothing to do."""
        return None

    async def close(self) -> None:
        """Nothing under way: returns at once."""
        return None


@dataclass
class VFSConfig:
    """How the VFS answers (times in seconds, sizes in bytes)."""

    read_only: bool = False
    """Files do not change while mounted: listings and layouts are trusted forever."""
    attr_timeout: float = 1.0
    entry_timeout: float = 1.0
    open_cache: float = 0.0
    """Read-write: trust a file's layout this long at open instead of revalidating."""
    small_file: int = 4 << 20
    """Files up to this size are fetched whole at open."""
    notify_store: bool = True
    """Hand small files to the kernel's page cache and drop them from the memory cache (at
    open, or where the kernel opens files itself once its READs have covered the file)."""
    kernel_ahead: int = 1 << 30
    """With ``notify_store`` on a read-only mount: bytes of swept directories handed to the
    kernel's page cache that sweeps may run ahead of readers by (``PrefetchConfig``)."""
    readdir_page: int = 1000
    short_circuit: bool = True
    """Read the volume files of storage nodes on this host directly (``shortcircuit.py``)."""
    dir_leases: bool = True
    """Read-write: answer creates in directories this mount writes from memory under a lease
    and commit them behind (``leases.py``)."""
    write_behind: bool = False
    """With ``dir_leases``: answer the close of a file made under a lease before its bytes are
    stored, and commit them behind it (a killed mount loses such files until their batch
    commits)."""


@dataclass
class OpenFile:
    """What ``open`` and ``create`` answer."""

    fh: int
    keep_cache: bool
    """The kernel may keep the pages it holds of this file (they are of this version)."""


OPEN_OUTCOMES = ("kernel", "prefetched", "memory", "disk", "fetched", "joined", "deferred",
                 "empty", "write")
"""How an open was served: the kernel keeps its cached pages; the bytes were prefetched, in the
memory or disk cache, fetched on demand, joined a fetch in flight, left for the reads (a large
file); an empty file; a write open."""


@dataclass(slots=True)
class Handed:
    """A file a sweep gave the kernel without its last page (``Handoff.hand``)."""

    version: int
    cut: int
    """Where the page held back starts (a multiple of the page size)."""
    tail: bytes
    carries: int
    """The bytes handed with it (its group's), released when that page is read."""


@dataclass
class VFSStats:
    """What the VFS counts: opens by how they were served, bytes, commits."""

    opens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPEN_OUTCOMES, 0))
    read_bytes: int = 0
    write_bytes: int = 0
    notify_store_bytes: int = 0
    handed_files: int = 0
    """Files a directory sweep fetched that went to the kernel's page cache before any read."""
    handed_reads: int = 0
    """READs of a page held back from such a file (one file in ``HAND_SAMPLE``)."""
    commits: int = 0
    capability_checks: int = 0
    """security.capability lookups answered from memory (one per write(2) otherwise)."""
    layouts_refreshed: int = 0
    """Reads that found every copy of a chunk moved (by the healer) and read the layout again."""
    lookups_asked: int = 0
    """Lookups the metadata service answered."""
    lookups_listed: int = 0
    """Lookups answered from a directory's listing."""
    closes_behind: int = 0
    """Files made under a lease committed after their close was answered."""
    closes_behind_failed: int = 0
    """... whose bytes could not be stored then (logged; their release tries again)."""

    def as_dict(self) -> dict:
        """Every counter by name, as one JSON-able object."""
        return asdict(self)


def outcome_of(sources: set[str]) -> str:
    """The ``OPEN_OUTCOMES`` entry of an open whose bytes came from ``sources``."""
    for s in ("fetched", "joined", "disk", "prefetched"):
        if s in sources:
            return s
    return "memory"


__all__ = ["OPEN_OUTCOMES", "Notifier", "NullNotifier", "OpenFile", "PrefetchOwner", "VFSConfig",
           "VFSStats"]
