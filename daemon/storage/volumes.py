"""Low-level volume file work shared by the writer, recovery and compaction.

Whole writes, quiet unlinks and directory syncs, and the crash points of the steps that write
volumes (test hooks): the few system calls whose loops and error handling each part would
otherwise repeat.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..common import fault_point


def crash_point(step: str) -> None:
    """Test hook: ``JPFS_FAULTS=storage.<step>`` makes the process die here like ``kill -9``.

    Steps: ``put_written`` (data fsynced, index not committed), ``compact_copying`` (half the
    live blobs copied), ``compact_copied`` (new volume fsynced, index not switched),
    ``compact_switched`` (index switched, old volume not unlinked).
    """
    fault_point(f"storage.{step}")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (``pwrite`` may write less)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def unlink_quietly(path: Path) -> None:
    """Delete ``path``; a file already gone (or one that cannot go) is no error."""
    try:
        path.unlink()
    except OSError:
        pass


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created, unlinked) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
