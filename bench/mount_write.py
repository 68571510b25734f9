"""``jpfs bench mount`` phases beyond whole-file reads: writes, namespace changes, large files.

``namespace`` (2 processes by default, each in its own directory, started together): file
creates (``open(O_CREAT|O_EXCL)`` + ``close``), directory creates, stats, renames, file removes,
directory removes; then ``cp -r``-like small-file writes (each file written whole, then closed)
and small files laid out in 4 KiB writes. ``large``: one large file read sequentially in 1 MiB
reads, and many small files read in 4 KiB reads, page cache dropped before each. Each figure is
measured on the local filesystem and through a read-write mount in the same run, the large
phase's reads also through a read-only mount (no OPEN: its READs open files); ops/s and the
ratio are reported. Both phases also run through a naive pyfuse3 passthrough of a local
directory (``passthrough.py``; for the large phase, of the local copy of its files): what the
FUSE round trips and a Python daemon alone cost here, so JPFS is measured against that floor
as well as against the local filesystem. Both phases (the large one also with its small files
read whole by 4 threads, as an epoch's readers would) run through a passthrough that speaks
the FUSE protocol itself on several threads as well (``rawfuse.py``): what a daemon not bound
to pyfuse3's one loop could reach. Both passthroughs get the mount's 4 MiB bdi read-ahead.
Each namespace figure also says how much CPU each daemon spent per operation (the mount, the
metadata shards, the storage nodes; the passthrough's one daemon as its "mount"): on a shared
2-core machine that, more than the wait, is what bounds these rates.

The mount's cluster keeps its metadata durable as configured by default (each change is synced
before it is answered); the local filesystem's baseline is ext4 as mounted, which syncs at its
journal's commit interval. That difference is the point of the comparison.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

NAMESPACE_OPS = ("create", "mkdir", "stat", "rename", "remove", "rmdir")
NAMESPACE_PHASES = (*NAMESPACE_OPS, "write_small", "layout_4k")
WHOLE_READERS = 4
"""Threads reading the large phase's small files whole, as an epoch's readers would."""


def _namespace_worker(root: str, n: int, small: int, small_files: int, layout_files: int,
                      barrier, results) -> None:
    """One process's share of every namespace phase, timed phase by phase. A failure breaks
    the barrier, so the others (and the parent) stop at once rather than wait for it."""
    try:
        _namespace_phases(root, n, small, small_files, layout_files, barrier, results)
    except BaseException:
        barrier.abort()
        raise


def _namespace_phases(root: str, n: int, small: int, small_files: int, layout_files: int,
                      barrier, results) -> None:
    out: dict[str, tuple[int, float, float]] = {}
    os.makedirs(root, exist_ok=True)

    def timed(name: str, count: int, fn) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        fn()
        out[name] = (count, t0, time.perf_counter())

    files = [os.path.join(root, f"f{i:06d}") for i in range(n)]
    dirs = [os.path.join(root, f"d{i:06d}") for i in range(n)]

    def create() -> None:
        for p in files:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

    def mkdir() -> None:
        for p in dirs:
            os.mkdir(p)

    def stat() -> None:
        for p in files:
            os.stat(p)

    def rename() -> None:
        for p in files:
            os.rename(p, p + ".r")

    def remove() -> None:
        for p in files:
            os.unlink(p + ".r")

    def rmdir() -> None:
        for p in dirs:
            os.rmdir(p)

    blob = os.urandom(small)

    def write_small() -> None:
        d = os.path.join(root, "small")
        os.mkdir(d)
        for i in range(small_files):
            with open(os.path.join(d, f"s{i:05d}"), "wb") as f:
                f.write(blob)

    def layout_4k() -> None:
        d = os.path.join(root, "layout")
        os.mkdir(d)
        for i in range(layout_files):
            with open(os.path.join(d, f"l{i:05d}"), "wb", buffering=0) as f:
                for off in range(0, small, 4096):
                    f.write(blob[off:off + 4096])

    counts = {"write_small": small_files, "layout_4k": layout_files}
    for name, fn in zip(NAMESPACE_PHASES, (create, mkdir, stat, rename, remove, rmdir,
                                           write_small, layout_4k), strict=True):
        timed(name, counts.get(name, n), fn)
    results.put(out)


def namespace_phase(root: Path, procs: int, n: int, small: int, small_files: int,
                    layout_files: int, daemons: dict[str, list[int]] | None = None
                    ) -> dict[str, dict]:
    """Rates of each namespace phase over ``procs`` processes under ``root``; with
    ``daemons`` (a name for each group of processes serving them: "mount", "shards", ...),
    each group's CPU milliseconds per operation too. This process passes the workers' barrier
    before each phase, so the CPU read there divides the run into its phases."""
    from .readers import proc_cpu

    def cpu() -> dict[str, float]:
        return {name: sum(proc_cpu(pid) for pid in pids) for name, pids in (daemons or {}).items()}

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    ps = [ctx.Process(target=_namespace_worker, args=(str(root / f"p{k}"), n, small,
                                                       small_files, layout_files, barrier,
                                                       results)) for k in range(procs)]
    for p in ps:
        p.start()
    marks = []
    try:
        for _ in NAMESPACE_PHASES:
            barrier.wait(timeout=1800)
            marks.append(cpu())
        got = [results.get(timeout=1800) for _ in ps]
        marks.append(cpu())
    except threading.BrokenBarrierError:
        for p in ps:
            p.join(timeout=60)
        raise RuntimeError(f"a namespace worker failed (exits {[p.exitcode for p in ps]})") \
            from None
    except BaseException:
        for p in ps:
            p.kill()
        raise
    finally:
        for p in ps:
            p.join(timeout=60)
    if any(p.exitcode != 0 for p in ps):
        raise RuntimeError(f"a namespace worker failed (exits {[p.exitcode for p in ps]})")
    out = {}
    for i, name in enumerate(NAMESPACE_PHASES):
        count = sum(g[name][0] for g in got)
        seconds = max(g[name][2] for g in got) - min(g[name][1] for g in got)
        out[name] = {"ops": count, "seconds": seconds, "ops_s": count / seconds}
        if daemons:
            out[name]["cpu_ms_per_op"] = {
                who: (marks[i + 1][who] - marks[i][who]) / count * 1e3 for who in daemons}
    return out


def _read_sequential(path: Path, size: int) -> float:
    buf = bytearray(size)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def _read_files(paths: list[Path], chunk: int) -> None:
    buf = bytearray(chunk)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _read_4k(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    _read_files(paths, 4096)
    return time.perf_counter() - t0


def _read_whole(paths: list[Path], readers: int) -> float:
    """``paths`` read whole (1 MiB reads) by ``readers`` threads, each a share in turn."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_read_files, args=(paths[k::readers], 1 << 20))
               for k in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def make_large_data(src: Path, large_bytes: int, small_files: int, small: int) -> None:
    """A large file and a directory of small files, written once locally."""
    src.mkdir(parents=True, exist_ok=True)
    with open(src / "large.bin", "wb") as f:
        left = large_bytes
        while left:
            piece = os.urandom(min(left, 16 << 20))
            f.write(piece)
            left -= len(piece)
    (src / "small").mkdir(exist_ok=True)
    for i in range(small_files):
        (src / "small" / f"s{i:05d}").write_bytes(os.urandom(small))


