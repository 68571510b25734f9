"""``jpfs cluster up|down|status``: a cluster of real daemons on loopback, in one directory.

A new cluster keeps its shape in a cluster map in its own etcd (``--static`` for the old fixed
cluster file), so a later ``up`` with more shards or nodes grows it while it serves."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

from .. import config, localcluster
from ..config import format_size, parse_size
from ..coord import clustermap
from ..localcluster import DEFAULT_META_REPLICAS
from .common import add_json, cluster_dir, plural, print_json
from .scrub import describe as describe_scrub


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="start, stop and inspect a local cluster",
                       description="Run a JPFS cluster of real daemon processes on loopback. "
                       "Everything (data, logs, pid files, cluster.toml, the secret, the etcd "
                       "that holds the cluster map) lives in one directory.")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    up = csub.add_parser("up", help="create (first time), start or grow a cluster",
                         description="Create the cluster on first use and start every daemon "
                         "that is not running; a second `up` restarts stopped daemons on their "
                         "data, and with more --meta-shards or --storage-nodes than the cluster "
                         "has, adds them to the running cluster. Prints the cluster file to "
                         "export as JPFS_CLUSTER.")
    up.add_argument("--dir", help="cluster directory (default ./jpfs-cluster)")
    up.add_argument("--meta-shards", type=int, help="metadata shards (default 2; a larger number "
                    "adds shards, which take their share of new directories)")
    up.add_argument("--storage-nodes", type=int, help="storage nodes (default 2; a larger "
                    "number adds nodes, which take new writes at once)")
    up.add_argument("--replicas", type=int, help="copies of every chunk (default 2 with 2 or "
                    "more storage nodes, else 1; fixed at creation)")
    up.add_argument("--meta-replicas", type=int,
                    help=f"copies of every metadata shard, each its own daemon (default "
                    f"{DEFAULT_META_REPLICAS}; 1 keeps one copy; fixed at creation)")
    up.add_argument("--static", action="store_true",
                    help="no cluster map: a fixed cluster file, no etcd (the shape cannot "
                    "change, one copy of each shard)")
    up.add_argument("--chunk-size", type=parse_size, help="chunk size, e.g. 4MiB (default)")
    up.add_argument("--metrics", action="store_true",
                    help="give every daemon a Prometheus metrics port (recorded in cluster.toml; "
                         "fixed at creation)")
    up.add_argument("--no-sync", action="store_true",
                    help="daemons skip fsync (faster; loses recent writes on power failure)")
    up.set_defaults(func=cmd_up)

    init = csub.add_parser(
        "init", help="write the map of a real cluster into etcd, and its cluster file",
        description="For a cluster whose daemons run on their own hosts: store its first map in "
        "etcd (every shard with the address of each copy, every storage node) and write the "
        "cluster file (where etcd is, the secret) that every daemon and client is started "
        "with. Then start each daemon on its host as the command prints.",
        epilog="example: jpfs cluster init /etc/jpfs/cluster.toml --etcd http://etcd-1:2379 "
        "--shard m1:7301,m2:7301,m3:7301 --shard m2:7302,m3:7302,m1:7302 "
        "--node s1:7401 --node s2:7401 --node s3:7401")
    init.add_argument("file", help="the cluster file to write (the secret goes beside it)")
    init.add_argument("--etcd", action="append", required=True, metavar="URL",
                      help="an etcd endpoint, e.g. http://etcd-1:2379 (repeat for each)")
    init.add_argument("--shard", action="append", required=True, metavar="ADDR[,ADDR...]",
                      help="one metadata shard: the HOST:PORT of each copy, comma-separated "
                      "(repeat per shard; every shard the same number of copies)")
    init.add_argument("--node", action="append", default=[], metavar="ADDR",
                      help="a storage node's HOST:PORT (repeat per node)")
    init.add_argument("--name", default="jpfs", help="cluster name (etcd key prefix /jpfs/NAME)")
    init.add_argument("--replicas", type=int,
                      help="copies of every chunk (default 2 with 2 or more nodes, else 1)")
    init.add_argument("--chunk-size", type=parse_size, default=config.DEFAULT_CHUNK_SIZE,
                      help="chunk size (default 4MiB)")
    init.set_defaults(func=cmd_init)

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
    etcd = not args.static
    meta_replicas = args.meta_replicas
    if not existed and meta_replicas is None:
        meta_replicas = DEFAULT_META_REPLICAS if etcd else 1
    cluster = localcluster.up(d, meta_shards=args.meta_shards, storage_nodes=args.storage_nodes,
                              replicas=args.replicas, chunk_size=args.chunk_size,
                              sync=not args.no_sync, metrics=args.metrics, etcd=etcd,
                              meta_replicas=meta_replicas)
    after = localcluster.status(d)
    started = [x.name for x in after if not before.get(x.name)]
    print(f"cluster {'up' if existed else 'created'}: {cluster.path}: {_shape(cluster)}")
    rows = [[x.name, x.address, f"{'running' if before.get(x.name) else 'started'}, pid {x.pid}",
             f"metrics http://{m}/metrics" if (m := _metrics(cluster, x)) else ""]
            for x in after]
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


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if path.exists():
        raise FileExistsError(errno.EEXIST, "a cluster file is already there (a cluster is "
                              "initialised once; `jpfs node add`, `jpfs shard add` grow it)",
                              str(path))
    shards = tuple(tuple(config.Server(a.strip()) for a in spec.split(",") if a.strip())
                   for spec in args.shard)
    if len({len(c) for c in shards}) != 1:
        raise ValueError("every --shard needs the same number of copies")
    for server in [s for c in shards for s in c] + [config.Server(a) for a in args.node]:
        config.parse_address(server.address)
    nodes = tuple(config.Server(a) for a in args.node)
    replicas = args.replicas or (2 if len(nodes) >= 2 else 1)
    if nodes and replicas > len(nodes):
        raise ValueError(f"replicas = {replicas} needs at least that many --node")
    path.parent.mkdir(parents=True, exist_ok=True)
    secret_path = path.parent / "secret"
    secret = (secret_path.read_bytes().strip() if secret_path.exists()
              else config.new_secret(secret_path))
    cluster = config.Cluster(meta=tuple(c[0] for c in shards), meta_replicas=shards,
                             storage=nodes, secret=secret, replicas=replicas,
                             chunk_size=args.chunk_size, name=args.name, path=path.resolve(),
                             etcd=tuple(args.etcd))
    try:
        made = clustermap.update_map_sync(cluster, lambda current: current or cluster)
    except ValueError as e:
        if "not signed" not in str(e):
            raise
        raise ValueError(f"etcd already holds a different map for cluster {args.name!r} (made "
                         "with another secret); choose another --name or use that cluster's "
                         "secret") from None
    if made.meta_replicas != shards or made.storage != nodes:
        raise ValueError(f"etcd already holds a different map for cluster {args.name!r} "
                         f"(epoch {made.epoch}); choose another --name or use that cluster")
    config.write(cluster, path)
    print(f"cluster {args.name!r}: map in etcd (epoch {made.epoch}), cluster file {path}, "
          f"secret {secret_path} (copy both to every host); start the daemons:")
    copies = cluster.n_meta_replicas
    for i, c in enumerate(shards):
        for j, s in enumerate(c):
            extra = f" --replica {j}" if copies > 1 else ""
            print(f"  on {s.address.rsplit(':', 1)[0]}: jpfs-meta --cluster {path} --index {i}"
                  f"{extra}")
    for i, s in enumerate(nodes):
        print(f"  on {s.address.rsplit(':', 1)[0]}: jpfs-storage --cluster {path} --index {i}")
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
    heal = _heal_lines(info)
    if args.json:
        print_json({"cluster": str(cluster.path), "epoch": cluster.epoch, "daemons": info,
                    "healing": heal})
        return 0
    print(f"cluster {cluster.path}: {_shape(cluster)}")
    rows = [["daemon", "address", "state", "details"]]
    for row in info:
        name = row["name"]
        if not row["alive"]:
            state = "DOWN"
            detail = [f"not running (log: {d / 'logs' / (name + '.log')})"]
        elif row.get("error"):
            state = f"up, pid {row['pid']}"
            detail = [f"not answering: {row['error']}"]
        elif row["role"] == "etcd":
            state = f"up, pid {row['pid']}"
            detail = [f"cluster map epoch {cluster.epoch}"]
        elif row["role"] == "meta":
            state = f"up, pid {row['pid']}"
            detail = [row["copy_state"]] if row.get("copy_state") else []
            if "inodes" in row:  # the copy that answered for the shard
                detail += [f"inodes {row.get('inodes', 0):,}",
                           f"entries {row.get('dentries', 0):,}",
                           f"commits {row.get('commits', 0):,}"]
        else:
            state = f"up, pid {row['pid']}"
            if row.get("state", "active") != "active":
                state += f", {row['state']}"
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
    if heal:
        print()
        for line in heal:
            print(line)
    down = [r["name"] for r in info if not r["alive"]]
    if down:
        print(f"{plural(len(down), 'daemon')} down ({', '.join(down)}): "
              f"jpfs cluster up --dir {d} restarts {'it' if len(down) == 1 else 'them'} "
              "(data is kept)")
    return 0 if not down else 1


def _shape(cluster: config.Cluster) -> str:
    copies = cluster.n_meta_replicas
    gone = sum(s.state == "removed" for s in cluster.storage)
    nodes = plural(cluster.n_nodes - gone, "storage node") + (f" (+{gone} removed)" if gone
                                                              else "")
    return (f"{plural(cluster.n_shards, 'metadata shard')}"
            + (f" x {copies} copies" if copies > 1 else "")
            + f", {nodes}, replicas {cluster.replicas}, "
            f"chunk size {format_size(cluster.chunk_size)}"
            + (f", map in etcd (epoch {cluster.epoch})" if cluster.etcd else ", static"))


def _metrics(cluster: config.Cluster, x) -> str | None:
    if x.role == "etcd":
        return None
    server = (cluster.meta_replicas[x.index][x.replica] if x.role == "meta"
              else cluster.storage[x.index])
    return server.metrics


def _table(rows: list[list[str]]) -> None:
    """Print rows with every column as wide as its widest cell; a row's last cell is left
    ragged and does not widen its column (a DOWN row's note, the header's "details")."""
    width = [max((len(r[i]) for r in rows if len(r) > i + 1), default=0)
             for i in range(max(len(r) for r in rows))]
    for r in rows:
        cells = [c.ljust(width[i]) for i, c in enumerate(r)]
        print("  " + "  ".join(cells).rstrip())


def _daemon_info(cluster: config.Cluster, daemons: list) -> list[dict]:
    rows = [{"name": x.name, "role": x.role, "index": x.index, "replica": x.replica,
             "address": x.address, "pid": x.pid, "alive": x.alive,
             "metrics": _metrics(cluster, x)} for x in daemons]
    if x_state := {i: s.state for i, s in enumerate(cluster.storage)}:
        for r in rows:
            if r["role"] == "storage":
                r["state"] = x_state[r["index"]]
    if not any(r["alive"] and r["role"] != "etcd" for r in rows):
        return rows
    from ..client import connect

    client = connect(cluster)
    try:
        for shard in range(cluster.n_shards):
            copies = [r for r in rows if r["role"] == "meta" and r["index"] == shard]
            if any(r["alive"] for r in copies):
                _place_shard_info(client, shard, copies)
        for r in rows:
            if not r["alive"] or r["role"] != "storage":
                continue
            try:
                r.update(client.run(_storage_stats, r["index"]))
            except OSError as e:
                r["error"] = e.strerror or str(e)
        rows.append({"name": "heal", "role": "heal", "alive": True,
                     "lines": _heal_status(client)})
    finally:
        client.close()
    return rows


def _place_shard_info(client, shard: int, copies: list[dict]) -> None:
    """Ask the shard (its leader answers) once; its figures go on the leading copy's row, and
    each other copy's row says how far it has followed."""
    try:
        info = client.run(_shard_info, shard)
    except OSError as e:
        for r in copies:
            if r["alive"]:
                r["error"] = e.strerror or str(e)
        return
    repl = info.replication_status
    leader = repl.leader if repl is not None else 0
    followers = {int(k): v for k, v in repl.followers.items()} if repl is not None else {}
    for r in copies:
        if r["replica"] == leader:
            r.update(info.as_dict())
            if repl is not None:
                r["copy_state"] = f"leader (term {repl.term}, seq {repl.seq})"
        elif r["alive"]:
            at = followers.get(r["replica"])
            r["copy_state"] = (f"follower at seq {at}" if at is not None
                               else "follower (not reached by the leader)")


def _heal_status(client) -> list[str]:
    """What the healers and scrubbers report (jpfs.cli.node, where healing is driven)."""
    from . import node

    try:
        return node.heal_status_lines(client)
    except OSError as e:
        return [f"healing: cannot tell ({e.strerror or e})"]


def _heal_lines(info: list[dict]) -> list[str]:
    lines = [line for r in info if r["role"] == "heal" for line in r["lines"]]
    info[:] = [r for r in info if r["role"] != "heal"]
    return lines


async def _shard_info(aclient, index: int):
    return await aclient.meta.shard_info(index, retry_for=1.0, timeout=5.0)


async def _storage_stats(aclient, index: int) -> dict:
    storage = getattr(aclient, "storage", None)
    if storage is None:
        return {}
    from ..client.tools.scrub import node_status

    stats = (await storage.stats(index)).as_dict()
    stats["scrub"] = await node_status(aclient, index)
    return stats
