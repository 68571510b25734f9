"""``jpfs cluster up|down|status``: a cluster of real daemons on loopback, in one directory."""

from __future__ import annotations

import argparse

from .. import config, localcluster
from ..config import format_size, parse_size
from .common import add_json, cluster_dir, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="start, stop and inspect a local cluster",
                       description="Run a JPFS cluster of real daemon processes on loopback. "
                       "Everything (data, logs, pid files, cluster.toml, the secret) lives in "
                       "one directory.")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    up = csub.add_parser("up", help="create (first time) and start a cluster",
                         description="Create the cluster on first use and start every daemon "
                         "that is not running; a second `up` restarts stopped daemons on their "
                         "data. Prints the cluster file to export as JPFS_CLUSTER.")
    up.add_argument("--dir", help="cluster directory (default ./jpfs-cluster)")
    up.add_argument("--meta-shards", type=int, help="metadata shards (default 2; fixed at "
                    "creation)")
    up.add_argument("--storage-nodes", type=int, help="storage nodes (default 2; fixed at "
                    "creation)")
    up.add_argument("--replicas", type=int, help="copies of every chunk (default 1)")
    up.add_argument("--chunk-size", type=parse_size, help="chunk size, e.g. 4MiB (default)")
    up.add_argument("--metrics", action="store_true",
                    help="give every daemon a Prometheus metrics port (recorded in cluster.toml; "
                         "fixed at creation)")
    up.add_argument("--no-sync", action="store_true",
                    help="daemons skip fsync (faster; loses recent writes on power failure)")
    up.set_defaults(func=cmd_up)

    down = csub.add_parser("down", help="stop every daemon of a cluster (data is kept)")
    down.add_argument("--dir", help="cluster directory (default ./jpfs-cluster)")
    down.set_defaults(func=cmd_down)

    st = csub.add_parser("status", help="daemons, shards and storage use",
                         description="List every daemon (running or not) with its address and "
                         "pid; for running ones, metadata counts per shard and volumes, bytes "
                         "used and live/dead share per storage node.")
    st.add_argument("--dir", help="cluster directory (default ./jpfs-cluster)")
    add_json(st)
    st.set_defaults(func=cmd_status)


def cmd_up(args: argparse.Namespace) -> int:
    d = cluster_dir(args)
    cluster = localcluster.up(d, meta_shards=args.meta_shards, storage_nodes=args.storage_nodes,
                              replicas=args.replicas, chunk_size=args.chunk_size,
                              sync=not args.no_sync, metrics=args.metrics)
    print(f"cluster up: {cluster.n_shards} metadata shards, {cluster.n_nodes} storage nodes, "
          f"replicas {cluster.replicas}, chunk size {format_size(cluster.chunk_size)}")
    for role, servers in (("meta", cluster.meta), ("storage", cluster.storage)):
        for i, s in enumerate(servers):
            print(f"  {role}-{i:<3} {s.address}"
                  + (f"   metrics http://{s.metrics}/metrics" if s.metrics else ""))
    print(f"export JPFS_CLUSTER={cluster.path}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stopped = localcluster.down(cluster_dir(args))
    print(f"stopped {len(stopped)} daemons" + (f": {', '.join(stopped)}" if stopped else ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    d = cluster_dir(args)
    daemons = localcluster.status(d)
    cluster = config.load(localcluster.cluster_file(d))
    info = _daemon_info(cluster, daemons)
    if args.json:
        print_json({"cluster": str(cluster.path), "daemons": info})
        return 0
    print(f"cluster {cluster.path}")
    for row in info:
        state = f"up   pid {row['pid']}" if row["alive"] else "DOWN"
        detail = ""
        if "inodes" in row:
            detail = f"inodes {row['inodes']:,}  entries {row['dentries']:,}  " \
                     f"commits {row['commits']:,}"
        elif "bytes_used" in row:
            live = row.get("live_bytes", 0)
            dead = row.get("dead_bytes", 0)
            ratio = live / (live + dead) if live + dead else 1.0
            detail = f"volumes {row.get('volumes', 0)}  used {format_size(row['bytes_used'])}  " \
                     f"live {ratio:.0%}  blobs {row.get('blobs', 0):,}"
        elif row.get("error"):
            detail = row["error"]
        if row["metrics"]:
            detail += f"  metrics http://{row['metrics']}/metrics"
        print(f"  {row['role']}-{row['index']:<3} {row['address']:<22} {state:<14} {detail}")
    return 0 if all(r["alive"] for r in info) else 1


def _daemon_info(cluster: config.Cluster, daemons: list) -> list[dict]:
    servers = {"meta": cluster.meta, "storage": cluster.storage}
    rows = [{"role": x.role, "index": x.index, "address": x.address, "pid": x.pid,
             "alive": x.alive, "metrics": servers[x.role][x.index].metrics} for x in daemons]
    if not any(r["alive"] for r in rows):
        return rows
    from ..client import connect

    client = connect(cluster)
    try:
        for r in rows:
            if not r["alive"]:
                continue
            try:
                if r["role"] == "meta":
                    r.update(client.run(_shard_info, r["index"]))
                else:
                    r.update(client.run(_storage_stats, r["index"]))
            except OSError as e:
                r["error"] = e.strerror or str(e)
    finally:
        client.close()
    return rows


async def _shard_info(aclient, index: int) -> dict:
    return await aclient.meta.call(index, "shard_info", retry_for=1.0, timeout=5.0)


async def _storage_stats(aclient, index: int) -> dict:
    storage = getattr(aclient, "storage", None)
    if storage is None:
        return {}
    return await storage.stats(index)
