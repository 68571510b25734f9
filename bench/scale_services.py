"""The two measurements of ``scale_check`` that need no network namespaces: a local etcd
(lease renewals, cluster-map reads and map changes fanned out to watchers: etcd's CPU and
memory per unit) and idle client connections to one shard and one storage daemon (memory per
connection, CPU per handshake). Apart from ``scale_check``'s simulated hosts because they
measure one service each, from this process."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from .readers import proc_cpu

# ---------------------------------------------------------------------- etcd


def map_value(shards: int, copies: int, nodes: int) -> bytes:
    """The cluster map document a cluster of this shape stores in etcd (addresses, data folders
    and metrics ports filled in as a real cluster file has them)."""
    import json

    from jpfs import config

    def srv(kind: str, i: int, j: int = 0) -> config.Server:
        host = f"10.{i // 250}.{i % 250}.{j + 10}"
        return config.Server(f"{host}:{7300 if kind == 'meta' else 7400}",
                             f"/srv/jpfs/{kind}-{i}-r{j}", f"{host}:9410")

    meta = tuple(tuple(srv("meta", i, j) for j in range(copies)) for i in range(shards))
    c = config.Cluster(meta=tuple(m[0] for m in meta), meta_replicas=meta,
                       storage=tuple(srv("storage", i) for i in range(nodes)), replicas=3)
    return json.dumps(config.map_document(c), sort_keys=True).encode()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _hammer(call, tasks: int, seconds: float, pid: int) -> dict:
    """``call()`` from ``tasks`` concurrent loops for ``seconds``: calls/s, etcd CPU each."""
    import trio

    count = 0

    async def loop(until: float) -> None:
        nonlocal count
        while trio.current_time() < until:
            await call(count)
            count += 1

    c0, t0 = proc_cpu(pid), time.monotonic()
    async with trio.open_nursery() as n:
        for _ in range(tasks):
            n.start_soon(loop, trio.current_time() + seconds)
    secs = time.monotonic() - t0
    return {"per_s": round(count / secs), "concurrent": tasks,
            "etcd_cpu_us_each": round((proc_cpu(pid) - c0) / max(count, 1) * 1e6, 1)}


async def _etcd_load(url: str, pid: int, args: argparse.Namespace) -> dict:
    import trio

    from jpfs.coord.etcd import Etcd

    value = map_value(args.map_shards, 3, args.map_nodes)
    key = "/jpfs/scale/map"
    out: dict = {"map_bytes": len(value)}
    async with Etcd([url], timeout=10) as etcd:
        # lease renewals and map reads, as fast as concurrent loops in one process go
        leases = [await etcd.grant(2.0) for _ in range(args.etcd_tasks)]
        out["keepalive"] = await _hammer(lambda i: etcd.keepalive(leases[i % len(leases)]),
                                         len(leases), args.etcd_seconds, pid)
        for lease in leases:
            await etcd.revoke(lease)
        rev = await etcd.put(key, value)
        out["map_read"] = await _hammer(lambda i: etcd.get(key), 8, args.etcd_seconds, pid)
    # watches: --watchers streams (50 per HTTP client), then map changes fanned out to all
    watchers = args.watchers
    seen: dict[int, int] = {}
    done: dict[int, trio.Event] = {}
    clients = [Etcd([url], timeout=10) for _ in range(-(-watchers // 50))]
    opened, all_open, rss0 = [0], trio.Event(), _rss_kib(pid)

    async def watch(etcd: Etcd) -> None:
        async with etcd.watch(key, start_revision=rev + 1) as batches:
            opened[0] += 1
            if opened[0] == watchers:
                all_open.set()
            async for events in batches:
                for ev in events:
                    r = ev.kv.mod_revision
                    seen[r] = seen.get(r, 0) + 1
                    if seen[r] == watchers:
                        done.setdefault(r, trio.Event()).set()

    lat = []
    async with trio.open_nursery() as n:
        for i in range(watchers):
            n.start_soon(watch, clients[i // 50])
        with trio.fail_after(120):
            await all_open.wait()
        await trio.sleep(1.0)  # streams registered on etcd's side
        rss1, c0 = _rss_kib(pid), proc_cpu(pid)
        async with Etcd([url], timeout=10) as etcd:
            for _ in range(args.map_changes):
                t = time.perf_counter()
                r = await etcd.put(key, value)
                with trio.fail_after(60):
                    await done.setdefault(r, trio.Event()).wait()
                lat.append(time.perf_counter() - t)
        cpu = proc_cpu(pid) - c0
        n.cancel_scope.cancel()
    for c in clients:
        await c.aclose()
    lat.sort()
    out["watch"] = {"watchers": watchers, "changes": len(lat),
                    "etcd_rss_kib_per_watch": round((rss1 - rss0) / watchers, 1),
                    "all_notified_ms_p50": round(lat[len(lat) // 2] * 1e3, 1),
                    "all_notified_ms_max": round(lat[-1] * 1e3, 1),
                    "etcd_cpu_ms_per_change": round(cpu / len(lat) * 1e3, 2),
                    "etcd_cpu_us_per_notification": round(cpu / len(lat) / watchers * 1e6, 2)}
    return out


def measure_etcd(args: argparse.Namespace, work: Path) -> dict:
    """Lease renewals, map reads and map-change fan-out against a local etcd (started as
    ``localcluster`` starts a cluster's, as a child of this process)."""
    import signal

    import trio

    from jpfs import localcluster

    d = work / "etcd-check"
    shutil.rmtree(d, ignore_errors=True)
    url = localcluster.start_etcd(d)
    pid = int((d / "etcd.pid").read_text())
    try:
        return trio.run(_etcd_load, url, pid, args)
    finally:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):  # it is our child: reap it (or see it reaped by subprocess)
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
            except ChildProcessError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------- connections


def measure_connections(n: int, work: Path) -> dict:
    """What ``n`` idle client connections cost a shard and a storage daemon: memory each, and the
    daemon's CPU per handshake (every client process opens its own to every daemon it reads
    from)."""
    import socket

    import trio

    from jpfs import config, localcluster
    from jpfs.rpc import frame as F
    from jpfs.rpc.auth import client_handshake

    from .harness import temporary_cluster

    out: dict = {}
    with temporary_cluster(1, 1, directory=str(work / "conn-check")) as d:
        cluster = config.load(localcluster.cluster_file(d))
        pids = {x.role: x.pid for x in localcluster.status(d) if x.pid}
        for role, address in (("meta", cluster.meta[0].address),
                              ("storage", cluster.storage[0].address)):
            pid = pids[role]
            socks = []
            rss0, cpu0, t0 = _rss_kib(pid), proc_cpu(pid), time.monotonic()
            try:
                for _ in range(n):
                    sock = socket.create_connection(config.parse_address(address))
                    socks.append(sock)
                    trio.run(client_handshake, F.FrameSocket(sock), cluster.secret)
                secs = time.monotonic() - t0
                time.sleep(0.5)
                rss1, cpu1 = _rss_kib(pid), proc_cpu(pid)
            finally:
                for sock in socks:
                    sock.close()
            out[role] = {"connections": n, "rss_kib_each": round((rss1 - rss0) / n, 1),
                         "cpu_us_per_handshake": round((cpu1 - cpu0) / n * 1e6, 1),
                         "handshakes_per_s": round(n / secs)}
    return out
