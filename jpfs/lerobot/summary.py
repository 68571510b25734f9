"""``jpfs lerobot info``: what a dataset holds, for either layout, in one dict."""

from __future__ import annotations

import logging
from typing import Any

from . import layout
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
        cameras[key] = {
            "shape": ft.get("shape"),
            "codec": vinfo.get("video.codec"),
            "files": len({ep.videos[key].path for ep in meta.episodes}),
        }
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
