"""``jpfs bench meta``: metadata operations per second, mdtest style.

C client processes create, stat (one call at a time, and batched), list (readdirplus) and remove
files, in a private directory each and then all in one shared directory, against clusters of 1,
2 and 4 metadata shards. The same phases run in the same run on the local filesystem (plain os
calls on a temporary directory) as the baseline.

JPFS creates are durable (group-committed, fsynced LMDB transactions); local creates are not
fsynced. Clients keep ``--inflight`` calls in flight each (what a parallel importer or a mount
serving many processes does). "stat" is one call at a time per client, "stat_inflight" the same
unbatched calls with ``--inflight`` of them in flight, "stat_batched" 100 names per call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time

from .harness import Phase, fmt_rate, fmt_ratio, print_table, ratio, temporary_cluster

HELP = "metadata ops/s (create, stat, list, remove) against 1, 2, 4 shards and the local fs"
DESCRIPTION = __doc__
PHASES = ("create", "stat", "stat_inflight", "stat_batched", "list", "remove")
BATCH = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", default="1,2,4", help="shard counts to measure (default 1,2,4)")
    p.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--files", type=int, default=2000, help="files per client (default 2000)")
    p.add_argument("--inflight", type=int, default=16,
                   help="calls in flight per client for create and remove (default 16)")
    p.add_argument("--no-sync", action="store_true", help="shards skip fsync")
    p.add_argument("--no-local", action="store_true", help="skip the local baseline")


# ---- client processes ------------------------------------------------------------------------

def _jpfs_client(cluster_dir: str, idx: int, directory: str, n: int, inflight: int, barrier,
                 out) -> None:
    import trio

    import jpfs

    async def run_all() -> dict:
        res: dict[str, tuple] = {}
        async with jpfs.aconnect(cluster_dir, dir_cache_ttl=600) as c:
            parent = (await c.stat(directory)).ino
            names = [f"f{idx}-{i:07d}".encode() for i in range(n)]

            async def parallel(fn, items, width):
                it = iter(items)

                async def worker():
                    for x in it:
                        await fn(x)

                async with trio.open_nursery() as nursery:
                    for _ in range(width):
                        nursery.start_soon(worker)

            async def phase(name, coro_fn, ops):
                await trio.to_thread.run_sync(barrier.wait)
                t0 = time.time()
                got = await coro_fn()
                res[name] = (got if got is not None else ops, t0, time.time())

            await phase("create", lambda: parallel(
                lambda nm: c.meta.create(parent, nm, 0o100644), names, inflight), n)
            await phase("stat", lambda: parallel(lambda nm: c.meta.lookup(parent, nm), names, 1),
                        n)
            await phase("stat_inflight", lambda: parallel(
                lambda nm: c.meta.lookup(parent, nm), names, inflight), n)

            async def batched():
                for i in range(0, n, BATCH):
                    await c.meta.batch_lookup(parent, names[i:i + BATCH])

            await phase("stat_batched", batched, n)

            async def listing():
                count = 0
                async for _ in c.meta.readdir(parent, plus=True, page=1000):
                    count += 1
                return count

            await phase("list", listing, n)
            await phase("remove", lambda: parallel(lambda nm: c.meta.unlink(parent, nm), names,
                                                   inflight), n)
        return res

    out.put((idx, trio.run(run_all)))


def _local_client(directory: str, idx: int, _unused: str, n: int, _inflight: int, barrier,
                  out) -> None:
    names = [os.path.join(directory, f"f{idx}-{i:07d}") for i in range(n)]
    res: dict[str, tuple] = {}

    def phase(name, fn):
        barrier.wait()
        t0 = time.time()
        got = fn()
        res[name] = (got if got is not None else n, t0, time.time())

    def create():
        for p in names:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

    def stat():
        for p in names:
            os.stat(p)

    def listing():
        count = 0
        with os.scandir(directory) as it:
            for e in it:
                e.stat()
                count += 1
        return count

    def remove():
        for p in names:
            os.unlink(p)

    phase("create", create)
    phase("stat", stat)
    phase("stat_inflight", stat)  # local calls do not overlap: the same calls again
    phase("stat_batched", stat)  # no batched stat locally: the same calls again
    phase("list", listing)
    phase("remove", remove)
    out.put((idx, res))


def _run_clients(target, base: str, dirs: list[str], n: int, inflight: int) -> dict[str, Phase]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(dirs))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(base, i, d, n, inflight, barrier, out))
             for i, d in enumerate(dirs)]
    for p in procs:
        p.start()
    results = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a benchmark client failed (exit status {p.exitcode})")
    phases = {name: Phase() for name in PHASES}
    for _, res in results:
        for name, (ops, t0, t1) in res.items():
            phases[name].add(ops, t0, t1)
    return phases


# ---- the benchmark ---------------------------------------------------------------------------

def _measure_jpfs(shards: int, args) -> dict[str, dict[str, Phase]]:
    import jpfs

    with temporary_cluster(shards, 0, sync=not args.no_sync) as d:
        c = jpfs.connect(d)
        try:
            private = [f"/bench/c{i}" for i in range(args.clients)]
            for p in private:
                c.makedirs(p)
            c.makedirs("/bench/shared")
        finally:
            c.close()
        return {
            "private": _run_clients(_jpfs_client, str(d), private, args.files, args.inflight),
            "shared": _run_clients(_jpfs_client, str(d), ["/bench/shared"] * args.clients,
                                   args.files, args.inflight),
        }


def _measure_local(args) -> dict[str, dict[str, Phase]]:
    root = tempfile.mkdtemp(prefix="jpfs-bench-local-")
    try:
        out = {}
        for layout in ("private", "shared"):
            dirs = [os.path.join(root, layout, f"c{i}" if layout == "private" else "shared")
                    for i in range(args.clients)]
            for d in dirs:
                os.makedirs(d, exist_ok=True)
            # the local client works in the directory it is given
            out[layout] = _run_clients(_local_client_in_dir, "", dirs, args.files, 0)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _local_client_in_dir(_base, idx, directory, n, inflight, barrier, out) -> None:
    _local_client(directory, idx, "", n, inflight, barrier, out)


def run(args: argparse.Namespace) -> dict:
    shard_counts = [int(x) for x in args.shards.split(",") if x]
    print(f"jpfs bench meta: {args.clients} clients x {args.files} files, "
          f"{args.inflight} in flight for create/remove, shards {shard_counts}", flush=True)
    local = None if args.no_local else _measure_local(args)
    results: dict = {"clients": args.clients, "files_per_client": args.files,
                     "inflight": args.inflight, "sync": not args.no_sync, "configs": {}}
    if local:
        results["local"] = {lay: {ph: round(v.rate) for ph, v in phs.items()}
                            for lay, phs in local.items()}
    for shards in shard_counts:
        print(f"  measuring {shards} shard(s)...", flush=True)
        got = _measure_jpfs(shards, args)
        results["configs"][str(shards)] = {
            lay: {ph: {"ops_per_s": round(v.rate),
                       "ratio_vs_local": ratio(v.rate, local[lay][ph].rate) if local else None}
                  for ph, v in phs.items()}
            for lay, phs in got.items()}
    for layout in ("private", "shared"):
        rows = []
        for ph in PHASES:
            row = [ph, fmt_rate(local[layout][ph].rate) if local else "-"]
            for shards in shard_counts:
                r = results["configs"][str(shards)][layout][ph]
                row.append(f"{fmt_rate(r['ops_per_s'])} ({fmt_ratio(r['ratio_vs_local'])})")
            rows.append(row)
        print_table(["phase", "local"] + [f"{s} shard(s)" for s in shard_counts], rows,
                    title=f"{layout} directories: ops/s (ratio to local)")
    return results
