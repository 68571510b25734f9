"""Prefetch's limits and switches, and its counters: what every part of it reads and counts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefetchConfig:
    """Limits and switches. Sizes are bytes."""

    enabled: bool = True
    ahead: bool = True
    """Learn from opens and fetch files ahead of their readers (scans, sweeps, co-access, hints).
    Off where another process does that for the same mount (a worker of the jpfs engine other
    than worker 0): lookups answered from listings and read-ahead of large files stay on."""
    small_file: int = 4 << 20
    """Files up to this size are fetched whole (on open, and when predicted)."""
    inflight_bytes: int = 64 << 20
    """Bytes of prefetch fetches in flight at once."""
    cache_share: float = 0.5
    """Prefetched-but-unused bytes stay below this share of the memory cache."""
    kernel_ahead: int = 1 << 30
    """Bytes of swept files handed to the kernel's page cache (``handoff``) and not reached by
    a reader yet that sweeps may run ahead by. The kernel holds them, not the memory cache,
    so the memory cache's share does not bound them."""
    scan_start: int = 4
    scan_max: int = 64
    """A confirmed directory scan fetches this many entries ahead at most (files)."""
    max_stride: int = 16
    coaccess_min: int = 2
    """Pairings seen this often become rules."""
    coaccess_window: int = 8
    """Opens per reading thread that a later open may be paired with."""
    readahead_max: int = 8
    """Chunks a sequential reader of a large file is read ahead at most."""
    listing_entries: int = 500_000
    """Directory entries kept in listings, over all directories."""
    listing_page: int = 1000
    layouts: bool = False
    """Fetch the layouts of a listed directory's files with its listing (one batch call per
    shard): opens then need no metadata call. For mounts whose files do not change."""
    sweep_after: int = 12
    """A directory with this many distinct files opened that nothing fetched ahead (no scan, no
    hint; a co-access prediction made at the partner's open is not ahead), mostly out of name
    order (an epoch in shuffled order), is fetched whole if it fits within the cache share."""
    sweep_disorder: float = 0.25
    """Share of those opens that went backwards in name order, for a sweep."""
    batch_files: int = 256
    batch_bytes: int = 32 << 20
    handoff: bool = False
    """Fetched sweep and scan batches go on to the reader's side (``Prefetcher.handoffs``): a
    read-only mount's VFS gives them to the kernel's page cache before they are read."""


@dataclass
class PrefetchStats:
    """What prefetch did: listings, scans, co-access rules, hints, read-ahead, batches."""

    scan_streams: int = 0
    scan_misses: int = 0
    scan_files: int = 0
    coaccess_pairs: int = 0
    coaccess_rules: int = 0
    coaccess_rules_dropped: int = 0
    coaccess_predictions: int = 0
    coaccess_hits: int = 0
    coaccess_files: int = 0
    hint_paths: int = 0
    hint_files: int = 0
    hint_opened: int = 0
    hint_errors: int = 0
    readahead_chunks: int = 0
    sweeps: int = 0
    sweep_files: int = 0
    sweep_bytes: int = 0
    layouts: int = 0
    batches: int = 0
    batch_files: int = 0
    batch_bytes: int = 0
    batches_cancelled: int = 0
    batch_errors: int = 0
    skipped_budget: int = 0
    skipped_cached: int = 0


__all__ = ["PrefetchConfig", "PrefetchStats"]
