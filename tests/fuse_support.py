"""Helpers for the FUSE tests: real kernel mounts (``jpfs mount``) of real clusters.

Every mount made here is unmounted when its ``with`` block ends, whatever happened inside:
``fusermount3 -u``, then ``-uz`` if that failed, and the daemon is waited for (and killed if it
hangs, since the test started it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jpfs.fuse.mount import daemon_pid, is_jpfs_mount


def fuse_unavailable() -> str | None:
    """Why a real FUSE mount cannot be made here (None if it can)."""
    if not sys.platform.startswith("linux"):
        return "FUSE mounts need Linux"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (load the fuse module, or give the container --device /dev/fuse)"
    if not shutil.which("fusermount3"):
        return "fusermount3 is not installed (apt install fuse3)"
    if os.geteuid() != 0:
        return "the FUSE tests run as root (they mount, set read-ahead and drop caches)"
    return None


requires_fuse = pytest.mark.skipif(fuse_unavailable() is not None,
                                   reason=fuse_unavailable() or "")


class Mount:
    def __init__(self, path: Path, cluster: Path, cache_dir: Path, pid: int):
        self.path = path
        self.cluster = cluster
        self.cache_dir = cache_dir
        self.pid = pid

    def __truediv__(self, other: str) -> Path:
        return self.path / other

    def stats(self) -> dict:
        with open(self.path / ".jpfs" / "stats") as f:
            return json.load(f)

    def hint(self, paths: list[str]) -> None:
        """Send prefetch hints: to the control file, or on a read-only mount (where the kernel
        refuses writes) to the socket ``.jpfs/socket`` names."""
        text = "".join(p + "\n" for p in paths)
        try:
            with open(self.path / ".jpfs" / "prefetch", "w") as f:
                f.write(text)
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            where = (self.path / ".jpfs" / "socket").read_text().strip()
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(where)
                s.sendall(text.encode())

    def wait_for(self, cond, timeout: float = 10.0, what: str = "condition") -> dict:
        """Poll the stats until ``cond(stats)`` holds (the mount works in the background)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if cond(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {json.dumps(s)[:2000]}")
            time.sleep(0.02)


def jpfs_cli(*args: str, check: bool = True, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jpfs.cli.main", *args], capture_output=True,
                          text=True, check=check, timeout=timeout)


def force_unmount(path: Path) -> None:
    """Unmount whatever jpfs mount is at ``path``; never raises."""
    pid = daemon_pid(str(path))
    if is_jpfs_mount(str(path)):
        r = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
        if r.returncode != 0 and is_jpfs_mount(str(path)):
            subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)
    if pid is not None:
        deadline = time.monotonic() + 15
        while daemon_pid(str(path)) == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if daemon_pid(str(path)) == pid:
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def mounted(cluster: Path, path: Path, *options: str, cache_dir: Path | None = None
            ) -> Iterator[Mount]:
    """``jpfs mount CLUSTER PATH OPTIONS`` in the background; unmounted on exit, always."""
    path.mkdir(parents=True, exist_ok=True)
    cache_dir = cache_dir or path.parent / f"{path.name}-cache"
    try:
        res = jpfs_cli("--cluster", str(cluster), "mount", str(path), "--cache-dir",
                       str(cache_dir), "--log-file", str(path.parent / f"{path.name}.log"),
                       *options, check=False)
        if res.returncode != 0:
            raise AssertionError(f"jpfs mount failed ({res.returncode}): {res.stderr}")
        pid = daemon_pid(str(path))
        assert pid is not None and is_jpfs_mount(str(path))
        yield Mount(path, cluster, cache_dir, pid)
    finally:
        force_unmount(path)


def errno_of(fn, *args) -> int:
    """The errno ``fn(*args)`` fails with (an AssertionError if it succeeds)."""
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    raise AssertionError(f"{fn.__name__}{args} did not fail")


def tree_files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = p.read_bytes()
    return out
