"""JPFS's own FUSE engine (``jpfs mount --engine jpfs``): a read-only mount served by worker
processes reads exactly what the cluster holds, survives a worker's death, and ends cleanly."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuse_support import errno_of, jpfs_cli, mounted, requires_fuse, tree_files

import jpfs
from jpfs import localcluster
from jpfs.fuse.mount import daemon_pid, is_jpfs_mount, state_file

pytestmark = [requires_fuse, pytest.mark.fuse]

CHUNK = 1 << 20
WIDE = 700
"""Entries of the wide directory: many READDIRPLUS answers."""
EPOCH = 300
"""Files of the directory a shuffled epoch reads (8-24 KB each)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("enginecluster")
    localcluster.up(d, meta_shards=2, storage_nodes=2, chunk_size=CHUNK, sync=False)
    try:
        _fill(d)
        yield d
    finally:
        localcluster.down(d, timeout=5)


def _fill(d: Path) -> None:
    """The tree the tests read: nested directories, files of every size class, a wide
    directory, an empty one, a symlink, an xattr, odd times."""
    rng = random.Random(7)
    with jpfs.connect(d) as c:
        c.makedirs("/ds/videos/chunk-000")
        c.makedirs("/ds/wide")
        c.makedirs("/ds/empty")
        for size in (0, 1, 4095, 4096, 100_000, CHUNK, 3 * CHUNK + 17):
            c.write_bytes(f"/ds/videos/chunk-000/f{size}", rng.randbytes(size))
        for i in range(WIDE):
            c.write_bytes(f"/ds/wide/episode_{i:06d}.parquet", rng.randbytes(i % 50))
        c.makedirs("/ds/epoch")
        for i in range(EPOCH):
            c.write_bytes(f"/ds/epoch/sample_{i:05d}.bin", rng.randbytes(rng.randrange(8000,
                                                                                    24000)))
        c.symlink("videos/chunk-000/f1", "/ds/link")
        c.setxattr("/ds/videos/chunk-000/f1", "user.origin", b"camera-0")
        c.utime("/ds/videos/chunk-000/f0", (1_000_000_000_000_000_123, 1_500_000_000_999_999_999))


@pytest.fixture(scope="module")
def source(cluster) -> dict[str, bytes]:
    """Every file of the tree, as the native client reads it."""
    out = {}
    with jpfs.connect(cluster) as c:
        for top, _dirs, files in c.walk("/ds"):
            for f in files:
                p = f"{top.rstrip('/')}/{f}"
                if not stat.S_ISLNK(c.lstat(p).mode):
                    out[p[len("/ds/"):]] = c.read_bytes(p)
    return out


