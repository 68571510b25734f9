"""``jpfs shard add|list``: metadata shards of a cluster whose shape lives in a cluster map.

A shard added to a running cluster takes its share of *new* directories (placement hashes a new
directory over every shard); nothing existing moves, because an inode id carries the shard it
lives on. A local cluster starts the new daemons itself; on a real cluster the command prints
how to start them on their hosts.
"""

from __future__ import annotations

import argparse
import dataclasses

import trio

from .. import config, localcluster
from ..coord import clustermap
from ..coord.etcd import Etcd
from .common import add_json, cluster_dir, plural, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shard", help="add and list metadata shards",
                       description="Metadata shards of a cluster with a cluster map (made by "
                       "`jpfs cluster up`). A new shard takes its share of new directories; "
                       "existing ones stay where they are.")
    ssub = p.add_subparsers(dest="shard_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    add = ssub.add_parser("add", help="add a shard to a running cluster",
                          description="Add one metadata shard. With --dir (a local cluster), "
                          "its daemons are started here on free ports. Otherwise name the "
                          "address of each copy (one ADDRESS per copy, as many as the other "
                          "shards have); the shard is added to the map and the command prints "
                          "the daemon command to run on each host.")
    add.add_argument("addresses", nargs="*", metavar="ADDRESS",
                     help="HOST:PORT of each copy of the new shard (a real cluster)")
    add.add_argument("--dir", help="a local cluster directory: start the shard's daemons here")
    add.set_defaults(func=cmd_add)

    ls = ssub.add_parser("list", help="every shard, its copies and their addresses")
    add_json(ls)
    ls.set_defaults(func=cmd_list)


def _load(args: argparse.Namespace) -> config.Cluster:
    cluster = config.load(args.cluster if not getattr(args, "dir", None)
                          else localcluster.cluster_file(args.dir))
    if not cluster.etcd:
        raise ValueError(f"{cluster.path} is a static cluster file: its shards are fixed (a "
                         "cluster made by `jpfs cluster up` keeps a map in etcd and can grow)")
    return cluster


def cmd_add(args: argparse.Namespace) -> int:
    cluster = _load(args)
    if args.dir:
        if args.addresses:
            raise ValueError("give either --dir (a local cluster) or ADDRESSes, not both")
        grown = localcluster.up(cluster_dir(args), meta_shards=cluster.n_shards + 1)
        index = grown.n_shards - 1
        print(f"added shard {index} ({', '.join(s.address for s in grown.meta_replicas[index])})"
              f"; {plural(grown.n_shards, 'shard')} now, map epoch {grown.epoch}")
        return 0
    copies = cluster.n_meta_replicas
    if len(args.addresses) != copies:
        raise ValueError(f"the other shards have {plural(copies, 'copy', 'copies')}: give "
                         f"{copies} ADDRESS{'es' if copies > 1 else ''}, one per copy")
    for a in args.addresses:
        config.parse_address(a)
    index = cluster.n_shards

    def added(current: config.Cluster) -> config.Cluster:
        if current.n_shards != index:
            raise ValueError(f"the cluster changed meanwhile (it has {current.n_shards} shards "
                             "now); run the command again")
        shard = tuple(config.Server(a, f"meta-{index}" + (f"-r{j}" if j else ""))
                      for j, a in enumerate(args.addresses))
        shards = current.meta_replicas + (shard,)
        return dataclasses.replace(current, meta=current.meta + (shard[0],),
                                   meta_replicas=shards)

    async def update() -> config.Cluster:
        async with Etcd(cluster.etcd) as etcd:
            return await clustermap.update_map(etcd, cluster, added)

    new = trio.run(update)
    print(f"added shard {index} to the map (epoch {new.epoch}); start its daemons:")
    for j, a in enumerate(args.addresses):
        extra = f" --replica {j}" if copies > 1 else ""
        print(f"  on {a.rsplit(':', 1)[0]}: jpfs-meta --cluster {cluster.path} --index {index}"
              f"{extra}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    cluster = config.load(args.cluster)
    rows: list[dict] = [{"shard": i, "copies": [s.address for s in copies]}
                        for i, copies in enumerate(cluster.meta_replicas)]
    if args.json:
        print_json({"epoch": cluster.epoch, "shards": rows})
        return 0
    for r in rows:
        print(f"  shard {r['shard']}: {', '.join(r['copies'])}")
    return 0
