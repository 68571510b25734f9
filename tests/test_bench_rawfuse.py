"""The raw-protocol passthrough ``jpfs bench mount`` reads through (``bench/rawfuse.py``), tried as
a reader would: on 4 threads sharing one FUSE connection it serves a directory's bytes, listings
and attributes unchanged to concurrent readers, answers a missing name with ENOENT and a write
with EROFS, and goes away cleanly when unmounted; with ``--read-write`` a writer's changes land
in the directory below."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import threading

import pytest
from fuse_support import requires_fuse


@pytest.fixture
def served(tmp_path):
    src, mp = tmp_path / "src", tmp_path / "mnt"
    (src / "d" / "e").mkdir(parents=True)
    mp.mkdir()
    files = {"big.bin": os.urandom(5 << 20), "d/small": b"x" * 1000, "d/e/empty": b""}
    files.update({f"d/f{i:03d}": os.urandom(1000 + 997 * i) for i in range(60)})
    for name, data in files.items():
        (src / name).write_bytes(data)
    os.symlink("d/small", src / "link")
    proc = subprocess.Popen([sys.executable, "-m", "jpfs_bench.rawfuse", str(src), str(mp),
                             "--threads", "4"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    try:
        yield src, mp, files, proc
    finally:
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)
        proc.wait(timeout=30)


@requires_fuse
def test_serves_the_directory_unchanged_to_concurrent_readers(served):
    src, mp, files, proc = served
    assert sorted(os.listdir(mp)) == sorted(os.listdir(src))
    assert sorted(os.listdir(mp / "d")) == sorted(os.listdir(src / "d"))
    for name in ("big.bin", "d/f007", "d/e/empty", "d", "link"):
        a, b = os.lstat(mp / name), os.lstat(src / name)
        assert (a.st_mode, a.st_size, a.st_mtime_ns) == (b.st_mode, b.st_size, b.st_mtime_ns)
    assert os.readlink(mp / "link") == "d/small"
    want = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    got: dict[str, str] = {}

    def read(names: list[str]) -> None:
        for name in names:
            with open(mp / name, "rb") as f:
                got[name] = hashlib.sha256(f.read()).hexdigest()

    names = sorted(files)
    readers = [threading.Thread(target=read, args=(names[k::6],)) for k in range(6)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert got == want
    with open(mp / "big.bin", "rb") as f:  # reads at an offset, across request boundaries
        f.seek((1 << 20) - 10)
        assert f.read(4 << 20) == files["big.bin"][(1 << 20) - 10:(5 << 20) - 10]
    assert proc.poll() is None


@requires_fuse
def test_errors_and_unmount(served):
    src, mp, files, proc = served
    with pytest.raises(FileNotFoundError):
        os.stat(mp / "d" / "nothing")
    with pytest.raises(OSError) as e:
        open(mp / "d" / "small", "wb")
    assert e.value.errno == errno.EROFS
    with pytest.raises(OSError) as e:
        os.mkdir(mp / "new")
    assert e.value.errno == errno.EROFS
    assert (src / "d" / "small").read_bytes() == files["d/small"]
    st = os.statvfs(mp)
    assert st.f_blocks > 0 and st.f_bsize > 0
    subprocess.run(["umount", str(mp)], check=True)
    assert proc.wait(timeout=30) == 0
    with open("/proc/mounts") as f:
        assert str(mp) not in f.read()


@requires_fuse
def test_read_write_serves_a_writers_changes(tmp_path):
    """With --read-write: the namespace phase's changes land in the directory below, and what
    a writer reads back through the mount is what it wrote."""
    src, mp = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "jpfs_bench.rawfuse", str(src), str(mp),
                             "--threads", "3", "--read-write"], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    try:
        (mp / "d").mkdir(mode=0o750)
        data = os.urandom(300_000)
        with open(mp / "d" / "f", "wb") as f:  # CREATE, WRITEs of up to 128 KiB
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        assert (src / "d" / "f").read_bytes() == data
        assert (mp / "d" / "f").read_bytes() == data
        with open(mp / "d" / "f", "r+b") as f:  # OPEN for writing, a write at an offset
            f.seek(1000)
            f.write(b"abc")
        assert (src / "d" / "f").read_bytes()[998:1005] == \
            data[998:1000] + b"abc" + data[1003:1005]
        os.truncate(mp / "d" / "f", 10)
        os.chmod(mp / "d" / "f", 0o600)
        os.utime(mp / "d" / "f", ns=(1_000_000_123, 2_000_000_456))
        st = os.stat(src / "d" / "f")
        assert (st.st_size, st.st_mode & 0o777, st.st_mtime_ns) == (10, 0o600, 2_000_000_456)
        assert os.stat(mp / "d" / "f").st_size == 10
        os.rename(mp / "d" / "f", mp / "g")
        assert not (src / "d" / "f").exists() and (src / "g").read_bytes() == data[:10]
        assert (mp / "g").read_bytes() == data[:10]
        (mp / "d" / "h").write_bytes(b"x")
        with pytest.raises(OSError) as e:
            os.rmdir(mp / "d")
        assert e.value.errno == errno.ENOTEMPTY
        os.unlink(mp / "d" / "h")
        os.rmdir(mp / "d")
        with pytest.raises(FileExistsError):
            os.open(mp / "g", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        assert sorted(os.listdir(mp)) == sorted(os.listdir(src)) == ["g"]
    finally:
        subprocess.run(["umount", "-l", str(mp)], capture_output=True)
        proc.wait(timeout=30)