def _workers(mp: Path) -> list[int]:
    return json.loads(state_file(str(mp)).read_text())["workers"]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _walk_and_read(root: str) -> dict[str, str]:
    """What another process reads (run in a subprocess)."""
    import hashlib

    out = {}
    for top, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(top, f)
            if not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_a_tree_reads_through_the_engine_as_the_cluster_holds_it(cluster, source, tmp_path):
    with mounted(cluster, tmp_path / "mnt", "--read-only", "--engine", "jpfs",
                 "--workers", "2") as m:
        root = m.path / "ds"
        assert tree_files(root) == {**source, "link": source["videos/chunk-000/f1"]}
        assert sorted(os.listdir(root / "wide")) == \
            [f"episode_{i:06d}.parquet" for i in range(WIDE)]
        assert os.listdir(root / "empty") == []
        with jpfs.connect(cluster) as c:
            for rel in ("videos/chunk-000/f4096", "wide", "videos"):
                mine, theirs = os.stat(root / rel), c.stat(f"/ds/{rel}")
                assert (mine.st_ino, mine.st_mode, mine.st_size, mine.st_nlink,
                        mine.st_mtime_ns) == (theirs.ino, theirs.mode, theirs.size,
                                              theirs.nlink, theirs.mtime_ns), rel
        old = os.stat(root / "videos/chunk-000/f0")
        assert (old.st_atime_ns, old.st_mtime_ns) == (1_000_000_000_000_000_123,
                                                      1_500_000_000_999_999_999)
        assert os.readlink(root / "link") == "videos/chunk-000/f1"
        assert (root / "link").read_bytes() == source["videos/chunk-000/f1"]
        assert stat.S_ISLNK(os.lstat(root / "link").st_mode)
        assert os.getxattr(root / "videos/chunk-000/f1", "user.origin") == b"camera-0"
        assert "user.origin" in os.listxattr(root / "videos/chunk-000/f1")
        assert errno_of(os.getxattr, root / "videos/chunk-000/f1", "user.none") == errno.ENODATA
        assert os.statvfs(m.path).f_blocks > 0
        assert errno_of(os.stat, root / "missing") == errno.ENOENT
        assert errno_of(os.listdir, root / "videos/chunk-000/f1") == errno.ENOTDIR
        assert errno_of(os.open, root / "new", os.O_CREAT | os.O_WRONLY) == errno.EROFS
        assert errno_of(os.mkdir, root / "newdir") == errno.EROFS
        with open(root / "videos/chunk-000" / f"f{3 * CHUNK + 17}", "rb") as f:
            f.seek(CHUNK - 10)  # a read across a chunk boundary
            assert f.read(20) == source[f"videos/chunk-000/f{3 * CHUNK + 17}"][CHUNK - 10:
                                                                               CHUNK + 10]
        # four processes at once, each reading everything: every worker serves some of it
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from test_fuse_engine import _walk_and_read; "
                f"print(json.dumps(_walk_and_read({str(root)!r})))")
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  text=True) for _ in range(4)]
        outs = [json.loads(pr.communicate(timeout=120)[0]) for pr in procs]
        assert all(pr.returncode == 0 for pr in procs)
        assert all(o == outs[0] for o in outs) and len(outs[0]) == len(source)
        # a control file's snapshot is taken by the worker that answers its lookup and read
        # by whichever answers the READ: whole every time
        seen = {m.stats()["mount"]["worker"] for _ in range(20)}
        s = m.stats()["mount"]
        assert (s["engine"], s["workers"], s["read_only"]) == ("jpfs", 2, True)
        assert seen <= {0, 1}
        assert len(_children(m.pid)) == 2


def test_every_worker_lets_go_of_the_inodes_the_kernel_forgets(cluster, source, tmp_path):
    """The kernel sends an evicted inode's FORGET to any one worker; the others hear of it."""
    with mounted(cluster, tmp_path / "mnt", "--read-only", "--engine", "jpfs",
                 "--workers", "2") as m:
        for name in os.listdir(m.path / "ds" / "wide"):
            os.stat(m.path / "ds" / "wide" / name)

        def held() -> dict[int, int]:
            """Each worker's node count, as its own stats say (whichever worker answers)."""
            out: dict[int, int] = {}
            deadline = time.monotonic() + 10
            while len(out) < 2:
                s = m.stats()["mount"]
                out[s["worker"]] = s["inodes"]
                assert time.monotonic() < deadline, f"only worker {list(out)} answered"
            return out

        assert sum(held().values()) >= WIDE
        Path("/proc/sys/vm/drop_caches").write_text("2")  # dentries and inodes: FORGETs
        deadline = time.monotonic() + 20
        while max((now := held()).values()) > 10:
            assert time.monotonic() < deadline, f"nodes still held: {now}"
            time.sleep(0.1)


def _stats_of(m, worker: int) -> dict:
    """One worker's stats (the control file is answered by whichever worker the kernel asks)."""
    deadline = time.monotonic() + 20
    while (s := m.stats())["mount"]["worker"] != worker:
        assert time.monotonic() < deadline, f"worker {worker} never answered"
    return s


