"""``jpfs node list|add|drain|remove``: the storage nodes of a cluster with a map, and healing.

The commands change the cluster map in etcd (compare-and-swap: two operators cannot lose each
other's change); daemons and clients follow it. The data moves are the metadata shards'
healers' (``jpfs_daemon.meta.heal``): a drained node's chunks are copied to active nodes, a
removed node's lost copies are restored from the others, a new node takes new writes at once
and a bounded rebalance evens usage out. ``heal_status_lines`` is what ``jpfs cluster status``
prints about it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import trio

from .. import config
from ..config import format_size
from .common import add_json, connect, plural, print_json

ACTIVE, DRAINING, REMOVED = "active", "draining", "removed"
CLEAN_ROUNDS = 2
"""Rounds of every shard's healer finding no chunk on a draining node before it is removed (as
the healers decide it; see jpfs_daemon.meta.heal)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="add, drain, remove and list storage nodes",
                       description="Change the storage nodes of a running cluster (one whose "
                       "shape lives in a cluster map in etcd, what `jpfs cluster up` makes). "
                       "The metadata shards' healers move the data in the background, bounded "
                       "in bandwidth (jpfs-meta --heal-rate); readers never wait for them.")
    nsub = p.add_subparsers(dest="node_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    ls = nsub.add_parser("list", help="each node: state, up or down, used bytes, chunks to move")
    add_json(ls)
    ls.set_defaults(func=cmd_list)

    add = nsub.add_parser("add", help="append a storage node (it takes new writes at once)",
                          description="Append a storage node to the map (a new index; indices "
                          "are never reused), then start its daemon: `jpfs cluster up --dir D` "
                          "for a local cluster, or `jpfs-storage --cluster FILE --index N` on "
                          "its host. New writes go to it at once and the healers move chunks to "
                          "it until usage is even.")
    add.add_argument("address", help="HOST:PORT the new node listens on")
    add.add_argument("--data", help="its data directory (relative: next to the cluster file)")
    add.add_argument("--domain", help="its failure domain, e.g. a rack name (default: its host; "
                     "a chunk's copies go to distinct domains)")
    add_json(add)
    add.set_defaults(func=cmd_add)

    dr = nsub.add_parser("drain", help="move every chunk off a node, then remove it",
                         description="Mark the node draining: it takes no new writes, its "
                         "copies still serve reads, and the healers copy each of its chunks to "
                         "an active node. Once no chunk names it the node becomes removed (the "
                         "healer of shard 0 flips it; --wait also does once it sees that).")
    dr.add_argument("node", type=int, help="the node's index (see `jpfs node list`)")
    dr.add_argument("--wait", action="store_true", help="wait until the node is removed")
    dr.add_argument("--timeout", type=float, default=3600.0,
                    help="give up waiting after this many seconds (default 3600)")
    dr.add_argument("--force", action="store_true",
                    help="drain even if fewer active nodes than replicas would be left")
    add_json(dr)
    dr.set_defaults(func=cmd_drain)

    rm = nsub.add_parser("remove", help="declare a node lost: its copies no longer count",
                         description="Mark the node removed at once (a dead disk or host): its "
                         "copies no longer count and the healers restore every chunk to the "
                         "replica count from the other copies. A chunk whose only copy was "
                         "there is lost; `jpfs cluster status` counts it as unrepairable.")
    rm.add_argument("node", type=int, help="the node's index (see `jpfs node list`)")
    rm.add_argument("--force", action="store_true",
                    help="remove even if fewer active nodes than replicas would be left")
    add_json(rm)
    rm.set_defaults(func=cmd_remove)


# ---- what the healers say ------------------------------------------------------------------


def _gather(client) -> dict:
    """Every shard's heal status and every node's stats, in one pass on the client's loop."""
    from ..client.tools.scrub import heal_status

    async def run(ac) -> dict:
        storage = getattr(ac, "storage", None)
        n_nodes = storage.n_nodes if storage is not None else 0
        stats: list[Any] = [None] * n_nodes  # each node's Stats, or why it did not answer

        async def one(n: int) -> None:
            assert storage is not None
            try:
                with trio.fail_after(10.0):
                    stats[n] = await storage.stats(n)
            except (OSError, trio.TooSlowError) as e:
                stats[n] = getattr(e, "strerror", None) or "did not answer in 10 s"

        async with trio.open_nursery() as nursery:
            for n in range(n_nodes):
                nursery.start_soon(one, n)
        return {"heal": await heal_status(ac), "stats": stats}

    return client.run(run)


def _summed(per_shard: list[dict[int, int]]) -> dict[int, int]:
    """``{node: count}`` maps of the shards added up."""
    out: dict[int, int] = {}
    for counts in per_shard:
        for node, count in (counts or {}).items():
            out[int(node)] = out.get(int(node), 0) + int(count)
    return out


def heal_status_lines(client) -> list[str]:
    """Under-replicated chunks and bytes, repair and rebalance progress, drains and scrub
    progress, in a few lines (``jpfs cluster status`` prints them). ``client``: a blocking
    ``jpfs.Client``."""
    from ..client.tools.scrub import answered
    from ..client.tools.scrub import status as scrub_status

    got = _gather(client)
    heal = got["heal"]
    lines: list[str] = []
    broken = [s for s in heal if s.error]
    ok = [s for s in answered(heal) if not s.error]
    if not ok:
        return [f"healing: no shard answered ({broken[0].error})" if broken else
                "healing: no shards"]
    under = sum(s.under_replicated for s in ok)
    under_b = sum(s.under_bytes for s in ok)
    lost = sum(s.unrepairable for s in ok)
    rate = sum(s.bytes_per_s for s in ok if s.state == "copying")
    busy = [s.shard for s in ok if s.state in ("scanning", "copying")]
    off = [s.shard for s in ok if not s.enabled]
    head = (f"healing: under-replicated {under:,} chunks ({format_size(under_b)})"
            + (f", {lost:,} with no copy left to copy from" if lost else "")
            + f"; repaired {sum(s.repaired_chunks for s in ok):,} chunks "
            f"({format_size(sum(s.repaired_bytes for s in ok))}), moved "
            f"{sum(s.moved_chunks for s in ok):,} "
            f"({format_size(sum(s.moved_bytes for s in ok))})")
    if busy:
        head += f"; shards {', '.join(map(str, busy))} at work"
        if rate:
            head += f", {format_size(rate)}/s"
    lines.append(head)
    never = [s.shard for s in ok if not s.rounds]
    if never:
        lines.append(f"  shards {', '.join(map(str, never))}: first healing round not finished "
                     "yet (the figures above leave them out)")
    if off:
        lines.append(f"  healing is off on shards {', '.join(map(str, off))} (--heal-rate 0)")
    for s in broken:
        lines.append(f"  shard {s.shard}: healing status unavailable: {s.error}")
    to_move = _summed([s.to_move for s in ok])
    for node, count in sorted(to_move.items()):
        lines.append(f"  storage-{node} draining: {count:,} chunks still to move")
    reb = [s.rebalance or {} for s in ok]
    moves = [m for r in reb for m in r.get("moves", [])]
    if moves:
        r0 = next(r for r in reb if r.get("moves"))
        lines.append(f"  rebalancing: usage spread {format_size(r0.get('spread', 0))} over "
                     f"{format_size(r0.get('allowed', 0))} allowed (mean "
                     f"{format_size(r0.get('mean', 0))})")
    try:
        scrubs = client.run(scrub_status)
    except OSError as e:
        scrubs = []
        lines.append(f"scrub: cannot tell ({e.strerror or e})")
    states = [s.state for s in client.aclient.cluster.storage]
    nodes = [(i, s) for i, s in enumerate(scrubs) if i >= len(states) or states[i] != REMOVED]
    if nodes:
        going = [(i, s) for i, s in nodes if s.get("state") == "scrubbing"]
        fine = [s for _, s in nodes if not s.get("error")]
        bad = sum(s.get("bad_blobs", 0) for s in fine)
        found = sum(s.get("bad_found", 0) for s in fine)
        repaired = sum(s.get("repaired", 0) for s in fine)
        cells = [f"{len(going)} of {len(nodes)} nodes scrubbing"] + [
            f"storage-{i} {s.get('progress', 0.0):.0%}" for i, s in going]
        lines.append(f"scrub: {', '.join(cells)}; bad copies {bad:,} (found {found:,}, "
                     f"repaired {repaired:,})")
    return lines


# ---- commands --------------------------------------------------------------------------------


def _cluster(args: argparse.Namespace) -> config.Cluster:
    cluster = config.load(args.cluster)
    if not cluster.etcd:
        raise ValueError(f"{cluster.path} is a static cluster file (no cluster map): its nodes "
                         "cannot change. A cluster made by `jpfs cluster up` keeps its shape in "
                         "etcd and can.")
    return cluster


def _change(cluster: config.Cluster, fn) -> config.Cluster:
    from ..coord.clustermap import update_map_sync

    def change(current: config.Cluster | None) -> config.Cluster:
        if current is None:
            raise ValueError(f"etcd has no map for cluster {cluster.name!r}")
        return fn(current)

    return update_map_sync(cluster, change)


def _set_state(cluster: config.Cluster, node: int, state: str, force: bool) -> config.Cluster:
    def fn(current: config.Cluster) -> config.Cluster:
        nodes = list(current.storage)
        if not 0 <= node < len(nodes):
            raise ValueError(f"no storage node {node} (the cluster has {len(nodes)}: "
                             "see `jpfs node list`)")
        have = nodes[node].state
        if have == REMOVED:
            raise ValueError(f"storage node {node} is removed already (indices are never "
                             "reused: add a new node with `jpfs node add`)")
        if have == state:
            return current
        left = [i for i, s in enumerate(nodes) if s.state == ACTIVE and i != node]
        if len(left) < current.replicas and not force:
            raise ValueError(f"storage node {node}: only {len(left)} active nodes would be left "
                             f"for replicas {current.replicas}; add a node first (`jpfs node "
                             "add`), or pass --force")
        nodes[node] = dataclasses.replace(nodes[node], state=state)
        return dataclasses.replace(current, storage=tuple(nodes))

    return _change(cluster, fn)


def cmd_list(args: argparse.Namespace) -> int:
    cluster = config.load(args.cluster)
    client = connect(args)
    try:
        got = _gather(client)
    finally:
        client.close()
    from ..client.tools.scrub import answered

    heal, stats = got["heal"], got["stats"]
    ok = [s for s in answered(heal) if not s.error]
    named = _summed([s.node_chunks for s in ok])
    to_move = _summed([s.to_move for s in ok])
    rows: list[dict[str, Any]] = []
    for i, s in enumerate(cluster.storage):
        st: Any = stats[i] if i < len(stats) else None
        err = st if isinstance(st, str) else None
        up = st is not None and err is None
        rows.append({"node": i, "address": s.address, "state": s.state, "up": up,
                     "used_bytes": st.live_bytes if up else None, "chunks": named.get(i, 0),
                     "to_move": to_move.get(i, 0) if s.state == DRAINING else 0,
                     **({"error": err} if err else {})})
    if args.json:
        print_json({"epoch": cluster.epoch, "replicas": cluster.replicas, "nodes": rows,
                    "shards": [s.as_dict() for s in heal]})
        return 0
    table = [["node", "address", "state", "up", "used", "chunks", "to move"]]
    for r in rows:
        table.append([f"storage-{r['node']}", r["address"], r["state"],
                      "up" if r["up"] else "DOWN",
                      format_size(r["used_bytes"]) if r["used_bytes"] is not None else "-",
                      f"{r['chunks']:,}", f"{r['to_move']:,}" if r["state"] == DRAINING else ""])
    width = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(width[k]) for k, c in enumerate(row)).rstrip())
    missing = [s for s in heal if s.error]
    if missing:
        print(f"chunk counts leave out {plural(len(missing), 'shard')} that did not answer: "
              + "; ".join(f"shard {s.shard}: {s.error}" for s in missing))
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    try:
        config.parse_address(args.address)
    except ValueError as e:
        raise ValueError(f"{args.address}: {e}") from None

    def fn(current: config.Cluster) -> config.Cluster:
        if any(s.address == args.address and s.state != REMOVED for s in current.storage):
            raise ValueError(f"{args.address} is a storage node of this cluster already")
        new = config.Server(args.address, args.data or f"storage-{current.n_nodes}",
                            domain=args.domain)
        return dataclasses.replace(current, storage=current.storage + (new,))

    new = _change(cluster, fn)
    index = next(i for i in range(new.n_nodes - 1, -1, -1)
                 if new.storage[i].address == args.address)
    if args.json:
        print_json({"node": index, "address": args.address, "epoch": new.epoch})
        return 0
    print(f"storage-{index} added at {args.address} (map epoch {new.epoch}); it takes new "
          "writes once its daemon runs:")
    print(f"  jpfs-storage --cluster {cluster.path} --index {index}    (or, for a local cluster, "
          f"`jpfs cluster up --dir {cluster.path.parent if cluster.path else 'DIR'}`)")
    return 0


