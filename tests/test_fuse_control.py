"""The ``.jpfs`` control tree (``jpfs.fuse.control.ControlTree``) and the adapter's one route to
it (``jpfs.fuse.operations.fuse_op``), called directly over a stand-in VFS: no cluster, no mount.

What the kernel sees of the tree through a real mount is in tests/test_fuse_posix.py ("control
files", the read-only mount's snapshots).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from types import SimpleNamespace

import pyfuse3
import pytest

from jpfs.client.vfs.types import VFSConfig, VFSStats
from jpfs.errors import error
from jpfs.fuse import control
from jpfs.fuse.control import CONTROL_DIR, METRICS, PREFETCH, SOCKET, STATS, ControlTree
from jpfs.fuse.operations import FuseConfig, Operations
from jpfs.fuse.stats import OPS
from jpfs.types import ROOT_INO, Attr

CTX = SimpleNamespace(uid=0, gid=0, pid=1)
FILE_INO = 42
"""An inode of the VFS (not the tree's)."""


class FakePrefetcher:
    def __init__(self) -> None:
        self.hinted: list[list[str]] = []

    def as_dict(self) -> dict:
        return {"enabled": True, "hint_paths": sum(map(len, self.hinted)), "hints_queued": 0}

    async def hint(self, paths) -> int:
        if any(p.endswith("/missing") for p in paths):
            raise error(errno.ENOENT, "no such file", paths[-1])
        self.hinted.append(list(paths))
        return len(paths)


class FakeVFS:
    """The VFS's public face as the adapter uses it; every call of a method is recorded."""

    def __init__(self, read_only: bool = False) -> None:
        self.config = VFSConfig(read_only=read_only)
        self.ro = read_only
        self.prefetcher = FakePrefetcher()
        self.cache = SimpleNamespace(as_dict=lambda: {"memory_bytes": 1})
        root = SimpleNamespace(attr=Attr(ROOT_INO, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 1, 1, 1))
        self.inodes = SimpleNamespace(root=root, get=lambda ino: None)
        self.handles: dict = {}
        self.calls: list[str] = []

    def snapshot(self) -> dict:
        return {"inodes": 1, "handles": 0, **VFSStats().as_dict(), "names": {}, "leases": {}}

    def __getattr__(self, name: str):
        async def call(*args):
            self.calls.append(name)
            return Attr(FILE_INO, stat.S_IFREG | 0o644, 1, 0, 0, 0, 1, 1, 1)

        return call


class FakeReads:
    """``lowlevel.InodeReads`` once installed: the kernel opens files itself."""

    installed = True

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}


def _ops(read_only: bool = False, **kw) -> tuple[Operations, FakeVFS]:
    vfs = FakeVFS(read_only)
    ops = Operations(vfs, FuseConfig(mountpoint="/mnt/x", cluster="/etc/jpfs/c.toml"), **kw)
    return ops, vfs


