#!/usr/bin/env python3
"""GPU check for jpfs.torch's pinned pipeline: run it on a machine with CUDA.

    python scripts/gpu_check.py [--out DIR]

1. Results: batches that ``to_device(..., "cuda")`` delivers (in-process pinned ring, and a
   DataLoader with workers and ``pin_memory=True``) equal, bit for bit, what the CPU path yields
   for the same dataset, seed and epoch (a LeRobot v3.0 copy with a decoded camera, and plain
   parquet shards with a wide column).
2. Overlap: a training-like loop (a few GEMMs per batch) runs under torch.profiler; in the trace,
   host-to-device copies run on another stream than the kernels and overlap them in time. The
   Chrome trace is written to ``--out`` (``trace.json``) with a summary (``summary.json``).
3. Timing: where the loop's time goes (loader alone, steps alone) and the loop fed by the ring,
   by DataLoader workers and by plain synchronous ``.to(device)`` copies, with light steps
   (the loader is the limit) and heavy ones (the GPU is).

Without CUDA it runs the CPU half of (1) and says so (exit 0), so the script itself is tested
anywhere. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from jpfs.torch import ShardDataset, to_device  # noqa: E402

log = logging.getLogger("gpu_check")

WIDE = 8192  # floats per row of the wide column: 32 KiB a sample, so copies show in a profile


def make_plain(root: str, files: int = 4, rows: int = 2048) -> str:
    """Plain parquet shards with a wide float column (episodes of 64 rows)."""
    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    index = 0
    for f in range(files):
        wide = rng.standard_normal((rows, WIDE), dtype=np.float32)
        table = pa.table({
            "index": pa.array(np.arange(index, index + rows), pa.int64()),
            "episode_index": pa.array((np.arange(index, index + rows) // 64), pa.int64()),
            "obs": pa.FixedSizeListArray.from_arrays(pa.array(wide.reshape(-1)), WIDE),
            "action": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(rows * 7, dtype=np.float32)), 7),
        })
        pq.write_table(table, os.path.join(root, f"part-{f:03d}.parquet"), row_group_size=rows)
        index += rows
    return root


def have_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def make_lerobot(root: str) -> str:
    """A LeRobot v3.0 dataset; with one encoded camera when PyAV is there (carry its wheel to
    the GPU machine: its image has no PyAV), else tabular with stand-in videos."""
    from jpfs.lerobot.generate import generate

    generate(root, episodes=12, cameras=1, frames_per_episode=(20, 60),
             video="encoded" if have_av() else "stub", format="v3.0", seed=1, progress=False,
             data_file_mb=0.02)
    return root


def same(a: dict, b: dict) -> bool:
    """Equal batches: tensors bit for bit, other values (a LeRobot batch's task strings) by ==."""
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k].cpu(), b[k].cpu()) if isinstance(a[k], torch.Tensor)
               else a[k] == b[k] for k in a)


