"""``jpfs bench loader``: ShardDataset vs a naive LeRobot-style map dataset and, where lerobot is
installed, the official ``LeRobotDataset``: same data, same DataLoader, same run."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

log = logging.getLogger(__name__)

HELP = "data loader samples/s: ShardDataset vs LeRobotDataset and a naive map dataset"
DESCRIPTION = """\
Measure training-sample throughput of jpfs.torch.ShardDataset against the baseline every LeRobot
user starts from: a map-style dataset that opens the episode's parquet file (and, with --video,
its mp4s) for every sample, shuffled by a seeded sampler. Both run through a torch DataLoader
with the same number of workers, on the same files, in the same run; samples carry the same
features and the same delta_timestamps action chunk.

Where the official lerobot package is importable (lerobot 0.6 needs Python >= 3.12), its
LeRobotDataset is measured too, over the v3.0 copy: the same delta_timestamps, a DataLoader with
the same workers and batch size and a seeded shuffle sampler, video decoded by its default
backend (torchcodec where it loads, else PyAV); without lerobot that row says why it is missing.
The hub is not contacted (HF_HUB_OFFLINE=1 unless set).

Reported: samples/s, MB/s (bytes of the tensors delivered) and the distinct episodes in a batch
(how far the shuffle mixes: a global shuffle draws nearly every sample from another episode, the
two-level one from the episodes in its buffer), for
  lerobot    the official LeRobotDataset over v3.0 (global random access over frames)
  naive      the map dataset over v2.1 (one file per episode)
  drop-in    ShardDataset yielding samples, batched by the DataLoader's default collate
  collate    drop-in, with collate_fn=jpfs.torch.collate (one shared buffer per batch)
  batched    ShardDataset yielding whole batches (columns gathered straight into buffers)
  ring       the batched ShardDataset through jpfs.torch.to_device in the training process
             (the pinned-ring pipeline: one reader thread, no DataLoader workers)
over v2.1 and over v3.0 copies of one generated dataset, and the ratios. Each figure is the median
of --repeat runs of --seconds each, epoch after epoch (persistent workers; only the very first
batch, worker start-up, is not timed).

examples:
  jpfs bench loader                      # generate a small dataset in a temp dir and compare
  jpfs bench loader --episodes 400 --workers 2 --seconds 10
  jpfs bench loader --video --episodes 20    # decode one camera too (encoded AV1)
  jpfs bench loader --video --cameras 2 --episodes 30   # beside lerobot: run where it imports
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench loader``."""
    parser.add_argument("--dir", default=None,
                        help="work folder for the v2.1 and v3.0 copies (local or jpfs:/path): "
                             "generated if absent, reused if there (default: a temporary "
                             "folder, removed afterwards)")
    parser.add_argument("--episodes", type=int, default=200, help="episodes (default 200)")
    parser.add_argument("--frames-per-episode", default="100-300", metavar="A-B",
                        help="frames per episode range (default 100-300)")
    parser.add_argument("--video", action="store_true",
                        help="encoded cameras, decoded by every loader (default: tabular)")
    parser.add_argument("--cameras", type=int, default=1,
                        help="cameras with --video (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--chunk", type=int, default=16,
                        help="future actions per sample (delta_timestamps; default 16)")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="time limit per measurement (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="dataset and shuffle seed")
    parser.add_argument("--no-lerobot", action="store_true",
                        help="leave out the official LeRobotDataset even where it is installed")
    parser.add_argument("--worker-sharing", default="file_system",
                        choices=["file_system", "file_descriptor", "keep"],
                        help="how ShardDataset's DataLoader workers hand tensors over "
                             "(ShardDataset's worker_sharing; keep: torch's setting, "
                             "file_descriptor by default; default file_system)")


# The baseline -------------------------------------------------------------------------------


def naive_dataset(root: str, delta_timestamps: dict[str, list[float]], video: bool) -> Any:
    """A LeRobot-style map dataset: each ``ds[i]`` opens its episode's files and picks a row."""
    import bisect

    import fsspec
    import numpy as np
    import torch

    from jpfs.lerobot.dataset import load_meta
    from jpfs.lerobot.fsutil import read_table

    class NaiveEpisodeDataset(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.fs, self.base = fsspec.core.url_to_fs(root)
            self.meta = load_meta(root, fs=self.fs)
            self.starts = [ep.dataset_from for ep in self.meta.episodes]
            fps = self.meta.fps
            self.deltas = {k: [round(d * fps) for d in v] for k, v in delta_timestamps.items()}
            self.video_keys = self.meta.video_keys if video else ()

        def __len__(self) -> int:
            return self.meta.total_frames

        def __getitem__(self, i: int) -> dict[str, Any]:
            ep = self.meta.episodes[bisect.bisect_right(self.starts, i) - 1]
            table = read_table(self.fs, f"{self.base}/{ep.data_file}")
            rows = table.slice(ep.row_start, ep.length).to_pydict()
            r = i - ep.dataset_from
            item: dict[str, Any] = {}
            for key, values in rows.items():
                if key in self.deltas:
                    q = [r + d for d in self.deltas[key]]
                    item[key] = torch.tensor([values[min(max(j, 0), ep.length - 1)] for j in q])
                    item[f"{key}_is_pad"] = torch.tensor([j < 0 or j >= ep.length for j in q])
                else:
                    item[key] = torch.tensor(values[r])
            for key in self.video_keys:
                import av

                seg = ep.videos[key]
                t = seg.from_timestamp + rows["timestamp"][r]
                with self.fs.open(f"{self.base}/{seg.path}", "rb") as f, av.open(f) as c:
                    s = c.streams.video[0]
                    c.seek(int(t / s.time_base), stream=s, backward=True)
                    for frame in c.decode(s):
                        if frame.time >= t - 1e-4:
                            break
                    rgb = frame.to_ndarray(format="rgb24")
                item[key] = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1))
                                             ).float() / 255
            return item

    return NaiveEpisodeDataset()


