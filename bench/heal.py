"""``jpfs bench heal``: what healing costs and how fast it goes, each beside its baseline.

Phase ``repair`` (storage): a cluster with a map in etcd, 2 shards, 3 storage nodes, replicas 2,
``--size`` bytes of 1 MiB files. First, one copy step measured both ways on the same blobs: a
node pulling blobs from another itself (``pull_blobs``, what the healers use) against a relay
through a third process (``get_blobs`` there, ``put_blobs`` on), the design the healer did not
take. Then a storage node is killed and the foreground reads (``read_many`` of 32 files in a
loop, one client) are measured with the node dead but not yet removed (no repair runs: a down
node's copies still count), then ``remove``d while the same reads go on: the healers restore
every chunk to 2 copies at ``--heal-rate`` each, and the figures are the repair's bandwidth
(bytes the healers copied over the time until every shard reports nothing under-replicated) and
the foreground read rate during it, as a ratio to the rate without repair.

Phases ``failover`` and ``replication`` (metadata) are ``bench/heal_meta.py``'s: the time from a
shard leader's kill to the first create answered, and creates/stats with one copy per shard
against three.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time

from jpfs.config import parse_size

from .harness import arg_type, fmt_ratio, print_table, ratio, temporary_cluster

try:
    from . import heal_meta
except ImportError:  # written by another change; the metadata phases are skipped without it
    heal_meta = None  # type: ignore[assignment]

HELP = "repair bandwidth and foreground reads during repair; metadata failover and replication"
DESCRIPTION = __doc__
PHASES = ("repair", "failover", "replication")
MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench heal``."""
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"which phases, comma-separated (default {','.join(PHASES)})")
    p.add_argument("--size", type=arg_type(parse_size), default=192 * MiB,
                   help="bytes of file data for the repair phase (default 192MiB)")
    p.add_argument("--seconds", type=float, default=5.0,
                   help="foreground read time without repair (default 5)")
    p.add_argument("--heal-rate", default="64MiB",
                   help="each shard's healer rate (jpfs-meta --heal-rate; default 64MiB)")
    p.add_argument("--copy-size", type=arg_type(parse_size), default=64 * MiB,
                   help="bytes copied node to node and relayed, each (default 64MiB)")
    if heal_meta is not None:
        heal_meta.add_arguments(p)


def _mib(x: float) -> str:
    return f"{x / MiB:,.1f}"


# ---- node to node against a relay --------------------------------------------------------------


