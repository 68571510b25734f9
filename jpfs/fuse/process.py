"""How a mount daemon's process is tuned for serving: the C library keeps freed buffers, the
garbage collector runs rarely. Both run once, before the mount is served (in a supervisor
before it forks its workers, so they inherit both)."""

from __future__ import annotations

import ctypes
import gc

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HEAP_BUFFERS_BELOW = 64 << 20
"""Buffers smaller than this come from the heap, not from a fresh mapping of their own."""
KEEP_FREED = 1 << 30
"""Free memory at the top of the heap that the mount keeps for its next buffers."""


def keep_freed_buffers() -> bool:
    """Let freed receive buffers serve the next ones; False where the C library is not glibc.

    The mount allocates a buffer per fetch (a 4 MiB chunk, a batch of small files) and frees it
    once the kernel has the bytes. With glibc's defaults such buffers are often mapped afresh
    and given back when freed, and then every byte costs a page fault and a zeroed page before
    the fetch can write it (a quarter of the mount's CPU in a cold sequential read; docs/perf.md,
    "Receive buffers"). Kept in the heap, the memory is reused warm; the memory cache's bound
    still bounds what is in use."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: its own policy stands
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BUFFERS_BELOW)) and \
        bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED))


GC_YOUNG_THRESHOLD = 50_000
"""Container allocations between collections of the youngest generation (Python's default: 700)."""


def quiet_collector() -> None:
    """Let the cyclic garbage collector run a hundredth as often, and never over startup's objects.

    The mount allocates a few tuples and dicts per FUSE request and per fetch, almost all freed
    by reference counting; with the default threshold a cold epoch collected every 700 of them
    and walked the modules' objects on each full collection (8% of the mount's CPU in a profile
    of a cold epoch). Freezing what startup made keeps those objects out of every collection;
    cycles made while serving are still collected, in larger and rarer steps."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


__all__ = ["keep_freed_buffers", "quiet_collector"]