async def _errno(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return e.value.errno


class Replies(list):
    """READDIR's replies, taken as an engine other than pyfuse3 takes them (an ``EntrySink``:
    pyfuse3's own token needs a kernel's request)."""

    def upto(self, total: int) -> Replies.Sink:
        """A sink that takes entries until this list holds ``total``."""
        return Replies.Sink(self, total)

    class Sink:
        def __init__(self, got: list, total: int):
            self.got, self.total = got, total

        def add(self, name, attr, nxt) -> bool:
            self.got.append((name, attr.st_ino, nxt))
            return len(self.got) < self.total


@pytest.fixture
def replies() -> Replies:
    return Replies()


# ---- the route -------------------------------------------------------------------------------

def test_every_request_but_forget_and_statfs_can_reach_the_tree():
    for op in OPS:
        route = getattr(Operations, op).control_if
        if op in ("forget", "statfs"):
            assert route is None, op
        else:
            assert route is not None, op
            assert callable(getattr(ControlTree, op, None)), f"ControlTree answers no {op}"


COUNTED_AS_DATA = {"mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "create",
                   "readlink", "fsync", "fallocate", "fsyncdir", "setxattr", "removexattr"}

# (request, arguments, errno): what each request on the tree is answered
REFUSED = [
    ("setattr", (STATS, None, None, None, CTX), errno.EPERM),
    ("readlink", (STATS, CTX), errno.EINVAL),
    ("mknod", (CONTROL_DIR, b"n", 0o644, 0, CTX), errno.EPERM),
    ("mknod", (ROOT_INO, b".jpfs", 0o644, 0, CTX), errno.EPERM),
    ("mkdir", (ROOT_INO, b".jpfs", 0o755, CTX), errno.EPERM),
    ("mkdir", (CONTROL_DIR, b"d", 0o755, CTX), errno.EPERM),
    ("symlink", (CONTROL_DIR, b"l", b"/x", CTX), errno.EPERM),
    ("link", (STATS, ROOT_INO, b"x", CTX), errno.EPERM),
    ("link", (FILE_INO, CONTROL_DIR, b"x", CTX), errno.EPERM),
    ("link", (FILE_INO, ROOT_INO, b".jpfs", CTX), errno.EPERM),
    ("unlink", (CONTROL_DIR, b"stats", CTX), errno.EPERM),
    ("unlink", (ROOT_INO, b".jpfs", CTX), errno.EPERM),
    ("rmdir", (ROOT_INO, b".jpfs", CTX), errno.EPERM),
    ("rename", (CONTROL_DIR, b"stats", ROOT_INO, b"s", 0, CTX), errno.EPERM),
    ("rename", (ROOT_INO, b"a", ROOT_INO, b".jpfs", 0, CTX), errno.EPERM),
    ("rename", (ROOT_INO, b"a", CONTROL_DIR, b"a", 0, CTX), errno.EPERM),
    ("create", (CONTROL_DIR, b"new", 0o644, os.O_WRONLY, CTX), errno.EPERM),
    ("create", (ROOT_INO, b".jpfs", 0o644, os.O_WRONLY, CTX), errno.EPERM),
    ("open", (CONTROL_DIR, os.O_RDONLY, CTX), errno.EISDIR),
    ("open", (STATS, os.O_WRONLY, CTX), errno.EACCES),
    ("open", (METRICS, os.O_RDWR, CTX), errno.EACCES),
    ("lookup", (CONTROL_DIR, b"nothing", CTX), errno.ENOENT),
    ("lookup", (STATS, b"below", CTX), errno.ENOENT),
    ("read", (control.CONTROL_FH + 99, 0, 10), errno.EBADF),
    ("write", (control.CONTROL_FH + 99, 0, b"x"), errno.EBADF),
    ("flush", (control.CONTROL_FH + 99,), errno.EBADF),
    ("readdir", (control.CONTROL_FH + 99, 0, 10), errno.EBADF),
    ("fallocate", (control.CONTROL_FH, 0, 0, 10), errno.EOPNOTSUPP),
    ("getxattr", (STATS, b"user.x", CTX), errno.ENODATA),
    ("setxattr", (STATS, b"user.x", b"v", CTX), errno.EPERM),
    ("removexattr", (CONTROL_DIR, b"user.x", CTX), errno.EPERM),
]


@pytest.mark.parametrize(("op", "args", "err"), REFUSED,
                         ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(REFUSED)])
async def test_the_tree_answers_its_requests_with_their_errno_and_the_vfs_never_hears(op, args,
                                                                                   err):
    ops, vfs = _ops()
    assert await _errno(getattr(ops, op)(*args)) == err
    assert vfs.calls == []
    assert ops.stats.errors == {errno.errorcode[err]: 1}
    if op in COUNTED_AS_DATA:  # attempts to change the tree: counted as they always were
        assert ops.stats.control_requests == 0 and ops.stats.requests[op] == 1
    else:  # reading the tree: apart, so that reading the stats changes no figure
        assert ops.stats.control_requests == 1 and sum(ops.stats.requests.values()) == 0


async def test_requests_outside_the_tree_go_to_the_vfs():
    ops, vfs = _ops()
    await ops.mkdir(ROOT_INO, b".jpfsx", 0o755, CTX)
    await ops.unlink(FILE_INO, b".jpfs", CTX)  # a .jpfs below the root is a plain name
    await ops.getattr(FILE_INO, CTX)
    await ops.fsync(5, False)
    assert vfs.calls == ["mkdir", "unlink", "getattr", "fsync"]
    assert ops.stats.control_requests == 0
    assert ops.stats.requests["mkdir"] == ops.stats.requests["unlink"] == 1


