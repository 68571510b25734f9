"""The raw-protocol passthrough ``jpfs bench mount`` reads through (``bench/rawfuse.py``), tried as
a reader would: on 4 threads sharing one FUSE connection it serves a directory's bytes, listings
and attributes unchanged to concurrent readers, answers a missing name with ENOENT and a write
with EROFS, and goes away cleanly when unmounted."""

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
