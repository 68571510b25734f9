"""``jpfs bench read``: whole-file reads through the native client against the local filesystem
and the loopback ``sendfile`` rate, warm and cold, in one run.

Two workloads, each read from the local filesystem and from a local cluster it was imported into:

  small  a LeRobot-shaped tree: per episode one ~100 KB parquet and one ~500 KB mp4 at the v2.1
         paths (random bytes: nothing parses them; --dataset reads a real dataset instead),
         read whole in shuffled episode order;
  large  one large file (default 512 MiB), read start to end.

Ways of reading (one process; the native ones keep --inflight calls in flight):

  local          open + readv into a reused buffer (4 MiB pieces for the large file);
  read_many      client.read_many(paths), --batch files per call (what applications call);
  into           the same round trips spelled out (stat_many, batch_layout, storage.get into
                 reused buffers): the read path without an allocation per file;
  open           client.open(path) + readinto a reused 4 MiB buffer (large file);
  chunks         the large file's chunks, 8 per storage call (--inflight at once), into
                 reused buffers.

The baseline of the server-side targets is a loopback stream of the large file with
``socket.sendfile`` into ``recv_into`` of one reused 1 MiB buffer, measured in every round; a
second one ("sendfile arena") receives into successive pieces of a 64 MiB buffer, as a reader
whose bytes must land in memory does (that costs a copy into RAM). Warm figures are medians
of --rounds rounds (everything read once before); cold figures come after ``sync`` and ``echo 3
> /proc/sys/vm/drop_caches`` (one round; reported as not cold where not permitted).
Each row carries the CPU seconds per GB of this process and of the cluster's daemons.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import size_arg
from .readers import (
    Counters,
    Dataset,
    epoch_order,
    interrupt_on_sigterm,
    page_cache_drops,
    proc_cpu,
    read_local,
    read_native,
    scan_dataset,
)

log = logging.getLogger(__name__)

HELP = "whole-file read GB/s and files/s: native client vs local fs vs loopback sendfile"
DESCRIPTION = __doc__ + """
examples:
  jpfs bench read                                   # ~2 GB tree + 512 MiB file, about 2 min
  jpfs bench read --episodes 500 --large 128M --rounds 1 --no-cold
  jpfs bench read --dataset /data/aloha --batch 128
