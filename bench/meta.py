"""``jpfs bench meta``: metadata operations per second, mdtest style.

C client processes create, stat (one call at a time, and batched), list (readdirplus) and remove
files, in a private directory each and then all in one shared directory, against clusters of 1,
2 and 4 metadata shards. The same phases run in the same run on the local filesystem (plain os
calls on a temporary directory) as the baseline.

JPFS creates are durable within one shared fsync (answered once committed; the shard's syncer
fsyncs behind them, and ``sync`` waits for it); local creates are not fsynced. Clients keep
``--inflight`` calls in flight each (what a parallel importer or a mount serving many processes
does). "stat" is one call at a time per client, "stat_inflight" the same
unbatched calls with ``--inflight`` of them in flight, "stat_batched" 100 names per call.

Last, one shard's ceiling: creates and lookups from a client that costs next to nothing
(pre-encoded frames on a blocking socket, many in flight). On this 2-core machine the client
processes above share the CPUs with the shards; the ceiling is what one shard serves when its
clients run on other machines, with the shard's CPU time per operation.
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
    """The options of ``jpfs bench meta``."""
    p.add_argument("--shards", default="1,2,4", help="shard counts to measure (default 1,2,4)")
    p.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--files", type=int, default=2000, help="files per client (default 2000)")
    p.add_argument("--inflight", type=int, default=16,
                   help="calls in flight per client for create and remove (default 16)")
    p.add_argument("--no-sync", action="store_true", help="shards skip fsync")
    p.add_argument("--no-local", action="store_true", help="skip the local baseline")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the ceiling of one shard driven by a pipelined raw-frame client")
    p.add_argument("--ceiling-inflight", type=int, default=256,
                   help="requests in flight for the ceiling, as from many client nodes "
                        "(default 256)")


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


# ---- the shard's own ceiling --------------------------------------------------------------------

def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive_pipelined(address: str, secret: bytes, frames: list[bytes], window: int) -> float:
    """Send pre-encoded request frames with ``window`` in flight over one blocking socket and
    count the answers (all must be RESPONSE frames); returns the seconds it took."""
    import socket

    import trio

    from jpfs.config import parse_address
    from jpfs.rpc import frame as F
    from jpfs.rpc.auth import client_handshake

    sock = socket.create_connection(parse_address(address))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        trio.run(client_handshake, F.FrameSocket(sock), secret)
        sock.setblocking(True)
        n, sent, got, buf = len(frames), 0, 0, bytearray()
        t0 = time.perf_counter()
        while got < n:
            if sent < n and sent - got < window:
                k = min(n, got + window) - sent
                sock.sendall(b"".join(frames[sent:sent + k]))
                sent += k
            data = sock.recv(1 << 20)
            if not data:
                raise RuntimeError("the shard closed the connection")
            buf += data
            pos = 0
            while len(buf) - pos >= F.HEADER_SIZE:
                _, _, kind, body_len, payload_len = F.HEADER.unpack_from(buf, pos)
                end = pos + F.HEADER_SIZE + body_len + payload_len
                if end > len(buf):
                    break
                if kind != F.RESPONSE:
                    raise RuntimeError(f"request failed: {F.unpack_body(buf[pos + 16:end])}")
                pos, got = end, got + 1
            del buf[:pos]
        return time.perf_counter() - t0
    finally:
        sock.close()


def _ceiling(args) -> dict[str, dict]:
    """One shard driven by a client that costs next to nothing (pre-encoded frames, a blocking
    socket, ``--ceiling-inflight`` requests in flight, as from many client nodes): what one
    shard serves when its clients run on other machines, and the shard's CPU per request."""
    import jpfs
    from jpfs import config, localcluster
    from jpfs.proto.meta import METHODS
    from jpfs.rpc import frame as F

    n = max(args.files * args.clients * 2, 10_000)
    window = args.ceiling_inflight
    with temporary_cluster(1, 0, sync=not args.no_sync) as d:
        c = jpfs.connect(d)
        try:
            c.makedirs("/bench/ceiling")
            parent = c.stat("/bench/ceiling").ino
        finally:
            c.close()
        cluster = config.load(localcluster.cluster_file(d))
        pid = next(x.pid for x in localcluster.status(d) if x.role == "meta")

        def frame(i: int, method: str, args_: list) -> bytes:
            assert METHODS[method].check(args_) is args_
            return b"".join(bytes(p) for p in F.FrameSocket.frame_parts(
                F.REQUEST, [i + 1, method, args_, None]))

        work = {
            "create": [frame(i, "create", [parent, b"c%08d" % i, 0o100644, 0, 0, True])
                       for i in range(n)],
            "stat": [frame(i, "lookup", [parent, b"c%08d" % i]) for i in range(n)],
        }
        out = {}
        for phase, frames in work.items():
            cpu0 = _cpu_seconds(pid)
            seconds = drive_pipelined(cluster.meta[0].address, cluster.secret, frames, window)
            out[phase] = {"ops_per_s": round(n / seconds),
                          "shard_cpu_us_per_op": round((_cpu_seconds(pid) - cpu0) / n * 1e6, 1)}
        return out


def run(args: argparse.Namespace) -> dict:
    """Run ``jpfs bench meta`` for each shard count (and the local baseline): print the report,
    return the figures."""
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
    if not args.no_ceiling:
        print("  measuring one shard's ceiling...", flush=True)
        ceiling = _ceiling(args)
        rows = []
        for phase, r in ceiling.items():
            base = local["private"][phase].rate if local else None
            r["ratio_vs_local"] = ratio(r["ops_per_s"], base) if base else None
            rows.append([phase, fmt_rate(base) if base else "-",
                         f"{fmt_rate(r['ops_per_s'])} ({fmt_ratio(r['ratio_vs_local'])})",
                         f"{r['shard_cpu_us_per_op']} us"])
        print_table(["phase", "local", "1 shard", "shard CPU per op"], rows,
                    title=f"one shard's ceiling ({args.ceiling_inflight} requests in flight from "
                          "a client that costs next to nothing)")
        results["ceiling"] = dict(ceiling, inflight=args.ceiling_inflight)
    return results
