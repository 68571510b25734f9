"""Prometheus metrics of a daemon (``--metrics HOST:PORT``).

prometheus_client serves HTTP from a thread of its own; each scrape takes one snapshot on the
daemon's trio loop (the daemon's own counters, as ``jpfs cluster status`` shows them, plus the
RPC layer's requests by method and errors by errno), so nothing is read while it changes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator

import trio
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from jpfs import config
from jpfs.rpc import Service

log = logging.getLogger(__name__)

IDENTITY = frozenset({"shard", "shards", "node", "pid", "chunk_size"})
"""Snapshot keys that name the daemon rather than measure it (labels, not metrics)."""


def families(role: str, index: int, snap: dict, service: Service,
             counters: frozenset[str]) -> Iterator:
    """Metric families: ``jpfs_<role>_<key>`` per numeric snapshot key (a counter when the key is
    in ``counters``, else a gauge), and the RPC requests and errors, labelled by daemon."""
    label = "shard" if role == "meta" else "node"
    labels = {label: str(index)}
    for key, value in sorted(snap.items()):
        if key in IDENTITY or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        kind = CounterMetricFamily if key in counters else GaugeMetricFamily
        family = kind(f"jpfs_{role}_{key}", f"{role} {key.replace('_', ' ')}",
                      labels=list(labels))
        family.add_metric(list(labels.values()), value)
        yield family
    requests = CounterMetricFamily(f"jpfs_{role}_rpc_requests", "requests received, by method",
                                   labels=[label, "method"])
    for method, n in sorted(service.requests.items()):
        requests.add_metric([str(index), method], n)
    yield requests
    errors = CounterMetricFamily(f"jpfs_{role}_rpc_errors", "requests answered with an error, "
                                 "by errno", labels=[label, "errno"])
    for name, n in sorted(service.errors.items()):
        errors.add_metric([str(index), name], n)
    yield errors


def serve_metrics(address: str, role: str, index: int, service: Service,
                  snapshot: Callable[[], Awaitable[dict]], counters: frozenset[str]) -> None:
    """Serve Prometheus metrics at ``http://address/metrics``; call from the trio thread."""
    token = trio.lowlevel.current_trio_token()

    class Collector:
        def collect(self) -> Iterator:
            snap = trio.from_thread.run(snapshot, trio_token=token)
            return families(role, index, snap, service, counters)

    registry = CollectorRegistry()
    registry.register(Collector())
    host, port = config.parse_address(address)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:  # the daemon's real work goes on without its metrics
        log.error("cannot serve Prometheus metrics on %s: %s", address, e.strerror or e)
        return
    log.info("Prometheus metrics at http://%s:%d/metrics", host, port)