def test_prefetch_hears_every_worker(cluster, source, tmp_path):
    """A shuffled epoch through two workers: worker 0 prefetches for both. It hears of the
    entries and the opens the other worker serves, so it sweeps the directory and hands it to
    the kernel's page cache ahead of the reader, and it answers the pages it held back
    whichever worker the kernel asks: the rest of the epoch waits for almost no fetch, and
    every byte reads right."""
    names = sorted(n for n in source if n.startswith("epoch/"))
    random.Random(3).shuffle(names)
    rest = len(names) - 30
    with mounted(cluster, tmp_path / "mnt", "--read-only", "--engine", "jpfs",
                 "--workers", "2") as m:
        root = m.path / "ds"
        for n in names[:30]:  # out of name order: enough for the directory's sweep
            assert (root / n).read_bytes() == source[n]
        deadline = time.monotonic() + 30
        while (handed := _stats_of(m, 0)["fuse"]["handed_files"]) < 0.8 * rest:
            assert time.monotonic() < deadline, f"{handed} files handed to the kernel"
            time.sleep(0.05)
        before = [_stats_of(m, k)["fuse"]["opens"] for k in (0, 1)]
        for n in names[30:]:
            assert (root / n).read_bytes() == source[n]
        after = [_stats_of(m, k)["fuse"]["opens"] for k in (0, 1)]
        waited = {k: sum(after[k][o] - before[k][o] for o in ("fetched", "joined", "disk"))
                  for k in (0, 1)}
        assert sum(waited.values()) <= 0.1 * rest, waited
        link = _stats_of(m, 1)["mount"]["relay"]
        assert link["connected"] and link["entries"] > 0, link


def test_a_killed_worker_is_started_again_while_the_others_serve(cluster, source, tmp_path):
    with mounted(cluster, tmp_path / "mnt", "--read-only", "--engine", "jpfs",
                 "--workers", "2") as m:
        root = m.path / "ds"
        first = _workers(m.path)
        assert sorted(_children(m.pid)) == sorted(first)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # the mount answers throughout: never ENOTCONN
            assert (root / "videos/chunk-000/f100000").read_bytes() == \
                source["videos/chunk-000/f100000"]
            kids = _children(m.pid)
            if len(kids) == 2 and first[0] not in kids:
                break
            assert time.monotonic() < deadline, f"no new worker: {kids}"
            time.sleep(0.05)
        assert tree_files(root) == {**source, "link": source["videos/chunk-000/f1"]}
        log = (m.path.parent / f"{m.path.name}.log").read_text()
        assert "worker 0 ended (exit status -9); starting it again" in log


def test_the_engine_ends_with_its_mount(cluster, tmp_path):
    mp = tmp_path / "mnt"
    with mounted(cluster, mp, "--read-only", "--engine", "jpfs", "--workers", "2") as m:
        workers = _children(m.pid)
    # unmounted (fusermount3 -u): the supervisor and its workers end (the supervisor a moment
    # after its state file goes, which is what the unmount above waited for)
    deadline = time.monotonic() + 20
    while live := [pid for pid in (m.pid, *workers) if _running(pid)]:
        assert time.monotonic() < deadline, f"still running: {live}"
        time.sleep(0.05)

    with mounted(cluster, mp, "--read-only", "--engine", "jpfs", "--workers", "2") as m:
        workers = _children(m.pid)
        os.kill(m.pid, signal.SIGTERM)  # unmounts, then ends
        deadline = time.monotonic() + 20
        while is_jpfs_mount(str(mp)) or daemon_pid(str(mp)) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    with mounted(cluster, mp, "--read-only", "--engine", "jpfs", "--workers", "2") as m:
        workers = _children(m.pid)
        os.kill(m.pid, signal.SIGKILL)  # the workers die with it: the mount is left dead
        deadline = time.monotonic() + 20
        while any(_running(w) for w in workers):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert errno_of(os.listdir, mp) == errno.ENOTCONN
        # mounting again clears the dead mount first
        res = jpfs_cli("--cluster", str(cluster), "mount", str(mp), "--read-only", "--engine",
                       "jpfs", "--workers", "1", "--cache-dir", str(tmp_path / "c2"),
                       check=False)
        assert res.returncode == 0, res.stderr
        assert "wide" in os.listdir(mp / "ds")
        assert jpfs_cli("umount", str(mp)).returncode == 0


def test_the_engine_serves_read_only_mounts_only(cluster, tmp_path):
    (tmp_path / "mnt").mkdir()
    res = jpfs_cli("--cluster", str(cluster), "mount", str(tmp_path / "mnt"), "--engine",
                   "jpfs", check=False)
    assert res.returncode != 0
    assert "--engine jpfs serves read-only mounts" in res.stderr
    assert not is_jpfs_mount(str(tmp_path / "mnt"))