def _clean_everywhere(heal: list, node: int) -> bool:
    from ..client.tools.scrub import answered

    ok = [s for s in answered(heal) if not s.error]
    return bool(heal) and len(ok) == len(heal) and all(
        int((s.clean_rounds or {}).get(node, 0)) >= CLEAN_ROUNDS for s in ok)


def _drained(current: config.Cluster, node: int) -> config.Cluster:
    """``current`` with ``node`` removed if it is still draining (else unchanged)."""
    if node >= current.n_nodes or current.storage[node].state != DRAINING:
        return current
    nodes = list(current.storage)
    nodes[node] = dataclasses.replace(nodes[node], state=REMOVED)
    return dataclasses.replace(current, storage=tuple(nodes))


def cmd_drain(args: argparse.Namespace) -> int:
    from ..client.tools.scrub import answered

    cluster = _cluster(args)
    new = _set_state(cluster, args.node, DRAINING, args.force)
    state = new.storage[args.node].state
    if not args.wait:
        if args.json:
            print_json({"node": args.node, "state": state, "epoch": new.epoch})
        else:
            print(f"storage-{args.node} is {state} (map epoch {new.epoch}); `jpfs node list` "
                  "shows the chunks still to move")
        return 0
    give_up = time.monotonic() + args.timeout
    client = connect(args)
    try:
        while state == DRAINING:
            heal = _gather(client)["heal"]
            if _clean_everywhere(heal, args.node):  # shard 0's healer may have done it already
                new = _change(cluster, lambda cur: _drained(cur, args.node))
            else:
                new = config.load(args.cluster)
            state = new.storage[args.node].state
            if state != DRAINING:
                break
            if time.monotonic() > give_up:
                left = sum(int((s.to_move or {}).get(args.node, 0)) for s in answered(heal))
                print(f"jpfs node drain: storage-{args.node}: still draining after "
                      f"{args.timeout:.0f} s ({left:,} chunks to move); `jpfs cluster status` "
                      "shows the healers' progress", file=sys.stderr)
                return 1
            time.sleep(1.0)
    finally:
        client.close()
    if args.json:
        print_json({"node": args.node, "state": state, "epoch": new.epoch})
    else:
        print(f"storage-{args.node} is {state}: no chunk names it (map epoch {new.epoch})")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    new = _set_state(cluster, args.node, REMOVED, args.force)
    if args.json:
        print_json({"node": args.node, "state": REMOVED, "epoch": new.epoch})
    else:
        print(f"storage-{args.node} removed (map epoch {new.epoch}): its copies no longer "
              "count; the healers restore the others (`jpfs cluster status` shows progress)")
    return 0
