"""``jpfs bench gen``: write a synthetic LeRobot dataset (v2.1 or v3.0) to a folder or into JPFS."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .harness import size_arg

log = logging.getLogger(__name__)

HELP = "generate a synthetic LeRobot dataset (v2.1 or v3.0)"
DESCRIPTION = """\
Write a LeRobot-shaped dataset: real meta files, real parquet columns and dtypes (timestamp,
frame_index, episode_index, index, task_index, observation.state, action), and one mp4 per camera
per episode: real tiny encoded video (PyAV; AV1 like LeRobot, else H.264) or sized stand-in bytes
(--video stub, for I/O benchmarks). Seeded: the same arguments give byte-identical parquet.

Real datasets have 200-800 frames per episode, 2-3 cameras, 30 fps (the defaults).

examples:
  jpfs bench gen /data/aloha-sim --episodes 200 --cameras 3
  jpfs bench gen jpfs:/datasets/toy --episodes 20 --video stub --video-bytes 512K
  jpfs bench gen /tmp/v30 --format v3.0 --episodes 100 --data-file-mb 10
  jpfs bench gen /tmp/bframes --codec h264 --video-options g=30,bf=2,preset=fast
"""


def _frames(text: str) -> int | tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        if not sep:
            return int(lo)
        return int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a frame count or range: {text!r} (200 or 200-800)"
                                         ) from None


def _options(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"not KEY=VALUE: {item!r} (e.g. g=30,bf=2)")
        out[key] = value
    return out


def _resolution(text: str) -> tuple[int, int]:
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise argparse.ArgumentTypeError(f"not a WIDTHxHEIGHT resolution: {text!r}")
    return int(w), int(h)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench gen``."""
    parser.add_argument("dir", metavar="DIR",
                        help="new or empty folder: a local path or jpfs:/path")
    parser.add_argument("--episodes", type=int, default=50, help="episodes (default 50)")
    parser.add_argument("--cameras", type=int, default=2, help="cameras (default 2)")
    parser.add_argument("--frames-per-episode", type=_frames, default=(200, 800), metavar="A[-B]",
                        help="frames per episode, fixed or a seeded uniform range "
                             "(default 200-800)")
    parser.add_argument("--fps", type=int, default=30, help="frames per second (default 30)")
    parser.add_argument("--video", choices=("auto", "encoded", "stub"), default="auto",
                        help="encoded: real mp4s via PyAV; stub: stand-in bytes; auto: encoded "
                             "when PyAV is installed (default)")
    parser.add_argument("--video-bytes", type=size_arg, default=256 * 1024, metavar="SIZE",
                        help="size of each stand-in video with --video stub (default 256K)")
    parser.add_argument("--resolution", type=_resolution, default=(96, 72), metavar="WxH",
                        help="camera resolution of encoded videos (default 96x72)")
    parser.add_argument("--codec", default=None,
                        help="video encoder: av1, h264, hevc or vp9 (default av1, else h264)")
    parser.add_argument("--video-options", type=_options, default={}, metavar="K=V[,K=V...]",
                        help="encoder options over the codec's defaults (a keyframe every 2 "
                             "frames, no B-frames), e.g. g=30,bf=2 for H.264 with B-frames")
    parser.add_argument("--format", choices=("v2.1", "v3.0"), default="v2.1",
                        help="LeRobot layout (default v2.1; v3.0 is generated then converted)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--state-dim", type=int, default=14,
                        help="observation.state length (default 14, ALOHA)")
    parser.add_argument("--action-dim", type=int, default=14, help="action length (default 14)")
    parser.add_argument("--tasks", type=int, default=4, help="distinct task strings (default 4)")
    parser.add_argument("--rewards", action="store_true",
                        help="add next.reward and next.done columns")
    parser.add_argument("--data-file-mb", type=float, default=100,
                        help="v3.0 data file size limit in MB (default 100)")
    parser.add_argument("--video-file-mb", type=float, default=200,
                        help="v3.0 video file size limit in MB (default 200)")
    parser.add_argument("--workers", type=int, default=None,
                        help="v3.0 conversion workers (default: one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``jpfs bench gen``: write a LeRobot-shaped dataset into ``args.dir``; its figures."""
    from jpfs.config import format_size
    from jpfs.lerobot.generate import generate
    from jpfs.uri import is_jpfs, to_path, to_url

    root = to_url(to_path(args.dir)) if is_jpfs(args.dir) else args.dir
    figures = generate(
        root, episodes=args.episodes, cameras=args.cameras,
        frames_per_episode=args.frames_per_episode, fps=args.fps, video=args.video,
        video_bytes=args.video_bytes, format=args.format, seed=args.seed,
        state_dim=args.state_dim, action_dim=args.action_dim, tasks=args.tasks,
        rewards=args.rewards, resolution=args.resolution, codec=args.codec,
        data_file_mb=args.data_file_mb, video_file_mb=args.video_file_mb,
        workers=args.workers, progress=not args.no_progress, video_options=args.video_options,
    )
    print(f"generated {figures['format']} dataset at {args.dir}")
    print(f"  episodes  {figures['episodes']}")
    print(f"  frames    {figures['frames']}")
    print(f"  cameras   {figures['cameras']}  video: {figures['video']}")
    print(f"  files     {figures['files']}  ({figures['data_files']} data, "
          f"{figures['video_files']} video)")
    print(f"  bytes     {format_size(figures['bytes'])}")
    print(f"  time      {figures['seconds']:.2f} s")
    return figures
