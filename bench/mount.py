"""``jpfs bench mount``: a LeRobot-shaped tree read whole through a FUSE mount, against the local
filesystem in the same run.

The dataset (generated, or --dataset) is imported into a fresh local cluster and read episode by
episode (its parquet, then every camera's mp4, each file whole), by R reader threads that take
every R-th episode of the epoch's order (as DataLoader workers do), for two epochs:

  epoch 1  cold: page cache dropped (the local tree, the servers' volumes, everything), a fresh
           mount with empty memory and disk caches;
  epoch 2  warm: the same files again (reshuffled when the order is shuffled).

The same files in the same order are read

  local            from the local copy (the baseline);
  fuse             through `jpfs mount --read-only` (dataset mode), prefetch on;
  fuse-noprefetch  the same mount with --no-prefetch;
  fuse-socket      the same mount with --no-short-circuit: every blob over the storage nodes'
                   sockets, as a mount on another host than the nodes reads them (the nodes
                   run on this host, so `fuse` reads their volume files itself);
  fuse-hinted      the read-only mount told all of each epoch's paths, in order, through its hint
                   socket before the epoch starts (ShardDataset on a mount announces its coming
                   paths the same way, a bounded window at a time; only with --via fuse-hinted);
  fuse-open        the same mount with --open-requests (the kernel sends OPEN and RELEASE per
                   open, as before no-open mode; only with --via fuse-open);
  fuse-rw          a read-write mount (opens revalidate, FLUSH is answered): what unchanged
                   training code gets without --read-only (only with --via fuse-rw);
  fuse-jpfs        the read-only mount served by JPFS's own FUSE engine (--engine jpfs), a
                   worker process per core (only with --via fuse-jpfs);
  fuse-jpfs1       the same engine with one worker (only with --via fuse-jpfs1);
  fuse-jpfs-noprefetch  fuse-jpfs with --no-prefetch.

Reported per order, readers and via: files/s and MB/s of each epoch and their ratio to local in
the same epoch, FUSE requests per file opened (the mount's own counters: the cost that bounds a
pyfuse3 mount, see docs/perf.md), how opens were served (prefetched, kernel page cache,
fetched), the mount daemon's CPU per file, the median and 99th percentile of one file's read
time, and the share of the epoch the first tenth of its files took (0.10 at an even pace). The
targets of the mount issue are checked at the end.

examples:
  jpfs bench mount                                  # 400 episodes x (1 parquet + 2 mp4s)
  jpfs bench mount --episodes 1000 --cameras 3 --readers 1,8 --orders shuffled,name
  jpfs bench mount --via local,fuse,fuse-noprefetch,fuse-rw --json
  jpfs bench mount --via local,fuse,fuse-hinted --orders shuffled   # a loader that announces
  jpfs bench mount --phases tree --episodes 200     # tar -x and rm -r of a downloaded dataset
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HELP = "FUSE mount files/s and FUSE requests per file, cold and warm, prefetch on/off, vs local"
DESCRIPTION = __doc__
VIAS = ("local", "fuse", "fuse-noprefetch", "fuse-socket", "fuse-hinted", "fuse-open",
        "fuse-rw", "fuse-jpfs", "fuse-jpfs1", "fuse-jpfs-noprefetch")
PHASES = ("read", "namespace", "large", "checkpoint", "tree")


def _list(kind, choices=None):
    def parse(text: str) -> list:
        out = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not out or (choices and any(x not in choices for x in out)):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of "
                                             f"{', '.join(choices) if choices else kind.__name__}")
        return list(dict.fromkeys(out))
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench mount``."""
    from jpfs.config import parse_size

    p.add_argument("--dataset", metavar="DIR", help="a local LeRobot v2.1 dataset (default: "
                   "generate one)")
    p.add_argument("--episodes", type=int, default=400, help="generated episodes (default 400)")
    p.add_argument("--cameras", type=int, default=2, help="cameras (default 2)")
    p.add_argument("--frames", type=int, default=300,
                   help="frames per episode (parquet size; default 300)")
    p.add_argument("--video-bytes", type=parse_size, default="512K",
                   help="size of each stand-in mp4 (default 512K)")
    p.add_argument("--seed", type=int, default=0, help="dataset and shuffle seed")
    p.add_argument("--readers", type=_list(int), default=[1, 8],
                   help="reader threads, comma-separated (default 1,8)")
    p.add_argument("--orders", type=_list(str, ("shuffled", "name")),
                   default=["shuffled", "name"], help="episode orders (default shuffled,name)")
    p.add_argument("--via", type=_list(str, VIAS), default=["local", "fuse", "fuse-noprefetch"],
                   help="what to read through (default local,fuse,fuse-noprefetch)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per figure; the median is reported (default 1)")
    p.add_argument("--read-size", type=parse_size, default="0",
                   help="read each file in reads of this size, as a video decoder does (e.g. "
                   "32K; default 0: each file in one read)")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the page cache before epoch 1 (then only the mount is "
                   "cold; the local tree and the servers' volumes stay in memory)")
    p.add_argument("--dir", help="work folder, kept afterwards (default: a temporary one)")
    p.add_argument("--phases", type=_list(str, PHASES), default=["read"],
                   help="read (the epochs above), namespace (creates, mkdirs, stats, renames, "
                   "removes, cp -r-like writes, 4 KiB-write layouts, through a read-write "
                   "mount and through a naive pyfuse3 passthrough of a local directory and a "
                   "raw-protocol threaded one), "
                   "large (a large file in 1 MiB reads, small files in 4 KiB reads and whole "
                   "by 4 threads, cold, through read-write and read-only mounts, the naive "
                   "passthrough and a raw-protocol threaded one), "
                   "checkpoint (torch.save of a state dict and fsync, then torch.load cold, "
                   "locally and through read-write mounts; needs torch), "
                   "tree (the dataset above, or --dataset, packed in a tar, then tar -x and "
                   "rm -r of it locally and through a read-write mount); "
                   "comma-separated (default read)")
    p.add_argument("--write-procs", type=int, default=2,
                   help="processes in the namespace phase (default 2)")
    p.add_argument("--namespace-ops", type=int, default=500,
                   help="files (and directories) each process creates, renames, removes "
                   "(default 500)")
    p.add_argument("--small-write-files", type=int, default=300,
                   help="100 KB files each process writes whole (default 300)")
    p.add_argument("--layout-files", type=int, default=50,
                   help="100 KB files each process writes in 4 KiB writes (default 50)")
    p.add_argument("--write-behind", action="store_true",
                   help="namespace phase: also through a read-write mount with --write-behind "
                   "(a new file's close answered before its bytes are stored), in the same run")
    p.add_argument("--large-bytes", type=parse_size, default="512M",
                   help="the large file of the large phase (default 512M)")
    p.add_argument("--small-read-files", type=int, default=1000,
                   help="100 KB files read in 4 KiB reads, then whole by 4 threads, in the "
                   "large phase (default 1000)")
    p.add_argument("--checkpoint-bytes", type=parse_size, default="1G",
                   help="the checkpoint phase's state dict (default 1G)")
    p.add_argument("--checkpoint-replicas", type=int, default=2,
                   help="copies of each chunk in the checkpoint phase's cluster, all on this "
                   "machine's disk (default 2)")
    p.add_argument("--raw-threads", type=int, default=4,
                   help="namespace and large phases: threads of the raw-protocol passthrough "
                   "they also run through (default 4; 0 leaves it out)")


