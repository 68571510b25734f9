"""The VFS's directories, extended attributes, statfs, read-only VFS and FORGET, called directly
as the FUSE adapter calls them (no kernel): readdir with "." and "..", attributes as getattr
gives them, positions to resume from (in a fresh handle and in the same one, past many pages),
entries removed during a listing; xattrs with their flags and errnos; statfs's totals; EROFS
for every change on a read-only VFS, whose reads (also those the kernel makes without an open)
work; and a VFS that the kernel told to forget its inodes."""

from __future__ import annotations

import errno
import os
import random
import stat
from contextlib import aclosing

import pytest
from vfs_harness import (
    CHUNK,
    GID,
    RDONLY,
    RDWR,
    UID,
    WRONLY,
    Fs,
    cluster,  # noqa: F401
    cluster_dir,  # noqa: F401
    entries,
    errno_of,
    eventually,
    exists,
    expect,
    fresh_dir,
    names,
    open_fs,
    open_vfs,
    read_at,
    read_file,
)

from jpfs.types import NAME_MAX, ROOT_INO

XATTR_CREATE, XATTR_REPLACE = 1, 2
PAGE = 50
"""A small readdir page, so that a few hundred entries take many pages."""


@pytest.fixture(params=["plain", "leased"])
async def fs(request, cluster):  # noqa: F811
    async with open_fs(cluster, request.param, readdir_page=PAGE) as f:
        yield f


async def _fill(fs: Fs, n: int) -> list[bytes]:
    made = [b"e%04d" % i for i in range(n)]
    for name in made:
        fh, _ = await fs.create(name)
        await fs.vfs.release(fh)
    return made


# ---- readdir -------------------------------------------------------------------------------------

async def test_readdir_gives_dots_then_every_entry_with_its_attributes(fs):
    await fs.write(b"file", b"12345")
    await fs.mkdir(b"dir")
    await fs.vfs.symlink(fs.d, b"link", b"file", UID, GID)
    await fs.vfs.mknod(fs.d, b"fifo", stat.S_IFIFO | 0o600, 0, UID, GID)
    got = await entries(fs.vfs, fs.d)
    assert [n for n, _, _ in got[:2]] == [b".", b".."]
    assert got[0][1].ino == fs.d and got[1][1].ino == ROOT_INO
    assert sorted(n for n, _, _ in got[2:]) == [b"dir", b"fifo", b"file", b"link"]
    nexts = [nxt for _, _, nxt in got]
    assert nexts == sorted(set(nexts)) and nexts[0] > 0
    for name, attr, _ in got[2:]:
        st = await fs.vfs.getattr((await fs.lookup(name)).ino)
        assert (attr.ino, attr.mode, attr.nlink, attr.size, attr.uid, attr.gid) == (
            st.ino, st.mode, st.nlink, st.size, st.uid, st.gid), name
    assert got[0][1].nlink == (await fs.vfs.getattr(fs.d)).nlink == 3


async def test_readdir_of_an_empty_directory_and_of_the_root(fs):
    got = await entries(fs.vfs, fs.d)
    assert [n for n, _, _ in got] == [b".", b".."]
    root = await entries(fs.vfs, ROOT_INO)
    assert [n for n, _, _ in root[:2]] == [b".", b".."]
    assert root[0][1].ino == ROOT_INO and root[1][1].ino == ROOT_INO
    assert any(a.ino == fs.d for _, a, _ in root[2:])


async def test_readdir_resumes_from_any_position_in_a_fresh_handle(fs):
    made = await _fill(fs, 4 * PAGE + 17)
    full = await entries(fs.vfs, fs.d)
    assert sorted(n for n, _, _ in full[2:]) == made
    positions = [0] + [nxt for _, _, nxt in full]
    for k in sorted({0, 1, 2, 3, PAGE, PAGE + 1, PAGE + 2, 2 * PAGE + 7, positions[-2],
                     positions[-1]}):
        i = positions.index(k)
        tail = await entries(fs.vfs, fs.d, k)
        assert [(n, a.ino) for n, a, _ in tail] == [(n, a.ino) for n, a, _ in full[i:]], k