def lerobot_missing() -> str | None:
    """Why the official LeRobotDataset cannot be measured here, or None when it can."""
    if importlib.util.find_spec("lerobot") is None:
        return ("lerobot is not installed in this environment (pip install lerobot==0.6.1; it "
                "needs Python >= 3.12 and torch>=2.7,<2.12)")
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to report
        return f"lerobot is installed but LeRobotDataset does not import: {e!r}"
    return None


def lerobot_default_backend() -> str:
    """LeRobot's own choice of video decoder here (torchcodec if it loads, else pyav), made
    once: lerobot logs a long traceback each time torchcodec fails to load."""
    from lerobot.utils.import_utils import get_safe_default_video_backend

    quiet = logging.getLogger("lerobot.utils.import_utils")
    was = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return get_safe_default_video_backend()
    finally:
        quiet.setLevel(was)


def lerobot_dataset(root: str, delta_timestamps: dict[str, list[float]], backend: str) -> Any:
    """The official ``LeRobotDataset`` over a local v3.0 root (``backend``: its default)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local root: never ask the hub
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    return LeRobotDataset("local/jpfs-bench", root=root, delta_timestamps=delta_timestamps,
                          video_backend=backend)


# Measuring ----------------------------------------------------------------------------------


def _nbytes(batch: dict[str, Any]) -> int:
    import torch

    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def measure(loader: Any, seconds: float) -> dict[str, float]:
    """Samples/s, MB/s and distinct episodes per batch (what the shuffle mixes) over
    ``seconds``, epoch after epoch, the first batch not timed.

    Epoch ends (and, for ShardDataset, the next epoch's first reads) are inside the timing.
    """
    epoch = 0
    it = iter(loader)
    next(it)
    samples = nbytes = batches = 0
    mixed: list[int] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            batch = next(it)
        except StopIteration:
            epoch += 1
            ds = loader.dataset
            if hasattr(ds, "set_epoch"):
                ds.set_epoch(epoch)
            it = iter(loader)
            continue
        samples += len(batch["index"])
        nbytes += _nbytes(batch)
        # How far the shuffle mixes; every 8th batch, to keep the count off the clock.
        if batches % 8 == 0 and "episode_index" in batch:
            mixed.append(len(set(batch["episode_index"].tolist())))
        batches += 1
    dt = time.perf_counter() - t0
    del it
    return {"samples_s": samples / dt, "mb_s": nbytes / dt / 1e6, "samples": samples,
            "episodes_per_batch": statistics.fmean(mixed) if mixed else 0.0}


def _exists(path: str) -> bool:
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


def _describe(root: str) -> dict[str, Any]:
    """The generator's figures for a dataset already there (--dir reused)."""
    from jpfs.lerobot.dataset import load_meta

    meta = load_meta(root)
    return {"episodes": len(meta.episodes), "frames": meta.total_frames,
            "data_files": len(meta.data_files)}


class _InProcess:
    """``to_device(ds, "cpu")``: the in-process pinned-ring pipeline (a reader thread, no
    workers), iterated like a DataLoader."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __iter__(self) -> Any:
        from jpfs.torch import to_device

        return to_device(self.dataset, "cpu")


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``jpfs bench loader`` (DataLoader throughput over the v2.1 and v3.0 copies): print the
    report, return the figures."""
    import torch
    from torch.utils.data import DataLoader

    from jpfs.lerobot.generate import generate
    from jpfs.torch import ShardDataset
    from jpfs.uri import is_jpfs, to_path, to_url

    lo, _, hi = args.frames_per_episode.partition("-")
    frames = (int(lo), int(hi or lo))
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="jpfs-bench-loader-")
        base = tmp
    else:
        base = to_url(to_path(args.dir)) if is_jpfs(args.dir) else args.dir
    roots = {"v2.1": f"{base.rstrip('/')}/v21", "v3.0": f"{base.rstrip('/')}/v30"}
    try:
        gen = {}
        for fmt, root in roots.items():
            t0 = time.perf_counter()
            if _exists(f"{root}/meta/info.json"):
                gen[fmt] = _describe(root)
                print(f"reusing {root} ({gen[fmt]['frames']} frames)")
                continue
            gen[fmt] = generate(root, episodes=args.episodes,
                                cameras=args.cameras if args.video else 0,
                                frames_per_episode=frames, video="encoded" if args.video else
                                "stub", format=fmt, seed=args.seed, progress=False)
            log.info("generated %s in %.1fs", fmt, time.perf_counter() - t0)
        fps = 30
        deltas = {"action": [i / fps for i in range(args.chunk)]}
        if args.video:
            print(f"video: {args.cameras} x 96x72 AV1 camera(s) decoded per sample")
        dl_kw = dict(num_workers=args.workers, persistent_workers=args.workers > 0)
        if args.workers:
            dl_kw["prefetch_factor"] = 4
        torch.set_num_threads(1)

        sharing = None if args.worker_sharing == "keep" else args.worker_sharing

        def naive() -> Any:
            g = torch.Generator().manual_seed(args.seed)
            return DataLoader(naive_dataset(roots["v2.1"], deltas, args.video),
                              batch_size=args.batch_size, shuffle=True, generator=g, **dl_kw)

        def dropin(fmt: str) -> Any:
            ds = ShardDataset(roots[fmt], delta_timestamps=deltas, video=args.video,
                              seed=args.seed, worker_sharing=sharing)
            return DataLoader(ds, batch_size=args.batch_size, **dl_kw)

        def packed(fmt: str) -> Any:
            from jpfs.torch import collate

            ds = ShardDataset(roots[fmt], delta_timestamps=deltas, video=args.video,
                              seed=args.seed, worker_sharing=sharing)
            return DataLoader(ds, batch_size=args.batch_size, collate_fn=collate, **dl_kw)

        def batched(fmt: str) -> Any:
            ds = ShardDataset(roots[fmt], delta_timestamps=deltas, video=args.video,
                              seed=args.seed, batch_size=args.batch_size,
                              worker_sharing=sharing)
            return DataLoader(ds, batch_size=None, **dl_kw)

        def ring(fmt: str) -> Any:
            ds = ShardDataset(roots[fmt], delta_timestamps=deltas, video=args.video,
                              seed=args.seed, batch_size=args.batch_size)
            return _InProcess(ds)

        cases: dict[str, Any] = {}
        lerobot_why = "left out (--no-lerobot)" if args.no_lerobot else lerobot_missing()
        if lerobot_why is None and is_jpfs(roots["v3.0"]):
            lerobot_why = ("LeRobotDataset reads local folders only; give a local --dir (or "
                           "a mounted one) to measure it")
        backend = video_keys = None
        if lerobot_why is None:
            backend = lerobot_default_backend()
            video_keys = lerobot_dataset(roots["v3.0"], deltas, backend).meta.video_keys

            def official() -> Any:
                g = torch.Generator().manual_seed(args.seed)
                return DataLoader(lerobot_dataset(roots["v3.0"], deltas, backend),
                                  batch_size=args.batch_size, shuffle=True, generator=g, **dl_kw)

            cases["lerobot v3.0"] = official
        cases |= {"naive v2.1": naive,
                 "drop-in v2.1": lambda: dropin("v2.1"), "drop-in v3.0": lambda: dropin("v3.0"),
                 "collate v3.0": lambda: packed("v3.0"),
                 "batched v2.1": lambda: batched("v2.1"), "batched v3.0": lambda: batched("v3.0"),
                 "ring v2.1": lambda: ring("v2.1"), "ring v3.0": lambda: ring("v3.0")}
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
        for _ in range(max(args.repeat, 1)):
            for name, make in cases.items():  # interleaved: drift hits every case alike
                runs[name].append(measure(make(), args.seconds))
        res = {k: _median(v) for k, v in runs.items()}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    naive_s = res["naive v2.1"]["samples_s"]
    lerobot_s = res["lerobot v3.0"]["samples_s"] if "lerobot v3.0" in res else None
    print(f"{gen['v2.1']['episodes']} episodes, {gen['v2.1']['frames']} frames; "
          f"v3.0: {gen['v3.0']['data_files']} data files; workers {args.workers}, "
          f"batch {args.batch_size}, action chunk {args.chunk}, cores {os.cpu_count()}; "
          f"ShardDataset workers share by {args.worker_sharing}")
    if lerobot_why is not None:
        print(f"lerobot baseline: skipped: {lerobot_why}")
    elif video_keys:
        print(f"lerobot baseline: LeRobotDataset, video decoded by {backend} (its default "
              "here: torchcodec where it loads, else pyav)")
        if backend != "torchcodec":
            print("  torchcodec did not load: it needs FFmpeg's shared libraries (Debian: "
                  "apt-get install ffmpeg); lerobot's default decoder is torchcodec")
    print(f"{'loader':<16}{'samples/s':>12}{'MB/s':>10}{'x naive':>10}"
          + (f"{'x lerobot':>11}" if lerobot_s else "") + f"{'episodes/batch':>16}")
    for name, r in res.items():
        ratio = r["samples_s"] / naive_s if naive_s else float("inf")
        line = f"{name:<16}{r['samples_s']:>12.0f}{r['mb_s']:>10.1f}{ratio:>10.1f}"
        if lerobot_s:
            line += f"{r['samples_s'] / lerobot_s:>11.1f}"
        print(line + f"{r['episodes_per_batch']:>16.1f}")
    fig: dict[str, Any] = {
        "workers": args.workers, "batch_size": args.batch_size, "video": args.video,
        "worker_sharing": args.worker_sharing,
        "cameras": args.cameras if args.video else 0,
        "episodes": gen["v2.1"]["episodes"], "frames": gen["v2.1"]["frames"],
        "lerobot_skipped": lerobot_why,
        "lerobot_video_backend": backend if video_keys else None,
    }
    for name, r in res.items():
        key = name.replace(" ", "_").replace("-", "").replace(".", "")
        fig[f"{key}_samples_s"] = round(r["samples_s"], 1)
        fig[f"{key}_mb_s"] = round(r["mb_s"], 2)
        fig[f"{key}_episodes_per_batch"] = round(r["episodes_per_batch"], 2)
    best = max(res["batched v3.0"]["samples_s"], res["batched v2.1"]["samples_s"])
    fig["ratio_batched_vs_naive"] = round(best / naive_s, 2) if naive_s else None
    fig["ratio_dropin_vs_naive"] = round(
        max(res["drop-in v3.0"]["samples_s"], res["drop-in v2.1"]["samples_s"]) / naive_s, 2
    ) if naive_s else None
    fig["ratio_v30_vs_v21_batched"] = round(
        res["batched v3.0"]["samples_s"] / res["batched v2.1"]["samples_s"], 3)
    fig["ratio_ring_vs_naive"] = round(
        max(res["ring v3.0"]["samples_s"], res["ring v2.1"]["samples_s"]) / naive_s, 2
    ) if naive_s else None
    fig["ratio_v30_vs_v21_dropin"] = round(
        res["drop-in v3.0"]["samples_s"] / res["drop-in v2.1"]["samples_s"], 3)
    if lerobot_s:
        fig["ratio_dropin_vs_lerobot"] = round(res["drop-in v3.0"]["samples_s"] / lerobot_s, 2)
        fig["ratio_batched_vs_lerobot"] = round(res["batched v3.0"]["samples_s"] / lerobot_s, 2)
        print(f"ShardDataset vs the official LeRobotDataset (v3.0, {args.workers} workers each): "
              f"{fig['ratio_dropin_vs_lerobot']}x drop-in, {fig['ratio_batched_vs_lerobot']}x "
              "batched")
    print(f"ShardDataset vs naive, {args.workers} workers each: "
          f"{fig['ratio_batched_vs_naive']}x batched, {fig['ratio_dropin_vs_naive']}x drop-in "
          f"(target 10x); in-process ring: {fig['ratio_ring_vs_naive']}x; v3.0/v2.1: "
          f"{fig['ratio_v30_vs_v21_batched']} batched, {fig['ratio_v30_vs_v21_dropin']} drop-in")
    return fig