async def test_nothing_to_sync_or_list_in_the_tree():
    ops, vfs = _ops()
    fh = await ops.opendir(CONTROL_DIR, CTX)
    assert fh >= control.CONTROL_FH
    assert await ops.fsyncdir(fh, False) is None
    assert await ops.fsync(control.CONTROL_FH, True) is None
    assert await ops.listxattr(STATS, CTX) == []
    await ops.releasedir(fh)
    assert vfs.calls == [] and ops.stats.control_requests == 3  # opendir, listxattr, releasedir
    assert ops.stats.requests["fsync"] == ops.stats.requests["fsyncdir"] == 1


# ---- names, attributes, listing ---------------------------------------------------------------

async def test_lookup_and_getattr():
    ops, _ = _ops()
    d = await ops.lookup(ROOT_INO, b".jpfs", CTX)
    assert d.st_ino == CONTROL_DIR and stat.S_ISDIR(d.st_mode) and d.st_mode & 0o777 == 0o555
    for name, ino in control.FILES.items():
        e = await ops.lookup(CONTROL_DIR, name, CTX)
        assert e.st_ino == ino and stat.S_ISREG(e.st_mode) and e.st_size == 0
        assert e.entry_timeout == 1.0  # the mount's: OPEN takes the snapshot
    assert (await ops.getattr(PREFETCH, CTX)).st_mode & 0o777 == 0o666
    assert (await ops.getattr(STATS, CTX)).st_mode & 0o777 == 0o444


async def test_readdir_lists_the_files_and_resumes(replies):
    ops, _ = _ops()
    fh = await ops.opendir(CONTROL_DIR, CTX)
    await ops.readdir(fh, 0, replies.upto(3))  # the kernel's buffer takes three
    assert [(n, i) for n, i, _ in replies] == [(b".", CONTROL_DIR), (b"..", ROOT_INO),
                                               (b"stats", STATS)]
    await ops.readdir(fh, replies[-1][2], replies.upto(100))
    assert [n for n, _, _ in replies[3:]] == [n for n in control.FILES if n != b"stats"]
    await ops.releasedir(fh)
    assert ops.control.open_handles == 0


async def test_the_root_listing_hides_a_stored_jpfs(replies):
    from jpfs.client.vfs.handles import DirHandle

    ops, vfs = _ops()
    attr = Attr(7, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 1, 1, 1)

    async def readdir(fh, start):
        for k, name in enumerate((b"a", b".jpfs", b"b")):
            yield name, attr, k + 1

    vfs.readdir = readdir
    vfs.handles[3] = DirHandle(ROOT_INO)
    await ops.readdir(3, 0, replies.upto(100))
    assert [n for n, _, _ in replies] == [b"a", b"b"]


# ---- files ------------------------------------------------------------------------------------

async def _read_all(ops: Operations, ino: int) -> bytes:
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    assert fi.direct_io and not fi.keep_cache
    got = b""
    while piece := await ops.read(fi.fh, len(got), 7):
        got += piece
    await ops.release(fi.fh)
    return got


async def test_stats_metrics_and_socket_show_the_mount():
    ops, _ = _ops(hint_socket="/run/jpfs/h.sock")
    await ops.getattr(FILE_INO, CTX)
    s = json.loads(await _read_all(ops, STATS))
    assert s["mount"]["mountpoint"] == "/mnt/x" and s["mount"]["cluster"] == "/etc/jpfs/c.toml"
    assert s["mount"]["kernel_opens"] is True and s["mount"]["read_only"] is False
    assert s["fuse"]["requests"]["getattr"] == 1 and s["fuse"]["requests_total"] == 1
    assert s["fuse"]["control_requests"] == 1  # this open, whose content is taken at it
    assert s["mount"]["handles"] == 0  # ... before its handle
    assert s["storage"] == {} and s["cache"] == {"memory_bytes": 1}
    assert set(s) == {"mount", "fuse", "cache", "prefetch", "storage", "names", "leases"}
    text = (await _read_all(ops, METRICS)).decode()
    assert 'jpfs_fuse_requests_total{op="getattr"} 1.0' in text
    assert await _read_all(ops, SOCKET) == b"/run/jpfs/h.sock\n"
    assert ops.control.open_handles == 0