async def test_readdir_resumed_in_one_handle_as_the_kernel_does(fs):
    """The kernel reads until its buffer is full, then asks again from the last position it
    took; a rewind (seekdir(0)) lists from the start again."""
    made = await _fill(fs, 3 * PAGE + 5)
    rng = random.Random(7)
    fh = fs.vfs.opendir(fs.d)
    try:
        for _ in range(2):  # the second time: a rewind of the same handle
            seen: list[bytes] = []
            pos = 0
            while True:
                room = rng.randrange(1, 2 * PAGE)
                got = []
                async with aclosing(fs.vfs.readdir(fh, pos)) as it:
                    async for name, _, nxt in it:
                        got.append(name)
                        pos = nxt
                        if len(got) == room:
                            break
                seen += got
                if len(got) < room:
                    break
            assert seen[:2] == [b".", b".."] and sorted(seen[2:]) == made
    finally:
        fs.vfs.releasedir(fh)


async def test_entries_removed_during_a_listing_leave_the_others_listed_once(fs):
    made = await _fill(fs, 3 * PAGE)
    fh = fs.vfs.opendir(fs.d)
    seen: list[bytes] = []
    pos = 0
    async with aclosing(fs.vfs.readdir(fh, 0)) as it:
        async for name, _, nxt in it:
            seen.append(name)
            pos = nxt
            if len(seen) == PAGE + 2:
                break
    removed = set(made[10:20]) | set(made[2 * PAGE:2 * PAGE + 10])  # read ones and others
    for name in sorted(removed):
        await fs.vfs.unlink(fs.d, name)
    await fs.write(b"zz-new")  # made meanwhile: listed or not
    async with aclosing(fs.vfs.readdir(fh, pos)) as it:
        seen += [name async for name, _, _ in it]
    fs.vfs.releasedir(fh)
    rest = [n for n in seen if n not in (b".", b"..")]
    assert len(rest) == len(set(rest)), "an entry listed twice"
    assert set(made) - removed <= set(rest) <= set(made) | {b"zz-new"}


async def test_readdir_with_the_default_page_past_one_page(cluster):  # noqa: F811
    async with open_fs(cluster, "plain") as fs:  # (leased: test_vfs_leases.py)
        made = await _fill(fs, 1005)
        assert await fs.names() == made
        tail = await entries(fs.vfs, fs.d, 1000)
        assert [n for n, _, _ in tail] == made[998:]


async def test_readdir_handle_errors(fs):
    f = await fs.write(b"f", b"x")
    h = await fs.vfs.open(f.ino, RDONLY)
    with pytest.raises(OSError) as e:
        async with aclosing(fs.vfs.readdir(h.fh, 0)) as it:
            async for _ in it:
                pass
    assert e.value.errno == errno.EBADF
    await fs.vfs.release(h.fh)


# ---- extended attributes -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["file", "dir", "fifo"])
async def test_xattrs_set_get_list_remove(fs, cluster, kind):  # noqa: F811
    if kind == "file":
        ino = (await fs.write(b"x", b"data")).ino
    elif kind == "dir":
        ino = (await fs.mkdir(b"x")).ino
    else:
        ino = (await fs.vfs.mknod(fs.d, b"x", stat.S_IFIFO | 0o644, 0, UID, GID)).ino
    assert await fs.vfs.listxattr(ino) == []
    await fs.vfs.setxattr(ino, b"user.a", b"1")
    await fs.vfs.setxattr(ino, b"user.bin", bytes(range(256)))
    await fs.vfs.setxattr(ino, b"user.empty", b"")
    await fs.vfs.setxattr(ino, b"trusted.t", b"t")
    assert await fs.vfs.getxattr(ino, b"user.a") == b"1"
    assert await fs.vfs.getxattr(ino, b"user.bin") == bytes(range(256))
    assert await fs.vfs.getxattr(ino, b"user.empty") == b""
    assert sorted(await fs.vfs.listxattr(ino)) == [b"trusted.t", b"user.a", b"user.bin",
                                                   b"user.empty"]
    await fs.vfs.setxattr(ino, b"user.a", b"2")  # replaced
    assert await fs.vfs.getxattr(ino, b"user.a") == b"2"
    await fs.vfs.removexattr(ino, b"user.a")
    await expect(errno.ENODATA, fs.vfs.getxattr(ino, b"user.a"))
    await expect(errno.ENODATA, fs.vfs.removexattr(ino, b"user.a"))
    assert sorted(await fs.vfs.listxattr(ino)) == [b"trusted.t", b"user.bin", b"user.empty"]
    async with open_vfs(cluster) as other:  # stored, not this VFS's memory
        assert await other.getxattr(ino, b"user.bin") == bytes(range(256))
        assert sorted(await other.listxattr(ino)) == [b"trusted.t", b"user.bin",
                                                      b"user.empty"]


