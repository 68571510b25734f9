"""Metadata replication: failover time after a leader is killed, and what three copies cost.

``run_failover``: one shard with three copies (etcd lease TTL 5 s, renewed every second); a
client creates files one after another; the shard's leader is SIGKILLed ``--kills`` times
(restarted and caught up between kills). Each figure is the time from the kill to the first
create answered afterwards: the lease running out, an election, the client finding the new
leader.

``run_replication``: the same creates (``--inflight`` in flight) and stats, against one shard
with one copy and one shard with three copies, both up in the same run and measured in turn
``--rounds`` times; the ratio of the medians and both absolute figures. On one machine the
three copies share its cores with each other and the client, so the ratio is an upper bound
on the cost a cluster with a host per copy pays (there the cost is a round trip to the
fastest follower per group commit).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time
from pathlib import Path

from .harness import fmt_rate, fmt_ratio, print_table, ratio, temporary_cluster

HELP = "metadata failover time and the cost of three copies per shard"
DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the failover and replication phases of ``jpfs bench heal``."""
    p.add_argument("--kills", type=int, default=5, help="leader kills (default 5)")
    p.add_argument("--files", type=int, default=3000,
                   help="files created (then stat-ed) per setting (default 3000)")
    p.add_argument("--inflight", type=int, default=16,
                   help="creates and stats in flight (default 16)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating rounds of 1 copy and 3 copies (default 3)")


def _opt(args: argparse.Namespace, name: str, default):
    return getattr(args, name, None) or default


def _leader(d: Path, shard: int = 0, timeout: float = 30.0) -> int:
    """The copy that leads ``shard`` (asked of every copy)."""
    import trio

    from jpfs import config
    from jpfs.errors import JPFSError
    from jpfs.proto import replica as R
    from jpfs.rpc import Pool

    cluster = config.load(d / "cluster.toml")

    async def ask() -> int | None:
        async with trio.open_nursery() as nursery:
            pool = Pool(nursery, [s.address for s in cluster.meta_replicas[shard]],
                        cluster.secret, role="meta", retry_for=0.0)
            try:
                for j in range(len(pool)):
                    try:
                        s = R.REPL_STATUS.decode(await pool.call(
                            j, R.REPL_STATUS, R.StatusReq(shard), timeout=1.0))
                    except JPFSError:
                        continue
                    if s.role == "leader":
                        return j
                return None
            finally:
                pool.close()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = trio.run(ask)
        if j is not None:
            return j
        time.sleep(0.1)
    raise RuntimeError(f"shard {shard} elected no leader within {timeout:.0f} s")


def run_failover(args: argparse.Namespace) -> dict:
    """Seconds from a leader's SIGKILL to the first create answered after it, per kill."""
    import trio

    from jpfs import config, localcluster
    from jpfs.client.wire import MetaClient

    kills = _opt(args, "kills", 5)
    times: list[float] = []
    with temporary_cluster(1, 1, etcd=True, meta_replicas=3) as d:
        cluster = config.load(d / "cluster.toml")

        async def first_create_after(kill, tag: int) -> float:
            async with trio.open_nursery() as nursery:
                meta = MetaClient(nursery, cluster)
                top = (await meta.mkdir(1, f"k{tag}".encode())).attr
                for i in range(20):  # a warm client that knows the leader
                    await meta.create(top.ino, f"warm-{i}".encode(), 0o644)
                t0 = time.monotonic()
                await trio.to_thread.run_sync(kill)
                n = 0
                while True:
                    try:
                        await meta.create(top.ino, f"after-{n}".encode(), 0o644)
                        break
                    except OSError:
                        n += 1
                        await trio.sleep(0.01)
                dt = time.monotonic() - t0
                meta.close()
                nursery.cancel_scope.cancel()
            return dt

        for k in range(kills):
            victim = _leader(d)

            def kill(victim: int = victim) -> None:
                localcluster.stop(d, "meta", 0, sig=signal.SIGKILL, replica=victim)

            times.append(trio.run(first_create_after, kill, k))
            localcluster.start(d, "meta", 0, replica=victim)
            time.sleep(1.0)  # caught up before the next kill
    out = {"kills": kills, "seconds": [round(t, 3) for t in times],
           "median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
           "lease_ttl_s": 5.0, "renew_s": 1.0}
    print_table(["kills", "median", "max", "each"],
                [[kills, f"{out['median_s']:.2f} s", f"{out['max_s']:.2f} s",
                  " ".join(f"{t:.2f}" for t in times)]],
                title="failover: SIGKILL of a shard leader -> first create answered")
    return out


