"""``jpfs lerobot``: convert LeRobot datasets from v2.1 to v3.0, verify, and describe them."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from jpfs.errors import JPFSError

from .common import plural

log = logging.getLogger(__name__)

CONVERT_DESCRIPTION = """\
Convert a LeRobot v2.1 dataset (a parquet and an mp4 per camera per episode) into the v3.0
layout (many episodes per file), as LeRobot's official converter does: episode parquets are
concatenated in episode order into data files of up to --data-file-mb, each camera's episode
mp4s are joined by stream copy (no re-encode) into video files of up to --video-file-mb, and
meta/ is rewritten (info.json, tasks.parquet, episodes/, stats.json). SRC is never modified.

Each episode's video keeps its frames where they were: rebased on its first presentation time
(B-frames included), shown from where the previous episode's last frame ends. Videos that
cannot be joined by stream copy (other codec parameters, frames hidden by an edit list) are
refused with the episode named, never re-timed or re-encoded silently.

Output files are written in parallel (--workers) under temporary names and renamed when
complete; a progress journal in DST/.jpfs-convert lets a rerun with the same arguments finish
an interrupted conversion. meta/info.json is written last, so an unfinished DST never looks like
a valid dataset. What was written is then checked against SRC (--verify, default sample: every
row, every frame's time and count, and the decoded pixels of each episode's first, middle and
last frames; full decodes every frame); a mismatch exits 1 and names the episode and frame.

SRC and DST are local paths or JPFS paths (jpfs:/datasets/aloha).

examples:
  jpfs lerobot convert /data/aloha-v21 /data/aloha-v30
  jpfs lerobot convert jpfs:/lerobot/pusht jpfs:/lerobot/pusht-v30 --workers 4 --verify full
"""

VERIFY_DESCRIPTION = """\
Check that DST (v3.0) is a faithful conversion of SRC (v2.1), by what a loader sees: every
frame's data row is equal; inside each episode's from/to span DST's video holds exactly SRC's
frames, each shown at the same time relative to the episode's start and decoding to SRC's
pixels bit for bit; episodes, tasks and index ranges match. Compressed packets are not
compared: a remuxer may rewrite them and keep every frame. Exits 1 and lists the problems when
anything differs, naming the episode, camera and frame, and where the wanted frame was found.

