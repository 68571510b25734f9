"""POSIX behaviour of a real kernel FUSE mount of a real cluster: every operation, with errnos,
the tools people use on it, write visibility between two mounts, and the mount's lifecycle."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from fuse_support import errno_of, force_unmount, jpfs_cli, mounted, requires_fuse, tree_files

import jpfs
from jpfs import localcluster
from jpfs.fuse.mount import daemon_pid, is_jpfs_mount

pytestmark = [requires_fuse, pytest.mark.fuse]

CHUNK = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("fusecluster")
    localcluster.up(d, meta_shards=2, storage_nodes=2, chunk_size=CHUNK, sync=False)
    yield d
    localcluster.down(d, timeout=5)


@pytest.fixture(scope="module")
def mnt(cluster, tmp_path_factory):
    with mounted(cluster, tmp_path_factory.mktemp("m") / "mnt") as m:
        yield m


@pytest.fixture
def d(mnt, request):
    """A fresh directory on the mount for one test."""
    p = mnt.path / request.node.name.replace("[", "_").replace("]", "")
    p.mkdir()
    return p



# ---- each operation, with its errors -------------------------------------------------------------

def test_lookup_getattr(d):
    (d / "f").write_bytes(b"abc")
    st = os.stat(d / "f")
    assert st.st_size == 3 and st.st_nlink == 1 and st.st_ino > 1
    assert errno_of(os.stat, d / "missing") == errno.ENOENT
    assert errno_of(os.stat, d / "f" / "x") == errno.ENOTDIR
    assert errno_of(os.stat, d / ("n" * 300)) == errno.ENAMETOOLONG


def test_create_open_read_write_release(d):
    p = d / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o640)
    assert os.write(fd, b"hello world") == 11
    os.lseek(fd, 0, os.SEEK_SET)
    assert os.read(fd, 100) == b"hello world"
    os.close(fd)
    assert (os.stat(p).st_mode & 0o777) == 0o640
    assert errno_of(os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    assert errno_of(os.open, d / "nope", os.O_RDONLY) == errno.ENOENT
    assert errno_of(os.open, d, os.O_WRONLY) == errno.EISDIR
    with open(p, "ab") as f:  # O_APPEND
        f.write(b"!")
    assert p.read_bytes() == b"hello world!"
    with open(p, "r+b") as f:
        f.seek(6)
        f.write(b"W")
    assert p.read_bytes() == b"hello World!"
    with open(p, "wb") as f:  # O_TRUNC
        f.write(b"new")
    assert p.read_bytes() == b"new"


def test_sparse_and_large_files(d):
    p = d / "sparse"
    with open(p, "wb") as f:
        f.seek(3 * CHUNK + 5)
        f.write(b"end")
    data = p.read_bytes()
    assert len(data) == 3 * CHUNK + 8 and data[:3 * CHUNK + 5] == bytes(3 * CHUNK + 5)
    big = os.urandom(5 * CHUNK + 123)
    (d / "big").write_bytes(big)
    assert (d / "big").read_bytes() == big
    with open(d / "big", "rb") as f:  # unaligned reads across chunk boundaries
        for off in (0, CHUNK - 7, 2 * CHUNK + 1, 5 * CHUNK):
            f.seek(off)
            assert f.read(CHUNK + 9) == big[off:off + CHUNK + 9]


def test_setattr_chmod_chown_truncate_utimens(d):
    p = d / "f"
    p.write_bytes(b"0123456789")
    os.chmod(p, 0o600)
    assert os.stat(p).st_mode & 0o7777 == 0o600
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.truncate(p, 4)
    assert p.read_bytes() == b"0123"
    os.truncate(p, 6)
    assert p.read_bytes() == b"0123\0\0"
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    with open(p, "r+b") as f:  # ftruncate on an open, written file
        f.write(b"abcdefgh")
        f.truncate(3)
    assert p.read_bytes() == b"abc"
    assert errno_of(os.truncate, d, 0) in (errno.EISDIR, errno.EINVAL)
    assert errno_of(os.chmod, d / "missing", 0o600) == errno.ENOENT


def test_mkdir_rmdir_readdir(d):
    os.mkdir(d / "sub", 0o750)
    assert os.stat(d / "sub").st_mode & 0o777 == 0o750
    assert errno_of(os.mkdir, d / "sub") == errno.EEXIST
    names = [f"f{i:04d}" for i in range(1100)]  # more than one readdir page
    for n in names:
        (d / "sub" / n).write_bytes(b"")
    assert sorted(os.listdir(d / "sub")) == names
    with os.scandir(d / "sub") as it:
        assert sum(1 for e in it if e.is_file()) == 1100
    assert errno_of(os.rmdir, d / "sub") == errno.ENOTEMPTY
    assert errno_of(os.rmdir, d / "sub" / "f0000") == errno.ENOTDIR
    assert errno_of(os.rmdir, d / "missing") == errno.ENOENT
    shutil.rmtree(d / "sub")
    assert not (d / "sub").exists()
    assert ".jpfs" not in os.listdir(d.parent)


def test_unlink(d):
    (d / "f").write_bytes(b"x")
    os.mkdir(d / "dir")
    os.unlink(d / "f")
    assert errno_of(os.unlink, d / "f") == errno.ENOENT
    assert errno_of(os.unlink, d / "dir") in (errno.EISDIR, errno.EPERM)


def test_unlinked_but_open_file_keeps_reading(d):
    data = os.urandom(3 * CHUNK)
    (d / "f").write_bytes(data)
    with open(d / "f", "rb") as f:
        head = f.read(100)
        os.unlink(d / "f")
        assert not (d / "f").exists()
        rest = f.read()
        assert head + rest == data
        assert os.fstat(f.fileno()).st_size == len(data)


def test_rename(d):
    (d / "a").write_bytes(b"A")
    (d / "b").write_bytes(b"B")
    os.rename(d / "a", d / "b")  # replaces
    assert (d / "b").read_bytes() == b"A" and not (d / "a").exists()
    os.mkdir(d / "x")
    os.mkdir(d / "y")
    (d / "y" / "f").write_bytes(b"")
    assert errno_of(os.rename, d / "x", d / "y") == errno.ENOTEMPTY
    assert errno_of(os.rename, d / "x", d / "b") == errno.ENOTDIR
    assert errno_of(os.rename, d / "b", d / "y") == errno.EISDIR
    assert errno_of(os.rename, d / "missing", d / "z") == errno.ENOENT
    os.rename(d / "y", d / "x" / "moved")  # a directory into another one
    assert os.listdir(d / "x" / "moved") == ["f"]
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:  # RENAME_NOREPLACE
        (d / "c").write_bytes(b"C")
        rc = renameat2(-100, str(d / "c").encode(), -100, str(d / "b").encode(), 1)
        assert rc == -1 and ctypes.get_errno() == errno.EEXIST
        rc = renameat2(-100, str(d / "c").encode(), -100, str(d / "b").encode(), 2)  # EXCHANGE
        assert rc == 0 and (d / "b").read_bytes() == b"C" and (d / "c").read_bytes() == b"A"


def test_link_symlink_readlink(d):
    (d / "f").write_bytes(b"data")
    os.link(d / "f", d / "h")
    assert os.stat(d / "f").st_nlink == 2 and (d / "h").read_bytes() == b"data"
    assert os.stat(d / "f").st_ino == os.stat(d / "h").st_ino
    assert errno_of(os.link, d / "f", d / "h") == errno.EEXIST
    os.mkdir(d / "dir")
    assert errno_of(os.link, d / "dir", d / "dl") == errno.EPERM
    os.symlink("f", d / "s")
    assert os.readlink(d / "s") == "f" and (d / "s").read_bytes() == b"data"
    assert os.lstat(d / "s").st_size == 1
    assert errno_of(os.symlink, "x", d / "s") == errno.EEXIST
    assert errno_of(os.readlink, d / "f") == errno.EINVAL
    os.symlink("loop", d / "loop")
    assert errno_of(os.stat, d / "loop") == errno.ELOOP


def test_xattrs(d):
    p = d / "f"
    p.write_bytes(b"")
    os.setxattr(p, "user.a", b"1")
    os.setxattr(p, "user.b", b"2" * 1000)
    assert os.getxattr(p, "user.a") == b"1"
    assert sorted(os.listxattr(p)) == ["user.a", "user.b"]
    os.removexattr(p, "user.a")
    assert errno_of(os.getxattr, p, "user.a") == errno.ENODATA
    assert errno_of(os.removexattr, p, "user.a") == errno.ENODATA
    acl = bytes.fromhex("02000000" "01000600ffffffff" "04000400ffffffff" "20000400ffffffff")
    assert errno_of(os.setxattr, p, "system.posix_acl_access", acl) == errno.EOPNOTSUPP


def test_statfs_fsync(d, cluster):
    st = os.statvfs(d)
    assert st.f_namemax == 255 and st.f_bsize > 0 and st.f_blocks > 0
    # df tells JPFS's own usage, and the two storage nodes' shared disk counts once
    host = os.statvfs(cluster)
    assert st.f_blocks * st.f_frsize <= host.f_blocks * host.f_frsize
    assert abs(st.f_bavail * st.f_frsize - host.f_bavail * host.f_frsize) < 1 << 30
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    (d / "big").write_bytes(os.urandom(8 << 20))
    time.sleep(1.1)  # statfs answers are cached for a second
    st2 = os.statvfs(d)
    grew = (st2.f_blocks - st2.f_bfree) * st2.f_frsize - used
    assert 8 << 20 <= grew < 9 << 20, grew  # one replica of 8 MiB (and nothing of the host's)
    fd = os.open(d / "f", os.O_CREAT | os.O_WRONLY)
    os.write(fd, b"durable")
    os.fsync(fd)
    os.close(fd)
    assert (d / "f").read_bytes() == b"durable"


def test_fifo_and_device_nodes(d):
    os.mkfifo(d / "fifo")
    assert os.stat(d / "fifo").st_mode & 0o170000 == 0o010000
    os.mknod(d / "null", 0o020666, os.makedev(1, 3))  # /dev/null's twin
    os.mknod(d / "blk", 0o060600, os.makedev(7, 0))
    st = os.stat(d / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert stat.S_ISBLK(os.stat(d / "blk").st_mode)
    # FUSE mounts are nodev (as fusermount3 makes them): device nodes are stored and copied,
    # and opening one is refused by the kernel, as on any nodev filesystem
    assert "nodev" in Path("/proc/self/mounts").read_text().split(str(d.parent), 1)[1] \
        .splitlines()[0]
    assert errno_of(open, d / "null", "rb") == errno.EACCES
    assert errno_of(os.mknod, d / "null", 0o020666, os.makedev(1, 3)) == errno.EEXIST
    src = d / "tree"
    src.mkdir()
    os.mknod(src / "zero", 0o020666, os.makedev(1, 5))
    subprocess.run(["cp", "-a", str(src), str(d / "copy")], check=True)
    assert os.stat(d / "copy" / "zero").st_rdev == os.makedev(1, 5)


def test_shared_writers_on_one_mount(d):
    p = d / "f"
    with open(p, "wb") as a, open(p, "r+b") as b:
        a.write(b"aaaa")
        a.flush()
        b.seek(2)
        b.write(b"BB")
        b.flush()
        with open(p, "rb") as r:  # this node reads its own writes
            assert r.read() == b"aaBB"
    assert p.read_bytes() == b"aaBB"


# ---- tools ---------------------------------------------------------------------------------------

def _sample_tree(root: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "x.bin").write_bytes(os.urandom(300_000))
    (root / "a" / "b" / "y.txt").write_text("hello\n" * 100)
    (root / "a" / "b" / "empty").write_bytes(b"")
    (root / "big.bin").write_bytes(os.urandom(2 * CHUNK + 77))
    os.symlink("a/x.bin", root / "link")


def test_cp_tar_mv_find_du_rsync(d, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _sample_tree(src)
    want = tree_files(src)
    subprocess.run(["cp", "-a", str(src), str(d / "cp")], check=True)
    assert tree_files(d / "cp") == want
    assert os.readlink(d / "cp" / "link") == "a/x.bin"
    subprocess.run(f"tar -C {src} -cf - . | tar -C {d} -xf - --one-top-level=tar",
                   shell=True, check=True)
    assert tree_files(d / "tar") == want
    subprocess.run(["tar", "-C", str(d / "cp"), "-cf", str(tmp_path / "back.tar"), "."],
                   check=True)
    (tmp_path / "back").mkdir()
    subprocess.run(["tar", "-C", str(tmp_path / "back"), "-xf", str(tmp_path / "back.tar")],
                   check=True)
    assert tree_files(tmp_path / "back") == want
    subprocess.run(["mv", str(d / "tar"), str(d / "moved")], check=True)
    assert tree_files(d / "moved") == want and not (d / "tar").exists()
    found = subprocess.run(["find", str(d / "cp"), "-type", "f"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(found) == 4
    def du(p):
        return subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True,
                              check=True).stdout.split()[0]

    sizes = sum(os.lstat(os.path.join(r, n)).st_size for r, _, ns in os.walk(src) for n in ns)
    assert int(du(d / "cp")) == sizes  # directories count 0 bytes on JPFS
    if shutil.which("rsync"):
        subprocess.run(["rsync", "-a", f"{src}/", f"{d}/rs/"], check=True)
        assert tree_files(d / "rs") == want
        subprocess.run(["rsync", "-a", f"{d}/rs/", f"{tmp_path}/rsback/"], check=True)
        assert tree_files(tmp_path / "rsback") == want


def test_editor_style_saves(d):
    p = d / "notes.txt"
    p.write_text("one\ntwo\n")
    subprocess.run(["sed", "-i", "s/two/TWO/", str(p)], check=True)  # temp file + rename
    assert p.read_text() == "one\nTWO\n"
    tmp = d / ".notes.txt.swp"  # vim-like: write a new file, then replace the old one
    tmp.write_text("three\n")
    os.replace(tmp, p)
    assert p.read_text() == "three\n"


def test_pyarrow_reads_parquet(d):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"i": list(range(10000)), "s": [str(i) for i in range(10000)]})
    pq.write_table(table, d / "t.parquet", row_group_size=1000)
    assert pq.read_table(d / "t.parquet").equals(table)
    pf = pq.ParquetFile(d / "t.parquet")
    assert pf.read_row_group(3).column("i").to_pylist() == list(range(3000, 4000))


# ---- control files -------------------------------------------------------------------------------

def test_stats_metrics_and_bad_hints(mnt, d):
    s = mnt.stats()
    assert s["fuse"]["requests"]["lookup"] > 0 and "cache" in s and "prefetch" in s
    text = (mnt.path / ".jpfs" / "metrics").read_text()
    assert "jpfs_fuse_requests_total{op=\"lookup\"}" in text
    ctl = mnt.path / ".jpfs" / "prefetch"
    with pytest.raises(OSError) as e:
        with open(ctl, "wb") as f:
            f.write(b"\xff\xfe garbage\n")
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        with open(ctl, "w") as f:
            f.write(f"{mnt.path}/definitely/not/there\n")
    assert e.value.errno == errno.ENOENT
    with pytest.raises(OSError) as e:
        with open(ctl, "w") as f:
            f.write("/etc/passwd\n")
    assert e.value.errno == errno.EINVAL
    status = json.loads(ctl.read_text())
    assert any("not under the mount point" in m for m in status["last_errors"])
    assert any("no such file" in m for m in status["last_errors"])
    assert errno_of(os.open, mnt.path / ".jpfs" / "stats", os.O_WRONLY) == errno.EACCES
    assert errno_of(os.unlink, mnt.path / ".jpfs" / "stats") == errno.EPERM
    (d / "ok").write_bytes(b"fine")  # the mount lives on
    assert (d / "ok").read_bytes() == b"fine"


# ---- two mounts, lifecycle -----------------------------------------------------------------------

def test_two_mounts_see_each_others_changes(cluster, tmp_path):
    with mounted(cluster, tmp_path / "a") as a, mounted(cluster, tmp_path / "b") as b:
        (a.path / "shared").mkdir()
        (a.path / "shared" / "f").write_bytes(b"v1")
        assert (b.path / "shared" / "f").read_bytes() == b"v1"  # close-to-open
        (a.path / "shared" / "f").write_bytes(b"version two")
        assert (b.path / "shared" / "f").read_bytes() == b"version two"
        (b.path / "shared" / "g").write_bytes(b"from b")
        deadline = time.monotonic() + 5  # a new name too: within the entry timeout (1 s), as a
        while not (a.path / "shared" / "g").exists():  # is writing there (listings.KnownDirs)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (a.path / "shared" / "g").read_bytes() == b"from b"
        os.unlink(b.path / "shared" / "g")
        deadline = time.monotonic() + 2.5  # the entry timeout (1 s) bounds how long a is stale
        while (a.path / "shared" / "g").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.rename(a.path / "shared" / "f", a.path / "shared" / "h")
        deadline = time.monotonic() + 2.5
        while not (b.path / "shared" / "h").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (b.path / "shared" / "h").read_bytes() == b"version two"


def test_read_only_mount(cluster, tmp_path):
    with jpfs.connect(cluster) as c:
        c.write_bytes("/ro-data", b"frozen")
        c.write_bytes("/ro-more", b"thawed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mounted(cluster, tmp_path / "ro", "--read-only", "--metrics",
                 f"127.0.0.1:{port}") as m:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b'jpfs_fuse_requests_total{op="lookup"}' in r.read()
        assert (m.path / "ro-data").read_bytes() == b"frozen"
        opts = Path("/proc/self/mounts").read_text().split(f" {m.path} ", 1)[1].split()[1]
        assert "ro" in opts.split(","), opts  # read-only in the kernel too
        assert errno_of(os.open, m.path / "ro-data", os.O_WRONLY) == errno.EROFS
        assert errno_of(os.mkdir, m.path / "newdir") == errno.EROFS
        assert errno_of(os.unlink, m.path / "ro-data") == errno.EROFS
        assert errno_of(os.open, m.path / "new", os.O_CREAT | os.O_WRONLY) == errno.EROFS
        assert m.stats()["mount"]["kernel_opens"] is False  # OPEN is answered ENOSYS
        ctl = os.stat(m.path / ".jpfs")
        assert stat.S_ISDIR(ctl.st_mode) and ctl.st_size == 0
        assert os.stat(m.path / ".jpfs" / "stats").st_size > 0  # the snapshot's size
        for _ in range(3):  # the kernel opens files itself: a file it caches costs nothing
            before = m.stats()["fuse"]
            assert (m.path / "ro-data").read_bytes() == b"frozen"
        after = m.stats()["fuse"]
        assert after["requests_total"] == before["requests_total"], (before, after)
        with open(m.path / "ro-more", "rb") as f:  # a first read: LOOKUP, READ (stats are fresh)
            assert f.read() == b"thawed"
            os.fsync(f.fileno())  # nothing to make durable, and no error
        later = m.stats()["fuse"]
        assert later["requests"]["lookup"] == after["requests"]["lookup"] + 1, (after, later)
        assert later["requests"]["read"] == after["requests"]["read"] + 1, (after, later)


def test_read_only_mount_holds_no_handle_for_files_read(cluster, tmp_path):
    """Without OPEN or RELEASE the mount opens a file at its first READ: a file read whole
    leaves no handle behind, one read in part keeps one until the kernel forgets the inode."""
    blobs = {f"/ro-h/{i}": os.urandom(200_000 + i) for i in range(20)}
    with jpfs.connect(cluster) as c:
        c.makedirs("/ro-h")
        for p, b in blobs.items():
            c.write_bytes(p, b)
    with mounted(cluster, tmp_path / "ro", "--read-only") as m:
        for p, b in blobs.items():
            assert (m.path / p.lstrip("/")).read_bytes() == b
        assert m.stats()["mount"]["handles"] == 0
        with open(m.path / "ro-h" / "0", "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # drop its pages
            assert os.pread(f.fileno(), 4096, 8192) == blobs["/ro-h/0"][8192:12288]
        assert m.stats()["mount"]["handles"] == 1  # read in part: the kernel may ask again
        Path("/proc/sys/vm/drop_caches").write_text("2")  # dentries and inodes: FORGET
        m.wait_for(lambda s: s["mount"]["handles"] == 0, what="the handle closed at FORGET")


def test_read_only_mount_with_open_requests(cluster, tmp_path):
    """--open-requests keeps the kernel asking at every open: a re-read costs OPEN and
    RELEASE, and the per-open counters see it."""
    with jpfs.connect(cluster) as c:
        c.write_bytes("/ro-asked", b"asked")
    with mounted(cluster, tmp_path / "ro", "--read-only", "--open-requests") as m:
        assert m.stats()["mount"]["kernel_opens"] is True
        assert (m.path / "ro-asked").read_bytes() == b"asked"
        for _ in range(3):
            before = m.stats()["fuse"]
            assert (m.path / "ro-asked").read_bytes() == b"asked"
        after = m.stats()["fuse"]
        assert after["requests_total"] - before["requests_total"] == 2
        assert after["opens"]["kernel"] - before["opens"]["kernel"] == 1


def test_sigterm_unmounts_cleanly(cluster, tmp_path):
    with mounted(cluster, tmp_path / "s") as m:
        fd = os.open(m.path / "pending", os.O_CREAT | os.O_WRONLY)
        os.write(fd, b"committed at shutdown")
        os.kill(m.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while is_jpfs_mount(str(m.path)) or daemon_pid(str(m.path)):
            assert time.monotonic() < deadline, "SIGTERM did not unmount"
            time.sleep(0.05)
        try:
            os.close(fd)
        except OSError:
            pass
    with jpfs.connect(cluster) as c:
        assert c.read_bytes("/pending") == b"committed at shutdown"


def _threads(pid: int) -> dict[str, str]:
    """Each thread of process ``pid`` that is left: its state and what it waits in."""
    out: dict[str, str] = {}
    try:
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone, reaped
        return out
    for t in tasks:
        try:
            name = (t / "comm").read_text().strip()
            state = (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (t / "wchan").read_text().strip()
        except OSError:
            continue
        out[f"{t.name} {name}"] = f"{state} {wchan}"
    return out


def test_killed_daemon_never_leaves_a_hung_mountpoint(cluster, tmp_path):
    mp = tmp_path / "k"
    with mounted(cluster, mp) as m:
        assert (m.path / ".jpfs" / "stats").exists()
        os.kill(m.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while daemon_pid(str(mp)):
            assert time.monotonic() < deadline, f"killed, still running: {_threads(m.pid)}"
            time.sleep(0.05)
        # ENOTCONN once the connection is gone; ECONNABORTED when the request was queued while
        # the daemon's other threads were still exiting (its main thread a zombie already)
        got = errno_of(os.listdir, mp)
        assert got in (errno.ENOTCONN, errno.ECONNABORTED), (os.strerror(got), _threads(m.pid))
        res = jpfs_cli("umount", str(mp))
        assert "lazily" in res.stdout
        assert not is_jpfs_mount(str(mp)) and os.listdir(mp) == []
        # and mounting again on the same point works
        res = jpfs_cli("--cluster", str(cluster), "mount", str(mp), "--cache-dir",
                       str(tmp_path / "c2"))
        assert is_jpfs_mount(str(mp))
        force_unmount(mp)
    assert jpfs_cli("umount", str(mp), check=False).returncode == 1  # not mounted: an error