def _rates(d: Path, files: int, inflight: int, tag: str) -> dict:
    import trio

    from jpfs import config
    from jpfs.client.wire import MetaClient

    cluster = config.load(d / "cluster.toml")

    async def main() -> dict:
        async with trio.open_nursery() as nursery:
            meta = MetaClient(nursery, cluster)
            for _ in range(100):  # the leader may still be being elected
                try:
                    top = (await meta.mkdir(1, tag.encode())).attr
                    break
                except OSError:
                    await trio.sleep(0.1)
            names = [f"f{i:06d}".encode() for i in range(files)]
            inos: list[int] = [0] * files

            async def creates(k: int) -> None:
                for i in range(k, files, inflight):
                    attr, _ = await meta.create(top.ino, names[i], 0o644)
                    inos[i] = attr.ino

            async def stats(k: int) -> None:
                for i in range(k, files, inflight):
                    await meta.getattr(inos[i])

            result = {}
            for phase, fn in (("create", creates), ("stat", stats)):
                t0 = time.perf_counter()
                async with trio.open_nursery() as inner:
                    for k in range(inflight):
                        inner.start_soon(fn, k)
                result[phase] = files / (time.perf_counter() - t0)
            meta.close()
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


def run_replication(args: argparse.Namespace) -> dict:
    """Creates/s and stats/s with one copy per shard and with three, in the same run: both
    clusters up at once, measured in turn ``--rounds`` times (medians: this machine is shared,
    and one measurement of each drifts with whatever else runs)."""
    files = _opt(args, "files", 3000)
    inflight = _opt(args, "inflight", 16)
    rounds = _opt(args, "rounds", 3)
    runs: dict[int, list[dict]] = {1: [], 3: []}
    with temporary_cluster(1, 1, etcd=True, meta_replicas=1) as one, \
            temporary_cluster(1, 1, etcd=True, meta_replicas=3) as three:
        for r in range(rounds):
            for copies, d in ((1, one), (3, three)):
                runs[copies].append(_rates(d, files, inflight, f"r{r}"))
    got = {c: {k: statistics.median(x[k] for x in runs[c]) for k in ("create", "stat")}
           for c in runs}
    out = {"files": files, "inflight": inflight, "rounds": rounds,
           "one_copy": {k: round(v) for k, v in got[1].items()},
           "three_copies": {k: round(v) for k, v in got[3].items()},
           "ratio": {k: round(ratio(got[3][k], got[1][k]) or 0.0, 3) for k in got[1]},
           "each": {str(c): [{k: round(v) for k, v in x.items()} for x in runs[c]]
                    for c in runs}}
    print_table(["phase", "1 copy", "3 copies", "3 / 1"],
                [[k, fmt_rate(got[1][k]), fmt_rate(got[3][k]),
                  fmt_ratio(ratio(got[3][k], got[1][k]))] for k in ("create", "stat")],
                title=f"metadata replication: {files} files, {inflight} in flight, 1 shard, "
                      f"median of {rounds} alternating rounds")
    return out


def run(args: argparse.Namespace) -> dict:
    """Both metadata phases: ``failover`` and ``replication``."""
    return {"failover": run_failover(args), "replication": run_replication(args)}


if __name__ == "__main__":
    import sys

    from .runner import standalone

    sys.exit(standalone(sys.modules[__name__], "heal_meta"))
