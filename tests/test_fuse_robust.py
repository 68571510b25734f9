"""A mount never dies on its own: read patterns that cancel prefetches under waiting readers, and
many readers at once, leave it answering (and every byte right)."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fuse_support import jpfs_cli, mounted, requires_fuse

import jpfs
from jpfs import localcluster
from jpfs.fuse.mount import daemon_pid, is_jpfs_mount

pytestmark = [requires_fuse, pytest.mark.fuse]

CHUNK = 1 << 20
BIG = 300 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("robustcluster")
    localcluster.up(d, meta_shards=2, storage_nodes=2, chunk_size=CHUNK, sync=False)
    rng = random.Random(11)
    digests = {}
    with jpfs.connect(d) as c:
        c.makedirs("/r/many")
        big = os.urandom(BIG)
        c.write_bytes("/r/big.bin", big)
        digests["big.bin"] = hashlib.sha256(big).hexdigest()
        del big
        for i in range(8):
            data = rng.randbytes(rng.randrange(3, 12) * CHUNK + rng.randrange(CHUNK))
            c.write_bytes(f"/r/many/f{i}.bin", data)
            digests[f"many/f{i}.bin"] = hashlib.sha256(data).hexdigest()
    yield d, digests
    localcluster.down(d, timeout=5)


def _drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")


def _read_fadvised(path: Path, size: int = 1 << 20) -> str:
    """What fio and dd-style readers do: POSIX_FADV_SEQUENTIAL, then sequential reads."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while chunk := os.read(fd, size):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def _alive(m) -> None:
    assert daemon_pid(str(m.path)) is not None and is_jpfs_mount(str(m.path))
    assert (m.path / "r").is_dir()
    m.stats()


@pytest.mark.parametrize("options", [(), ("--read-only",)], ids=["rw", "ro"])
def test_fadvise_sequential_cold_read_of_a_large_file(cluster, tmp_path, options):
    d, digests = cluster
    with mounted(d, tmp_path / "mnt", *options) as m:
        for _ in range(2):
            _drop_caches()
            assert _read_fadvised(m / "r" / "big.bin") == digests["big.bin"]
        _alive(m)
        assert m.stats()["fuse"]["errors"].get("EIO", 0) == 0


@pytest.mark.parametrize("options", [(), ("--read-only",)], ids=["rw", "ro"])
def test_readers_that_keep_cancelling_prefetch(cluster, tmp_path, options):
    """Several readers over overlapping files, sequential and random, opening and closing while
    read-ahead is in flight: every read is right and the mount answers afterwards (read-only:
    with no OPEN or RELEASE, the mount opens each file at its first READ)."""
    d, digests = cluster
    names = sorted(k for k in digests if k.startswith("many/"))
    failures: list[str] = []

    def reader(seed: int, m) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(12):
                name = rng.choice(names)
                p = m / "r" / name
                if rng.random() < 0.5:
                    got = _read_fadvised(p, rng.choice([4096, 128 << 10, 1 << 20]))
                    if got != digests[name]:
                        failures.append(f"{name}: wrong bytes in a sequential read")
                    continue
                size = p.stat().st_size
                with open(p, "rb", buffering=0) as f:
                    for _ in range(rng.randrange(1, 6)):  # hops, then closes mid-read-ahead
                        off = rng.randrange(size)
                        f.seek(off)
                        f.read(rng.randrange(1, 3 * CHUNK))
        except OSError as e:
            failures.append(f"{name}: {e}")

    with mounted(d, tmp_path / "mnt", "--memory-cache", "32M", *options) as m:
        for _round in range(2):
            _drop_caches()
            threads = [threading.Thread(target=reader, args=(s, m)) for s in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=240)
            assert not any(t.is_alive() for t in threads)
        assert not failures, failures[:5]
        _alive(m)
        for name in names:  # and it still reads right
            assert _read_fadvised(m / "r" / name) == digests[name]
        s = m.stats()
        assert s["fuse"]["errors"].get("EIO", 0) == 0
        assert s["prefetch"]["readahead_chunks"] > 0