"""
MiB = 1 << 20
JPFS_ROOT = "/bench/read"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench read``."""
    p.add_argument("--dataset", metavar="DIR",
                   help="read this local tree as the small-file workload (default: make one)")
    p.add_argument("--episodes", type=int, default=2000,
                   help="episodes of the made tree (default 2000)")
    p.add_argument("--cameras", type=int, default=1, help="mp4s per episode (default 1)")
    p.add_argument("--parquet-bytes", type=size_arg, default=100 * 1024, metavar="SIZE",
                   help="mean parquet size (default 100K; sizes vary +-30%%)")
    p.add_argument("--video-bytes", type=size_arg, default=500 * 1024, metavar="SIZE",
                   help="mean mp4 size (default 500K; sizes vary +-10%%)")
    p.add_argument("--large", type=size_arg, default=512 * MiB, metavar="SIZE",
                   help="size of the large file (default 512M; 0: skip it)")
    p.add_argument("--batch", type=int, default=64,
                   help="files per native call for the small files (default 64)")
    p.add_argument("--inflight", type=int, default=2,
                   help="native calls in flight (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="warm rounds (default 3)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold round")
    p.add_argument("--storage-nodes", type=int, default=2, help="storage nodes (default 2)")
    p.add_argument("--meta-shards", type=int, default=1, help="metadata shards (default 1)")
    p.add_argument("--seed", type=int, default=0, help="tree and order seed (default 0)")
    p.add_argument("--work", metavar="DIR",
                   help="keep the tree, the large file and the cluster here and reuse them "
                        "(default: a temporary directory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------- the files


def make_tree(root: Path, episodes: int, cameras: int, parquet_bytes: int, video_bytes: int,
              seed: int) -> None:
    """A LeRobot v2.1-shaped tree of random bytes (paths and sizes as the generator makes)."""
    from jpfs.lerobot.layout import CAMERA_NAMES

    rng = random.Random(seed)
    pool = os.urandom(32 * MiB)
    tmp = root.with_name(root.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)

    def put(rel: str, size: int) -> None:
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        off = rng.randrange(0, len(pool) - size) if size < len(pool) else 0
        with open(p, "wb") as f:
            f.write(pool[off:off + size])

    cams = [CAMERA_NAMES[i] if i < len(CAMERA_NAMES) else f"cam_{i}" for i in range(cameras)]
    for e in range(episodes):
        chunk = e // 1000
        put(f"data/chunk-{chunk:03d}/episode_{e:06d}.parquet",
            int(parquet_bytes * rng.uniform(0.7, 1.3)))
        for cam in cams:
            put(f"videos/chunk-{chunk:03d}/observation.images.{cam}/episode_{e:06d}.mp4",
                int(video_bytes * rng.uniform(0.9, 1.1)))
    os.replace(tmp, root)


def make_large(path: Path, size: int) -> None:
    """Write ``size`` random bytes to ``path`` (through a ``.part`` file renamed into place)."""
    tmp = path.with_suffix(".part")
    with open(tmp, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MiB)
            f.write(os.urandom(n))
            left -= n
    os.replace(tmp, path)


# ---------------------------------------------------------------------- baseline


ARENA = 64 * MiB
"""The second baseline receives into a rotating buffer this large: memory a reader keeps."""


def _sendfile_round(path: Path, port: int, server_pid: int, arena: bool = False) -> dict:
    """One loopback stream of ``path``: ``socket.sendfile`` into ``recv_into`` of one reused
    1 MiB buffer (the baseline of the targets: the bytes stay in the CPU cache and are dropped),
    or, with ``arena``, into successive 1 MiB pieces of a 64 MiB buffer (the bytes land in
    memory, as a reader's do)."""
    from .storage_micro import baseline

    size = path.stat().st_size
    sc = proc_cpu(server_pid)
    drops = page_cache_drops()
    secs, cc = _arena_baseline(path, port) if arena else baseline(path, port)
    sc = proc_cpu(server_pid) - sc
    return {"GBps": size / secs / 1e9, "files_per_s": None, "seconds": secs, "bytes": size,
            "files": 1, "client_cpu_s_per_GB": cc / size * 1e9,
            "server_cpu_s_per_GB": sc / size * 1e9,
            "page_cache_dropped_by_others": page_cache_drops() != drops}


def _arena_baseline(path: Path, port: int) -> tuple[float, float]:
    import resource
    import socket

    size = path.stat().st_size
    arena = memoryview(bytearray(ARENA))
    arena[:] = bytes(ARENA)  # touched: no page faults in the timed part
    with socket.create_connection(("127.0.0.1", port)) as s:
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t = time.perf_counter()
        s.sendall(b"g")
        got = off = 0
        while got < size:
            n = s.recv_into(arena[off:off + MiB])
            if not n:
                raise RuntimeError("baseline stream ended early")
            got += n
            off = (off + n) % (ARENA - MiB)
        secs = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
    return secs, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


# ---------------------------------------------------------------------- workloads


def _row(c: Counters, server_cpu: float, files_expected: int, bytes_expected: int) -> dict:
    secs = max(c.end - c.start, 1e-9)
    gb = c.bytes / 1e9
    if c.errors or c.files != files_expected or c.bytes != bytes_expected:
        raise RuntimeError(f"read {c.files} files / {c.bytes} bytes, expected "
                           f"{files_expected} / {bytes_expected}: {c.errors[:5]}")
    return {"GBps": gb / secs, "files_per_s": c.files / secs, "seconds": secs,
            "bytes": c.bytes, "files": c.files,
            "client_cpu_s_per_GB": c.cpu_s / gb if gb else None,
            "server_cpu_s_per_GB": server_cpu / gb if gb else None}


WORKLOADS = (
    # name, data set, how
    ("small local", "small", "local"),
    ("small read_many", "small", "read_many"),
    ("small into", "small", "into"),
    ("large local", "large", "local"),
    ("large open", "large", "open"),
    ("large chunks", "large", "chunks"),
)
COLD = ("small local", "small read_many", "small into", "large local", "large open")


async def _measure(client, name: str, sets: dict, args, daemon_pids: list[int]) -> dict:
    import trio

    _, which, how = next(w for w in WORKLOADS if w[0] == name)
    ds: Dataset = sets[which]
    order = epoch_order(len(ds.units), "shuffled", args.seed, sets["round"])
    units = [ds.units[k] for k in order]
    sizes = [ds.unit_sizes(u) for u in units]
    nfiles, nbytes = sum(map(len, units)), sum(map(sum, sizes))
    srv = sum(proc_cpu(p) for p in daemon_pids)
    drops = page_cache_drops()
    if how == "local":
        c = await trio.to_thread.run_sync(lambda: read_local(ds.root, units, sizes))
    else:
        per_file = max(1.0, nfiles / max(1, len(units)))
        batch = max(1, round(args.batch / per_file)) if which == "small" else 1
        c = await read_native(client, sets["jpfs_" + which], units, sizes,
                              inflight=1 if how == "open" else args.inflight, api=how,
                              batch=batch)
    row = _row(c, sum(proc_cpu(p) for p in daemon_pids) - srv, nfiles, nbytes)
    row["page_cache_dropped_by_others"] = page_cache_drops() != drops
    return row


def run(args: argparse.Namespace) -> dict:
    """Run ``jpfs bench read`` (small and large files, warm and cold, by each path): print the
    report, return the figures."""
    if args.rounds < 1 or args.batch < 1 or args.inflight < 1:
        raise SystemExit("--rounds, --batch and --inflight must be at least 1")
    keep = bool(args.work)
    work = Path(args.work).resolve() if keep else Path(tempfile.mkdtemp(prefix="jpfs-read-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with interrupt_on_sigterm():
            return _run(args, work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> dict:
    import trio
    from tqdm import tqdm

    import jpfs
    from jpfs import localcluster
    from jpfs.client.tools import import_tree

    from .harness import drop_caches, free_port, wait_port
    from .storage_micro import SENDFILE_SERVER

    # ---- files
    if args.dataset:
        tree = Path(args.dataset).resolve()
    else:
        tree = work / (f"tree-{args.episodes}ep-{args.cameras}cam-{args.parquet_bytes}-"
                       f"{args.video_bytes}-s{args.seed}")
        if not tree.is_dir():
            print(f"making a LeRobot-shaped tree of {args.episodes} episodes in {tree}",
                  flush=True)
            make_tree(tree, args.episodes, args.cameras, args.parquet_bytes, args.video_bytes,
                      args.seed)
    small = scan_dataset(tree)
    large_path = work / f"large-{args.large}.bin"
    if args.large and not large_path.exists():
        print(f"making a {args.large / MiB:.0f} MiB file", flush=True)
        make_large(large_path, args.large)
    sets: dict = {"small": small, "round": 0,
                  "jpfs_small": f"{JPFS_ROOT}/{tree.name}", "jpfs_large": JPFS_ROOT}
    if args.large:
        sets["large"] = Dataset(str(work), ((large_path.name,),),
                                {large_path.name: args.large})
    names = [w[0] for w in WORKLOADS if w[1] in sets]
    # the baseline file: the large file, or as many bytes as the tree holds
    base_file = large_path if args.large else work / "baseline.bin"
    if not args.large and not base_file.exists():
        make_large(base_file, min(small.bytes, 512 * MiB))
    # ---- cluster and import
    cdir = work / "cluster"
    localcluster.up(cdir, meta_shards=args.meta_shards, storage_nodes=args.storage_nodes,
                    sync=False)
    port = free_port()
    base = subprocess.Popen([sys.executable, "-c", SENDFILE_SERVER, str(base_file), str(port)],
                            stdin=subprocess.DEVNULL)
    try:
        wait_port("127.0.0.1", port, base)
        daemons = [d.pid for d in localcluster.status(cdir) if d.pid]
        bar = tqdm(total=len(names) * args.rounds + (0 if args.no_cold else len(COLD)),
                   desc="read", unit="run", disable=args.no_progress, leave=False)

        async def main() -> dict:
            out: dict[str, list[dict]] = {}
            cold: dict[str, dict] = {}
            async with jpfs.aconnect(cdir, dir_cache_ttl=3600) as client:
                st = await import_tree(client, tree, sets["jpfs_small"])
                if args.large:
                    try:
                        have = (await client.stat(f"{JPFS_ROOT}/{large_path.name}")).size
                    except FileNotFoundError:
                        have = -1
                    if have != args.large:
                        await client.put(large_path, f"{JPFS_ROOT}/{large_path.name}")
                print(f"cluster: {args.meta_shards} meta shard(s), {args.storage_nodes} "
                      f"storage node(s); imported {st.files} files ({st.skipped} already "
                      f"there)", flush=True)
                for n in names:  # warm everything, connections included
                    await _measure(client, n, sets, args, daemons)
                for r in range(args.rounds):
                    sets["round"] = r + 1
                    b = await trio.to_thread.run_sync(_sendfile_round, base_file, port,
                                                      base.pid)
                    out.setdefault("sendfile", []).append(b)
                    b = await trio.to_thread.run_sync(_sendfile_round, base_file, port,
                                                      base.pid, True)
                    out.setdefault("sendfile arena", []).append(b)
                    for n in names:
                        out.setdefault(n, []).append(await _measure(client, n, sets, args,
                                                                    daemons))
                        bar.update()
                if not args.no_cold:
                    for n in [c for c in COLD if c in names]:
                        how = drop_caches()
                        row = await _measure(client, n, sets, args, daemons)
                        # someone else's drop after ours leaves it cold: no disturbance
                        row["page_cache_dropped_by_others"] = False
                        cold[n] = {**row, "cache": how["method"], "cold": how["cold"]}
                        bar.update()
            return {"warm": {k: _median(v) for k, v in out.items()}, "cold": cold}

        try:
            res = trio.run(main)
        finally:
            bar.close()
    finally:
        base.terminate()
        base.wait()
        localcluster.down(cdir, timeout=10)
    result = {"benchmark": "read", "small": {"files": small.files, "bytes": small.bytes,
                                             "episodes": len(small.units), "root": str(tree)},
              "large_bytes": args.large, "batch": args.batch, "inflight": args.inflight,
              "rounds": args.rounds, "storage_nodes": args.storage_nodes,
              "meta_shards": args.meta_shards, "load_avg": [round(x, 2) for x in
                                                            os.getloadavg()], **res}
    _ratios(result)
    report(result)
    return result


def _median(rows: list[dict]) -> dict:
    """Medians over rounds, of the rounds no other process disturbed when there are any."""
    clean = [r for r in rows if not r.get("page_cache_dropped_by_others")]
    use = clean or rows
    out: dict = {}
    for k in rows[0]:
        if k == "page_cache_dropped_by_others":
            continue
        vals = [r[k] for r in use if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    out["rounds"] = len(use)
    out["page_cache_dropped_by_others"] = not clean
    return out


def _ratios(result: dict) -> None:
    warm, cold = result["warm"], result["cold"]
    send = warm["sendfile"]["GBps"]
    for table in (warm, cold):
        for name, r in table.items():
            if name.startswith("sendfile"):
                r["vs_sendfile"] = r["GBps"] / send if send else None
                continue
            which = name.split()[0]
            local = table.get(f"{which} local")
            r["vs_local_GBps"] = r["GBps"] / local["GBps"] if local and local["GBps"] else None
            r["vs_local_files"] = (r["files_per_s"] / local["files_per_s"]
                                   if local and local["files_per_s"] else None)
            r["vs_sendfile"] = r["GBps"] / send if send else None

    def best(table: dict, names: tuple[str, ...], key: str) -> tuple[str | None, float | None]:
        got = [(n, table[n][key]) for n in names if n in table and table[n][key] is not None]
        return max(got, key=lambda x: x[1]) if got else (None, None)

    arena = warm.get("sendfile arena", {}).get("GBps")
    t: dict = {}
    for key, names in (("warm_small_native_vs_sendfile", ("small read_many", "small into")),
                       ("warm_large_native_vs_sendfile", ("large open", "large chunks"))):
        n, v = best(warm, names, "vs_sendfile")
        t[key] = {"value": v, "target": 0.8, "via": n,
                  "vs_sendfile_arena": warm[n]["GBps"] / arena if n and arena else None}
    n, v = best(cold, ("small read_many", "small into"), "vs_local_files")
    t["cold_small_native_files_vs_local"] = {"value": v, "target": 1.5, "via": n}
    for x in t.values():
        x["met"] = None if x["value"] is None else x["value"] >= x["target"]
    result["targets"] = t


def report(result: dict) -> None:
    """Print the result as tables, warm and cold."""
    from .harness import fmt_rate, print_table

    def f(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
        return "-" if x is None else f"{x:{spec}}{suffix}"

    rows = []
    for state in ("warm", "cold"):
        for name, r in result[state].items():
            label = state if state == "warm" or r.get("cold") else "not cold"
            if r.get("page_cache_dropped_by_others"):
                label += "*"
            rows.append([name, label,
                         f(r["GBps"]), "-" if r["files_per_s"] is None
                         else fmt_rate(r["files_per_s"]),
                         f(r.get("vs_local_GBps"), ".2f", "x"),
                         f(r.get("vs_sendfile"), ".2f", "x"),
                         f(r["client_cpu_s_per_GB"], ".3f"), f(r["server_cpu_s_per_GB"], ".3f")])
    s = result["small"]
    print()
    print_table(["workload", "cache", "GB/s", "files/s", "vs local", "vs sendfile",
                 "CPU s/GB cli", "srv"], rows,
                title=f"whole-file reads: {s['files']} small files ({s['bytes'] / 1e9:.2f} GB), "
                f"{result['large_bytes'] / MiB:.0f} MiB large file; batch {result['batch']} "
                f"files, {result['inflight']} in flight; warm = median of {result['rounds']}; "
                f"load {result['load_avg']}")
    if any(r.get("page_cache_dropped_by_others") for r in result["warm"].values()):
        print("* every round of this workload had the page cache dropped by another process "
              "(shared machine): not a warm figure")
    cold = {r.get("cache") for r in result["cold"].values()}
    if cold:
        print("cold: " + "; ".join(sorted(c for c in cold if c)))
    print("targets:")
    labels = {"warm_small_native_vs_sendfile": "warm small-file native GB/s vs sendfile",
              "warm_large_native_vs_sendfile": "warm large-file native GB/s vs sendfile",
              "cold_small_native_files_vs_local": "cold small-file native files/s vs local"}
    for k, t in result["targets"].items():
        if t["value"] is None:
            print(f"  {labels[k]}: not measured")
            continue
        extra = (f"; {t['vs_sendfile_arena']:.2f}x of sendfile into a 64 MiB buffer"
                 if t.get("vs_sendfile_arena") else "")
        print(f"  {labels[k]}: {t['value']:.2f}x ({t['via']}; target >= {t['target']}x: "
              f"{'met' if t['met'] else 'NOT met'}{extra})")


def main(argv: list[str] | None = None) -> int:
    """``python -m jpfs_bench.read`` (what torchrun can start without the jpfs script)."""
    from .runner import standalone

    return standalone(sys.modules[__name__], "read", argv)


if __name__ == "__main__":
    raise SystemExit(main())