async def test_xattr_create_and_replace_flags(fs):
    ino = (await fs.write(b"f")).ino
    await expect(errno.ENODATA, fs.vfs.setxattr(ino, b"user.k", b"v", XATTR_REPLACE))
    await fs.vfs.setxattr(ino, b"user.k", b"v1", XATTR_CREATE)
    await expect(errno.EEXIST, fs.vfs.setxattr(ino, b"user.k", b"v2", XATTR_CREATE))
    assert await fs.vfs.getxattr(ino, b"user.k") == b"v1"
    await fs.vfs.setxattr(ino, b"user.k", b"v3", XATTR_REPLACE)
    assert await fs.vfs.getxattr(ino, b"user.k") == b"v3"
    assert await fs.vfs.listxattr(ino) == [b"user.k"]


async def test_xattr_limits_and_acls(fs):
    ino = (await fs.write(b"f")).ino
    await fs.vfs.setxattr(ino, b"user.big", b"v" * (64 << 10))
    assert len(await fs.vfs.getxattr(ino, b"user.big")) == 64 << 10
    await expect(errno.E2BIG, fs.vfs.setxattr(ino, b"user.huge", b"v" * ((64 << 10) + 1)))
    await expect(errno.ERANGE, fs.vfs.setxattr(ino, b"user." + b"n" * 251, b"v"))
    await fs.vfs.setxattr(ino, b"user." + b"n" * 250, b"v")  # 255 bytes: the limit
    assert await errno_of(fs.vfs.setxattr(ino, b"", b"v")) in (errno.EINVAL, errno.ERANGE)
    acl = bytes.fromhex("02000000" "01000600ffffffff" "04000400ffffffff" "20000400ffffffff")
    await expect(errno.EOPNOTSUPP, fs.vfs.setxattr(ino, b"system.posix_acl_access", acl))
    await expect(errno.ENODATA, fs.vfs.getxattr(ino, b"system.posix_acl_access"))
    await expect(errno.ENODATA, fs.vfs.getxattr(ino, b"system.posix_acl_default"))
    assert sorted(await fs.vfs.listxattr(ino)) == [b"user.big", b"user." + b"n" * 250]


async def test_security_capability_is_asked_often_and_answered_right(fs):
    """The kernel asks for security.capability before every write: answered from memory while
    known absent, and never stale after this VFS sets it."""
    f = await fs.write(b"f", b"x")
    cap = b"security.capability"
    for _ in range(3):
        await expect(errno.ENODATA, fs.vfs.getxattr(f.ino, cap))
    value = bytes.fromhex("0000000200200000000000000000000000000000")
    await fs.vfs.setxattr(f.ino, cap, value)
    assert await fs.vfs.getxattr(f.ino, cap) == value
    await fs.vfs.removexattr(f.ino, cap)
    await expect(errno.ENODATA, fs.vfs.getxattr(f.ino, cap))
    fh, attr = await fs.create(b"new")  # a new file has none
    await expect(errno.ENODATA, fs.vfs.getxattr(attr.ino, cap))
    await fs.vfs.write(fh, 0, b"y")
    await fs.vfs.release(fh)


async def test_xattrs_belong_to_the_inode(fs):
    f = await fs.write(b"f", b"x")
    before = await fs.vfs.getattr(f.ino)
    await fs.vfs.setxattr(f.ino, b"user.k", b"v")
    after = await fs.vfs.getattr(f.ino)
    assert after.ctime_ns > before.ctime_ns and after.mtime_ns == before.mtime_ns
    await fs.vfs.link(f.ino, fs.d, b"g")
    await fs.vfs.rename(fs.d, b"f", fs.d, b"h", 0)
    for name in (b"g", b"h"):
        assert await fs.vfs.getxattr((await fs.lookup(name)).ino, b"user.k") == b"v"
    await fs.vfs.unlink(fs.d, b"g")
    await fs.vfs.unlink(fs.d, b"h")
    fs.vfs.forget([(f.ino, 1 << 20)])
    await expect(errno.ENOENT, fs.vfs.getxattr(f.ino, b"user.k"))
    await expect(errno.ENOENT, fs.vfs.listxattr(f.ino))
    await expect(errno.ENOENT, fs.vfs.setxattr(f.ino, b"user.k", b"v"))


