"""Storage server micro-benchmark: batched blob reads against plain loopback sendfile.

Run by hand (not a test)::

    python -m jpfs_bench.storage_micro [--big 64] [--small 20000] [--rounds 3]
    python -m jpfs_bench.storage_micro --cold [--small 5000]

It starts one ``jpfs-storage`` process on loopback (``--fsync never``: only reads are timed), and
a baseline process that streams a file of the same total size with ``socket.sendfile`` to a
client doing ``recv_into`` on a 1 MiB buffer. Everything is warm (page cache). Figures are
medians of ``--rounds`` runs; each workload reports its ratio to the baseline of the same run,
and the CPU seconds per GB that the client (this process, all threads: receiving, verifying
checksums) and the server spent, which move less than wall-clock rates on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from jpfs import config
from jpfs.client.wire import StorageClient
from jpfs.types import Chunk

from .harness import free_port, wait_port

MiB = 1 << 20


# ---------------------------------------------------------------------- the baseline

SENDFILE_SERVER = r"""
import socket, sys
path, port = sys.argv[1], int(sys.argv[2])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port)); ls.listen(8)
while True:
    conn, _ = ls.accept()
    with conn, open(path, "rb") as f:
        if conn.recv(1):
            conn.sendfile(f)
"""


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _my_cpu(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def baseline(path: Path, port: int) -> tuple[float, float]:
    """Seconds and client CPU seconds to receive the whole file over loopback (sendfile ->
    recv_into 1 MiB)."""
    size = path.stat().st_size
    buf = memoryview(bytearray(MiB))
    with socket.create_connection(("127.0.0.1", port)) as s:
        c = _my_cpu(resource.RUSAGE_THREAD)
        t = time.perf_counter()
        s.sendall(b"g")
        got = 0
        while got < size:
            n = s.recv_into(buf)
            if not n:
                raise RuntimeError("baseline stream ended early")
            got += n
        return time.perf_counter() - t, _my_cpu(resource.RUSAGE_THREAD) - c


# ---------------------------------------------------------------------- the storage workloads


async def _put_all(client: StorageClient, sizes: list[int], group: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for k in range(0, len(sizes), group):
        blobs = [(os.urandom(16), (0,), os.urandom(s)) for s in sizes[k:k + group]]
        res = await client.put(blobs)
        chunks += [Chunk(len(chunks) + j, b, nodes, len(d), len(d), xxh)
                   for j, ((b, _, d), (nodes, xxh)) in enumerate(zip(blobs, res, strict=True))]
    return chunks


async def _read_all(client: StorageClient, chunks: list[Chunk], batch: int, tasks: int,
                    into: list[memoryview] | None) -> float:
    """Seconds to read every chunk in batches of ``batch`` with ``tasks`` concurrent callers."""
    batches = [range(k, min(k + batch, len(chunks))) for k in range(0, len(chunks), batch)]
    it = iter(batches)

    async def worker() -> None:
        for r in it:
            part = chunks[r.start:r.stop]
            await client.get(part, into=into[r.start:r.stop] if into is not None else None)

    t = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(tasks):
            n.start_soon(worker)
    return time.perf_counter() - t


WORKLOADS = (
    # name, which blobs, blobs per get() call, concurrent callers, into caller buffers
    ("big_1x1", "big", 1, 1, False),
    ("big_8x2", "big", 8, 2, False),
    ("big_8x2_into", "big", 8, 2, True),
    ("big_16x4_into", "big", 16, 4, True),
    ("small_500x2", "small", 500, 2, False),
    ("small_500x2_into", "small", 500, 2, True),
    ("small_500x4_into", "small", 500, 4, True),
    ("small_50x4", "small", 50, 4, False),
)


async def run_storage(cluster: config.Cluster, args, pids: tuple[int, int], base_port: int,
                      base_file: Path) -> dict:
    """Medians over rounds of: GB/s, blobs/s, and CPU seconds per GB of client and server."""
    server_pid, base_pid = pids
    rng = random.Random(1)
    sizes = {"big": [4 * MiB] * args.big,
             "small": [rng.randint(1 << 10, 64 << 10) for _ in range(args.small)]}
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)

    async with trio.open_nursery() as nursery:
        client = StorageClient(nursery, cluster)
        sets = {"big": await _put_all(client, sizes["big"], 8),
                "small": await _put_all(client, sizes["small"], 200)}
        intos = {k: [memoryview(bytearray(n)) for n in v] for k, v in sizes.items()}
        for k in sets:  # warm everything up once, buffers included
            await _read_all(client, sets[k], 100, 2, intos[k])
        for _ in range(args.rounds):
            size = base_file.stat().st_size
            sc = _proc_cpu(base_pid)
            secs, cc = await trio.to_thread.run_sync(baseline, base_file, base_port)
            sc = _proc_cpu(base_pid) - sc
            add("baseline_GBps", size / secs / 1e9)
            add("baseline_client_s_per_GB", cc / size * 1e9)
            add("baseline_server_s_per_GB", sc / size * 1e9)
            for name, which, batch, tasks, into in WORKLOADS:
                chunks = sets[which]
                nbytes = sum(sizes[which])
                sc, cc = _proc_cpu(server_pid), _my_cpu()
                tc = _my_cpu(resource.RUSAGE_THREAD)
                secs = await _read_all(client, chunks, batch, tasks,
                                       intos[which] if into else None)
                tc = _my_cpu(resource.RUSAGE_THREAD) - tc
                sc, cc = _proc_cpu(server_pid) - sc, _my_cpu() - cc
                add(f"{name}_GBps", nbytes / secs / 1e9)
                add(f"{name}_blobs_per_s", len(chunks) / secs)
                add(f"{name}_client_s_per_GB", cc / nbytes * 1e9)
                add(f"{name}_client_loop_s_per_GB", tc / nbytes * 1e9)
                add(f"{name}_server_s_per_GB", sc / nbytes * 1e9)
        stats = await client.stats(0)
        client.close()
        nursery.cancel_scope.cancel()
    res = {k: statistics.median(v) for k, v in out.items()}
    res["segments_per_blob"] = stats.segments_sent / max(1, stats.blobs_sent)
    res["cold_warmups"] = stats.cold_warmups
    return res


def report(res: dict) -> None:
    """Print the figures against the loopback sendfile baseline."""
    base = res["baseline_GBps"]
    bc, bs = res["baseline_client_s_per_GB"], res["baseline_server_s_per_GB"]
    base_cap = 1 / max(bc, bs)
    print(f"baseline, loopback socket.sendfile -> recv_into 1 MiB: {base:.2f} GB/s; CPU s/GB "
          f"client {bc:.3f} server {bs:.3f}")
    print("CPU s/GB: client (all threads), its event loop thread alone (checksums run in worker "
          "threads), server.\nbound = 1 / max(client, server): the rate with one free core per "
          "process; loop-bound = 1 / max(loop, server): with spare cores for the checksums")
    print(f"{'workload':>17} {'GB/s':>6} {'ratio':>6} {'blobs/s':>8} {'client':>7} {'loop':>6} "
          f"{'server':>7} {'bound':>6} {'ratio':>6} {'loop-bound':>10} {'ratio':>6}")
    for name, *_ in WORKLOADS:
        gb = res[f"{name}_GBps"]
        c, s = res[f"{name}_client_s_per_GB"], res[f"{name}_server_s_per_GB"]
        t = res[f"{name}_client_loop_s_per_GB"]
        cap, tcap = 1 / max(c, s), 1 / max(t, s)
        print(f"{name:>17} {gb:6.2f} {gb / base:5.2f}x {res[name + '_blobs_per_s']:8.0f} "
              f"{c:7.3f} {t:6.3f} {s:7.3f} {cap:6.2f} {cap / base_cap:5.2f}x {tcap:10.2f} "
              f"{tcap / base_cap:5.2f}x")
    print(f"segments per blob sent: {res['segments_per_blob']:.3f}; "
          f"cold warm-ups: {res['cold_warmups']}")


# ---------------------------------------------------------------------- cold reads


def _evict(data_dir: Path) -> None:
    """Drop the volumes' pages from the page cache (clean pages only: fsync first)."""
    for vol in (data_dir / "volumes").iterdir():
        fd = os.open(vol, os.O_RDONLY)
        try:
            os.fsync(fd)
            for _ in range(3):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def _cold_round(cluster: config.Cluster, cold: list[Chunk], hot: list[Chunk],
                      data_dir: Path) -> dict:
    """Cold batched reads (2 tasks) while a third task reads one cached blob at a time."""
    async with trio.open_nursery() as nursery:
        client = StorageClient(nursery, cluster)
        await client.get(hot)
        _evict(data_dir)
        await client.get(hot)  # the hot set is cached again, the rest is not
        lat: list[float] = []
        done = trio.Event()

        async def hot_reader() -> None:
            k = 0
            while not done.is_set():
                t = time.perf_counter()
                await client.get([hot[k % len(hot)]])
                lat.append(time.perf_counter() - t)
                k += 1

        nursery.start_soon(hot_reader)
        t = time.perf_counter()
        await _read_all(client, cold, 100, 2, None)
        wall = time.perf_counter() - t
        done.set()
        await trio.sleep(0)
        stats = await client.stats(0)
        client.close()
        nursery.cancel_scope.cancel()
    lat.sort()
    return {
        "cold_GBps": sum(c.blob_len for c in cold) / wall / 1e9,
        "cold_blobs_per_s": len(cold) / wall,
        "hot_p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan"),
        "hot_p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else float("nan"),
        "hot_max_ms": 1000 * lat[-1] if lat else float("nan"),
        "hot_reads": len(lat),
        "warmups": stats.cold_warmups,
    }


