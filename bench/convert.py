"""``jpfs bench convert``: v2.1 -> v3.0 conversion speed, and reading v2.1 against v3.0."""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

HELP = "v2.1 -> v3.0 conversion rate, file-count reduction, and v2.1 vs v3.0 read speed"
DESCRIPTION = """\
Generate (or take with --src) a LeRobot v2.1 dataset and measure:

  convert  episodes/s and MB/s of `jpfs lerobot convert` for each --workers x --executor setting,
           with the file-count reduction; the baseline is one inline worker, run in the same
           invocation, and every setting is reported as a ratio against it. Conversions are
           timed without their check; the check (`jpfs lerobot verify`, sample and full
           decoded-frame levels, at the fastest setting's workers) is timed after them and
           reported as a share of that conversion's time.
  read     time to read every frame's data (all parquet rows) of the dataset as v2.1 and as
           v3.0, for each --via (where the files are read from), in two patterns: "scan" (every
           data file in order) and "episodes" (each episode's rows on its own, shuffled, as a
           training loader asks for them). The baseline is v2.1 through the same via.

Reads are timed warm (after one untimed pass) and reported as medians of --repeat runs.

--via takes `local` (the generated folders) and any fsspec URL or JPFS path
(jpfs:/bench/convert): the two datasets are copied there first (untimed) and read back through
fsspec. JPFS paths work once the JPFS fsspec filesystem and a cluster are up.

examples:
  jpfs bench convert
  jpfs bench convert --episodes 200 --workers 1,2,4 --executor process,thread
  jpfs bench convert --src /data/aloha-v21 --via local,jpfs:/bench/aloha
"""


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}"
                                         ) from None


def _str_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench convert``."""
    parser.add_argument("--src", default=None,
                        help="an existing v2.1 dataset to use instead of generating one")
    parser.add_argument("--dir", default=None,
                        help="work folder (default: a temporary folder, removed afterwards)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--episodes", type=int, default=40, help="generated episodes (40)")
    parser.add_argument("--cameras", type=int, default=2, help="generated cameras (2)")
    parser.add_argument("--frames-per-episode", default="100-300", metavar="A[-B]",
                        help="generated frames per episode (100-300)")
    parser.add_argument("--video", choices=("auto", "encoded", "stub"), default="auto",
                        help="generated video kind (default: encoded when PyAV is installed)")
    parser.add_argument("--video-bytes", type=int, default=256 * 1024,
                        help="size of stand-in videos with --video stub (256 KiB)")
    parser.add_argument("--resolution", default="64x48", metavar="WxH",
                        help="generated camera resolution (64x48)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    parser.add_argument("--data-file-mb", type=float, default=1.0,
                        help="v3.0 data file limit in MB (1: several files at the default size; "
                             "LeRobot's default is 100)")
    parser.add_argument("--video-file-mb", type=float, default=4.0,
                        help="v3.0 video file limit in MB (4; LeRobot's default is 200)")
    parser.add_argument("--workers", type=_int_list, default=[1, 2], metavar="N[,N...]",
                        help="conversion worker counts to measure (1,2); 1 is the baseline")
    parser.add_argument("--executor", type=_str_list, default=["thread"], metavar="KIND[,...]",
                        help="thread and/or process workers (thread)")
    parser.add_argument("--via", type=_str_list, default=["local"], metavar="VIA[,VIA...]",
                        help="where to read from: local, an fsspec URL or jpfs:/path (local)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each conversion setting and each read (median; 3)")
    parser.add_argument("--no-read", action="store_true", help="skip the read comparison")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``jpfs bench convert`` (a v2.1 dataset to v3.0): print the report, return the figures."""
    from jpfs.lerobot.dataset import load_meta

    work = args.dir or tempfile.mkdtemp(prefix="jpfs-bench-convert-")
    os.makedirs(work, exist_ok=True)
    try:
        src = args.src or _generate(args, os.path.join(work, "v21"))
        meta = load_meta(src)
        print(f"dataset: {len(meta.episodes)} episodes, {meta.total_frames} frames, "
              f"{len(meta.video_keys)} cameras ({src})")
        conv = _bench_convert(args, src, work)
        result: dict[str, Any] = {"episodes": len(meta.episodes), "frames": meta.total_frames,
                                  "cameras": len(meta.video_keys), "convert": conv}
        if not args.no_read:
            result["read"] = _bench_read(args, src, conv["dst"], work)
        return result
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"kept {work}")


