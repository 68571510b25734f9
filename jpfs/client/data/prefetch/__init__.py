"""Prefetch: fetch what readers will open next, driven by evidence, bounded and counted.

A training loop reads millions of small files; each one fetched only when opened costs a metadata
and a storage round trip while the reader waits. The prefetcher watches opens and reads and
fetches ahead, in batches (one ``batch_layout`` per shard and one storage call per node for many
files), into the blob cache:

- a forward scan of a directory (in name order, also with a stride, per reading thread) fetches
  the next entries; the window starts small and doubles while it keeps being right;
- co-access learned across directories: when opening ``A/x_42.parquet`` is followed by opening
  ``B/cam/x_42.mp4`` (the same number in the name), a rule "A/x_N -> B/cam/x_N" is counted; once
  seen twice, opening a file of shape A fetches its partners. Nothing about LeRobot is built in;
- hints: paths a reader announces (``hint``) are fetched in order, ahead of it;
- sequential reads of a large file read ahead several chunks at once (striped: several nodes).

Everything is bounded: bytes in flight, and prefetched-but-unused bytes as a share of the memory
cache. A scan that turns out wrong and a reader that stops being sequential cancel their fetches
in flight (unless a reader already waits for them); a co-access rule whose predictions go unused
is dropped. The blob cache counts hits and wasted bytes; this module counts what it fetched, why,
and what it cancelled.

The prefetcher also keeps directory listings (readdirplus, one call per thousand entries) for the
directories being read: they give positions for scans, resolve predicted and hinted paths without
a lookup per component, and let the mount answer lookups from memory.

The parts, each with its own state, over the ``Budget`` (budget.py) and the ``Fetcher``
(fetch.py) that runs every fetch: ``Paths`` (paths.py: listings, path resolution), ``Scans``
(scans.py), ``Sweeps`` (sweeps.py: directories read whole out of order), ``Partners``
(partners.py: co-access), ``Hints`` (hints.py), ``ReadAhead`` (readahead.py) and ``KernelAhead``
(handoff.py: what goes on to a mount's kernel, handed out as values, never called up into the
mount). ``Prefetcher`` (core.py) is the one object the mount and the client hold; its limits and
counters are config.py's.
"""

from .config import PrefetchConfig, PrefetchStats
from .core import Prefetcher
from .handoff import KernelBatch

__all__ = ["KernelBatch", "PrefetchConfig", "PrefetchStats", "Prefetcher"]