def _read_small_files(mp: str, names: list[str], seed: int) -> list[str]:
    """One reader process: small files in a shuffled order, each read whole, in chunks, in
    part, or after dropping its pages; returns what was wrong."""
    rng = random.Random(seed)
    wrong = []
    for name in rng.sample(names, len(names)):
        p = Path(mp) / "s" / name
        want = int(name.split(".")[0])
        fd = os.open(p, os.O_RDONLY)
        try:
            how = rng.randrange(4)
            if how == 3:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if how == 2:  # a footer first, then a piece, as pyarrow reads parquet
                size = os.fstat(fd).st_size
                got = os.pread(fd, 4096, size - 4096) + os.pread(fd, 8192, 0)
                ok = got == _small(want)[size - 4096:] + _small(want)[:8192]
            else:
                step = rng.choice([4096, 32 << 10, 1 << 20])
                parts = []
                while part := os.read(fd, step):
                    parts.append(part)
                got = b"".join(parts)
                ok = got == _small(want)
            if not ok:
                wrong.append(f"{name} (way {how})")
        finally:
            os.close(fd)
    return wrong


def _small(i: int) -> bytes:
    return random.Random(i).randbytes(20_000 + 7_919 * i)


def test_processes_reading_the_same_small_files_on_a_read_only_mount(cluster, tmp_path):
    """Four processes read the same small files at once in different orders and ways, with
    the page cache dropped between rounds: on a read-only mount (no OPEN, no RELEASE) every byte
    is right, no error is answered, and no handle is left once the kernel forgets the files."""
    import multiprocessing

    d, _ = cluster
    names = [f"{i}.bin" for i in range(60)]
    with jpfs.connect(d) as c:
        c.makedirs("/s", exist_ok=True)
        for i, n in enumerate(names):
            c.write_bytes(f"/s/{n}", _small(i))
    with mounted(d, tmp_path / "mnt", "--read-only") as m:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4) as pool:
            for round_ in range(3):
                _drop_caches()
                results = pool.starmap(_read_small_files,
                                       [(str(m.path), names, 10 * round_ + k) for k in range(4)])
                assert not [w for r in results for w in r], results
        _alive(m)
        s = m.stats()
        # ENOSYS: the first FLUSH's answer, which stops them all
        assert not {k: v for k, v in s["fuse"]["errors"].items() if k != "ENOSYS"}, s["fuse"]
        _drop_caches()
        m.wait_for(lambda s: s["mount"]["handles"] == 0, what="no handle left")


def test_kill_9_of_the_mount_mid_copy_leaves_fsck_clean(cluster, tmp_path):
    """Crash safety: the mount daemon killed while ``cp -r`` writes through it leaves a
    namespace that fsck finds clean, and every file either absent or whole as last committed
    (close-to-open: a file's bytes appear in one commit, never half)."""
    d, _ = cluster
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(3)
    for i in range(400):
        (src / f"f{i:03d}.bin").write_bytes(rng.randbytes(rng.randrange(1, 200_000)))
    (src / "large.bin").write_bytes(os.urandom(24 * CHUNK))
    mp = tmp_path / "mnt"
    with mounted(d, mp) as m:
        (m / "copy").mkdir()
        cp = subprocess.Popen(["cp", "-r", str(src), str(m / "copy")],
                              stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while len(list((m / "copy").rglob("*"))) < 150:  # part way through
                assert cp.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(m.pid, signal.SIGKILL)
        finally:
            cp.wait(timeout=60)
        assert cp.returncode != 0  # the copy saw the mount go away
    res = jpfs_cli("--cluster", str(d), "fsck")
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr
    with jpfs.connect(d) as c:
        for e in c.scandir("/copy/src"):
            data = c.read_bytes(e.path)
            assert data == (src / e.name).read_bytes()[:len(data)]
            assert len(data) in (0, (src / e.name).stat().st_size), e.name