async def test_the_storage_counters_come_from_the_client_given():
    ops, _ = _ops(storage=SimpleNamespace(as_dict=lambda: {"requests": 3}))
    assert ops.snapshot()["storage"] == {"requests": 3}


async def test_hints_are_queued_by_line_and_errors_shown():
    ops, vfs = _ops()
    fi = await ops.open(PREFETCH, os.O_WRONLY, CTX)
    assert await ops.write(fi.fh, 0, b"/mnt/x/a/1\nb/2\njpfs:/c/") == 23
    assert vfs.prefetcher.hinted == [["/a/1", "/b/2"]]
    assert await ops.write(fi.fh, 23, b"3") == 1  # no newline yet: kept
    await ops.flush(fi.fh)  # the rest is a line too
    assert vfs.prefetcher.hinted[-1] == ["/c/3"]
    assert await _errno(ops.write(fi.fh, 25, b"/etc/passwd\n")) == errno.EINVAL
    assert await _errno(ops.write(fi.fh, 37, b"gone/missing\n")) == errno.ENOENT
    await ops.write(fi.fh, 50, b"d/4")
    await ops.release(fi.fh)  # submitted at the last close
    assert vfs.prefetcher.hinted[-1] == ["/d/4"]
    ro = await ops.open(STATS, os.O_RDONLY, CTX)
    assert await _errno(ops.write(ro.fh, 0, b"a\n")) == errno.EBADF
    status = json.loads(await _read_all(ops, PREFETCH))
    assert any("not under the mount point" in m for m in status["last_errors"])
    assert any("no such file" in m for m in status["last_errors"])
    assert status["hint_paths"] == 4 and "usage" in status
    await ops.control.submit_hints(b"e/5\n")  # the socket's way in
    assert vfs.prefetcher.hinted[-1] == ["/e/5"]


async def test_a_hint_line_without_a_newline_is_bounded():
    ops, _ = _ops()
    fi = await ops.open(PREFETCH, os.O_WRONLY, CTX)
    assert await _errno(ops.write(fi.fh, 0, b"x" * (control.HINT_BUFFER_MAX + 1))) \
        == errno.EINVAL
    await ops.release(fi.fh)  # nothing left to submit
    assert "longer than 16 MiB" in ops.control.hint_errors[-1]


# ---- where the kernel opens files itself -------------------------------------------------------

async def test_without_opens_each_lookup_takes_a_snapshot_read_by_inode():
    reads = FakeReads()
    ops, vfs = _ops(read_only=True, reads=reads)
    assert ops.kernel_opens is False
    e = await ops.lookup(CONTROL_DIR, b"stats", CTX)
    assert e.entry_timeout == 0 and e.attr_timeout == 0 and e.st_size > 0
    again = await ops.getattr(STATS, CTX)  # the same snapshot
    assert (again.st_size, again.st_mtime_ns) == (e.st_size, e.st_mtime_ns)
    data = await ops.read(STATS, 0, 1 << 20)  # the READ names the inode
    assert len(data) == e.st_size and json.loads(data)["mount"]["kernel_opens"] is False
    later = await ops.lookup(CONTROL_DIR, b"stats", CTX)
    assert later.st_mtime_ns > e.st_mtime_ns  # the kernel drops the old pages
    d = await ops.lookup(ROOT_INO, b".jpfs", CTX)
    assert d.st_size == 0 and d.entry_timeout == 1.0
    assert ops.stats.control_requests == 5 and vfs.calls == []
    # OPEN is ENOSYS for every file, control files too, and counted as any OPEN
    assert await _errno(ops.open(STATS, os.O_RDONLY, CTX)) == errno.ENOSYS
    assert ops.stats.requests["open"] == 1 and ops.stats.errors == {}
    reads.pids[FILE_INO] = 77
    await ops.read(FILE_INO, 0, 10)
    assert vfs.calls == ["read_unopened"] and reads.pids == {}


async def test_before_reads_are_installed_the_kernel_opens_through_the_mount():
    reads = FakeReads()
    reads.installed = False
    ops, _ = _ops(read_only=True, reads=reads)
    assert ops.kernel_opens is True
    assert json.loads(await _read_all(ops, STATS))["mount"]["kernel_opens"] is True