def host_copy(batch: dict) -> dict:
    """A batch on the host, owning its tensors (the pipeline reuses its pinned buffers)."""
    return {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def check_results(root: str, kw: dict, device: str, workers: int = 2) -> dict:
    """CPU-path batches vs device batches, in-process ring and DataLoader workers."""
    def ds() -> ShardDataset:
        return ShardDataset(root, batch_size=32, seed=3, **kw)

    ref = [host_copy(b) for b in to_device(ds(), "cpu")]
    res = {"batches": len(ref)}
    if device == "cpu":
        return res
    got = [host_copy(b) for b in to_device(ds(), device)]
    res["ring_equal"] = len(got) == len(ref) and all(map(same, ref, got))
    ref_w = [host_copy(b) for b in DataLoader(ds(), batch_size=None, num_workers=workers)]
    loader = DataLoader(ds(), batch_size=None, num_workers=workers, pin_memory=True)
    got_w = [host_copy(b) for b in to_device(loader, device)]
    res["dataloader_equal"] = len(got_w) == len(ref_w) and all(map(same, ref_w, got_w))
    return res


def step(batch: dict, weight: torch.Tensor, gemms: int = 12) -> torch.Tensor:
    """A stand-in training step: ``gemms`` fp32 GEMMs over the wide column (12 are ~7 ms on an
    H200, 256 rows by 8192 by 8192 each)."""
    x = batch["obs"]
    for _ in range(gemms):
        x = torch.tanh(x @ weight)
    return x.sum()


def plain_dataset(root: str) -> ShardDataset:
    return ShardDataset(root, columns=["index", "obs", "action"], batch_size=256, seed=5,
                        shuffle_buffer=1024)


def run_loop(source, weight: torch.Tensor, gemms: int) -> float:
    t0 = time.perf_counter()
    total = torch.zeros((), device=weight.device)
    for batch in source:
        total += step(batch, weight, gemms)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def check_overlap(root: str, out: str) -> dict:
    """Profile the loop; measure how much HtoD copy time overlaps kernels on other streams."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    weight = torch.randn(WIDE, WIDE, device=dev) / WIDE ** 0.5
    run_loop(to_device(plain_dataset(root), dev), weight, 12)  # warm-up: cuBLAS, page cache
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_loop(to_device(plain_dataset(root), dev), weight, 12)
    trace = os.path.join(out, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copy_streams = sorted({e["args"].get("stream") for e in copies})
    kernel_streams = sorted({e["args"].get("stream") for e in kernels})
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    overlapped = 0.0
    copy_time = 0.0
    for c in copies:
        a, z = c["ts"], c["ts"] + c["dur"]
        copy_time += z - a
        for s, e in spans:
            if s >= z:
                break
            overlapped += max(0.0, min(z, e) - max(a, s))
    res = {"copies": len(copies), "kernels": len(kernels), "copy_streams": copy_streams,
           "kernel_streams": kernel_streams, "copy_us": round(copy_time, 1),
           "copy_us_overlapped": round(overlapped, 1),
           "overlap_fraction": round(overlapped / copy_time, 3) if copy_time else 0.0,
           "trace": trace}
    res["separate_stream"] = bool(copy_streams) and not set(copy_streams) & set(kernel_streams)
    res["overlap_visible"] = res["overlap_fraction"] > 0.05
    return res


def time_loops(root: str, gemms: int) -> dict:
    """Where a training loop's time goes, in seconds per epoch of the plain shards: the loader
    alone (host only), the steps alone (batches already on the GPU), and the loop fed by
    ``to_device`` (in-process ring; DataLoader workers with pinned memory) or by synchronous
    ``.to(device)`` copies. A loop bound by its loader runs at the loader's pace whatever the
    copies do; one bound by its steps should run at the steps' pace."""
    dev = torch.device("cuda")
    weight = torch.randn(WIDE, WIDE, device=dev) / WIDE ** 0.5
    t0 = time.perf_counter()
    on_gpu = [{k: v.to(dev) for k, v in b.items()} for b in plain_dataset(root)]
    res = {"gemms_per_step": gemms, "loader_alone": time.perf_counter() - t0}
    torch.cuda.synchronize()
    res["steps_alone"] = run_loop(on_gpu, weight, gemms)
    del on_gpu
    res["to_device_ring"] = run_loop(to_device(plain_dataset(root), dev), weight, gemms)
    res["sync_copies"] = run_loop(({k: v.to(dev) for k, v in b.items()}
                                   for b in plain_dataset(root)), weight, gemms)
    workers = min(4, os.cpu_count() or 1)
    loader = DataLoader(plain_dataset(root), batch_size=None, num_workers=workers,
                        pin_memory=True)
    res[f"to_device_dataloader_{workers}_workers"] = run_loop(to_device(loader, dev), weight,
                                                              gemms)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or ".",
                        help="folder for trace.json and summary.json (default $OUT or .)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    summary: dict = {"torch": torch.__version__, "cuda": cuda,
                     "device": torch.cuda.get_device_name() if cuda else None}
    ok = True
    with tempfile.TemporaryDirectory(prefix="jpfs-gpu-check-") as tmp:
        plain = make_plain(os.path.join(tmp, "plain"))
        lerobot = make_lerobot(os.path.join(tmp, "lerobot"))
        summary["plain"] = check_results(plain, {}, device)
        deltas = {"action": [i / 30 for i in range(16)]}
        summary["video"] = have_av()
        if summary["video"]:
            deltas["observation.images.cam_high"] = [-1 / 30, 0.0]
        summary["lerobot"] = check_results(lerobot, {"delta_timestamps": deltas}, device)
        if cuda:
            ok &= all(summary[k][c] for k in ("plain", "lerobot")
                      for c in ("ring_equal", "dataloader_equal"))
            summary["overlap"] = check_overlap(plain, args.out)
            summary["timing_s"] = [time_loops(plain, g) for g in (12, 96)]
            ok &= summary["overlap"]["separate_stream"] and summary["overlap"]["overlap_visible"]
    summary["ok"] = bool(ok)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    if not cuda:
        print("no CUDA here: only the CPU path ran; run this on a GPU machine for the checks")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
