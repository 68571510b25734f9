"""What a read-write mount is asked and what it asks in turn: read opens send no FLUSH; the
kernel's LOOKUP before each new name and its security.capability check before each write are
answered from memory, and so is the GETATTR of a directory after a mkdir in it; and what other
nodes change is still seen, within the entry timeout."""

from __future__ import annotations

import errno
import os
import struct
import time

import pytest
from fuse_support import mounted, requires_fuse

import jpfs
from jpfs import localcluster
from jpfs.placement import shard_of

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
    # a long entry timeout: every lookup below falls in the window, however slow the machine
    with mounted(cluster, tmp_path / "m", "--entry-timeout", "120") as m, \
            jpfs.connect(cluster) as c:
        d = m / "w"
        d.mkdir()
        absent = m.stats()["names"]["absent"]
        for i in range(30):
            os.close(os.open(d / f"f{i:02d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        # each create's LOOKUP of the new name was answered from memory
        assert m.stats()["names"]["absent"] - absent >= 30
        os.rename(d / "f00", d / "g00")
        os.unlink(d / "f01")
        os.mkdir(d / "sub")
        os.close(os.open(d / "sub" / "x", os.O_CREAT | os.O_WRONLY, 0o644))
        os.symlink("g00", d / "link")
        os.link(d / "g00", d / "hard")
        for gone in ("f00", "f01", "nothing"):
            with pytest.raises(FileNotFoundError):
                os.stat(d / gone)
        assert (d / "g00").exists() and (d / "sub" / "x").exists()
        assert os.readlink(d / "link") == "g00" and os.stat(d / "hard").st_nlink == 2
        want = sorted([f"f{i:02d}" for i in range(2, 30)] + ["g00", "sub", "link", "hard"])
        assert sorted(os.listdir(d)) == want and sorted(c.listdir("/w")) == want
        # a name another client made: O_EXCL still fails as it must, at once
        c.write_bytes("/w/theirs", b"hi")
        with pytest.raises(FileExistsError):
            os.open(d / "theirs", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with pytest.raises(FileExistsError):
            os.mkdir(d / "theirs")


@requires_fuse
def test_a_directory_made_on_either_shard_leaves_its_parent_right(cluster, tmp_path):
    """mkdir answers its parent's attributes after the change, wherever the new directory
    lives (on the parent's shard or the other one): a stat of the parent right after shows
    the link count and the times its shard holds. (Without leases: under its parent's lease a
    mkdir is answered before its shard has it, ``test_fuse_leases.py``.)"""
    with mounted(cluster, tmp_path / "m", "--no-dir-leases") as m, \
            jpfs.connect(cluster, dir_cache_ttl=0) as c:
        (m / "mk").mkdir()
        names = [f"d{i}" for i in range(16)]
        for i, n in enumerate(names):
            os.mkdir(m / "mk" / n)
            st, theirs = os.stat(m / "mk"), c.stat("/mk")
            assert st.st_nlink == theirs.nlink == 3 + i
            assert (st.st_mtime_ns, st.st_ctime_ns) == (theirs.mtime_ns, theirs.ctime_ns)
        assert {shard_of(c.stat(f"/mk/{n}").ino) for n in names} == {0, 1}


@requires_fuse
def test_other_clients_names_show_within_the_entry_timeout(cluster, tmp_path):
    # without leases: the names this VFS knows age, and misses list the directory again
    with mounted(cluster, tmp_path / "m", "--no-dir-leases") as m, jpfs.connect(cluster) as c:
        d = m / "v"
        d.mkdir()
        os.close(os.open(d / "mine", os.O_CREAT | os.O_WRONLY, 0o644))
        c.write_bytes("/v/later", b"ho")
        _eventually(lambda: (d / "later").exists(), "another client's new name is seen")
        assert (d / "later").read_bytes() == b"ho"
        c.remove("/v/later")
        _eventually(lambda: not (d / "later").exists(), "another client's removal is seen")
        # once the set has aged, lookups that keep missing list the directory again
        time.sleep(1.2)
        for i in range(40):
            os.close(os.open(d / f"n{i:02d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        names = m.stats()["names"]
        assert names["aged"] >= 1 and names["listed"] >= 1, names
        assert sorted(os.listdir(d)) == sorted(["mine"] + [f"n{i:02d}" for i in range(40)])


@requires_fuse
def test_a_stat_of_every_file_lists_the_directory_and_still_shows_each_change(cluster,
                                                                             tmp_path):
    """`du`, an indexer or a loader checking sizes stats every file of a directory another node
    filled: after a few lookups the mount lists the directory with attributes and answers the
    rest from the listing, each file as the shard has it; another node's change shows once the
    entry and attribute timeouts have passed, this mount's own at once."""
    n = 300
    with jpfs.connect(cluster) as c:
        c.makedirs("/statdir")
        for i in range(n):
            c.write_bytes(f"/statdir/f{i:03d}", b"x" * i)
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster) as c:
        d = m / "statdir"
        before = m.stats()["fuse"]
        assert {f"f{i:03d}": os.stat(d / f"f{i:03d}").st_size for i in range(n)} == {
            f"f{i:03d}": i for i in range(n)}
        after = m.stats()["fuse"]
        asked = after["lookups_asked"] - before["lookups_asked"]
        assert after["lookups_listed"] - before["lookups_listed"] >= n - 50, after
        assert asked <= 50 and m.stats()["prefetch"]["listings"] >= 1, after
        (d / "f007").write_bytes(b"mine")  # this mount's change: at once
        assert os.stat(d / "f007").st_size == 4
        c.write_bytes("/statdir/f010", b"theirs")  # another node's: within the timeouts
        c.remove("/statdir/f011")
        _eventually(lambda: os.stat(d / "f010").st_size == 6, "another node's write shows")
        _eventually(lambda: not (d / "f011").exists(), "another node's removal shows")
        assert os.stat(d / "f299").st_size == 299


@requires_fuse
def test_a_directory_being_emptied_is_not_listed_between_its_removes(cluster, tmp_path):
    """Lookups before each remove ask the shard (the kernel's entries expired), but a listing
    taken for them would be dropped by the next remove: none is taken while the mount keeps
    changing the directory."""
    with jpfs.connect(cluster) as c:
        c.makedirs("/emptied")
        for i in range(120):
            c.makedirs(f"/emptied/d{i:03d}")
    with mounted(cluster, tmp_path / "m", "--no-dir-leases") as m:
        d = m / "emptied"
        assert len(os.listdir(d)) == 120
        time.sleep(1.2)  # the kernel's entries from the listing expire: a LOOKUP per rmdir
        before = m.stats()
        for i in range(120):
            os.rmdir(d / f"d{i:03d}")
        after = m.stats()
        assert after["fuse"]["lookups_asked"] - before["fuse"]["lookups_asked"] >= 100, after
        assert after["prefetch"]["listings"] - before["prefetch"]["listings"] <= 1, after
        assert os.listdir(d) == []


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
