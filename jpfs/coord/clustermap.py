"""The cluster map in etcd: read it, change it (compare-and-swap), and follow its changes.

The map is one JSON document under ``/jpfs/<name>/map`` (``config.map_document``): every shard
with its copies, every storage node with its state, replicas, chunk size. Its etcd
``mod_revision`` is the map's *epoch*: it grows with every change, so "which map is newer" is one
integer compare. Changes are rare (an operator adds a node, a drain finishes), so one document
read whole is simpler than a key per member and costs nothing measurable; watches on it are what
let clients and daemons follow a change without a restart.

Per-shard leader leases live beside it (``leader_key``), written by the shards themselves.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import urllib.request
from base64 import b64decode, b64encode
from collections.abc import Callable

import trio

from .. import config
from ..config import Cluster
from .etcd import Etcd, EtcdError

log = logging.getLogger(__name__)

RETRY = 0.5  # seconds between attempts to re-open a broken watch


def map_key(name: str) -> str:
    """The etcd key of cluster ``name``'s map."""
    return config.map_key(name)


def leader_key(name: str, shard: int) -> str:
    """The key a shard's leader holds under its lease (value: JSON naming the leader)."""
    return f"/jpfs/{name}/shard/{shard}/leader"


MAP_KEY = map_key
LEADER_KEY = leader_key


def _encode(cluster: Cluster, secret: bytes) -> bytes:
    """The stored form of a map, signed with ``secret`` (the cluster's, from the base)."""
    doc = config.map_document(dataclasses.replace(cluster, secret=secret))
    return json.dumps(doc, sort_keys=True).encode()


async def read_map(etcd: Etcd, base: Cluster) -> Cluster:
    """The current map, on top of ``base`` (which gives the name, the secret, etcd)."""
    kv = await etcd.get(map_key(base.name))
    if kv is None:
        raise EtcdError(errno.ENOENT, f"etcd has no map for cluster {base.name!r} "
                                      f"({map_key(base.name)})")
    return config.from_map(json.loads(kv.value), base, kv.mod_revision)


async def create_map(etcd: Etcd, cluster: Cluster) -> Cluster:
    """Store the first map of a new cluster; an existing map is left alone and returned."""
    if await etcd.put_if(map_key(cluster.name), _encode(cluster, cluster.secret),
                         mod_revision=0):
        return await read_map(etcd, cluster)
    return await read_map(etcd, cluster)


async def update_map(etcd: Etcd, base: Cluster, change: Callable[[Cluster], Cluster]
                     ) -> Cluster:
    """Apply ``change`` to the current map and store it, again on a concurrent change; the map
    stored. ``change`` may raise to refuse (its error reaches the caller)."""
    while True:
        current = await read_map(etcd, base)
        new = change(current)
        if new == current:
            return current
        if await etcd.put_if(map_key(base.name), _encode(new, base.secret),
                             mod_revision=current.epoch):
            return await read_map(etcd, base)


async def follow_map(etcd: Etcd, cluster: Cluster, on_change: Callable[[Cluster], None], *,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Call ``on_change(map)`` for every map newer than ``cluster.epoch`` until cancelled.

    A broken watch is opened again from the last epoch seen, so no change is missed (etcd keeps
    history until it compacts; a compacted revision is caught by reading the map again).
    """
    epoch = cluster.epoch
    started = False
    while True:
        try:
            latest = await read_map(etcd, cluster)
            if latest.epoch > epoch:
                epoch = latest.epoch
                on_change(latest)
            async with etcd.watch(map_key(cluster.name), start_revision=epoch + 1) as batches:
                if not started:
                    started = True
                    task_status.started()
                async for events in batches:
                    for ev in events:
                        if ev.kind != "put" or ev.kv.mod_revision <= epoch:
                            continue
                        new = config.from_map(json.loads(ev.kv.value), cluster,
                                              ev.kv.mod_revision)
                        epoch = new.epoch
                        on_change(new)
        except (EtcdError, ValueError) as e:
            log.warning("following the cluster map: %s (again in %.1f s)", e, RETRY)
        if not started:
            started = True
            task_status.started()
        await trio.sleep(RETRY)


class MapFollower:
    """The latest map for a client or daemon: ``cluster`` is always the newest seen, and each
    subscriber is called with every newer one. A static cluster file never changes."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._subscribers: list[Callable[[Cluster], None]] = []
        self.etcd: Etcd | None = None

    def subscribe(self, callback: Callable[[Cluster], None]) -> None:
        """Have ``callback`` called (in the following task) with each newer map; one that raises is
        logged and the others still run."""
        self._subscribers.append(callback)

    async def start(self, nursery: trio.Nursery) -> None:
        """Start following (no-op for a static cluster file); returns once the watch is open."""
        if not self.cluster.etcd:
            return
        self.etcd = Etcd(self.cluster.etcd, timeout=max(2.0, self.cluster.peer_timeout))
        await nursery.start(self._run)

    def start_soon(self, nursery: trio.Nursery) -> None:
        """``start`` without waiting for the watch (the map was read when the cluster was
        loaded, and the watch begins right after that epoch, so nothing is missed)."""
        if self.cluster.etcd:
            self.etcd = Etcd(self.cluster.etcd, timeout=max(2.0, self.cluster.peer_timeout))
            nursery.start_soon(self._run)

    async def _run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        assert self.etcd is not None
        try:
            await follow_map(self.etcd, self.cluster, self._changed, task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self.etcd.aclose()

    def _changed(self, new: Cluster) -> None:
        if new.epoch <= self.cluster.epoch:
            return
        log.info("cluster map epoch %d: %d shards, %d storage nodes", new.epoch, new.n_shards,
                 new.n_nodes)
        self.cluster = new
        for callback in self._subscribers:
            try:
                callback(new)
            except Exception:  # one subscriber's failure must not stop the others
                log.exception("applying cluster map epoch %d", new.epoch)


# ---- blocking forms, for code that runs outside trio (jpfs.localcluster)

def _gateway(endpoints: tuple[str, ...], path: str, body: dict, timeout: float = 5.0) -> dict:
    data = json.dumps(body).encode()
    errors = []
    for endpoint in endpoints:
        req = urllib.request.Request(endpoint.rstrip("/") + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except (OSError, ValueError) as e:
            errors.append(f"{endpoint}: {getattr(e, 'reason', e)}")
    raise EtcdError(errno.EIO, f"etcd did not answer ({'; '.join(errors)})")


def update_map_sync(base: Cluster, change: Callable[[Cluster | None], Cluster]) -> Cluster:
    """``update_map`` without trio; ``change(None)`` makes the first map of a new cluster."""
    key = b64encode(map_key(base.name).encode()).decode()
    while True:
        got = _gateway(base.etcd, "/v3/kv/range", {"key": key})
        kvs = got.get("kvs") or []
        current = config.from_map(json.loads(b64decode(kvs[0]["value"])), base,
                                  int(kvs[0]["mod_revision"])) if kvs else None
        new = change(current)
        if current is not None and new == current:
            return current
        rev = current.epoch if current is not None else 0
        target, field = ("MOD", "mod_revision") if rev else ("CREATE", "create_revision")
        txn = {"compare": [{"key": key, "result": "EQUAL", "target": target, field: str(rev)}],
               "success": [{"request_put": {
                   "key": key, "value": b64encode(_encode(new, base.secret)).decode()}}]}
        if _gateway(base.etcd, "/v3/kv/txn", txn).get("succeeded"):
            return config.fetch_map(base)
