"""How the VFS reaches the kernel's caches on a FUSE mount: pyfuse3's notify calls.

The VFS decides when the kernel must learn something (a file's bytes to cache, attributes gone
stale); this object only carries it, so the VFS never imports pyfuse3. A failed notification is
never an error for the request that caused it: the kernel then asks again on its own.
"""

from __future__ import annotations

import logging

import pyfuse3

log = logging.getLogger(__name__)


class KernelNotifier:
    """The ``jpfs.client.vfs.Notifier`` of a live pyfuse3 mount."""

    def store(self, ino: int, data: memoryview) -> bool:
        """Put ``data`` (a whole file) into the kernel's page cache for ``ino``."""
        try:
            # pyfuse3 takes any contiguous buffer (PyObject_GetBuffer); its stub says bytes, and
            # a copy of a whole file is what this avoids.
            pyfuse3.notify_store(ino, 0, data)  # type: ignore[arg-type]
        except OSError as e:
            log.debug("notify_store of inode %d failed: %s", ino, e)
            return False
        return True

    def invalidate_attr(self, ino: int) -> None:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as e:
            log.debug("invalidate_inode %d failed: %s", ino, e)


__all__ = ["KernelNotifier"]
