"""``jpfs-meta``'s command line and startup: open one shard (or one copy of it), build its
parts in order and serve it until cancelled.

Kept apart from ``server.py`` (the RPC handlers) so that the server reads as what it answers,
and startup (stores, replication, healer, metrics, the cluster map) as one sequence here.
"""

from __future__ import annotations

import logging
import sys

import trio

from jpfs import config
from jpfs.proto import meta as P
from jpfs.rpc import Service, serve

from . import copies as C
from . import heal
from .replica import RENEW, STALL, TTL, Replication
from .server import MetaShard, init_shard, stored_chunk_size
from .store import SYNC_DELAY, Store

log = logging.getLogger(__name__)

COUNTERS = frozenset({"commits", "ops", "transactions_committed", "transactions_aborted",
                      "leases_granted", "leases_recalled", "leases_given_back", "leases_revoked"})
"""shard_info keys that only grow (Prometheus counters); the rest are gauges."""


async def run_shard(cluster: config.Cluster, index: int, data, host: str, port: int, *,
                    replica: int = 0, sync: bool = True, ack_after_sync: bool = False,
                    sync_delay: float = SYNC_DELAY, metrics: str | None = None,
                    heal_options: dict | None = None,
                    ttl: float = TTL, renew: float = RENEW, stall: float = STALL,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Open shard ``index`` (copy ``replica``) and serve it until cancelled;
    ``task_status.started(port)``. ``metrics``: HOST:PORT for Prometheus. A shard with
    several copies elects a leader on etcd (lease ``ttl``, renewed every ``renew`` s)."""
    copies = cluster.meta_replicas[index]
    replicated = len(copies) > 1
    etcd = tuple(cluster.etcd)
    if replicated and not etcd:
        raise SystemExit(f"metadata shard {index} has {len(copies)} copies but the cluster "
                         "names no etcd (replication elects its leader there): add "
                         '[cluster] etcd = ["http://HOST:PORT"]')
    store: Store | None = None
    try:
        async with trio.open_nursery() as nursery:
            def replication(s: Store) -> Replication:
                return Replication(s, replica, [c.address for c in copies], cluster.secret,
                                   etcd, cluster.name, nursery, ttl=ttl, renew=renew,
                                   stall=stall, peer_timeout=min(cluster.peer_timeout, ttl / 2))

            store = Store(data, index, cluster.n_shards, sync=sync,
                          ack_after_sync=ack_after_sync, sync_delay=sync_delay,
                          replication=replication if replicated else None)
            await nursery.start(store.committer)
            peers = C.shard_peers(nursery, cluster)
            if not isinstance(store.repl, Replication):
                chunk_size = await store.write(init_shard, cluster.chunk_size)
                shard = MetaShard(store, peers, chunk_size)
                await nursery.start(shard.coord.resolver)
                nursery.start_soon(shard.coord.orphan_checker)
                await nursery.start(shard.leases.start)
            else:
                if store.created and replica != 0:
                    store.mark_new_copy()
                stored = store.read(stored_chunk_size)
                shard = MetaShard(store, peers, stored or cluster.chunk_size, store.repl)
            healer = heal.Healer(store, cluster, **(heal_options or {}))  # leads only: heal.py
            await nursery.start(healer.run)
            service = Service("meta", P.METHODS, {**shard.handlers(), **healer.handlers()})
            bound = await nursery.start(serve, service, host, port, cluster.secret)
            if shard.repl is not None:
                await nursery.start(shard.repl.run, shard.lead)
            if etcd:
                nursery.start_soon(C.follow_map, cluster, shard)
            if metrics:
                from ..metrics import serve_metrics

                serve_metrics(metrics, "meta", index, service,
                              healer.with_metrics(shard.shard_info), COUNTERS | heal.COUNTERS)
            log.info("meta shard %d of %d (copy %d of %d) serving %s on port %d", index,
                     cluster.n_shards, replica, len(copies), data, bound)
            task_status.started(bound)
    finally:
        if store is not None:
            store.close()


def main(argv: list[str] | None = None) -> None:
    """``jpfs-meta``: serve one metadata shard (or one copy of it) until SIGTERM or SIGINT."""
    from .. import common

    p = common.parser("meta", "Serve one metadata shard of a JPFS cluster (LMDB over TCP).")
    p.add_argument("--no-sync", action="store_true",
                   help="do not fsync commits (faster; loses recent changes on power failure)")
    p.add_argument("--ack-after-sync", action="store_true",
                   help="answer single-shard changes only once they are fsynced (default: once "
                   "committed, durable within one fsync; clients call sync for fsync(2))")
    p.add_argument("--sync-delay", type=float, default=SYNC_DELAY, metavar="SECONDS",
                   help="how long an fsync that no client waits for may wait for more changes "
                   "to cover (default %(default)s; a power failure can lose this much more of "
                   "the changes already answered; 0: fsync after every commit)")
    p.add_argument("--replica", type=int, default=0,
                   help="which copy of the shard this is (0-based; shards with several copies "
                   "elect a leader on etcd)")
    p.add_argument("--lease-ttl", type=float, default=TTL,
                   help="seconds of the leader's etcd lease (default %(default)s)")
    p.add_argument("--lease-renew", type=float, default=RENEW,
                   help="seconds between lease renewals (default %(default)s)")
    p.add_argument("--stall-timeout", type=float, default=STALL,
                   help="seconds a write waits for a majority of the copies before it is "
                   "answered with an error (default %(default)s)")
    heal.add_arguments(p)
    args = p.parse_args(argv)
    common.setup_logging(args.log_level, args.log_file)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per etcd request otherwise
    cluster, data, host, port = common.resolve(args, "meta")
    copies = cluster.meta_replicas[args.index]
    if not 0 <= args.replica < len(copies):
        raise SystemExit(f"jpfs-meta: --replica {args.replica} but shard {args.index} has "
                         f"{len(copies)} copies")
    if args.replica and not args.listen:
        host, port = config.parse_address(copies[args.replica].address)
    if args.replica and not args.data:
        data = cluster.data_dir("meta", args.index, args.replica)

    async def serve_shard() -> None:
        await run_shard(cluster, args.index, data, host, port, replica=args.replica,
                        sync=not args.no_sync, ack_after_sync=args.ack_after_sync,
                        sync_delay=args.sync_delay,
                        metrics=common.metrics_address(args, cluster, "meta"),
                        heal_options=heal.options(args), ttl=args.lease_ttl,
                        renew=args.lease_renew, stall=args.stall_timeout)

    common.run(args, serve_shard)


if __name__ == "__main__":
    main(sys.argv[1:])
