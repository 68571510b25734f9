"""How a shard daemon serves with several copies: client methods guarded on copies that do not
lead, the replication methods, the calls to other shards, and following the cluster map.

Kept beside ``server.py`` (which binds the namespace methods) so that neither grows past what
one reads at once; ``replica.py`` is the replication itself.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any

import trio

from jpfs import config
from jpfs.coord.clustermap import MapFollower
from jpfs.errors import JPFSError, error
from jpfs.proto import replica as R
from jpfs.proto.replica import ShardPool
from jpfs.rpc import Handler, Later, Pool

from . import replog

if TYPE_CHECKING:
    from .replica import Replication
    from .server import MetaShard

log = logging.getLogger(__name__)


def guarded(table: dict, repl: Replication | None) -> dict:
    """Every client method answers "not leader" on a copy that does not lead, and a leader's
    answers wait until a majority holds what they saw (``Store.hold``); unchanged with one
    copy."""
    if repl is None:
        return table
    check, hold = repl.check, repl.store.hold
    out = {}
    for m, h in table.items():
        now, run = h.now, h.run

        def g_now(*a, _now=now):
            check()
            try:
                result = _now(*a)
            except JPFSError as e:
                return hold(None, e)
            return result if isinstance(result, Later) else hold(result)

        async def g_run(*a, _run=run, **kw):
            check()
            try:
                result = await _run(*a, **kw)
            except JPFSError as e:
                return await _settled(hold(None, e))
            return await _settled(hold(result))

        out[m] = Handler(g_run if run is not None else None, g_now if now else None)
    return out


async def _settled(answer: object) -> object:
    """``answer``, or what the ``Later`` it is settles with."""
    if not isinstance(answer, Later):
        return answer
    done = trio.Event()
    box: list = []

    def settled(result: object, exc: BaseException | None) -> None:
        box.append((result, exc))
        done.set()

    answer.on_settled(settled)
    await done.wait()
    result, exc = box[0]
    if exc is not None:
        raise exc
    return result


def replica_handlers(shard: MetaShard) -> dict:
    """The replication methods (``jpfs.proto.replica``); a shard with one copy answers its
    status and digest and refuses the rest."""
    repl, store = shard.repl, shard.store

    async def digest(index: int) -> dict:
        d = await trio.to_thread.run_sync(replog.digest, store.env, store.dbs)
        return d.to_wire()

    if repl is not None:
        return {R.REPL_STATUS: Handler(repl.repl_status),
                R.REPL_APPEND: Handler(None, repl.repl_append),
                R.REPL_SNAPSHOT: Handler(repl.repl_snapshot),
                R.REPL_DIGEST: Handler(digest)}

    async def single(index: int) -> dict:
        term, seq = store.pos
        return R.ReplStatus.single(shard.shard, term, seq).to_wire()

    def refused() -> Exception:
        return error(errno.EINVAL, f"metadata shard {shard.shard} has one copy: nothing "
                                   "replicates to it")

    async def refuse(*args: Any) -> None:
        raise refused()

    def refuse_now(*args: Any) -> None:
        raise refused()

    return {R.REPL_STATUS: Handler(single), R.REPL_APPEND: Handler(None, refuse_now),
            R.REPL_SNAPSHOT: Handler(refuse), R.REPL_DIGEST: Handler(digest)}


def replication_info(repl: Replication) -> tuple[str, R.ReplStatus]:
    """The copies as `jpfs cluster status` shows them: a line, and the status in full
    (``ShardInfo.replication`` and ``replication_status``)."""
    st = repl.status()
    behind = [f"copy {j} {'at' if seq == st.seq else 'behind, at'} seq {seq:,}"
              for j, seq in sorted(st.followers.items())]
    missing = [f"copy {j} not in contact" for j in range(repl.n)
               if j != st.replica and j not in st.followers]
    line = (f"copy {st.replica} of {repl.n} leads (term {st.term:,}, seq "
            f"{st.seq:,}): " + ", ".join(behind + missing))
    return line, st


def shard_peers(nursery: trio.Nursery, cluster: config.Cluster) -> Pool | ShardPool:
    """How a shard calls the others: their leaders when any is replicated, else (as before)
    one Pool over the shards' addresses."""
    reps = cluster.meta_replicas
    if all(len(r) == 1 for r in reps):
        return Pool(nursery, [s.address for s in cluster.meta], cluster.secret, role="meta",
                    retry_for=5.0)
    return ShardPool(nursery, [[s.address for s in r] for r in reps], cluster.secret,
                     peer_timeout=cluster.peer_timeout)


async def follow_map(cluster: config.Cluster, shard: MetaShard) -> None:
    """Follow the cluster map: new shards join the peers and take their share of new
    directories (``n_shards`` is what directory placement hashes over)."""
    def changed(new: config.Cluster) -> None:
        if isinstance(shard.peers, ShardPool):
            shard.peers.set_replicas([[s.address for s in r] for r in new.meta_replicas])
        else:
            shard.peers.set_addresses([s.address for s in new.meta])
        if new.n_shards != shard.n_shards:
            log.info("the map has %d metadata shards (was %d)", new.n_shards, shard.n_shards)
        shard.n_shards = shard.store.n_shards = new.n_shards

    try:
        async with trio.open_nursery() as nursery:
            follower = MapFollower(cluster)
            follower.subscribe(changed)
            await follower.start(nursery)
    except Exception:  # the shard serves on with the map it has
        log.exception("following the cluster map failed; serving with the map at start")