# ---- reading ----------------------------------------------------------------------------------

def _read_units(root: str, units: list[tuple[str, ...]], sizes: dict[str, int], largest: int,
                barrier: threading.Barrier, out: dict, read_size: int = 0) -> None:
    buf = bytearray(largest + 1)
    mv = memoryview(buf)
    files = nbytes = 0
    errors: list[str] = []
    spans: list[tuple[float, float]] = []  # (opened, read whole) per file
    barrier.wait()
    start = time.perf_counter()
    for unit in units:
        for rel in unit:
            want = sizes[rel]
            began = time.perf_counter()
            try:
                with open(os.path.join(root, rel), "rb", buffering=0) as f:
                    got = 0
                    while got <= want:
                        end = want + 1 if not read_size else min(want + 1, got + read_size)
                        n = f.readinto(mv[got:end])
                        if not n:
                            break
                        got += n
            except OSError as e:
                errors.append(f"{rel}: {e}")
                continue
            if got != want:
                errors.append(f"{rel}: read {got} bytes, expected {want}")
            spans.append((began, time.perf_counter()))
            files += 1
            nbytes += got
    out.update(files=files, bytes=nbytes, start=start, end=time.perf_counter(), errors=errors,
               spans=spans)


def file_times(spans: list[tuple[float, float]], start: float, seconds: float) -> dict:
    """How the epoch's time was spread over its files: the median and 99th percentile of one
    file's open-to-last-byte time (ms), and the share of the epoch that passed before the
    first tenth of its files were read (0.1 for an even pace; a cold mount that waits for its
    prefetch to catch up shows more)."""
    if not spans:
        return {}
    took = sorted(e - b for b, e in spans)
    ends = sorted(e for _, e in spans)
    tenth = ends[max(0, len(ends) // 10 - 1)]
    return {"file_ms_p50": took[len(took) // 2] * 1e3,
            "file_ms_p99": took[min(len(took) - 1, len(took) * 99 // 100)] * 1e3,
            "first_tenth_share": (tenth - start) / seconds if seconds > 0 else None}


def read_epoch(root: str, ds, order: list[int], readers: int, read_size: int = 0) -> dict:
    """All units in ``order``, split round-robin over ``readers`` threads (each file in reads of
    ``read_size``, or in one)."""
    from .readers import share

    units = [ds.units[i] for i in order]
    results = [{} for _ in range(readers)]
    barrier = threading.Barrier(readers)
    threads = [threading.Thread(target=_read_units, args=(
        root, [units[j] for j in share(range(len(units)), k, readers)], ds.sizes, ds.largest,
        barrier, results[k], read_size)) for k in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} read errors, first: {errors[0]}")
    start = min(r["start"] for r in results)
    seconds = max(r["end"] for r in results) - start
    files = sum(r["files"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    return {"files": files, "bytes": nbytes, "seconds": seconds, "files_s": files / seconds,
            "MBps": nbytes / seconds / 1e6,
            **file_times([s for r in results for s in r["spans"]], start, seconds)}


def _counted(before: dict, after: dict) -> dict:
    """The counters that moved between two snapshots of one stats section."""
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, int) and not isinstance(v, bool) and v != before.get(k, 0)}


def _fuse_delta(before: dict, after: dict, files: int, cpu: float) -> dict:
    from .aggregate_setup import prefetch_summary

    if after["mount"].get("workers", 1) > 1:  # each worker counts its own requests
        return {"mount_cpu_us_per_file": cpu / files * 1e6,
                "workers": after["mount"]["workers"]}
    fb, fa = before["fuse"], after["fuse"]
    reqs = {k: fa["requests"][k] - fb["requests"][k] for k in fa["requests"]}
    pf = prefetch_summary(before, after)
    return {
        "requests_per_file": pf["fuse_requests"] / files,
        "requests": {k: v for k, v in reqs.items() if v},
        "opens": {k: v for k, v in pf["opens"].items() if v},
        "handed_files": pf["handed"],
        "prefetch_hit_rate": pf["prefetch_hit_rate"],
        "mount_cpu_us_per_file": cpu / files * 1e6,
        "prefetch": _counted(before.get("prefetch", {}), after.get("prefetch", {})),
        "cache": _counted(before.get("cache", {}), after.get("cache", {})),
    }


# ---- the run ----------------------------------------------------------------------------------

def _measure(via: str, order_name: str, readers: int, ds, local_root: str, cluster_file: str,
             work: Path, args, generation: int) -> list[dict]:
    from .aggregate import drop_caches
    from .harness import Mount
    from .readers import epoch_order, tree_cpu

    mount = None
    try:
        if via.startswith("fuse"):
            mount = Mount(cluster_file, work, via, generation)
            root = str(mount.mp) + "/dataset"
        else:
            root = local_root
        cold = {"method": "skipped", "cold": False} if args.no_drop_caches else drop_caches()
        out = []
        for epoch in (1, 2):
            order = epoch_order(len(ds.units), order_name, args.seed, epoch)
            hinted = mount.hint([os.path.join(root, rel) for i in order for rel in ds.units[i]]
                                ) if mount and via == "fuse-hinted" else None
            before = mount.stats() if mount else None
            cpu0 = tree_cpu(mount.pid) if mount else 0.0
            r = read_epoch(root, ds, order, readers, args.read_size)
            if hinted is not None:
                r["hinted_paths"] = hinted
            r.update(via=via, order=order_name, readers=readers, epoch=epoch,
                     read_size=args.read_size,
                     cold=cold["cold"] if epoch == 1 else False)
            if mount:
                r.update(_fuse_delta(before, mount.stats(), r["files"],
                                     tree_cpu(mount.pid) - cpu0))
            out.append(r)
        return out
    finally:
        if mount:
            mount.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``jpfs bench mount`` (the dataset read through each via): print the report, return the
    figures. FUSE vias need root and /dev/fuse."""
    from jpfs.client.tools import import_tree
    from jpfs.fuse.mount import mount_entry

    from .harness import temporary_cluster
    from .readers import scan_dataset

    if any(v.startswith("fuse") for v in args.via) and (os.geteuid() != 0 or
                                                        not os.path.exists("/dev/fuse")):
        raise SystemExit("jpfs bench mount: FUSE mounts need root and /dev/fuse")
    if "checkpoint" in args.phases:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise SystemExit("jpfs bench mount: the checkpoint phase needs torch "
                             "(pip install 'jpfs[torch]')") from None
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="jpfs-bench-mount-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result: dict[str, Any] = {}
        if set(args.phases) - {"read"}:
            from .mount_write import ratios, run_phases

            print("namespace/large/checkpoint/tree phases ...", flush=True)
            result["phases"] = run_phases(args, work) if {"namespace", "large"} & set(
                args.phases) else {}
            result["phase_ratios"] = ratios(result["phases"])
            if "checkpoint" in args.phases:
                from .harness import drop_caches
                from .mount_checkpoint import checkpoint_phase, checkpoint_rows

                result["phases"]["checkpoint"] = checkpoint_phase(
                    work, args.checkpoint_bytes, args.checkpoint_replicas, drop_caches)
                result["phase_ratios"] += checkpoint_rows(result["phases"]["checkpoint"])
            if "tree" in args.phases:
                from .mount_tree import tree_phase, tree_rows

                result["phases"]["tree"] = tree_phase(work, _dataset(args, work))
                result["phase_ratios"] += tree_rows(result["phases"]["tree"])
            if "read" not in args.phases:
                report_phases(result)
                return result
        local_root = str(_dataset(args, work))
        ds = scan_dataset(local_root)
        print(f"dataset: {ds.files} files in {len(ds.units)} episodes, "
              f"{ds.bytes / 1e6:.0f} MB", flush=True)
        with temporary_cluster(2, 2, directory=str(work / "cluster"), keep=bool(args.dir),
                               sync=False) as cdir:
            cluster_file = str(cdir / "cluster.toml")
            if any(v.startswith("fuse") for v in args.via):
                import jpfs

                with jpfs.connect(cluster_file) as c:
                    c.run(import_tree, local_root, "/dataset")
            runs: list[dict] = []
            generation = 0
            for order in args.orders:
                for readers in args.readers:
                    for via in args.via:
                        reps = []
                        for _ in range(max(1, args.repeat)):
                            generation += 1
                            reps.append(_measure(via, order, readers, ds, local_root,
                                                 cluster_file, work, args, generation))
                        runs += _median(reps)
                        _progress(runs[-2:])
        for v in args.via:
            if v.startswith("fuse") and mount_entry(str(work / f"mnt-{v}")):
                raise RuntimeError(f"{work}/mnt-{v} is still mounted")
        result.update({"dataset": {"files": ds.files, "episodes": len(ds.units),
                                   "bytes": ds.bytes, "root": local_root},
                       "runs": runs, "summary": summarize(runs, args)})
        report(result, args)
        if "phases" in result:
            report_phases(result)
        return result
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def _dataset(args: argparse.Namespace, work: Path) -> Path:
    """The LeRobot v2.1 tree the read and tree phases use: ``--dataset``, or one generated under
    ``work`` (once)."""
    if args.dataset:
        return Path(args.dataset)
    root = work / "dataset"
    if not (root / "meta").is_dir():
        from jpfs.lerobot.generate import generate

        print(f"generating {args.episodes} episodes x ({args.cameras} cameras) ...", flush=True)
        generate(str(root), episodes=args.episodes, cameras=args.cameras,
                 frames_per_episode=args.frames, video="stub", video_bytes=args.video_bytes,
                 format="v2.1", seed=args.seed, progress=False)
    return root


def report_phases(result: dict) -> None:
    """Print the per-phase table of a result (rates, ratios, CPU per op)."""
    from .harness import fmt_ratio, print_table

    def cpu(r: dict) -> str:
        if "cpu_s_per_gb" in r:
            c = r["cpu_s_per_gb"]
            return " / ".join(f"{c[who]:.2f}" for who in ("mount", "shards", "storage")) + \
                " s/GB"
        c = r.get("cpu_ms_per_op")
        if c is None:
            return "-"
        mine = " / ".join(f"{c[who]:.2f}" for who in ("mount", "shards", "storage"))
        floor = r.get("passthrough_cpu_ms_per_op")
        return mine + (f" ({floor:.2f})" if floor is not None else "")

    def raw(r: dict) -> str:
        if "raw_passthrough" not in r:
            return "-"
        return f"{r['raw_passthrough']:,.0f} ({fmt_ratio(r['raw_passthrough'] / r['local'])})"

    def num(r: dict, x: float) -> str:
        return f"{x:.2f}" if r["unit"] == "GB/s" else f"{x:,.0f}"

    rows = [[r["phase"], r["what"], r["unit"], num(r, r["local"]),
             num(r, r["passthrough"]) if "passthrough" in r else "-", raw(r),
             num(r, r["fuse"]), fmt_ratio(r["ratio"]), fmt_ratio(r.get("ratio_passthrough")),
             cpu(r)]
            for r in result["phase_ratios"]]
    threads = result.get("phases", {}).get("raw-passthrough", {}).get("threads")
    print_table(["phase", "what", "unit", "local", "passthrough",
                 f"raw x{threads} (vs local)" if threads else "raw", "mount", "vs local",
                 "vs passthrough", "CPU ms/op: mount / shards / storage (passthrough)"], rows,
                title="writes, namespace changes, large files and checkpoints (passthrough: a "
                "naive pyfuse3 mount of a local directory; raw: one speaking the FUSE protocol "
                "on threads; CPU: each daemon's per operation, or per GB)")


def _median(reps: list[list[dict]]) -> list[dict]:
    """Per epoch, the run with the median files/s."""
    out = []
    for epoch_runs in zip(*reps, strict=True):
        ranked = sorted(epoch_runs, key=lambda r: r["files_s"])
        pick = dict(ranked[len(ranked) // 2])
        if len(ranked) > 1:
            pick["files_s_all"] = [round(r["files_s"]) for r in epoch_runs]
        out.append(pick)
    return out


def _progress(rows: list[dict]) -> None:
    for r in rows:
        extra = f", {r['requests_per_file']:.2f} req/file" if "requests_per_file" in r else ""
        print(f"  {r['order']:8s} {r['readers']} reader(s) {r['via']:16s} epoch {r['epoch']}: "
              f"{r['files_s']:8.0f} files/s{extra}", flush=True)


def _get(runs, via, order, readers, epoch) -> dict | None:
    for r in runs:
        if (r["via"], r["order"], r["readers"], r["epoch"]) == (via, order, readers, epoch):
            return r
    return None


def summarize(runs: list[dict], args) -> dict:
    """The issue's targets, each with its measured ratio (None where not measured)."""
    out: dict[str, Any] = {}
    targets = []

    def ratio(a, b):
        return a["files_s"] / b["files_s"] if a and b else None

    for order in args.orders:
        for readers in args.readers:
            fuse2 = _get(runs, "fuse", order, readers, 2)
            local2 = _get(runs, "local", order, readers, 2)
            fuse1 = _get(runs, "fuse", order, readers, 1)
            local1 = _get(runs, "local", order, readers, 1)
            none1 = _get(runs, "fuse-noprefetch", order, readers, 1)
            key = f"{order}_{readers}r"
            if fuse2:
                targets.append((f"{key}: epoch 2 FUSE requests per open", "<=", 2.0,
                                fuse2["requests_per_file"]))
            want = 0.3 if readers == 1 else 0.6
            targets.append((f"{key}: epoch 2 files/s vs local", ">=", want,
                            ratio(fuse2, local2)))
            targets.append((f"{key}: epoch 1 files/s prefetch vs local cold", ">=", 1.0,
                            ratio(fuse1, local1)))
            targets.append((f"{key}: epoch 1 files/s prefetch vs no prefetch", ">=", 2.0,
                            ratio(fuse1, none1)))
    # compared as printed (two decimals): one stray request in a thousand opens is noise
    out["targets"] = [{"what": w, "goal": f"{op} {goal}", "value": v,
                       "met": None if v is None else (round(v, 2) <= goal if op == "<="
                                                      else round(v, 2) >= goal)}
                      for w, op, goal, v in targets]
    return out


def report(result: dict, args) -> None:
    """Print the result as one table per order and reader count."""
    from .harness import fmt_rate, fmt_ratio, print_table

    runs = result["runs"]
    for order in args.orders:
        for readers in args.readers:
            rows = []
            for via in args.via:
                for epoch in (1, 2):
                    r = _get(runs, via, order, readers, epoch)
                    base = _get(runs, "local", order, readers, epoch)
                    if r is None:
                        continue
                    rows.append([
                        via, f"{epoch} ({'cold' if r['cold'] else 'warm'})"
                        if epoch == 1 else "2 (warm)",
                        fmt_rate(r["files_s"]), f"{r['MBps']:.0f}",
                        fmt_ratio(r["files_s"] / base["files_s"] if base else None),
                        f"{r['requests_per_file']:.2f}" if "requests_per_file" in r else "-",
                        f"{r['prefetch_hit_rate']:.0%}" if r.get("prefetch_hit_rate")
                        is not None else "-",
                        f"{r['mount_cpu_us_per_file']:.0f}" if "mount_cpu_us_per_file" in r
                        else "-",
                        f"{r['file_ms_p50']:.2f} / {r['file_ms_p99']:.1f}"
                        if "file_ms_p50" in r else "-",
                        f"{r['first_tenth_share']:.2f}"
                        if r.get("first_tenth_share") is not None else "-",
                    ])
            print_table(["via", "epoch", "files/s", "MB/s", "vs local", "FUSE req/file",
                         "prefetched", "mount CPU us/file", "ms/file p50 / p99",
                         "first 10% took"], rows,
                        title=f"{order} order, {readers} reader thread(s), "
                        f"{result['dataset']['files']} files per epoch")
    rows = [[t["what"], t["goal"], "-" if t["value"] is None else f"{t['value']:.2f}",
             {True: "yes", False: "NO", None: "-"}[t["met"]]]
            for t in result["summary"]["targets"]]
    print_table(["target", "goal", "measured", "met"], rows, title="targets")
    if any(r.get("files_s_all") for r in runs):
        print("(medians of", args.repeat, "runs;",
              "spread:", statistics.mean(max(r["files_s_all"]) / min(r["files_s_all"])
                                         for r in runs if r.get("files_s_all")), ")")