def _generate(args: argparse.Namespace, root: str) -> str:
    from jpfs.lerobot.generate import generate

    lo, _, hi = args.frames_per_episode.partition("-")
    frames: int | tuple[int, int] = (int(lo), int(hi)) if hi else int(lo)
    w, _, h = args.resolution.partition("x")
    figures = generate(root, episodes=args.episodes, cameras=args.cameras,
                       frames_per_episode=frames, video=args.video, video_bytes=args.video_bytes,
                       seed=args.seed, resolution=(int(w), int(h)), progress=False)
    print(f"generated v2.1 in {figures['seconds']:.1f} s: {figures['files']} files, "
          f"{figures['bytes'] / 1e6:.1f} MB, video {figures['video']}")
    return root


def _bench_convert(args: argparse.Namespace, src: str, work: str) -> dict[str, Any]:
    """Each setting --repeat times, interleaved (ABAB...) so load from other processes on a
    shared machine spreads over all settings; reports the median and the best run."""
    from jpfs.lerobot.convert import convert

    configs = [(1, "inline")]
    configs += [(w, kind) for kind in args.executor for w in args.workers if w > 1]
    times: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
    cpu: dict[tuple[int, str], list[float]] = {c: [] for c in configs}
    last: dict[str, Any] = {}
    base_dst = os.path.join(work, "v30")
    for _ in range(max(1, args.repeat)):
        for workers, kind in configs:
            dst = base_dst if (workers, kind) == configs[0] else os.path.join(work, "v30-other")
            shutil.rmtree(dst, ignore_errors=True)
            c0 = _cpu_seconds()
            last = convert(src, dst, data_file_mb=args.data_file_mb,
                           video_file_mb=args.video_file_mb, workers=workers,
                           executor="thread" if kind == "inline" else kind, progress=False,
                           verify="off")
            cpu[(workers, kind)].append(_cpu_seconds() - c0)
            times[(workers, kind)].append(last["seconds"])
    shutil.rmtree(os.path.join(work, "v30-other"), ignore_errors=True)
    runs = []
    for workers, kind in configs:
        secs = statistics.median(times[(workers, kind)])
        runs.append({
            "workers": workers, "executor": kind, "seconds": secs,
            "best_seconds": min(times[(workers, kind)]),
            "cpu_seconds": statistics.median(cpu[(workers, kind)]),
            "episodes_per_s": last["episodes"] / secs,
            "mb_per_s": last["source_bytes"] / secs / 1e6,
        })
    base = runs[0]
    for r in runs:
        r["speedup"] = base["seconds"] / r["seconds"]
    source_files = last["source_files"] + 4  # + the 4 v2.1 meta files
    output_files = last["data_files"] + last["video_files"] + 4  # + info, stats, tasks, episodes
    reduction = source_files / output_files
    print(f"\nconvert, median of {max(1, args.repeat)} (baseline: 1 worker inline)")
    print(f"  {'workers':>7} {'executor':>8} {'seconds':>8} {'best':>7} {'cpu s':>7} "
          f"{'eps/s':>8} {'MB/s':>7} {'x':>6}")
    for r in runs:
        print(f"  {r['workers']:>7} {r['executor']:>8} {r['seconds']:>8.2f} "
              f"{r['best_seconds']:>7.2f} {r['cpu_seconds']:>7.2f} {r['episodes_per_s']:>8.1f} "
              f"{r['mb_per_s']:>7.2f} {r['speedup']:>6.2f}")
    print(f"  files: {source_files} -> {output_files} ({reduction:.1f}x fewer); bytes: "
          f"{last['source_bytes'] / 1e6:.1f} MB -> {last['output_bytes'] / 1e6:.1f} MB")
    best = max(runs, key=lambda r: r["episodes_per_s"])
    checks = _bench_verify(args, src, base_dst, best)
    return {"runs": runs, "file_reduction": reduction, "source_files": source_files,
            "output_files": output_files, "source_bytes": last["source_bytes"],
            "output_bytes": last["output_bytes"], "best": best, "dst": base_dst,
            "verify": checks}


