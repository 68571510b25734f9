"""The mount's counters, and their Prometheus form.

Counting FUSE requests per operation is what the benchmark divides by files opened: requests per
file are the cost of a mount (see docs/perf.md), so they are counted where every request passes,
at the Operations boundary; what the VFS counts (opens, bytes, commits) is added to the same
section. Requests on the ``.jpfs`` control files are counted apart, so reading the
stats does not change the figures.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

OPS = (
    "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink", "rmdir",
    "symlink", "rename", "link", "open", "read", "write", "flush", "release", "fsync", "opendir",
    "readdir", "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr",
    "removexattr", "create", "fallocate",
)

_VFS_COUNTERS = ("read_bytes", "write_bytes", "notify_store_bytes", "commits",
                 "capability_checks", "layouts_refreshed", "lookups_asked", "lookups_listed",
                 "closes_behind", "closes_behind_failed", "handed_files", "handed_reads")
"""The VFS's counters (``VFSStats``) in the mount's stats and its metrics."""


class MountStats:
    """What the FUSE layer counts: requests by operation, errors by errno."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = dict.fromkeys(OPS, 0)
        self.control_requests = 0
        self.errors: dict[str, int] = {}
        self.started = time.time()

    def as_dict(self, vfs: dict) -> dict:
        """With the VFS's counters (``VFS.snapshot()``: opens by outcome, bytes, commits)."""
        return {
            "requests": dict(self.requests),
            "requests_total": sum(self.requests.values()),
            "control_requests": self.control_requests,
            "opens": dict(vfs["opens"]),
            "errors": dict(self.errors),
            **{key: vfs[key] for key in _VFS_COUNTERS},
            "uptime": round(time.time() - self.started, 3),
        }


_GAUGES = frozenset({
    "memory_bytes", "memory_used", "memory_blobs", "disk_bytes", "disk_used", "disk_blobs",
    "prefetched_unused_bytes", "write_queue_bytes", "inflight_bytes", "hints_queued",
    "hinted_unopened", "listing_dirs", "listing_entries_kept", "enabled", "dirs", "names",
    "held", "unsent", "handed_bytes",
})


def families(snap: dict) -> list:
    """Prometheus metric families from a stats snapshot (``Operations.snapshot()``)."""
    out: list = []
    fuse = snap["fuse"]
    c = CounterMetricFamily("jpfs_fuse_requests", "FUSE requests answered, by operation",
                            labels=["op"])
    for op, n in fuse["requests"].items():
        c.add_metric([op], n)
    out.append(c)
    out.append(CounterMetricFamily("jpfs_fuse_control_requests",
                                   "FUSE requests on the .jpfs control files",
                                   value=fuse["control_requests"]))
    c = CounterMetricFamily("jpfs_fuse_errors", "FUSE requests answered with an error",
                            labels=["errno"])
    for name, n in fuse["errors"].items():
        c.add_metric([name], n)
    out.append(c)
    c = CounterMetricFamily("jpfs_opens", "File opens, by how their bytes were served",
                            labels=["outcome"])
    for name, n in fuse["opens"].items():
        c.add_metric([name], n)
    out.append(c)
    for key in _VFS_COUNTERS:
        out.append(CounterMetricFamily(f"jpfs_fuse_{key}", key.replace("_", " "),
                                       value=fuse[key]))
    for section in ("cache", "prefetch", "storage", "names", "leases"):
        for key, v in snap.get(section, {}).items():
            if isinstance(v, bool):
                v = int(v)
            if not isinstance(v, int | float):
                continue
            name = f"jpfs_{section}_{key}"
            if key in _GAUGES:
                out.append(GaugeMetricFamily(name, f"{section} {key}", value=v))
            else:
                out.append(CounterMetricFamily(name, f"{section} {key}", value=v))
    for key in ("inodes", "handles"):
        out.append(GaugeMetricFamily(f"jpfs_mount_{key}", f"{key} the mount holds",
                                     value=snap["mount"][key]))
    return out


class SnapshotCollector:
    """A Prometheus collector over a function that returns a stats snapshot."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        """The metric families of a fresh snapshot (the ``prometheus_client`` collector
        protocol)."""
        yield from families(self.snapshot())


def registry_for(snapshot) -> CollectorRegistry:
    """A Prometheus registry whose every scrape takes a fresh ``snapshot()``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(snapshot))
    return reg