def _copy_compare(d, nbytes: int) -> dict:
    """Seconds to copy ``nbytes`` of 1 MiB blobs from node 0: pulled by node 1, relayed to 2."""
    import trio
    import xxhash

    from jpfs import config
    from jpfs.proto import storage as S
    from jpfs.rpc import Pool

    cluster = config.load(d)
    blobs = [(os.urandom(16), os.urandom(MiB)) for _ in range(max(1, nbytes // MiB))]
    entries = [[bid, len(b), xxhash.xxh3_64_intdigest(b)] for bid, b in blobs]
    per = 16

    async def main() -> dict:
        async with trio.open_nursery() as nursery:
            pool = Pool(nursery, [s.address for s in cluster.storage], cluster.secret,
                        role="storage", timeout=300.0)
            for k in range(0, len(blobs), per):
                await pool.call(0, S.PUT_BLOBS, S.PutBlobsReq(entries[k:k + per]),
                                [b for _, b in blobs[k:k + per]])
            source = cluster.storage[0].address
            limiter = trio.CapacityLimiter(2)

            async def pull(k: int) -> None:
                async with limiter:
                    await pool.call(1, S.PULL_BLOBS, S.PullBlobsReq(source, entries[k:k + per]))

            async def relay(k: int) -> None:
                async with limiter:
                    ids = [e[0] for e in entries[k:k + per]]
                    _, payload = await pool.call_payload(0, S.GET_BLOBS, S.IdsReq(ids))
                    data = payload if not isinstance(payload, list) else b"".join(payload)
                    await pool.call(2, S.PUT_BLOBS, S.PutBlobsReq(entries[k:k + per]),
                                    [data if data is not None else b""])

            out = {}
            for name, fn in (("pull", pull), ("relay", relay)):
                t0 = time.monotonic()
                async with trio.open_nursery() as inner:
                    for k in range(0, len(blobs), per):
                        inner.start_soon(fn, k)
                out[name] = time.monotonic() - t0
            for node in range(3):
                await pool.call(node, S.DELETE_BLOBS, S.IdsReq([e[0] for e in entries]))
            pool.close()
            return out

    secs = trio.run(main)
    total = len(blobs) * MiB
    return {"bytes": total, "pull_s": secs["pull"], "relay_s": secs["relay"],
            "pull_bytes_per_s": total / secs["pull"], "relay_bytes_per_s": total / secs["relay"]}


# ---- the repair phase --------------------------------------------------------------------------


class _Reader(threading.Thread):
    """``read_many`` of 32 files at a time, round and round; bytes per window on demand."""

    def __init__(self, client, paths: list[str]):
        super().__init__(daemon=True)
        self.client, self.paths = client, paths
        self.bytes = 0
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        k = 0
        while not self.stop.is_set():
            batch = [self.paths[(k + i) % len(self.paths)] for i in range(32)]
            k += 32
            try:
                self.bytes += sum(len(b) for b in self.client.read_many(batch))
            except OSError:
                self.failures += 1

    def window(self, until) -> tuple[float, float]:
        """(bytes/s, seconds) from now until ``until()`` is true."""
        b0, t0 = self.bytes, time.monotonic()
        while not until():
            time.sleep(0.05)
        dt = time.monotonic() - t0
        return (self.bytes - b0) / dt if dt > 0 else 0.0, dt


def run_repair(args: argparse.Namespace) -> dict:
    """The repair phase: foreground read rates with and without the healer re-replicating a lost
    node's chunks, and the time it takes."""
    import jpfs
    from jpfs import localcluster
    from jpfs.client.tools import answered, heal_status
    from jpfs.coord.clustermap import update_map_sync

    size = getattr(args, "size", 192 * MiB)
    seconds = getattr(args, "seconds", 5.0)
    rate = getattr(args, "heal_rate", "64MiB")
    with temporary_cluster(2, 3, etcd=True, replicas=2, chunk_size=MiB, sync=False,
                           extra_args={"meta": ["--heal-interval", "1", "--heal-rate", rate],
                                       "storage": ["--scrub-rate", "0"]}) as d:
        copy = _copy_compare(d, getattr(args, "copy_size", 64 * MiB))
        c = jpfs.connect(d)
        try:
            paths = [f"/r/d{i % 16:02d}/f{i:05d}" for i in range(max(32, size // MiB))]
            for k in range(16):
                c.makedirs(f"/r/d{k:02d}")
            for p in paths:
                c.write_bytes(p, os.urandom(MiB))
            reader = _Reader(c, paths)
            reader.start()
            time.sleep(1.0)  # warm: the client's connections, the page cache
            localcluster.kill(d, "storage", 2)
            time.sleep(0.5)
            end = time.monotonic() + seconds
            base, base_s = reader.window(lambda: time.monotonic() >= end)

            def lost(cur):  # `jpfs node remove 2`
                return dataclasses.replace(cur, storage=tuple(
                    dataclasses.replace(s, state="removed") if i == 2 else s
                    for i, s in enumerate(cur.storage)))

            new = update_map_sync(c.cluster, lost)
            t0 = time.monotonic()
            state: dict = {}

            def healed() -> bool:
                if time.monotonic() - state.get("at", 0.0) < 0.25:
                    return False
                state["at"] = time.monotonic()
                s = c.run(heal_status)
                state["s"] = s
                return all(not x.error and x.round_epoch >= new.epoch
                           and x.under_replicated == 0 and x.pending == 0
                           for x in answered(s)) and len(answered(s)) == len(s)

            during, _ = reader.window(healed)
            took = time.monotonic() - t0
            reader.stop.set()
            reader.join(30)
            repaired = sum(x.repaired_bytes for x in answered(state["s"]))
        finally:
            c.close()
    out = {"files": len(paths), "bytes": len(paths) * MiB, "heal_rate": rate,
           "repaired_bytes": repaired, "repair_seconds": took,
           "repair_bytes_per_s": repaired / took if took else 0.0,
           "read_bytes_per_s_without_repair": base, "read_seconds_without_repair": base_s,
           "read_bytes_per_s_during_repair": during,
           "read_ratio": ratio(during, base), "read_failures": reader.failures, "copy": copy}
    print_table(["figure", "MiB/s", "ratio"], [
        ["copy: node pulls from node", _mib(copy["pull_bytes_per_s"]),
         fmt_ratio(ratio(copy["pull_bytes_per_s"], copy["relay_bytes_per_s"]))],
        ["copy: relayed by a third process", _mib(copy["relay_bytes_per_s"]), "1.00x"],
        ["repair (2 shards' healers)", _mib(out["repair_bytes_per_s"]), "-"],
        ["foreground reads, no repair", _mib(base), "1.00x"],
        ["foreground reads during repair", _mib(during), fmt_ratio(out["read_ratio"])],
    ], title=f"storage repair: {len(paths)} files of 1 MiB, replicas 2, a node lost; "
             f"{_mib(repaired)} MiB restored in {took:.1f} s at --heal-rate {rate} per shard; "
             f"{reader.failures} failed foreground reads")
    return out


def run(args: argparse.Namespace) -> dict:
    """Run ``jpfs bench heal``'s phases (``--phases``); their figures by phase. ValueError for an
    unknown phase."""
    phases = [p.strip() for p in getattr(args, "phases", ",".join(PHASES)).split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phases {unknown} (choose from {', '.join(PHASES)})")
    out: dict = {}
    if "repair" in phases:
        out["repair"] = run_repair(args)
    for name in ("failover", "replication"):
        if name not in phases:
            continue
        fn = getattr(heal_meta, f"run_{name}", None) if heal_meta is not None else None
        if fn is None:
            print(f"phase {name}: skipped (bench/heal_meta.py with run_{name} is not there)")
            out[name] = {"skipped": "bench/heal_meta.py is not there"}
            continue
        out[name] = fn(args)
    return out


if __name__ == "__main__":
    import sys

    from .runner import standalone

    sys.exit(standalone(sys.modules[__name__], "heal"))