def _bench_verify(args: argparse.Namespace, src: str, dst: str, best: dict[str, Any]
                  ) -> list[dict[str, Any]]:
    """The conversion's own check at each decoded-frame level, against the best conversion."""
    from jpfs.lerobot.verify import verify

    out = []
    executor = "thread" if best["executor"] == "inline" else best["executor"]
    for frames in ("sample", "full"):
        secs, cpu = [], []
        report: dict[str, Any] = {}
        for _ in range(max(1, args.repeat)):
            c0, t0 = _cpu_seconds(), time.perf_counter()
            report = verify(src, dst, workers=best["workers"], executor=executor,
                            progress=False, frames=frames)
            secs.append(time.perf_counter() - t0)
            cpu.append(_cpu_seconds() - c0)
        if not report["ok"]:
            raise RuntimeError(f"the benchmark's conversion does not verify: "
                               f"{report['problems'][:3]}")
        median = statistics.median(secs)
        out.append({"frames": frames, "seconds": median, "cpu_seconds": statistics.median(cpu),
                    "video_frames_decoded": report["video_frames_decoded"],
                    "share_of_convert": median / best["seconds"]})
    print(f"\nverify after convert, median of {max(1, args.repeat)} ({best['workers']} workers, "
          f"against the best conversion's {best['seconds']:.2f} s)")
    print(f"  {'frames':>7} {'seconds':>8} {'cpu s':>7} {'decoded':>8} {'x convert':>9}")
    for r in out:
        print(f"  {r['frames']:>7} {r['seconds']:>8.2f} {r['cpu_seconds']:>7.2f} "
              f"{r['video_frames_decoded']:>8} {r['share_of_convert']:>9.2f}")
    return out


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (process workers included)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ----------------------------------------------------------------------------------------------
# Reading. A "via" turns a local dataset folder into the root it is read from; add new ones to
# VIAS (e.g. a native-client reader) or pass any fsspec URL / jpfs: path.


def _via_local(root: str, name: str) -> str:
    return root


VIAS: dict[str, Callable[[str, str], str]] = {"local": _via_local}


def _via_url(base: str) -> Callable[[str, str], str]:
    """Copy the dataset under ``base`` (fsspec URL) once, untimed, and read it from there."""
    from jpfs.uri import is_jpfs, to_path, to_url

    url = to_url(to_path(base)) if is_jpfs(base) else base

    def place(root: str, name: str) -> str:
        from jpfs.lerobot.fsutil import get_fs, join

        fs, path = get_fs(url)
        dest = join(path, name)
        if fs.exists(dest):
            fs.rm(dest, recursive=True)
        fs.put(root.rstrip("/") + "/", dest, recursive=True)
        return url.rstrip("/") + "/" + name

    return place


def read_scan(root: str) -> int:
    """Read every row of every data file in order; returns the rows read."""
    from jpfs.lerobot.dataset import load_meta
    from jpfs.lerobot.fsutil import get_fs, join, open_parquet

    meta = load_meta(root)
    fs, base = get_fs(root)
    rows = 0
    for rel in meta.data_files:
        rows += open_parquet(fs, join(base, rel)).read().num_rows
    return rows