--frames full (default) decodes every frame of both; sample decodes each episode's first,
middle and last frames (frame times and counts are still checked for every frame).
"""

INFO_DESCRIPTION = """\
Print a dataset's summary: LeRobot version, episodes, frames, fps, cameras and codecs, tasks,
and file counts and sizes of data/, videos/ and meta/. Works on v2.1 and v3.0 datasets, local or
in JPFS (jpfs:/path). The first video file of each camera is probed, and a codec or frame size
that contradicts meta/info.json is printed as a warning.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lerobot", help="LeRobot datasets: convert v2.1 -> v3.0, verify, info",
                       description="LeRobot datasets (v2.1 and v3.0) on local disks and in JPFS.")
    lsub = p.add_subparsers(dest="lerobot", metavar="COMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    raw = argparse.RawDescriptionHelpFormatter

    c = lsub.add_parser("convert", help="convert a v2.1 dataset to v3.0 (parallel, resumable)",
                        description=CONVERT_DESCRIPTION, formatter_class=raw)
    c.add_argument("src", metavar="SRC", help="the v2.1 dataset (read only)")
    c.add_argument("dst", metavar="DST",
                   help="where the v3.0 dataset goes: new, empty, or an unfinished conversion")
    c.add_argument("--data-file-mb", type=float, default=100, metavar="MB",
                   help="data file size limit, uncompressed parquet MB (default 100)")
    c.add_argument("--video-file-mb", type=float, default=200, metavar="MB",
                   help="video file size limit in MB (default 200)")
    c.add_argument("--workers", type=int, default=None, metavar="N",
                   help="output files written in parallel (default: one per core, at most 8)")
    c.add_argument("--executor", choices=("thread", "process"), default="thread",
                   help="worker threads (default: measured faster) or processes")
    c.add_argument("--files-per-chunk", type=int, default=1000, metavar="N",
                   help="files per chunk-NNN folder (LeRobot: 1000)")
    c.add_argument("--row-group-rows", type=int, default=0, metavar="N",
                   help="parquet row groups: 0 (default) puts each episode in its own row group "
                        "so one episode is read without its neighbours; N packs whole episodes "
                        "until a group has N rows (faster full scans)")
    c.add_argument("--verify", nargs="?", const="full", default="sample",
                   choices=("sample", "full", "off"),
                   help="check DST against SRC after converting: sample (default) decodes each "
                        "episode's first, middle and last frames, full (or a bare --verify) "
                        "every frame, off skips the check")
    _common(c)
    c.set_defaults(func=_convert)

    v = lsub.add_parser("verify", help="check a conversion frame by frame",
                        description=VERIFY_DESCRIPTION, formatter_class=raw)
    v.add_argument("src", metavar="SRC", help="the v2.1 dataset")
    v.add_argument("dst", metavar="DST", help="its v3.0 conversion")
    v.add_argument("--workers", type=int, default=None, metavar="N",
                   help="files checked in parallel (default: one per core, at most 8)")
    v.add_argument("--frames", choices=("full", "sample"), default="full",
                   help="decode every video frame (full, default) or each episode's first, "
                        "middle and last (sample)")
    _common(v)
    v.set_defaults(func=_verify)

    i = lsub.add_parser("info", help="summarize a dataset (v2.1 or v3.0)",
                        description=INFO_DESCRIPTION, formatter_class=raw)
    i.add_argument("path", metavar="PATH", help="dataset root, local or jpfs:/path")
    i.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    i.set_defaults(func=_info)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print the figures as one JSON object on the last line")


def _root(path: str) -> str:
    """A command-line path as lerobot functions take it: jpfs:/a/b becomes jpfs://a/b."""
    from jpfs.uri import is_jpfs, to_path, to_url

    return to_url(to_path(path)) if is_jpfs(path) else path


def _dataset(call: Callable[[], Any], *given: str) -> Any:
    """``call()``, with "meta/info.json: missing" said as what it means for the path the user
    gave: not a LeRobot dataset's root."""
    from jpfs.lerobot.fsutil import DatasetError
    from jpfs.lerobot.layout import INFO_PATH

    try:
        return call()
    except DatasetError as e:
        if e.message != "missing" or not e.path.endswith(INFO_PATH):
            raise
        root = e.path[:-len(INFO_PATH)].rstrip("/")
        path = next((g for g in given if root in (_key(g), _key(g)[len("jpfs:"):],
                                                  _key(g)[len("jpfs:/"):])), given[0])
        raise JPFSError(errno.ENOENT, "not a LeRobot dataset: it has no meta/info.json (give "
                        "the dataset's root, the folder that holds meta/ and data/)",
                        path) from None


def _key(path: str) -> str:
    """A dataset root, local or JPFS, spelled one way for comparisons."""
    from jpfs.uri import is_jpfs, to_path

    if is_jpfs(path):
        return "jpfs:" + to_path(path)
    return os.path.realpath(path)


def _check_destination(src: str, dst: str) -> None:
    """A conversion writes a new dataset beside its source, never into it."""
    s, d = _key(src), _key(dst)
    if d == s or d.startswith(s.rstrip("/") + "/"):
        where = "is the source" if d == s else f"is inside the source {src}"
        raise JPFSError(errno.EINVAL, f"the destination {where}: convert writes a new v3.0 "
                        f"dataset and never modifies SRC; choose a folder outside it, e.g. "
                        f"{src.rstrip('/')}-v3.0", dst)


def _emit(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    if args.json:
        sys.stdout.flush()
        print(json.dumps(figures, sort_keys=True, default=str))


def _convert(args: argparse.Namespace) -> int:
    from jpfs.config import format_size
    from jpfs.lerobot.convert import convert

    _check_destination(args.src, args.dst)
    figures = _dataset(lambda: convert(
        _root(args.src), _root(args.dst), data_file_mb=args.data_file_mb,
        video_file_mb=args.video_file_mb, workers=args.workers,
        chunks_size=args.files_per_chunk, executor=args.executor,
        row_group_rows=args.row_group_rows, progress=not args.no_progress, verify="off"),
        args.src)
    if figures.get("already_done"):
        print(f"{args.dst} already holds the finished v3.0 dataset; nothing to do")
    else:
        secs = max(figures["seconds"], 1e-9)
        print(f"converted {figures['episodes']} episodes ({figures['frames']} frames, "
              f"{figures['cameras']} cameras) in {secs:.2f} s")
        print(f"  files  {figures['source_files']} -> {figures['data_files']} data + "
              f"{figures['video_files']} video")
        print(f"  bytes  {format_size(figures['source_bytes'])} -> "
              f"{format_size(figures['output_bytes'])}")
        print(f"  rate   {figures['episodes'] / secs:.1f} episodes/s, "
              f"{figures['source_bytes'] / secs / 1e6:.1f} MB/s")
        if figures["tasks_resumed"]:
            print(f"  resumed: {figures['tasks_resumed']} files were already done")
    rc = 0
    if args.verify != "off":
        report = _run_verify(args, args.verify)
        figures["verify"] = report
        rc = 0 if report["ok"] else 1
    _emit(args, figures)
    return rc


def _run_verify(args: argparse.Namespace, frames: str) -> dict[str, Any]:
    from jpfs.lerobot.verify import verify

    report = _dataset(lambda: verify(_root(args.src), _root(args.dst), workers=args.workers,
                                     progress=not args.no_progress, frames=frames),
                      args.src, args.dst)
    if report["ok"]:
        decoded = (f" ({report['video_frames_decoded']} video frames decoded, {frames})"
                   if report["episode_videos_checked"] else "")
        print(f"verified {report['episodes']} episodes: {report['frames_checked']} frames and "
              f"{report['episode_videos_checked']} episode videos match{decoded}")
        for n in report.get("notes", ()):
            print(f"  note: {n}")
    else:
        print(f"verify FAILED: {report['problem_count']} problems", file=sys.stderr)
        for p in report["problems"]:
            print(f"  {p}", file=sys.stderr)
    return report


def _verify(args: argparse.Namespace) -> int:
    report = _run_verify(args, args.frames)
    _emit(args, report)
    return 0 if report["ok"] else 1


def _info(args: argparse.Namespace) -> int:
    from jpfs.config import format_size
    from jpfs.lerobot.summary import describe

    d = _dataset(lambda: describe(_root(args.path)), args.path)
    lengths = d["episode_length"]
    print(f"{args.path}: LeRobot {d['version']} ({d['robot_type']})")
    print(f"  episodes   {d['episodes']}  (length {lengths['min']}-{lengths['max']}, "
          f"mean {lengths['mean']:.0f})")
    print(f"  frames     {d['frames']} at {d['fps']} fps")
    print(f"  tasks      {d['tasks']}")
    print(f"  features   {', '.join(d['features'])}")
    for key, cam in d["cameras"].items():
        shape = "x".join(str(s) for s in cam["shape"] or [])
        print(f"  camera     {key}: {shape} {cam['codec']}, {plural(cam['files'], 'file')}")
        for line in cam.get("mismatch", ()):
            print(f"  warning    {key}: {line}")
    for part, v in d["parts"].items():
        if v["files"]:
            print(f"  {part + '/':<10} {plural(v['files'], 'file')}, {format_size(v['bytes'])}")
    print(f"  total      {plural(d['files'], 'file')}, {format_size(d['bytes'])}")
    if d["version"] == "v3.0":
        print(f"  limits     data {d['data_files_size_in_mb']} MB, "
              f"video {d['video_files_size_in_mb']} MB")
    _emit(args, d)
    return 0
