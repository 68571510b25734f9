"""What a read-write mount is asked and what it asks in turn: read opens send no FLUSH; the
kernel's LOOKUP before each new name and its security.capability check before each write are
answered from memory; and what other nodes change is still seen, within the entry timeout."""

from __future__ import annotations

import errno
import os
import struct
import time

import pytest
from fuse_support import mounted, requires_fuse

import jpfs
from jpfs import localcluster

CAP_V2 = struct.pack("<IIIII", 0x02000000, 0, 0, 0, 0)
"""An empty VFS_CAP_REVISION_2 security.capability value (the kernel checks the format)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("reqcluster")
    localcluster.up(d, meta_shards=2, storage_nodes=1, sync=False)
    yield d
    localcluster.down(d, timeout=5)


def _requests(m) -> dict:
    return m.stats()["fuse"]["requests"]


def _eventually(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


@requires_fuse
def test_read_opens_send_no_flush_and_closes_still_commit(cluster, tmp_path):
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster) as c:
        (m / "r").mkdir()
        (m / "r" / "f").write_bytes(b"x" * 1000)
        assert c.read_bytes("/r/f") == b"x" * 1000  # committed by close: another client sees it
        before = _requests(m)
        for _ in range(20):
            assert (m / "r" / "f").read_bytes() == b"x" * 1000
        after = _requests(m)
        assert after["open"] - before["open"] == 20
        assert after["flush"] == before["flush"]
        with open(m / "r" / "f", "r+b") as f:  # a write open still flushes: close commits
            f.write(b"y")
        assert _requests(m)["flush"] > after["flush"]
        assert c.read_bytes("/r/f") == b"y" + b"x" * 999


@requires_fuse
def test_names_of_a_directory_being_written_are_answered_and_stay_right(cluster, tmp_path):
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster) as c:
        d = m / "w"
        d.mkdir()
        absent = m.stats()["names"]["absent"]
        for i in range(30):
            os.close(os.open(d / f"f{i:02d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        # each create's LOOKUP of the new name was answered from memory (renewed by a getattr
        # of the directory if the machine is slow: only this mount changed it)
        assert m.stats()["names"]["absent"] - absent >= 30
        os.rename(d / "f00", d / "g00")
        os.unlink(d / "f01")
        os.mkdir(d / "sub")
        os.close(os.open(d / "sub" / "x", os.O_CREAT | os.O_WRONLY, 0o644))
        for gone in ("f00", "f01", "nothing"):
            with pytest.raises(FileNotFoundError):
                os.stat(d / gone)
        assert (d / "g00").exists() and (d / "sub" / "x").exists()
        assert sorted(os.listdir(d)) == sorted([f"f{i:02d}" for i in range(2, 30)]
                                               + ["g00", "sub"])
        assert sorted(c.listdir("/w")) == sorted(os.listdir(d))
        # another client's new names: O_EXCL fails as it must at once, and the name shows
        # within the entry timeout
        c.write_bytes("/w/theirs", b"hi")
        with pytest.raises(FileExistsError):
            os.open(d / "theirs", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        c.write_bytes("/w/later", b"ho")
        _eventually(lambda: (d / "later").exists(), "another client's new name is seen")
        assert (d / "later").read_bytes() == b"ho"
        c.remove("/w/f02")
        _eventually(lambda: not (d / "f02").exists(), "another client's removal is seen")


@requires_fuse
def test_capability_checks_before_writes_are_answered_from_memory(cluster, tmp_path):
    with mounted(cluster, tmp_path / "m") as m:
        p = m / "caps"
        checks = m.stats()["fuse"]["capability_checks"]
        with open(p, "wb", buffering=0) as f:
            for _ in range(20):
                f.write(b"z" * 4096)
        assert m.stats()["fuse"]["capability_checks"] - checks >= 10
        with pytest.raises(OSError) as e:
            os.getxattr(p, "security.capability")
        assert e.value.errno == errno.ENODATA
        # a capability set here is seen at once, and a write drops it, as on ext4
        os.setxattr(p, "security.capability", CAP_V2)
        assert os.getxattr(p, "security.capability") == CAP_V2
        with open(p, "r+b", buffering=0) as f:
            f.write(b"w")
        with pytest.raises(OSError) as e:
            os.getxattr(p, "security.capability")
        assert e.value.errno == errno.ENODATA
        assert p.read_bytes() == b"w" + b"z" * (20 * 4096 - 1)