def read_episodes(root: str, seed: int = 0) -> int:
    """Read each episode's rows on its own in shuffled order, opening each file once (a file
    off the local filesystem is fetched whole at its first episode)."""
    from jpfs.lerobot.dataset import load_meta
    from jpfs.lerobot.fsutil import get_fs, join, open_parquet

    meta = load_meta(root)
    fs, base = get_fs(root)
    order = list(meta.episodes)
    random.Random(seed).shuffle(order)
    handles: dict[str, Any] = {}
    rows = 0
    for ep in order:
        parquet = handles.get(ep.data_file)
        if parquet is None:
            parquet = handles[ep.data_file] = open_parquet(fs, join(base, ep.data_file))
        groups, first = _row_groups(parquet.metadata, ep.row_start, ep.length)
        table = parquet.read_row_groups(groups)
        rows += table.slice(ep.row_start - first, ep.length).num_rows
    return rows


def _row_groups(md: Any, start: int, length: int) -> tuple[list[int], int]:
    """Row groups covering rows [start, start + length), and the first row of the first one."""
    groups = []
    first = None
    pos = 0
    for i in range(md.num_row_groups):
        n = md.row_group(i).num_rows
        if pos + n > start and pos < start + length:
            groups.append(i)
            first = pos if first is None else first
        pos += n
    return groups, first or 0


def data_bytes(root: str) -> int:
    """Bytes of a dataset's data files (what a full read touches)."""
    from jpfs.lerobot.dataset import load_meta
    from jpfs.lerobot.fsutil import get_fs, join

    meta = load_meta(root)
    fs, base = get_fs(root)
    return sum(fs.size(join(base, rel)) for rel in meta.data_files)


PATTERNS: dict[str, Callable[[str], int]] = {
    "scan": read_scan, "episodes": read_episodes}


def _bench_read(args: argparse.Namespace, v21: str, v30: str, work: str) -> dict[str, Any]:
    """Both formats per pattern, interleaved run by run; wall and CPU seconds, medians."""
    out: dict[str, Any] = {}
    n = max(1, args.repeat)
    print(f"\nread every frame's data, warm, median of {n} (baseline: v2.1, same via)")
    print(f"  {'via':<16} {'pattern':<9} {'format':<6} {'seconds':>8} {'cpu s':>7} "
          f"{'frames/s':>10} {'MB/s':>7} {'x':>6} {'x cpu':>6}")
    for via in args.via:
        place = VIAS.get(via) or _via_url(via)
        roots = {"v2.1": place(v21, "v21"), "v3.0": place(v30, "v30")}
        out[via] = {}
        for pattern, reader in PATTERNS.items():
            wall: dict[str, list[float]] = {fmt: [] for fmt in roots}
            cpu: dict[str, list[float]] = {fmt: [] for fmt in roots}
            rows: dict[str, int] = {}
            for root in roots.values():
                reader(root)  # warm-up, untimed
            for _ in range(n):
                for fmt, root in roots.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    rows[fmt] = reader(root)
                    wall[fmt].append(time.perf_counter() - t0)
                    cpu[fmt].append(time.process_time() - c0)
            res: dict[str, Any] = {}
            for fmt, root in roots.items():
                secs = statistics.median(wall[fmt])
                res[fmt] = {"seconds": secs, "cpu_seconds": statistics.median(cpu[fmt]),
                            "frames_per_s": rows[fmt] / secs,
                            "mb_per_s": data_bytes(root) / secs / 1e6, "frames": rows[fmt]}
            for fmt, r in res.items():
                r["ratio"] = res["v2.1"]["seconds"] / r["seconds"]
                r["cpu_ratio"] = res["v2.1"]["cpu_seconds"] / max(r["cpu_seconds"], 1e-9)
                print(f"  {via:<16} {pattern:<9} {fmt:<6} {r['seconds']:>8.3f} "
                      f"{r['cpu_seconds']:>7.3f} {r['frames_per_s']:>10.0f} "
                      f"{r['mb_per_s']:>7.1f} {r['ratio']:>6.2f} {r['cpu_ratio']:>6.2f}")
            out[via][pattern] = res
    return out
