"""What prefetch gives the reader's side to hold before it reads it: a read-only mount's kernel.

A directory sweep or a scan fetches files into the blob cache ahead of their readers; where
the reader's side has a page cache of its own (``PrefetchConfig.handoff``), each fetched batch
is offered to it as a ``KernelBatch`` on ``KernelAhead.batches``, a value prefetch hands out
rather than a call it makes: the taker (the mount's VFS) tells ``handed`` what it gave the
kernel, and ``reached`` when a reader got to it. Those bytes are the kernel's, not the memory
cache's, so they have a bound of their own (``kernel_ahead``) that sweeps wait under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio

from ....types import Attr
from .budget import Budget
from .config import PrefetchConfig, PrefetchStats


@dataclass(slots=True, eq=False)
class KernelBatch:
    """Files of directory ``parent`` fetched into the cache, for the reader's side to take."""

    parent: int
    attrs: list[Attr]
    reserved: int
    """Bytes of ``kernel_ahead`` the batch holds until ``handed`` (a sweep's; 0 for a scan's)."""


class KernelAhead:
    """The batches on their way to the kernel and the bytes it holds that no reader reached."""

    def __init__(self, config: PrefetchConfig, budget: Budget, stats: PrefetchStats):
        self.config = config
        self.budget = budget
        self.stats = stats
        self.enabled = config.handoff
        self.handed_bytes = 0
        """Bytes the taker gave the kernel that no reader has read yet (``kernel_ahead``
        bounds them)."""
        self._handing = 0
        """Bytes of fetched sweep batches on their way to the taker."""
        self._send, self.batches = trio.open_memory_channel[KernelBatch](math.inf)
        """What was fetched for the kernel, in the order it was (``PrefetchConfig.handoff``)."""

    def room(self) -> int:
        """Bytes a sweep may fetch now for the kernel's page cache (``kernel_ahead``), counting
        what is in flight as bound there."""
        if not self.enabled:
            return self.config.kernel_ahead
        return self.config.kernel_ahead - self.handed_bytes - self._handing - self.budget.inflight

    def holds(self) -> bool:
        """Whether anything handed (or on its way) waits for a reader."""
        return bool(self.handed_bytes or self._handing)

    def give(self, parent: int, attrs: list[Attr], reserved: int) -> None:
        """Offer fetched files of ``parent`` to the taker; ``reserved`` bytes count against
        ``kernel_ahead`` until it has handed them."""
        self._handing += reserved
        self._send.send_nowait(KernelBatch(parent, attrs, reserved))

    def handed(self, batch: KernelBatch, nbytes: int, *, failed: bool = False) -> None:
        """The taker is done with ``batch``: it gave the kernel ``nbytes`` (``failed``: it
        could not, and logged why)."""
        self.handed_bytes += nbytes
        if failed:
            self.stats.batch_errors += 1
        if batch.reserved:
            self._handing -= batch.reserved
            self.budget.notify()

    def reached(self, nbytes: int) -> None:
        """A reader got to ``nbytes`` the taker handed: there may be room for more."""
        self.handed_bytes -= nbytes
        self.budget.notify()


__all__ = ["KernelAhead", "KernelBatch"]
