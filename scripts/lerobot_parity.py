#!/usr/bin/env python3
"""Frame-for-frame parity of JPFS's v2.1 -> v3.0 conversion with lerobot's own converter.

Run it in an environment where lerobot 0.6 imports (Python >= 3.12; README says how to install
JPFS beside it):

    python scripts/lerobot_parity.py SRC [--work DIR] [--data-file-mb MB] [--video-file-mb MB]

SRC is a local LeRobot v2.1 dataset (``jpfs bench gen`` makes one; add ``--codec h264
--video-options g=12,bf=2`` for B-frames). It is copied, never changed. The script converts it
twice, with lerobot's ``convert_dataset`` and with ``jpfs.lerobot.convert``, at the same file
size limits; checks both with ``jpfs lerobot verify --frames full``; then reads every sample of
both copies through the official ``LeRobotDataset`` (its default video decoder: torchcodec where
it loads, else PyAV) and compares every key, bit for bit. Exits 1 on any difference and names it;
3 when lerobot's converter fails on SRC (JPFS's conversion is then verified and read whole by
``LeRobotDataset`` alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("src", help="a local LeRobot v2.1 dataset")
    parser.add_argument("--work", default=None, help="work folder (default: a temporary one, "
                                                     "removed afterwards)")
    parser.add_argument("--data-file-mb", type=int, default=1,
                        help="v3.0 data file limit, both converters (1: several files)")
    parser.add_argument("--video-file-mb", type=int, default=2,
                        help="v3.0 video file limit, both converters (2: several files)")
    parser.add_argument("--backend", default=None,
                        help="LeRobotDataset's video_backend (default: lerobot's own choice)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local roots only: never ask the hub
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
        from lerobot.scripts.convert_dataset_v21_to_v30 import convert_dataset
    except ImportError as e:
        print(f"lerobot_parity: lerobot does not import here ({e}); install lerobot 0.6 "
              "(Python >= 3.12) and JPFS beside it as README says", file=sys.stderr)
        return 2
    from jpfs.lerobot.convert import convert
    from jpfs.lerobot.verify import verify

    work = Path(args.work or tempfile.mkdtemp(prefix="jpfs-lerobot-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        theirs = work / "lerobot" / "ds"  # lerobot converts in place, keeping ds_old beside
        ours = work / "jpfs"
        for p in (theirs.parent, ours):
            shutil.rmtree(p, ignore_errors=True)
        shutil.copytree(args.src, theirs)
        t0 = time.perf_counter()
        lerobot_failed = None
        try:
            convert_dataset("local/parity", root=theirs, push_to_hub=False,
                            data_file_size_in_mb=args.data_file_mb,
                            video_file_size_in_mb=args.video_file_mb)
        except Exception as e:  # noqa: BLE001 - whatever lerobot raises is the finding
            lerobot_failed = f"{type(e).__name__}: {e}"
        t1 = time.perf_counter()
        convert(args.src, str(ours), data_file_mb=args.data_file_mb,
                video_file_mb=args.video_file_mb, progress=False, verify="off")
        t2 = time.perf_counter()
        print(f"converted: lerobot {t1 - t0:.1f} s, jpfs {t2 - t1:.1f} s")
        failures = 0
        backend = args.backend or _default_backend()
        if lerobot_failed:
            print(f"lerobot's converter failed on this dataset: {lerobot_failed}")
            report = verify(args.src, str(ours), progress=False, frames="full")
            print(f"verify --frames full of jpfs's conversion: "
                  f"{'ok' if report['ok'] else 'FAILED'}; " + "; ".join(report["problems"][:5]))
            a = LeRobotDataset("local/parity-jpfs", root=ours, video_backend=backend)
            for i in range(len(a)):
                a[i]  # raises where a frame is not within the loader's tolerance
            print(f"LeRobotDataset read all {len(a)} samples of jpfs's conversion ({backend}); "
                  "no parity to show")
            return 3
        for name, root in (("jpfs", ours), ("lerobot", theirs)):
            report = verify(args.src, str(root), progress=False, frames="full")
            state = "ok" if report["ok"] else f"FAILED ({report['problem_count']} problems)"
            print(f"verify --frames full of {name}'s conversion: {state}, "
                  f"{report['video_frames_decoded']} frames decoded")
            for line in report["problems"][:10]:
                print(f"  {line}")
            failures += not report["ok"]
        a = LeRobotDataset("local/parity-jpfs", root=ours, video_backend=backend)
        b = LeRobotDataset("local/parity-lerobot", root=theirs, video_backend=backend)
        print(f"LeRobotDataset: {len(a)} and {len(b)} samples, video decoded by {backend}")
        if len(a) != len(b):
            print("sample counts differ")
            return 1
        failures += _compare(a, b)
        print("parity: " + ("every sample equal, every key" if not failures else
                            f"{failures} differences"))
        return 1 if failures else 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _default_backend() -> str:
    """lerobot's own choice (torchcodec where it loads, else pyav), said in one line: lerobot
    logs a long traceback when torchcodec does not load."""
    from lerobot.utils.import_utils import get_safe_default_video_backend

    quiet = logging.getLogger("lerobot.utils.import_utils")
    quiet.setLevel(logging.CRITICAL)
    backend = get_safe_default_video_backend()
    if backend != "torchcodec":
        print("torchcodec does not load here: it needs FFmpeg's shared libraries (Debian: "
              "apt-get install ffmpeg); lerobot decodes with pyav instead")
    return backend


def _compare(a, b) -> int:
    """Every key of every sample; the first differences printed."""
    import torch

    bad = 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        if x.keys() != y.keys():
            print(f"sample {i}: keys {sorted(x)} against {sorted(y)}")
            bad += 1
            continue
        for key in x:
            u, v = x[key], y[key]
            same = (torch.equal(u, v) if isinstance(u, torch.Tensor) and
                    isinstance(v, torch.Tensor) else u == v)
            if not same:
                bad += 1
                if bad <= 10:
                    print(f"sample {i} (episode {int(x['episode_index'])}, frame "
                          f"{int(x['frame_index'])}): {key} differs")
    return bad


if __name__ == "__main__":
    sys.exit(main())
