"""``jpfs lerobot info``: what a dataset holds, for either layout, in one dict."""

from __future__ import annotations

import logging
from typing import Any

from . import layout, video
from .dataset import load_meta
from .fsutil import DatasetError, get_fs, join

log = logging.getLogger(__name__)

__all__ = ["describe"]


def describe(root: str) -> dict[str, Any]:
    """Version, episodes, frames, cameras, and file counts and bytes per part of the tree."""
    fs, base = get_fs(root)
    if not fs.exists(join(base, layout.INFO_PATH)) and fs.exists(join(base, ".jpfs-convert")):
        raise DatasetError(join(base, layout.INFO_PATH),
                           "missing: this is an unfinished `jpfs lerobot convert`; rerun it "
                           "with the same arguments to finish")
    meta = load_meta(root)
    parts: dict[str, dict[str, int]] = {p: {"files": 0, "bytes": 0}
                                        for p in ("data", "videos", "meta", "other")}
    prefix = fs._strip_protocol(base).rstrip("/") + "/"
    for name, entry in fs.find(base, detail=True).items():
        rel = fs._strip_protocol(name)[len(prefix):]
        part = rel.split("/", 1)[0]
        part = part if part in parts else "other"
        parts[part]["files"] += 1
        parts[part]["bytes"] += int(entry.get("size") or 0)
    cameras = {}
    for key in meta.video_keys:
        ft = meta.features[key]
        vinfo = ft.get("info", {})
        files = list(dict.fromkeys(ep.videos[key].path for ep in meta.episodes))
        cameras[key] = {
            "shape": ft.get("shape"),
            "codec": vinfo.get("video.codec"),
            "files": len(files),
        }
        if files:
            cameras[key].update(_probe_camera(fs, join(base, files[0]), ft))
    lengths = [ep.length for ep in meta.episodes]
    out: dict[str, Any] = {
        "root": root,
        "version": meta.version,
        "robot_type": meta.info.get("robot_type"),
        "fps": meta.fps,
        "episodes": len(meta.episodes),
        "frames": meta.total_frames,
        "episode_length": {"min": min(lengths, default=0), "max": max(lengths, default=0),
                           "mean": (sum(lengths) / len(lengths)) if lengths else 0.0},
        "tasks": len(meta.tasks),
        "features": [k for k in meta.features if k not in meta.video_keys],
        "cameras": cameras,
        "data_files": len(meta.data_files),
        "files": sum(p["files"] for p in parts.values()),
        "bytes": sum(p["bytes"] for p in parts.values()),
        "parts": parts,
    }
    if meta.version == layout.V30:
        out["data_files_size_in_mb"] = meta.info.get("data_files_size_in_mb")
        out["video_files_size_in_mb"] = meta.info.get("video_files_size_in_mb")
    return out


def _probe_camera(fs: Any, path: str, feature: dict[str, Any]) -> dict[str, Any]:
    """What the camera's first file holds (``probed``), and where that contradicts info.json
    (``mismatch``: a list of sentences, empty when they agree)."""
    try:
        got = video.probe(fs, path)
    except DatasetError as e:
        return {"probed": None, "mismatch": [f"its first file cannot be read: {e}"]}
    vinfo = feature.get("info", {})
    shape = feature.get("shape") or [None, None]
    said_codec = vinfo.get("video.codec")
    said_h = vinfo.get("video.height", shape[0])
    said_w = vinfo.get("video.width", shape[1])
    mismatch = []
    if said_codec and said_codec != got.codec and not got.stub:
        mismatch.append(f"info.json says {said_codec}, the files hold {got.codec} ({path})")
    if (said_h, said_w) != (None, None) and (said_h, said_w) != (got.height, got.width):
        mismatch.append(f"info.json says {said_h}x{said_w} (height x width), the files hold "
                        f"{got.height}x{got.width} ({path})")
    return {"probed": {"path": path, "codec": got.codec, "height": got.height,
                       "width": got.width}, "mismatch": mismatch}
