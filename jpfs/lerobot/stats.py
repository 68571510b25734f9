"""Per-episode feature statistics, their aggregation, and the flattened v3.0 columns.

Follows LeRobot's ``compute_stats``: vectors are reduced over frames, images per channel
(shape [3, 1, 1], values in [0, 1]); aggregation weights means and variances by frame count.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

STAT_NAMES = ("min", "max", "mean", "std", "count")

Stats = dict[str, dict[str, np.ndarray]]


def feature_stats(values: np.ndarray, image: bool = False) -> dict[str, np.ndarray]:
    """min/max/mean/std/count of one feature over an episode's frames.

    Args:
        values: (frames, ...) for vectors and scalars; (frames, H, W, 3) uint8 for images.
        image: reduce per channel, to shape [3, 1, 1], after scaling to [0, 1].
    """
    if image:
        # Channels first and contiguous: row reductions are several times faster than strided.
        px = np.ascontiguousarray(values.reshape(-1, values.shape[-1]).T).astype(np.float32)

        def chan(a: np.ndarray) -> np.ndarray:
            return (np.asarray(a, np.float64) / 255.0).reshape(-1, 1, 1)

        return {
            "min": chan(px.min(axis=1)),
            "max": chan(px.max(axis=1)),
            "mean": chan(px.mean(axis=1, dtype=np.float64)),
            "std": chan(px.std(axis=1, dtype=np.float64)),
            "count": np.array([len(values)]),
        }
    x = values if values.ndim > 1 else values.reshape(-1, 1)
    if x.dtype == np.bool_:
        x = x.astype(np.float64)
    return {
        "min": x.min(axis=0),
        "max": x.max(axis=0),
        "mean": x.mean(axis=0, dtype=np.float64),
        "std": x.std(axis=0, dtype=np.float64),
        "count": np.array([len(x)]),
    }


def column_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A parquet column as a (frames, ...) numpy array (fixed-size lists become 2-D)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return np.array(arr.to_pylist())
    return arr.to_numpy(zero_copy_only=False)


def table_stats(table: pa.Table, columns: list[str]) -> Stats:
    """Stats of the given frame-table columns."""
    return {c: feature_stats(column_values(table.column(c))) for c in columns}


def aggregate(stats_list: list[Stats]) -> Stats:
    """Dataset stats from per-episode stats (LeRobot's ``aggregate_stats``)."""
    keys: list[str] = []
    for s in stats_list:
        keys.extend(k for k in s if k not in keys)
    out: Stats = {}
    for key in keys:
        parts = [s[key] for s in stats_list if key in s]
        means = np.stack([np.asarray(p["mean"], dtype=np.float64) for p in parts])
        variances = np.stack([np.asarray(p["std"], dtype=np.float64) ** 2 for p in parts])
        counts = np.stack([np.asarray(p["count"]) for p in parts])
        total = counts.sum(axis=0)
        while counts.ndim < means.ndim:
            counts = np.expand_dims(counts, axis=-1)
        mean = (means * counts).sum(axis=0) / total
        var = ((variances + (means - mean) ** 2) * counts).sum(axis=0) / total
        out[key] = {
            "min": np.min(np.stack([np.asarray(p["min"]) for p in parts]), axis=0),
            "max": np.max(np.stack([np.asarray(p["max"]) for p in parts]), axis=0),
            "mean": mean,
            "std": np.sqrt(var),
            "count": total,
        }
    return out


def to_json(stats: Stats) -> dict[str, dict[str, Any]]:
    """Stats as JSON-ready nested lists (how LeRobot writes them)."""
    return {k: {n: np.asarray(v).tolist() for n, v in s.items()} for k, s in stats.items()}


def from_json(obj: dict[str, dict[str, Any]]) -> Stats:
    """Stats read from JSON, as numpy arrays."""
    return {k: {n: np.asarray(v) for n, v in s.items()} for k, s in obj.items()}


def flatten(stats: Stats, prefix: str = "stats") -> dict[str, Any]:
    """``{"stats/<feature>/<name>": list}`` columns of the v3.0 episodes table."""
    return {f"{prefix}/{k}/{n}": np.asarray(v).tolist() for k, s in stats.items()
            for n, v in s.items()}
