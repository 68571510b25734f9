"""PyTorch loading for JPFS: ``ShardDataset`` (drop-in for LeRobotDataset) and ``to_device``.

Needs torch (the ``torch`` extra); ``import jpfs`` does not import this package.
"""

from __future__ import annotations

from .dataset import ShardDataset, delta_indices
from .partition import Slot, loader_progress, worker_ids
from .pipeline import PinnedRing, collate, to_device

__all__ = [
    "PinnedRing",
    "ShardDataset",
    "Slot",
    "collate",
    "delta_indices",
    "loader_progress",
    "to_device",
    "worker_ids",
]