def cold_main(args, work: Path, cluster: config.Cluster) -> dict:
    """Cold reads with the server's worker-thread warm-up against sendfile straight away."""
    rng = random.Random(2)
    data_dir = cluster.data_dir("storage", 0)

    def start(mode: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "jpfs_daemon.storage.server", "--cluster",
                                 str(work / "cluster.toml"), "--index", "0", "--cold-reads", mode,
                                 "--log-file", str(work / "storage-0.log")])
        wait_port("127.0.0.1", cluster.storage[0].host_port[1], proc)
        return proc

    async def fill() -> tuple[list[Chunk], list[Chunk]]:
        async with trio.open_nursery() as nursery:
            client = StorageClient(nursery, cluster)
            cold = await _put_all(client, [rng.randint(1 << 10, 64 << 10)
                                           for _ in range(args.small)], 200)
            hot = await _put_all(client, [4096] * 50, 50)
            client.close()
            nursery.cancel_scope.cancel()
        return cold, hot

    proc = start("warm")
    try:
        cold, hot = trio.run(fill)
    finally:
        proc.terminate()
        proc.wait()
    rng.shuffle(cold)  # training reads in shuffled order: little is adjacent on disk
    out: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for mode in ("warm", "direct"):
            proc = start(mode)
            try:
                r = trio.run(_cold_round, cluster, cold, hot, data_dir)
            finally:
                proc.terminate()
                proc.wait()
            for k, v in r.items():
                out.setdefault(mode, {}).setdefault(k, []).append(v)
    res = {mode: {k: statistics.median(v) for k, v in d.items()} for mode, d in out.items()}
    for mode, r in res.items():
        print(f"cold reads, {mode:>6}: {r['cold_GBps']:.2f} GB/s {r['cold_blobs_per_s']:7.0f} "
              f"blobs/s; a cached blob meanwhile: p50 {r['hot_p50_ms']:.2f} ms, p99 "
              f"{r['hot_p99_ms']:.2f} ms, max {r['hot_max_ms']:.1f} ms ({r['hot_reads']:.0f} "
              f"reads, {r['warmups']:.0f} warm-ups)")
    return res


