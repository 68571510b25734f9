"""``jpfs bench mount --phases checkpoint``: a training job's checkpoint, saved and loaded back.

A state dict of float32 tensors (``--checkpoint-bytes``, 1 GiB by default, in 64 MiB tensors as
a large model's layers are) is written with ``torch.save`` into an open file that is then
fsynced, as a job that must find its checkpoint after a crash does; the page cache is dropped
and the file is read back with ``torch.load``, checked equal to what was saved. Local disk
first, then through a read-write mount of a fresh local cluster (``--checkpoint-replicas``
copies of every chunk, all on this machine's disk); the load goes through a second mount with an
empty cache, as a job resumed on another node reads it. Each figure is GB/s, the ratio to the
local disk in the same run, and the CPU seconds per GB of the mount, the metadata shards and the
storage nodes. torch is the ``torch`` extra's; without it the phase says so and is left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TENSOR_BYTES = 64 << 20
"""Bytes per tensor of the state dict."""


def state_dict(nbytes: int, seed: int = 0) -> dict:
    """Float32 tensors adding up to ``nbytes`` (rounded up to whole 4-byte values), random."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out, left, i = {}, nbytes, 0
    while left > 0:
        n = min(left, TENSOR_BYTES)
        out[f"layers.{i}.weight"] = torch.rand(-(-n // 4), generator=g)
        left -= n
        i += 1
    return out


def _save(state: dict, path: Path) -> float:
    import torch

    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _load(path: Path, state: dict) -> float:
    import torch

    t0 = time.perf_counter()
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    secs = time.perf_counter() - t0
    if loaded.keys() != state.keys() or not all(torch.equal(loaded[k], v)
                                                for k, v in state.items()):
        raise RuntimeError(f"{path}: the checkpoint read back differs from the one saved")
    return secs


def _figure(nbytes: int, secs: float, cpu: dict[str, float] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"bytes": nbytes, "seconds": secs, "GBps": nbytes / secs / 1e9}
    if cpu is not None:
        row["cpu_s_per_gb"] = {who: c / (nbytes / 1e9) for who, c in cpu.items()}
    return row


def checkpoint_phase(work: Path, nbytes: int, replicas: int, drop: Callable[[], object]
                     ) -> dict[str, Any]:
    """Save and load back a checkpoint of ``nbytes``, locally and through mounts of a cluster
    keeping ``replicas`` copies (see the module docstring)."""
    from .harness import Mount, temporary_cluster
    from .mount_write import serving_daemons
    from .readers import proc_cpu

    state = state_dict(nbytes)
    size = sum(t.numel() * 4 for t in state.values())
    out: dict[str, Any] = {"replicas": replicas}

    local = work / "checkpoint-local"
    local.mkdir(parents=True, exist_ok=True)
    save = _save(state, local / "ckpt.pt")
    nfile = (local / "ckpt.pt").stat().st_size
    drop()
    out["local"] = {"save": _figure(nfile, save, None),
                    "load": _figure(nfile, _load(local / "ckpt.pt", state), None)}
    (local / "ckpt.pt").unlink()

    def cpu(pids: dict[str, list[int]]) -> dict[str, float]:
        return {who: sum(proc_cpu(p) for p in ps) for who, ps in pids.items()}

    with temporary_cluster(2, 2, directory=str(work / "ckpt-cluster"), replicas=replicas) as cdir:
        cluster_file = str(cdir / "cluster.toml")
        row: dict[str, Any] = {}
        for step, generation in (("save", 0), ("load", 1)):
            mount = Mount(cluster_file, work, "fuse-rw", generation)
            try:
                pids = serving_daemons(cdir, mount.pid)
                if step == "load":
                    drop()
                before = cpu(pids)
                secs = (_save(state, mount.mp / "ckpt.pt") if step == "save"
                        else _load(mount.mp / "ckpt.pt", state))
                after = cpu(pids)
                row[step] = _figure(nfile, secs, {w: after[w] - before[w] for w in pids})
                if step == "load":  # how the bytes came: read from the volumes, or sent
                    storage = mount.stats().get("storage", {})
                    row[step]["short_circuit_bytes"] = storage.get("local_bytes", 0)
            finally:
                mount.close()
        out["fuse-rw"] = row
    out["tensor_bytes"] = size
    return out


def checkpoint_rows(result: dict[str, Any]) -> list[dict]:
    """The phase's figures as ``ratios`` rows: save and load, mount against local disk."""
    rows = []
    for step in ("save", "load"):
        base, r = result["local"][step], result["fuse-rw"][step]
        rows.append({"phase": "checkpoint", "what": f"{step} (replicas {result['replicas']})",
                     "unit": "GB/s", "local": base["GBps"], "fuse": r["GBps"],
                     "ratio": r["GBps"] / base["GBps"], "cpu_s_per_gb": r["cpu_s_per_gb"]})
    return rows


__all__ = ["checkpoint_phase", "checkpoint_rows", "state_dict"]
