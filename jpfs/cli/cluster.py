"""``jpfs cluster up|down|status``: a cluster of real daemons on loopback, in one directory."""

from __future__ import annotations

import argparse
import errno

from .. import config, localcluster
from ..config import format_size, parse_size
from .common import add_json, cluster_dir, plural, print_json
from .scrub import describe as describe_scrub


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
                         "used, live/dead share, scrub progress and bad blobs (found, "
                         "repaired) per storage node.")
    st.add_argument("--dir", help="cluster directory (default ./jpfs-cluster)")
    add_json(st)
    st.set_defaults(func=cmd_status)


def cmd_up(args: argparse.Namespace) -> int:
    d = cluster_dir(args)
    existed = localcluster.cluster_file(d).exists()
    before = {x.name: x.alive for x in localcluster.status(d)} if existed else {}
    cluster = localcluster.up(d, meta_shards=args.meta_shards, storage_nodes=args.storage_nodes,
                              replicas=args.replicas, chunk_size=args.chunk_size,
                              sync=not args.no_sync, metrics=args.metrics)
    after = localcluster.status(d)
    started = [x.name for x in after if not before.get(x.name)]
    print(f"cluster {'up' if existed else 'created'}: {cluster.path}: {_shape(cluster)}")
    rows = [[x.name, x.address, f"{'running' if before.get(x.name) else 'started'}, pid {x.pid}",
             f"metrics http://{s.metrics}/metrics" if s.metrics else ""]
            for x, s in zip(after, cluster.meta + cluster.storage, strict=True)]
    _table(rows)
    if not existed:
        print(f"started {plural(len(started), 'daemon')}")
    elif started:
        print(f"started {plural(len(started), 'daemon')} ({', '.join(started)}); "
              f"{len(after) - len(started):,} already running")
    else:
        print(f"all {plural(len(after), 'daemon')} already running; nothing started")
    print(f"export JPFS_CLUSTER={cluster.path}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stopped = localcluster.down(cluster_dir(args))
    print(f"stopped {plural(len(stopped), 'daemon')}"
          + (f": {', '.join(stopped)}" if stopped else " (none was running)"))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    d = cluster_dir(args)
    if not localcluster.cluster_file(d).exists():
        raise FileNotFoundError(errno.ENOENT, "no cluster here (create one with jpfs cluster up "
                                f"--dir {d})", str(d))
    daemons = localcluster.status(d)
    cluster = config.load(localcluster.cluster_file(d))
    info = _daemon_info(cluster, daemons)
    if args.json:
        print_json({"cluster": str(cluster.path), "daemons": info})
        return 0
    print(f"cluster {cluster.path}: {_shape(cluster)}")
    rows = [["daemon", "address", "state", "details"]]
    for row in info:
        name = f"{row['role']}-{row['index']}"
        if not row["alive"]:
            state = "DOWN"
            detail = [f"not running (log: {d / 'logs' / (name + '.log')})"]
        elif row.get("error"):
            state = f"up, pid {row['pid']}"
            detail = [f"not answering: {row['error']}"]
        elif row["role"] == "meta":
            state = f"up, pid {row['pid']}"
            detail = [f"inodes {row.get('inodes', 0):,}", f"entries {row.get('dentries', 0):,}",
                      f"commits {row.get('commits', 0):,}"]
        else:
            state = f"up, pid {row['pid']}"
            live, dead = row.get("live_bytes", 0), row.get("dead_bytes", 0)
            ratio = live / (live + dead) if live + dead else 1.0
            detail = [f"volumes {row.get('volumes', 0):,}",
                      f"used {format_size(row.get('bytes_used', 0))}",
                      f"live {ratio:.0%}", f"blobs {row.get('blobs', 0):,}"]
            if "scrub" in row:
                detail += describe_scrub(row["scrub"])
        if row["metrics"]:
            detail.append(f"metrics http://{row['metrics']}/metrics")
        rows.append([name, row["address"], state, *detail])
    _table(rows)
    down = [f"{r['role']}-{r['index']}" for r in info if not r["alive"]]
    if down:
        print(f"{plural(len(down), 'daemon')} down ({', '.join(down)}): "
              f"jpfs cluster up --dir {d} restarts {'it' if len(down) == 1 else 'them'} "
              "(data is kept)")
    return 0 if not down else 1


def _shape(cluster: config.Cluster) -> str:
    return (f"{plural(cluster.n_shards, 'metadata shard')}, "
            f"{plural(cluster.n_nodes, 'storage node')}, replicas {cluster.replicas}, "
            f"chunk size {format_size(cluster.chunk_size)}")


def _table(rows: list[list[str]]) -> None:
    """Print rows with every column as wide as its widest cell; a row's last cell is left
    ragged and does not widen its column (a DOWN row's note, the header's "details")."""
    width = [max((len(r[i]) for r in rows if len(r) > i + 1), default=0)
             for i in range(max(len(r) for r in rows))]
    for r in rows:
        cells = [c.ljust(width[i]) for i, c in enumerate(r)]
        print("  " + "  ".join(cells).rstrip())


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
    from ..client.scrub import node_status

    stats = await storage.stats(index)
    stats["scrub"] = await node_status(aclient, index)
    return stats
