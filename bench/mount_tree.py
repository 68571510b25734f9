"""``jpfs bench mount --phases tree``: a downloaded dataset unpacked, then removed.

A LeRobot v2.1 tree (generated with ``--episodes``/``--cameras``/``--video-bytes``, or
``--dataset``) is packed once into an uncompressed tar on the local disk. The archive is then
unpacked with ``tar -x`` and the tree removed with ``rm -r``, on the local disk and through a
fresh read-write mount of a fresh local cluster, in turn: what a user does with a dataset
downloaded to a training node. Each figure is files/s (directories count as files, as tar
counts them) and MB/s, the ratio to the local disk in the same run, and the CPU milliseconds
per file of the mount, the metadata shards and the storage nodes. The tree through the mount is
checked whole (every file's size) before it is removed.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any


def _pack(tree: Path, archive: Path) -> tuple[int, int]:
    """``tree`` as an uncompressed tar at ``archive``: (entries, bytes of file content)."""
    entries = content = 0
    with tarfile.open(archive, "w") as tar:
        for path in sorted(tree.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(tree.parent)), recursive=False)
            entries += 1
            if path.is_file():
                content += path.stat().st_size
    return entries, content


def _sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def tree_phase(work: Path, tree: Path) -> dict[str, Any]:
    """``tar -x`` and ``rm -r`` of ``tree`` on the local disk and through a mount (see the module
    docstring)."""
    from .harness import Mount, drop_caches, temporary_cluster
    from .mount_write import serving_daemons
    from .readers import proc_cpu

    archive = work / "tree.tar"
    entries, content = _pack(tree, archive)
    want = _sizes(tree)
    out: dict[str, Any] = {"entries": entries, "bytes": content}

    def figures(untar: float, remove: float, cpu: dict | None = None) -> dict[str, Any]:
        row: dict[str, Any] = {
            "tar_x": {"seconds": untar, "files_s": entries / untar,
                      "MBps": content / untar / 1e6},
            "rm_r": {"seconds": remove, "files_s": entries / remove}}
        if cpu is not None:
            for step in ("tar_x", "rm_r"):
                row[step]["cpu_ms_per_file"] = {w: c / entries * 1e3
                                                for w, c in cpu[step].items()}
        return row

    local = work / "tree-local"
    local.mkdir(parents=True, exist_ok=True)
    drop_caches()
    untar = _timed(["tar", "-xf", str(archive), "-C", str(local)])
    remove = _timed(["rm", "-r", str(local / tree.name)])
    out["local"] = figures(untar, remove)

    def cpu(pids: dict[str, list[int]]) -> dict[str, float]:
        return {who: sum(proc_cpu(p) for p in ps) for who, ps in pids.items()}

    with temporary_cluster(2, 2, directory=str(work / "tree-cluster")) as cdir:
        mount = Mount(str(cdir / "cluster.toml"), work, "fuse-rw", 0)
        try:
            pids = serving_daemons(cdir, mount.pid)
            drop_caches()
            before = cpu(pids)
            untar = _timed(["tar", "-xf", str(archive), "-C", str(mount.mp)])
            mid = cpu(pids)
            got = _sizes(mount.mp / tree.name)
            if got != want:
                missing = sorted(set(want) - set(got))[:5]
                raise RuntimeError(f"the tree unpacked through the mount differs from the "
                                   f"archive's (missing or resized, first: {missing})")
            mid2 = cpu(pids)
            remove = _timed(["rm", "-r", str(mount.mp / tree.name)])
            after = cpu(pids)
            if os.listdir(mount.mp):
                raise RuntimeError("rm -r left something behind in the mount")
        finally:
            mount.close()
    out["fuse-rw"] = figures(untar, remove, {
        "tar_x": {w: mid[w] - before[w] for w in pids},
        "rm_r": {w: after[w] - mid2[w] for w in pids}})
    archive.unlink()
    return out


def tree_rows(result: dict[str, Any]) -> list[dict]:
    """The phase's figures as ``ratios`` rows: ``tar -x`` and ``rm -r``, mount against local."""
    rows = []
    for step, what in (("tar_x", "tar -x"), ("rm_r", "rm -r")):
        base, r = result["local"][step], result["fuse-rw"][step]
        rows.append({"phase": "tree", "what": what, "unit": "files/s",
                     "local": base["files_s"], "fuse": r["files_s"],
                     "ratio": r["files_s"] / base["files_s"],
                     "cpu_ms_per_op": r["cpu_ms_per_file"]})
    return rows


__all__ = ["tree_phase", "tree_rows"]