# ---- statfs --------------------------------------------------------------------------------------

async def test_statfs(fs, cluster, cluster_dir):  # noqa: F811
    await fs.vfs.fsyncdir(fs.d)  # what the lease answered is counted
    st = await fs.vfs.statfs()
    assert st.name_max == NAME_MAX and st.block_size > 0
    assert st.blocks >= st.blocks_free > 0 and st.files > st.files_free > 0
    host = os.statvfs(cluster_dir)  # both storage nodes' volumes lie on this disk: once
    assert st.blocks * st.block_size <= host.f_blocks * host.f_frsize
    assert abs(st.blocks_free * st.block_size - host.f_bavail * host.f_frsize) < 1 << 30
    written = 1 << 20
    for i in range(4):
        fh, _ = await fs.create(b"f%d" % i)
        await fs.vfs.write(fh, 0, os.urandom(written // 4))
        await fs.vfs.fsync(fh)
        await fs.vfs.release(fh)
    async with open_vfs(cluster) as other:  # a VFS's answer is kept for a second
        st2 = await other.statfs()
    used = (st.blocks - st.blocks_free) * st.block_size
    grew = (st2.blocks - st2.blocks_free) * st2.block_size - used
    assert written - st.block_size <= grew < written + (256 << 10), grew  # one replica
    assert (st2.files - st2.files_free) - (st.files - st.files_free) == 4


# ---- a read-only VFS -----------------------------------------------------------------------------

@pytest.fixture
async def ro(cluster):  # noqa: F811
    """A tree made by a read-write VFS, and a read-only VFS over it."""
    small, large = os.urandom(1000), os.urandom(3 * CHUNK + 5)
    async with open_fs(cluster, "leased") as fs:
        await fs.write(b"small", small)
        await fs.write(b"large", large)
        await fs.mkdir(b"dir")
        await fs.vfs.symlink(fs.d, b"link", b"small", UID, GID)
        await fs.vfs.setxattr((await fs.lookup(b"small")).ino, b"user.k", b"v")
        d = fs.d
    async with open_vfs(cluster, read_only=True) as vfs:
        yield Fs(vfs, d, "read-only"), {b"small": small, b"large": large}


async def _ro_change(fs: Fs, op: str):
    v, d = fs.vfs, fs.d
    f = (await fs.lookup(b"small")).ino
    return await {
        "mkdir": lambda: v.mkdir(d, b"new", 0o755, UID, GID),
        "create": lambda: v.create(d, b"new", stat.S_IFREG | 0o644, os.O_CREAT | WRONLY, UID,
                                   GID),
        "create existing": lambda: v.create(d, b"small", stat.S_IFREG | 0o644,
                                            os.O_CREAT | WRONLY, UID, GID),
        "mknod": lambda: v.mknod(d, b"new", stat.S_IFIFO | 0o644, 0, UID, GID),
        "symlink": lambda: v.symlink(d, b"new", b"t", UID, GID),
        "link": lambda: v.link(f, d, b"new"),
        "unlink": lambda: v.unlink(d, b"small"),
        "rmdir": lambda: v.rmdir(d, b"dir"),
        "rename": lambda: v.rename(d, b"small", d, b"new", 0),
        "chmod": lambda: v.setattr(f, {"mode": 0o600}),
        "truncate": lambda: v.setattr(f, {}, 0),
        "utimens": lambda: v.setattr(f, {"mtime_ns": 1}),
        "open wronly": lambda: v.open(f, WRONLY),
        "open rdwr": lambda: v.open(f, RDWR),
        "open trunc": lambda: v.open(f, RDONLY | os.O_TRUNC),
        "setxattr": lambda: v.setxattr(f, b"user.k", b"w"),
        "removexattr": lambda: v.removexattr(f, b"user.k"),
    }[op]()


RO_CHANGES = ["mkdir", "create", "create existing", "mknod", "symlink", "link", "unlink",
              "rmdir", "rename", "chmod", "truncate", "utimens", "open wronly", "open rdwr",
              "open trunc", "setxattr", "removexattr"]


@pytest.mark.parametrize("op", RO_CHANGES)
async def test_a_read_only_vfs_refuses_every_change(ro, op):
    fs, data = ro
    before = await fs.names()
    await expect(errno.EROFS, _ro_change(fs, op))
    assert await fs.names() == before == [b"dir", b"large", b"link", b"small"]
    assert await fs.read((await fs.lookup(b"small")).ino) == data[b"small"]
    assert await fs.vfs.getxattr((await fs.lookup(b"small")).ino, b"user.k") == b"v"


async def test_a_read_only_vfs_reads(ro):
    fs, data = ro
    for name, want in data.items():
        a = await fs.lookup(name)
        assert a.size == len(want) and (await fs.vfs.getattr(a.ino)).size == len(want)
        assert await fs.read(a.ino) == want
        h = await fs.vfs.open(a.ino, RDONLY)
        assert await read_at(fs.vfs, h.fh, CHUNK - 1, 10) == want[CHUNK - 1:CHUNK + 9]
        await fs.vfs.release(h.fh)
    assert await fs.vfs.readlink((await fs.lookup(b"link")).ino) == b"small"
    small = (await fs.lookup(b"small")).ino
    assert await fs.vfs.listxattr(small) == [b"user.k"]
    assert (await fs.vfs.statfs()).name_max == NAME_MAX
    await expect(errno.ENOENT, fs.lookup(b"missing"))


@pytest.mark.parametrize("name", [b"small", b"large"])
async def test_a_read_only_vfs_reads_files_the_kernel_opened_itself(ro, name):
    """Where OPEN is answered ENOSYS the kernel READs by inode: read_unopened."""
    fs, data = ro
    want = data[name]
    ino = (await fs.lookup(name)).ino
    assert bytes(await fs.vfs.read_unopened(ino, 10, 100)) == want[10:110]
    out = bytearray()
    while len(out) < len(want):
        got = bytes(await fs.vfs.read_unopened(ino, len(out), 32 << 10))
        assert got
        out += got
    assert bytes(out) == want
    assert bytes(await fs.vfs.read_unopened(ino, len(want), 100)) == b""
    fs.vfs.forget([(ino, 1)])


# ---- forget --------------------------------------------------------------------------------------

async def test_forgotten_inodes_are_asked_for_again(fs, cluster):  # noqa: F811
    f = await fs.write(b"f", b"one")
    sub = await fs.mkdir(b"sub")
    h = await fs.vfs.open(f.ino, RDONLY)
    fs.vfs.forget([(f.ino, 1 << 20), (sub.ino, 1 << 20), (0xdead_beef, 3)])  # and one unknown
    assert bytes(await fs.vfs.read(h.fh, 0, 10)) == b"one"  # an open handle holds its inode
    await fs.vfs.release(h.fh)
    async with open_vfs(cluster) as other:
        h2 = await other.open(f.ino, WRONLY | os.O_TRUNC)
        await other.write(h2.fh, 0, b"two")
        await other.release(h2.fh)
    a = await fs.lookup(b"f")
    assert a.ino == f.ino and await fs.read(a.ino) == b"two"
    assert (await fs.vfs.getattr(sub.ino)).is_dir
    assert 0 <= fs.vfs.fresh_for(a.ino) <= 1.0
    assert await names(fs.vfs, fs.d) == [b"f", b"sub"]


async def test_a_directory_made_by_another_vfs(cluster):  # noqa: F811
    async with open_vfs(cluster) as a, open_vfs(cluster) as b:
        d = await fresh_dir(a)
        assert (await b.getattr(d)).is_dir
        assert [n for n, _, _ in await entries(b, d)] == [b".", b".."]
        f, attr = await b.create(d, b"f", stat.S_IFREG | 0o644, os.O_CREAT | WRONLY, UID, GID)
        await b.write(f.fh, 0, b"from b")
        await b.release(f.fh)
        assert await names(a, d) == [b"f"]  # a listing asks the shard
        # a's lookups in the directory it made answer from its names for the entry timeout
        await eventually(lambda: exists(a, d, b"f"), "the other VFS's file found")
        assert await read_file(a, (await a.lookup(d, b"f")).ino) == b"from b"