def main(argv: list[str] | None = None) -> dict:
    """``python -m jpfs_bench.storage_micro``: measure, print the report and return the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--big", type=int, default=64, help="4 MiB blobs (default 64)")
    p.add_argument("--small", type=int, default=20000, help="1-64 KiB blobs (default 20000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", help="work directory (default: a temporary one)")
    p.add_argument("--cold", action="store_true",
                   help="measure cold reads instead: the server's worker-thread warm-up against "
                        "sendfile straight from the event loop")
    args = p.parse_args(argv)
    if args.dir:
        work = Path(args.dir)
        work.mkdir(parents=True, exist_ok=True)
        return _main(args, work)
    with tempfile.TemporaryDirectory(prefix="jpfs-storage-micro-") as tmp:
        return _main(args, Path(tmp))


def _main(args, work: Path) -> dict:
    cfg = config.Cluster(meta=(config.Server(f"127.0.0.1:{free_port()}"),),
                         storage=(config.Server(f"127.0.0.1:{free_port()}", "storage-0"),))
    config.new_secret(work / "secret")
    config.write(cfg, work / "cluster.toml")
    cluster = config.load(work / "cluster.toml")
    if args.cold:
        return cold_main(args, work, cluster)
    base_file = work / "baseline.bin"
    with open(base_file, "wb") as f:  # as many bytes as the big workload reads
        for _ in range(args.big * 4):
            f.write(os.urandom(MiB))
    base_file.read_bytes()  # warm
    base_port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", "jpfs_daemon.storage.server", "--cluster",
                          str(work / "cluster.toml"), "--index", "0", "--fsync", "never",
                          "--log-file", str(work / "storage-0.log")]),
        subprocess.Popen([sys.executable, "-c", SENDFILE_SERVER, str(base_file),
                          str(base_port)]),
    ]
    try:
        wait_port("127.0.0.1", cluster.storage[0].host_port[1], procs[0])
        wait_port("127.0.0.1", base_port, procs[1])
        res = trio.run(run_storage, cluster, args, (procs[0].pid, procs[1].pid), base_port,
                       base_file)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    report(res)
    return res


if __name__ == "__main__":
    main()