def large_phase(root: Path, large_bytes: int, small_files: int, drop) -> dict[str, dict]:
    """Cold reads under ``root``: the large file in 1 MiB reads, small files in 4 KiB reads."""
    drop()
    secs = _read_sequential(root / "large.bin", 1 << 20)
    out = {"large_1m": {"bytes": large_bytes, "seconds": secs, "MBps": large_bytes / secs / 1e6}}
    paths = sorted((root / "small").iterdir())
    nbytes = sum(p.stat().st_size for p in paths)
    drop()
    secs = _read_4k(paths)
    out["small_4k"] = {"bytes": nbytes, "files": len(paths), "seconds": secs,
                       "MBps": nbytes / secs / 1e6}
    drop()
    secs = _read_whole(paths, WHOLE_READERS)
    out[f"small_whole_x{WHOLE_READERS}"] = {"bytes": nbytes, "files": len(paths),
                                            "seconds": secs, "MBps": nbytes / secs / 1e6}
    return out


@contextmanager
def passthrough_mount(source: Path, mountpoint: Path, threads: int | None = None,
                      read_write: bool = False):
    """A passthrough of ``source`` mounted at ``mountpoint`` while in the block: the naive
    pyfuse3 one, or with ``threads`` the raw-protocol one on that many threads (read-only
    unless ``read_write``); gives the mountpoint and the daemon's pid."""
    source.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "jpfs_bench.passthrough", str(source), str(mountpoint)]
    if threads:
        cmd = [sys.executable, "-m", "jpfs_bench.rawfuse", str(source), str(mountpoint),
               "--threads", str(threads), *(["--read-write"] if read_write else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the passthrough mount at {mountpoint} did not start "
                               f"(exit {proc.wait()})")
        # the read-ahead a JPFS mount sets itself by default, so READs are as large
        from jpfs.fuse.mount import MountOptions, tune_readahead

        tune_readahead(str(mountpoint), MountOptions.read_ahead)
        yield mountpoint, proc.pid
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


def serving_daemons(cluster_dir: Path, mount_pid: int) -> dict[str, list[int]]:
    """The processes that serve a mount of the local cluster in ``cluster_dir``, by role."""
    from jpfs import localcluster

    out: dict[str, list[int]] = {"mount": [mount_pid], "shards": [], "storage": []}
    for d in localcluster.status(cluster_dir):
        if d.pid is not None and d.role in ("meta", "storage"):
            out["shards" if d.role == "meta" else "storage"].append(d.pid)
    return out


def run_phases(args, work: Path) -> dict[str, Any]:
    """The ``namespace`` and ``large`` phases, local and through a read-write mount; the large
    phase's reads also through a read-only one (where the kernel opens files itself)."""
    import jpfs

    from .aggregate import drop_caches
    from .harness import Mount, temporary_cluster

    phases = [p for p in args.phases if p != "read"]
    out: dict[str, Any] = {}
    raw_threads = args.raw_threads
    if raw_threads and os.geteuid() != 0:
        print("the raw-protocol passthrough is left out: it mounts with the system call, "
              "which needs root", flush=True)
        raw_threads = 0
    src = work / "large-src"
    if "large" in phases:
        make_large_data(src, args.large_bytes, args.small_read_files, 100 << 10)
    with temporary_cluster(2, 2, directory=str(work / "wcluster"), keep=bool(args.dir)) as cdir:
        cluster_file = str(cdir / "cluster.toml")
        if "large" in phases:
            with jpfs.connect(cluster_file) as c:
                c.makedirs("/large/small")
                c.put(src / "large.bin", "/large/large.bin")
                for p in sorted((src / "small").iterdir()):
                    c.put(p, f"/large/small/{p.name}")
        if "namespace" in phases:
            with passthrough_mount(work / "passthrough-src", work / "mnt-passthrough") as (
                    mp_, pid):
                (mp_ / "ns").mkdir()
                out.setdefault("passthrough", {})["namespace"] = namespace_phase(
                    mp_ / "ns", args.write_procs, args.namespace_ops, 100 << 10,
                    args.small_write_files, args.layout_files, {"mount": [pid]})
            if raw_threads:
                with passthrough_mount(work / "raw-src", work / "mnt-raw", raw_threads,
                                       read_write=True) as (mp_, pid):
                    (mp_ / "ns").mkdir()
                    out.setdefault("raw-passthrough", {"threads": raw_threads})[
                        "namespace"] = namespace_phase(
                        mp_ / "ns", args.write_procs, args.namespace_ops, 100 << 10,
                        args.small_write_files, args.layout_files, {"mount": [pid]})
        if "large" in phases:  # the same reads through the naive layer, over the local copy
            with passthrough_mount(src, work / "mnt-passthrough-large") as (mp_, _):
                out.setdefault("passthrough", {})["large"] = large_phase(
                    mp_, args.large_bytes, args.small_read_files, drop_caches)
            if raw_threads:
                with passthrough_mount(src, work / "mnt-raw-large", raw_threads) as (mp_, _):
                    out.setdefault("raw-passthrough", {"threads": raw_threads})[
                        "large"] = large_phase(mp_, args.large_bytes, args.small_read_files,
                                               drop_caches)
        vias = ["local", "fuse-rw"]
        if "namespace" in phases and args.write_behind:
            vias.append("fuse-rw-write-behind")
        if "large" in phases:
            vias.append("fuse")
        for via in vias:
            mount = Mount(cluster_file, work, via, 0) if via != "local" else None
            try:
                base = (mount.mp if mount else work / "local-ns")
                res: dict[str, Any] = {}
                if "namespace" in phases and via != "fuse":  # writes: not on read-only
                    ns_root = base / ("ns" if via != "fuse-rw-write-behind" else "ns-wb")
                    ns_root.mkdir(parents=True, exist_ok=True)
                    res["namespace"] = namespace_phase(
                        ns_root, args.write_procs, args.namespace_ops, 100 << 10,
                        args.small_write_files, args.layout_files,
                        serving_daemons(cdir, mount.pid) if mount else None)
                if "large" in phases and via != "fuse-rw-write-behind":
                    res["large"] = large_phase(mount.mp / "large" if mount else src,
                                               args.large_bytes, args.small_read_files,
                                               drop_caches)
                out[via] = res
            finally:
                if mount:
                    mount.close()
    return out


def _namespace_row(what: str, r: dict, base: dict, floor: dict | None,
                   raw: dict | None = None) -> dict:
    """One namespace figure: the mount's against the local filesystem's (and the
    passthroughs', where run)."""
    row = {"phase": "namespace", "what": what, "unit": "ops/s", "local": base["ops_s"],
           "fuse": r["ops_s"], "ratio": r["ops_s"] / base["ops_s"]}
    if floor is not None:
        row["passthrough"] = floor["ops_s"]
        row["ratio_passthrough"] = r["ops_s"] / floor["ops_s"]
        if "cpu_ms_per_op" in floor:
            row["passthrough_cpu_ms_per_op"] = floor["cpu_ms_per_op"]["mount"]
    if raw is not None:
        row["raw_passthrough"] = raw["ops_s"]
    if "cpu_ms_per_op" in r:
        row["cpu_ms_per_op"] = r["cpu_ms_per_op"]
    return row


def ratios(phases: dict[str, Any]) -> list[dict]:
    """One row per figure: local, mount, mount vs local (and the passthroughs, where run)."""
    rows = []
    local = phases.get("local", {})
    floor = phases.get("passthrough", {}).get("namespace", {})
    raw_ns = phases.get("raw-passthrough", {}).get("namespace", {})
    for via, label in (("fuse-rw", ""), ("fuse-rw-write-behind", " --write-behind")):
        for name, r in phases.get(via, {}).get("namespace", {}).items():
            rows.append(_namespace_row(name + label, r, local["namespace"][name],
                                       floor.get(name), raw_ns.get(name)))
    large_floor = phases.get("passthrough", {}).get("large", {})
    raw_floor = phases.get("raw-passthrough", {}).get("large", {})
    for via, label in (("fuse-rw", ""), ("fuse", " read-only")):
        for name, r in phases.get(via, {}).get("large", {}).items():
            base = local["large"][name]
            row = {"phase": "large", "what": name + label, "unit": "MB/s",
                   "local": base["MBps"], "fuse": r["MBps"], "ratio": r["MBps"] / base["MBps"]}
            if name in large_floor:
                row["passthrough"] = large_floor[name]["MBps"]
                row["ratio_passthrough"] = r["MBps"] / large_floor[name]["MBps"]
            if name in raw_floor:
                row["raw_passthrough"] = raw_floor[name]["MBps"]
            rows.append(row)
    return rows


__all__ = ["NAMESPACE_OPS", "large_phase", "namespace_phase", "ratios", "run_phases",
           "serving_daemons"]
