"""Random file operations on a mount against a shadow file on the local disk (fsx style).

Each step picks one of: write, read, truncate, mmap read, mmap write, copy_file_range (from a
second file and within the file), fallocate, fsync, close and reopen. It is applied to the file on
the mount and to its shadow, and every read (and the size, after every step) must match. CI runs
a few thousand steps per seed; ``JPFS_RANDOM_OPS=100000`` runs the long version.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from pathlib import Path

import pytest
from fuse_support import mounted, requires_fuse

from jpfs import localcluster

pytestmark = [requires_fuse, pytest.mark.fuse]

CHUNK = 64 << 10
"""A small chunk size, so that operations cross chunk boundaries all the time."""
MAX_SIZE = 6 * CHUNK + 777
STEPS = int(os.environ.get("JPFS_RANDOM_OPS", "2500"))
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _fallocate(fd: int, mode: int, off: int, n: int) -> None:
    if _libc.fallocate(fd, mode, off, n) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@pytest.fixture(scope="module")
def mnt(tmp_path_factory):
    d = tmp_path_factory.mktemp("rocluster")
    localcluster.up(d, meta_shards=1, storage_nodes=2, chunk_size=CHUNK, sync=False)
    with mounted(d, tmp_path_factory.mktemp("rom") / "mnt") as m:
        yield m
    localcluster.down(d, timeout=5)


class Pair:
    """One file on the mount and its shadow, opened and changed together."""

    def __init__(self, mine: Path, shadow: Path):
        self.paths = (mine, shadow)
        self.fds = [-1, -1]
        self.open()

    def open(self) -> None:
        self.fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in self.paths]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def both(self, fn):
        return [fn(fd) for fd in self.fds]

    def size(self) -> int:
        a, b = self.both(lambda fd: os.fstat(fd).st_size)
        assert a == b, f"size {a} on the mount, {b} in the shadow"
        return a


def _copy(src: int, dst: int, n: int, src_off: int, dst_off: int) -> None:
    """copy_file_range until ``n`` bytes are copied or the source ends."""
    done = 0
    while done < n:
        k = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
        if k == 0:
            return
        done += k


def _step(pair: Pair, src: Pair, rng: random.Random, log: list[str]) -> None:
    size = pair.size()
    op = rng.choices(["write", "read", "truncate", "mmap_read", "mmap_write", "copy",
                      "copy_self", "fallocate", "fsync", "reopen"],
                     [30, 25, 8, 8, 6, 6, 4, 4, 4, 5])[0]
    off = rng.randrange(MAX_SIZE)
    n = rng.choice([1, 7, 511, 4096, CHUNK - 3, CHUNK + 9, rng.randrange(1, 3 * CHUNK)])
    n = max(1, min(n, MAX_SIZE - off))
    log.append(f"{op} off={off} n={n} size={size}")
    if op == "write":
        data = rng.randbytes(n)
        assert pair.both(lambda fd: os.pwrite(fd, data, off)) == [n, n]
    elif op == "read":
        a, b = pair.both(lambda fd: os.pread(fd, n, off))
        assert a == b, f"read {n} at {off}: {len(a)} bytes differ from the shadow's {len(b)}"
    elif op == "truncate":
        pair.both(lambda fd: os.ftruncate(fd, off))
    elif op in ("mmap_read", "mmap_write") and size:
        start = rng.randrange(size) // mmap.PAGESIZE * mmap.PAGESIZE
        length = min(n, size - start)
        if op == "mmap_read":
            def get(fd):
                with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                    return m[start:start + length]
            a, b = pair.both(get)
            assert a == b, f"mmap read of {length} at {start} differs"
        else:
            data = rng.randbytes(length)

            def put(fd):
                with mmap.mmap(fd, size, mmap.MAP_SHARED) as m:
                    m[start:start + length] = data
                    m.flush()
            pair.both(put)
    elif op == "copy":
        ssize = src.size()
        if ssize:
            soff = rng.randrange(ssize)
            for s_fd, d_fd in zip(src.fds, pair.fds, strict=True):
                _copy(s_fd, d_fd, n, soff, off)
    elif op == "copy_self" and size:
        soff = rng.randrange(size)
        k = min(n, size - soff)
        if soff + k <= off or off + k <= soff:  # ranges must not overlap (EINVAL)
            for fd in pair.fds:
                _copy(fd, fd, k, soff, off)
    elif op == "fallocate":
        mode = rng.choice([0, 1])  # 0 or FALLOC_FL_KEEP_SIZE
        pair.both(lambda fd: _fallocate(fd, mode, off, n))
    elif op == "fsync":
        pair.both(os.fsync)
    elif op == "reopen":
        pair.close()
        pair.open()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_a_shadow_file(mnt, tmp_path, seed):
    rng = random.Random(seed)
    d = mnt.path / f"ro{seed}"
    d.mkdir()
    src = Pair(d / "src", tmp_path / "src")
    data = rng.randbytes(3 * CHUNK + 5)
    src.both(lambda fd: os.pwrite(fd, data, 0))
    pair = Pair(d / "f", tmp_path / "f")
    log: list[str] = []
    try:
        for _ in range(STEPS):
            _step(pair, src, rng, log)
        pair.close()
        pair.open()
        a, b = pair.both(lambda fd: os.pread(fd, MAX_SIZE * 2, 0))
        assert a == b
    except AssertionError as e:
        raise AssertionError(f"{e}\nlast steps:\n" + "\n".join(log[-12:])) from None
    finally:
        pair.close()
        src.close()
    assert (d / "f").read_bytes() == (tmp_path / "f").read_bytes()  # from a fresh open
