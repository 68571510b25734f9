"""Extended attributes for the VFS, and the one the kernel asks for before every write.

The kernel asks for ``security.capability`` before every ``write(2)`` (to drop file
capabilities), so before each 4 KiB write: it is answered from memory while known absent (for
the attribute timeout; a file made here has none). POSIX ACL names are asked by ``ls`` and
``cp`` for every file and never stored (JPFS has mode bits only).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Awaitable, Callable

from ...errors import JPFSError, error
from ..wire.meta import MetaClient
from .inodes import Inodes
from .types import VFSStats


async def _nothing(ino: int) -> None:
    return None

_ACL = b"system.posix_acl_"
_CAPS = b"security.capability"
_NO_CAPS_MAX = 65536


class Xattrs:
    """getxattr/setxattr/listxattr/removexattr by inode, with the capability shortcut.

    Args:
        writable: raises EROFS on a read-only mount.
        settle: awaited before the shard is asked about an inode (what a lease answered for it
            reaches the shard first).
    """

    def __init__(self, meta: MetaClient, inodes: Inodes, stats: VFSStats, attr_age: float,
                 writable: Callable[[], None],
                 settle: Callable[[int], Awaitable[None]] = _nothing):
        self.meta = meta
        self.inodes = inodes
        self.stats = stats
        self._attr_age = attr_age
        self._writable = writable
        self.settle = settle
        """Awaited before the shard is asked about an inode (the VFS's lease settle)."""
        self._no_caps: dict[int, float] = {}
        """Inodes known to have no security.capability, and since when (time.monotonic())."""
        self._changes = 0

    async def get(self, ino: int, name: bytes) -> bytes:
        """The value of attribute ``name``; ENODATA where it is not set. POSIX ACL names are ENODATA
        at once, and ``security.capability`` (asked before every write) is answered from memory
        when the inode was seen without it in the last attribute timeout."""
        if name.startswith(_ACL):  # asked by ls and cp for every file; never stored
            raise error(errno.ENODATA, "no such attribute")
        if name != _CAPS:
            await self.settle(ino)
            return await self.meta.getxattr(ino, name)
        since = self._no_caps.get(ino)
        sent = time.monotonic()
        if since is not None and sent - since < self._attr_age:
            self.stats.capability_checks += 1
            raise error(errno.ENODATA, "no such attribute")
        changes = self._changes
        try:
            await self.settle(ino)
            return await self.meta.getxattr(ino, name)
        except JPFSError as e:
            if e.errno == errno.ENODATA and changes == self._changes:
                self.none_since(ino, sent)
            raise

    def none_since(self, ino: int, t: float) -> None:
        """Inode ``ino`` had no security.capability at ``t``."""
        if len(self._no_caps) > _NO_CAPS_MAX:
            self._no_caps.clear()
        self._no_caps[ino] = t

    async def set(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """Set attribute ``name``; EROFS on a read-only mount, EOPNOTSUPP for POSIX ACLs."""
        self._writable()
        if name.startswith(_ACL):
            raise error(errno.EOPNOTSUPP, "JPFS has no POSIX ACLs (mode bits only)")
        self._changes += 1
        self._no_caps.pop(ino, None)
        try:
            await self.settle(ino)
            await self.meta.setxattr(ino, name, value, flags)
        finally:
            self._changes += 1
        self.inodes.stale(ino)

    async def list(self, ino: int) -> list[bytes]:
        """The names of the inode's extended attributes."""
        await self.settle(ino)
        return await self.meta.listxattr(ino)

    async def remove(self, ino: int, name: bytes) -> None:
        """Remove attribute ``name``; ENODATA where it is not set, EROFS on a read-only mount."""
        self._writable()
        self._changes += 1
        try:
            await self.settle(ino)
            await self.meta.removexattr(ino, name)
        finally:
            self._changes += 1
        self.inodes.stale(ino)
