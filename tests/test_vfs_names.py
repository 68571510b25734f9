"""The VFS's namespace, called directly as the FUSE adapter calls it (no kernel): names and their
limits, lookup and getattr, create, mknod, mkdir, symlink and readlink, link, unlink, rmdir and
rename, with the errno a POSIX filesystem gives, link counts, the parent's times, and the group
a setgid directory gives. Each test runs on a VFS that sends every change to the shard
("plain") and on one that holds the test directory's write lease ("leased")."""

from __future__ import annotations

import errno
import os
import stat

import pytest
from vfs_harness import (
    GID,
    UID,
    UMASK,
    Fs,
    cluster,  # noqa: F401
    cluster_dir,  # noqa: F401
    entries,
    errno_of,
    expect,
    open_fs,
    read_file,
)

from jpfs.placement import shard_of
from jpfs.types import ROOT_INO

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
LONG = b"n" * 255


@pytest.fixture(params=["plain", "leased"])
async def fs(request, cluster):  # noqa: F811
    async with open_fs(cluster, request.param) as f:
        yield f


# ---- names ---------------------------------------------------------------------------------------

BAD_NAMES = {
    "empty": (b"", errno.EINVAL),
    "slash": (b"a/b", errno.EINVAL),
    "nul": (b"a\0b", errno.EINVAL),
    "dot": (b".", errno.EINVAL),
    "dotdot": (b"..", errno.EINVAL),
    "256 bytes": (b"n" * 256, errno.ENAMETOOLONG),
}


async def _bad_name_op(fs: Fs, op: str, name: bytes):
    vfs, d = fs.vfs, fs.d
    if op == "lookup":
        return await vfs.lookup(d, name)
    if op == "create":
        return await vfs.create(d, name, stat.S_IFREG | 0o644, os.O_CREAT | os.O_WRONLY, UID,
                                GID)
    if op == "create excl":
        return await vfs.create(d, name, stat.S_IFREG | 0o644,
                                os.O_CREAT | os.O_EXCL | os.O_WRONLY, UID, GID)
    if op == "mknod":
        return await vfs.mknod(d, name, stat.S_IFIFO | 0o644, 0, UID, GID)
    if op == "mkdir":
        return await vfs.mkdir(d, name, 0o755, UID, GID)
    if op == "symlink":
        return await vfs.symlink(d, name, b"target", UID, GID)
    if op == "link":
        return await vfs.link((await fs.lookup(b"file")).ino, d, name)
    if op == "unlink":
        return await vfs.unlink(d, name)
    if op == "rmdir":
        return await vfs.rmdir(d, name)
    if op == "rename from":
        return await vfs.rename(d, name, d, b"elsewhere", 0)
    if op == "rename to":
        await fs.lookup(b"file")
        return await vfs.rename(d, b"file", d, name, 0)
    raise ValueError(op)


BAD_NAME_OPS = ["lookup", "create", "create excl", "mknod", "mkdir", "symlink", "link",
                "unlink", "rmdir", "rename from", "rename to"]


@pytest.mark.parametrize("op", BAD_NAME_OPS)
@pytest.mark.parametrize("bad", list(BAD_NAMES))
async def test_an_invalid_name_is_refused_and_changes_nothing(fs, op, bad):
    name, err = BAD_NAMES[bad]
    await fs.write(b"file", b"data")
    before = await fs.names()
    await expect(err, _bad_name_op(fs, op, name))
    assert await fs.names() == before
    assert await fs.read((await fs.lookup(b"file")).ino) == b"data"
    await fs.vfs.fsyncdir(fs.d)  # what a lease answered is committed: nothing was refused
    assert await fs.names() == before


async def test_names_of_255_bytes_work_everywhere(fs):
    f = await fs.write(LONG, b"long")
    assert (await fs.lookup(LONG)).ino == f.ino
    await fs.vfs.rename(fs.d, LONG, fs.d, b"m" * 255, 0)
    assert await fs.read((await fs.lookup(b"m" * 255)).ino) == b"long"
    sub = await fs.mkdir(b"d" * 255)
    assert (await fs.vfs.symlink(sub.ino, b"s" * 255, LONG, UID, GID)).size == 255
    assert await fs.names() == sorted([b"d" * 255, b"m" * 255])


async def test_names_are_bytes_not_text(fs):
    odd = [b"\xff\xfe", "é".encode(), "e\u0301".encode(), b" lead", b"trail ", b"a\nb", b"-x"]
    for n in odd:
        await fs.write(n, n)
    assert await fs.names() == sorted(odd)  # NFC and NFD are two names, as on ext4
    for n in odd:
        assert await fs.read((await fs.lookup(n)).ino) == n


# ---- lookup and getattr --------------------------------------------------------------------------

async def test_lookup_and_getattr_agree_and_say_what_was_made(fs):
    made = await fs.write(b"f", b"abc", perm=0o640)
    got = await fs.lookup(b"f")
    assert got.ino == made.ino
    st = await fs.vfs.getattr(got.ino)
    assert stat.S_IFMT(st.mode) == stat.S_IFREG and stat.S_IMODE(st.mode) == 0o640 & ~UMASK
    assert (st.uid, st.gid, st.nlink, st.size) == (UID, GID, 1, 3)
    assert st.mtime_ns >= st.atime_ns > 0 and st.ctime_ns >= st.mtime_ns
    assert (await fs.vfs.getattr(fs.d)).is_dir
    assert (await fs.vfs.getattr(ROOT_INO)).is_dir


async def test_lookup_errors(fs):
    await fs.write(b"f", b"x")  # (a file made empty under a lease: test_vfs_leases.py)
    await expect(errno.ENOENT, fs.lookup(b"missing"))
    await expect(errno.ENOTDIR, fs.lookup(b"x", parent=(await fs.lookup(b"f")).ino))
    gone = await fs.mkdir(b"gone")
    await fs.vfs.rmdir(fs.d, b"gone")
    await expect(errno.ENOENT, fs.lookup(b"x", parent=gone.ino))
    await expect(errno.ENOENT, fs.vfs.getattr(gone.ino))


async def test_a_name_removed_is_not_found_and_can_be_made_again(fs):
    first = await fs.write(b"f", b"one")
    await fs.vfs.unlink(fs.d, b"f")
    await expect(errno.ENOENT, fs.lookup(b"f"))
    again = await fs.write(b"f", b"two")
    assert again.ino != first.ino
    assert await fs.read((await fs.lookup(b"f")).ino) == b"two"


# ---- create, mknod, mkdir ------------------------------------------------------------------------

async def test_create_exclusive_and_not(fs):
    made = await fs.write(b"f", b"keep")
    await expect(errno.EEXIST, fs.create(b"f", flags=os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    fh, attr = await fs.create(b"f")  # made elsewhere since the kernel's lookup: opened
    assert attr.ino == made.ino
    await fs.vfs.release(fh)
    assert await fs.read(made.ino) == b"keep"
    fh, attr = await fs.create(b"f", flags=os.O_CREAT | os.O_TRUNC | os.O_WRONLY)
    assert attr.ino == made.ino and attr.size == 0
    await fs.vfs.release(fh)
    assert await fs.read(made.ino) == b""
    dirs = await fs.mkdir(b"dir")
    await expect(errno.EISDIR, fs.create(b"dir"))
    await expect(errno.EEXIST, fs.create(b"dir", flags=os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    assert (await fs.vfs.getattr(dirs.ino)).is_dir


async def test_create_where_there_is_no_directory(fs):
    f = await fs.write(b"f", b"x")
    await expect(errno.ENOTDIR, fs.create(b"x", parent=f.ino))
    gone = await fs.mkdir(b"gone")
    await fs.vfs.rmdir(fs.d, b"gone")
    await expect(errno.ENOENT, fs.create(b"x", parent=gone.ino))
    await expect(errno.ENOENT, fs.mkdir(b"x", parent=gone.ino))


@pytest.mark.parametrize("kind, rdev", [
    (stat.S_IFIFO, 0), (stat.S_IFSOCK, 0), (stat.S_IFREG, 0),
    (stat.S_IFCHR, os.makedev(1, 5)), (stat.S_IFBLK, os.makedev(7, 1))])
async def test_mknod_makes_each_type(fs, kind, rdev):
    a = await fs.vfs.mknod(fs.d, b"n", kind | 0o640, rdev, UID, GID)
    st = await fs.vfs.getattr((await fs.lookup(b"n")).ino)
    assert st.ino == a.ino and stat.S_IFMT(st.mode) == kind and stat.S_IMODE(st.mode) == 0o640
    assert st.rdev == rdev and st.nlink == 1 and st.size == 0 and (st.uid, st.gid) == (UID, GID)
    await expect(errno.EEXIST, fs.vfs.mknod(fs.d, b"n", kind | 0o640, rdev, UID, GID))
    other = await fs.vfs.mknod(fs.d, b"m", stat.S_IFIFO | 0o644, os.makedev(1, 5), UID, GID)
    assert other.rdev == 0  # only devices have a device number


async def test_mkdir(fs):
    before = await fs.vfs.getattr(fs.d)
    sub = await fs.mkdir(b"sub", perm=0o750)
    st = await fs.vfs.getattr(sub.ino)
    assert st.is_dir and stat.S_IMODE(st.mode) == 0o750 & ~UMASK and st.nlink == 2
    assert (st.uid, st.gid) == (UID, GID)
    after = await fs.vfs.getattr(fs.d)
    assert after.nlink == before.nlink + 1 and after.mtime_ns > before.mtime_ns
    await expect(errno.EEXIST, fs.mkdir(b"sub"))
    await fs.write(b"f")
    await expect(errno.EEXIST, fs.mkdir(b"f"))
    await expect(errno.ENOTDIR, fs.mkdir(b"x", parent=(await fs.lookup(b"f")).ino))
    assert await fs.names(sub.ino) == []


# ---- symlinks ------------------------------------------------------------------------------------

async def test_symlink_and_readlink(fs):
    for target in (b"f", b"../a/b/c", b"/abs/path", b"\xff odd bytes", b"t" * 4096):
        name = b"l%d" % len(target)
        a = await fs.vfs.symlink(fs.d, name, target, UID, GID)
        st = await fs.vfs.getattr((await fs.lookup(name)).ino)
        assert st.ino == a.ino and stat.S_ISLNK(st.mode) and st.size == len(target)
        assert await fs.vfs.readlink(st.ino) == target
    await expect(errno.EEXIST, fs.vfs.symlink(fs.d, b"l1", b"x", UID, GID))
    await expect(errno.ENAMETOOLONG, fs.vfs.symlink(fs.d, b"long", b"t" * 4097, UID, GID))
    assert await errno_of(fs.vfs.symlink(fs.d, b"empty", b"", UID, GID)) in (
        errno.ENOENT, errno.EINVAL)  # Linux refuses an empty target (ENOENT)
    f = await fs.write(b"file")
    await expect(errno.EINVAL, fs.vfs.readlink(f.ino))
    await expect(errno.EINVAL, fs.vfs.readlink(fs.d))


# ---- hard links ----------------------------------------------------------------------------------

async def _other_shard_dir(fs: Fs) -> int:
    """A directory under the test's whose inode lives on another shard than the test's."""
    for i in range(64):
        a = await fs.mkdir(b"far%d" % i)
        if shard_of(a.ino) != shard_of(fs.d):
            return a.ino
    raise AssertionError("64 directories on one shard of two")


@pytest.mark.parametrize("where", ["same dir", "other shard"])
async def test_hard_links_count_and_share_bytes(fs, where):
    f = await fs.write(b"f", b"shared")
    d2 = fs.d if where == "same dir" else await _other_shard_dir(fs)
    a = await fs.vfs.link(f.ino, d2, b"g")
    assert a.ino == f.ino and a.nlink == 2
    assert (await fs.lookup(b"g", parent=d2)).ino == f.ino
    assert (await fs.vfs.getattr(f.ino)).nlink == 2
    await fs.vfs.link(f.ino, fs.d, b"h")
    assert (await fs.vfs.getattr(f.ino)).nlink == 3
    await fs.vfs.unlink(d2, b"g")
    assert (await fs.vfs.getattr(f.ino)).nlink == 2
    await fs.vfs.unlink(fs.d, b"f")
    st = await fs.vfs.getattr((await fs.lookup(b"h")).ino)
    assert st.ino == f.ino and st.nlink == 1
    assert await fs.read(f.ino) == b"shared"
    await fs.vfs.unlink(fs.d, b"h")
    await expect(errno.ENOENT, fs.vfs.getattr(f.ino))


async def test_link_errors(fs):
    f = await fs.write(b"f")
    await fs.write(b"g")
    await expect(errno.EEXIST, fs.vfs.link(f.ino, fs.d, b"g"))
    await expect(errno.EEXIST, fs.vfs.link(f.ino, fs.d, b"f"))
    sub = await fs.mkdir(b"sub")
    await expect(errno.EPERM, fs.vfs.link(sub.ino, fs.d, b"sub2"))
    await expect(errno.ENOTDIR, fs.vfs.link(sub.ino, f.ino, b"x"))
    assert (await fs.vfs.getattr(f.ino)).nlink == 1
    assert (await fs.vfs.getattr(sub.ino)).nlink == 2
    fifo = await fs.vfs.mknod(fs.d, b"p", stat.S_IFIFO | 0o644, 0, UID, GID)
    assert (await fs.vfs.link(fifo.ino, fs.d, b"q")).nlink == 2
    await fs.vfs.unlink(fs.d, b"g")
    t = await fs.write(b"tmp")
    await fs.vfs.unlink(fs.d, b"tmp")
    await expect(errno.ENOENT, fs.vfs.link(t.ino, fs.d, b"again"))
    assert await fs.names() == [b"f", b"p", b"q", b"sub"]


# ---- unlink and rmdir ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["file", "fifo", "sock", "symlink", "chr"])
async def test_unlink_each_kind(fs, kind):
    if kind == "file":
        await fs.write(b"x", b"data")
    elif kind == "symlink":
        await fs.vfs.symlink(fs.d, b"x", b"t", UID, GID)
    else:
        mode = {"fifo": stat.S_IFIFO, "sock": stat.S_IFSOCK, "chr": stat.S_IFCHR}[kind]
        await fs.vfs.mknod(fs.d, b"x", mode | 0o644, os.makedev(1, 3), UID, GID)
    ino = (await fs.lookup(b"x")).ino
    await fs.vfs.unlink(fs.d, b"x")
    await expect(errno.ENOENT, fs.lookup(b"x"))
    await expect(errno.ENOENT, fs.vfs.getattr(ino))
    assert await fs.names() == []


async def test_unlink_errors(fs):
    await expect(errno.ENOENT, fs.vfs.unlink(fs.d, b"missing"))
    await fs.mkdir(b"dir")
    await expect(errno.EISDIR, fs.vfs.unlink(fs.d, b"dir"))
    assert await fs.names() == [b"dir"]
    f = await fs.write(b"f")
    await expect(errno.ENOTDIR, fs.vfs.unlink(f.ino, b"x"))


async def test_unlinked_file_stays_readable_while_open(fs):
    data = os.urandom(200_000)
    f = await fs.write(b"f", data)
    h = await fs.vfs.open(f.ino, os.O_RDONLY)
    await fs.vfs.unlink(fs.d, b"f")
    await expect(errno.ENOENT, fs.lookup(b"f"))
    assert (await fs.vfs.getattr(f.ino)).nlink == 0  # fstat of an open, removed file
    assert bytes(await fs.vfs.read(h.fh, 100_000, 1000)) == data[100_000:101_000]
    await fs.vfs.release(h.fh)
    fs.vfs.forget([(f.ino, 1 << 20)])  # the kernel lets go of the removed inode
    await expect(errno.ENOENT, fs.vfs.getattr(f.ino))


async def test_rmdir(fs):
    before = await fs.vfs.getattr(fs.d)
    sub = await fs.mkdir(b"sub")
    await fs.write(b"inside", parent=sub.ino)
    await expect(errno.ENOTEMPTY, fs.vfs.rmdir(fs.d, b"sub"))
    await fs.mkdir(b"deeper", parent=sub.ino)
    await fs.vfs.unlink(sub.ino, b"inside")
    await expect(errno.ENOTEMPTY, fs.vfs.rmdir(fs.d, b"sub"))
    await fs.vfs.rmdir(sub.ino, b"deeper")
    await fs.vfs.rmdir(fs.d, b"sub")
    await expect(errno.ENOENT, fs.lookup(b"sub"))
    after = await fs.vfs.getattr(fs.d)
    assert after.nlink == before.nlink and after.mtime_ns > before.mtime_ns
    await expect(errno.ENOENT, fs.vfs.rmdir(fs.d, b"sub"))
    await fs.write(b"f")
    await expect(errno.ENOTDIR, fs.vfs.rmdir(fs.d, b"f"))
    await fs.vfs.symlink(fs.d, b"l", b"f", UID, GID)
    await expect(errno.ENOTDIR, fs.vfs.rmdir(fs.d, b"l"))
    assert await fs.names() == [b"f", b"l"]


# ---- rename --------------------------------------------------------------------------------------

async def test_rename_a_file_over_a_file(fs):
    a = await fs.write(b"a", b"A")
    b = await fs.write(b"b", b"B")
    await fs.lookup(b"a")
    await fs.lookup(b"b")
    await fs.vfs.rename(fs.d, b"a", fs.d, b"b", 0)
    assert await fs.names() == [b"b"]
    assert (await fs.lookup(b"b")).ino == a.ino
    assert await fs.read(a.ino) == b"A"
    await expect(errno.ENOENT, fs.lookup(b"a"))
    await expect(errno.ENOENT, fs.vfs.getattr(b.ino))  # its last link gone


async def test_rename_keeps_a_replaced_file_readable_while_open(fs):
    await fs.write(b"a", b"new")
    b = await fs.write(b"b", b"old")
    h = await fs.vfs.open(b.ino, os.O_RDONLY)
    await fs.vfs.rename(fs.d, b"a", fs.d, b"b", 0)
    assert bytes(await fs.vfs.read(h.fh, 0, 10)) == b"old"
    await fs.vfs.release(h.fh)
    assert await fs.read((await fs.lookup(b"b")).ino) == b"new"


async def test_rename_directories_over_directories(fs):
    a = await fs.mkdir(b"a")
    await fs.write(b"in-a", parent=a.ino)
    empty = await fs.mkdir(b"empty")
    full = await fs.mkdir(b"full")
    await fs.write(b"in-full", parent=full.ino)
    nlink = (await fs.vfs.getattr(fs.d)).nlink
    await expect(errno.ENOTEMPTY, fs.vfs.rename(fs.d, b"a", fs.d, b"full", 0))
    await fs.vfs.rename(fs.d, b"a", fs.d, b"empty", 0)
    assert await fs.names() == [b"empty", b"full"]
    assert (await fs.lookup(b"empty")).ino == a.ino
    assert await fs.names(a.ino) == [b"in-a"]
    await expect(errno.ENOENT, fs.vfs.getattr(empty.ino))
    assert (await fs.vfs.getattr(fs.d)).nlink == nlink - 1
    assert await fs.names(full.ino) == [b"in-full"]


async def test_rename_between_kinds_refused(fs):
    await fs.write(b"f", b"F")
    sub = await fs.mkdir(b"sub")
    await expect(errno.EISDIR, fs.vfs.rename(fs.d, b"f", fs.d, b"sub", 0))
    await expect(errno.ENOTDIR, fs.vfs.rename(fs.d, b"sub", fs.d, b"f", 0))
    await fs.vfs.symlink(fs.d, b"l", b"sub", UID, GID)
    await expect(errno.ENOTDIR, fs.vfs.rename(fs.d, b"sub", fs.d, b"l", 0))
    await expect(errno.EISDIR, fs.vfs.rename(fs.d, b"l", fs.d, b"sub", 0))
    assert await fs.names() == [b"f", b"l", b"sub"]
    assert (await fs.lookup(b"sub")).ino == sub.ino


async def test_rename_a_directory_into_itself_is_refused(fs):
    top = await fs.mkdir(b"top")
    mid = await fs.mkdir(b"mid", parent=top.ino)
    low = await fs.mkdir(b"low", parent=mid.ino)
    await expect(errno.EINVAL, fs.vfs.rename(fs.d, b"top", top.ino, b"x", 0))
    await expect(errno.EINVAL, fs.vfs.rename(fs.d, b"top", low.ino, b"x", 0))
    await expect(errno.EINVAL, fs.vfs.rename(top.ino, b"mid", low.ino, b"x", 0))
    assert await fs.names() == [b"top"] and await fs.names(low.ino) == []
    await fs.vfs.rename(mid.ino, b"low", fs.d, b"low", 0)  # upwards is fine
    assert await fs.names() == [b"low", b"top"]


async def test_rename_of_nothing_and_to_nowhere(fs):
    await expect(errno.ENOENT, fs.vfs.rename(fs.d, b"missing", fs.d, b"x", 0))
    await fs.write(b"f")
    gone = await fs.mkdir(b"gone")
    await fs.vfs.rmdir(fs.d, b"gone")
    await expect(errno.ENOENT, fs.vfs.rename(fs.d, b"f", gone.ino, b"f", 0))
    file_ino = (await fs.lookup(b"f")).ino
    await expect(errno.ENOTDIR, fs.vfs.rename(fs.d, b"f", file_ino, b"x", 0))
    assert await fs.names() == [b"f"]


async def test_rename_onto_itself_or_its_own_link_does_nothing(fs):
    f = await fs.write(b"f", b"x")
    await fs.vfs.link(f.ino, fs.d, b"g")
    await fs.vfs.rename(fs.d, b"f", fs.d, b"f", 0)
    await fs.vfs.rename(fs.d, b"f", fs.d, b"g", 0)
    assert await fs.names() == [b"f", b"g"]
    assert (await fs.vfs.getattr(f.ino)).nlink == 2


async def test_rename_noreplace_and_exchange(fs):
    a = await fs.write(b"a", b"A")
    b = await fs.write(b"b", b"B")
    await expect(errno.EEXIST, fs.vfs.rename(fs.d, b"a", fs.d, b"b", RENAME_NOREPLACE))
    await fs.vfs.rename(fs.d, b"a", fs.d, b"c", RENAME_NOREPLACE)
    assert await fs.names() == [b"b", b"c"]
    sub = await fs.mkdir(b"sub")
    await fs.write(b"inside", parent=sub.ino)
    await fs.vfs.rename(fs.d, b"c", fs.d, b"sub", RENAME_EXCHANGE)  # a file and a full dir
    assert (await fs.lookup(b"sub")).ino == a.ino and (await fs.lookup(b"c")).ino == sub.ino
    assert await fs.names(sub.ino) == [b"inside"]
    await expect(errno.ENOENT, fs.vfs.rename(fs.d, b"b", fs.d, b"nothing", RENAME_EXCHANGE))
    for bad in (RENAME_NOREPLACE | RENAME_EXCHANGE, 8):
        await expect(errno.EINVAL, fs.vfs.rename(fs.d, b"b", fs.d, b"z", bad))
    assert await fs.names() == [b"b", b"c", b"sub"]
    assert await fs.read(b.ino) == b"B"


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("where", ["same shard", "other shard"])
async def test_rename_between_directories(fs, kind, where):
    src = await fs.mkdir(b"src")
    if where == "other shard":
        dst = await _other_shard_dir(fs)
    else:
        for i in range(64):
            dst = (await fs.mkdir(b"near%d" % i)).ino
            if shard_of(dst) == shard_of(src.ino):
                break
    if kind == "file":
        moved = await fs.write(b"m", b"moved bytes", parent=src.ino)
    else:
        moved = await fs.mkdir(b"m", parent=src.ino)
        await fs.write(b"inside", b"in", parent=moved.ino)
    links = [(await fs.vfs.getattr(p)).nlink for p in (src.ino, dst)]
    await fs.vfs.rename(src.ino, b"m", dst, b"n", 0)
    assert await fs.names(src.ino) == [] and await fs.names(dst) == [b"n"]
    assert (await fs.lookup(b"n", parent=dst)).ino == moved.ino
    step = 1 if kind == "dir" else 0
    assert [(await fs.vfs.getattr(p)).nlink for p in (src.ino, dst)] == [
        links[0] - step, links[1] + step]
    if kind == "file":
        assert await fs.read(moved.ino) == b"moved bytes"
    else:
        inside = await fs.lookup(b"inside", parent=moved.ino)
        assert await read_file(fs.vfs, inside.ino) == b"in"
        ents = {n: a for n, a, _ in await _dots(fs, moved.ino)}
        assert ents[b".."].ino == dst  # its parent is its new one
        await expect(errno.EINVAL, fs.vfs.rename(dst, b"n", moved.ino, b"loop", 0))


async def _dots(fs: Fs, ino: int):
    return [e for e in await entries(fs.vfs, ino) if e[0] in (b".", b"..")]


async def test_rename_moves_ctime_of_what_it_moves(fs):
    f = await fs.write(b"f", b"x")
    await fs.vfs.fsyncdir(fs.d)  # (a file not committed yet: test_vfs_leases.py)
    before = await fs.vfs.getattr(f.ino)
    await fs.vfs.rename(fs.d, b"f", fs.d, b"g", 0)
    after = await fs.vfs.getattr(f.ino)
    assert after.ctime_ns > before.ctime_ns and after.mtime_ns == before.mtime_ns


# ---- times, link counts, setgid ------------------------------------------------------------------

async def _change(fs: Fs, op: str) -> None:
    v, d = fs.vfs, fs.d
    if op == "create":
        await fs.write(b"new")
    elif op == "mkdir":
        await fs.mkdir(b"new")
    elif op == "mknod":
        await v.mknod(d, b"new", stat.S_IFIFO | 0o644, 0, UID, GID)
    elif op == "symlink":
        await v.symlink(d, b"new", b"t", UID, GID)
    elif op == "link":
        await v.link((await fs.lookup(b"old")).ino, d, b"new")
    elif op == "unlink":
        await v.unlink(d, b"old")
    elif op == "rmdir":
        await v.rmdir(d, b"olddir")
    elif op == "rename":
        await v.rename(d, b"old", d, b"new", 0)
    else:
        raise ValueError(op)


@pytest.mark.parametrize("op", ["create", "mkdir", "mknod", "symlink", "link", "unlink",
                                "rmdir", "rename"])
async def test_a_change_of_names_moves_the_directorys_times(fs, op):
    await fs.write(b"old")
    await fs.mkdir(b"olddir")
    before = await fs.vfs.getattr(fs.d)
    await _change(fs, op)
    after = await fs.vfs.getattr(fs.d)
    assert after.mtime_ns > before.mtime_ns and after.ctime_ns > before.ctime_ns, (before, after)
    assert after.nlink == before.nlink + {"mkdir": 1, "rmdir": -1}.get(op, 0)


async def test_directory_link_counts(fs):
    assert (await fs.vfs.getattr(fs.d)).nlink == 2
    subs = [await fs.mkdir(b"s%d" % i) for i in range(4)]
    await fs.write(b"file")  # files do not count
    assert (await fs.vfs.getattr(fs.d)).nlink == 6
    await fs.mkdir(b"deep", parent=subs[0].ino)
    assert (await fs.vfs.getattr(subs[0].ino)).nlink == 3
    await fs.vfs.rename(fs.d, b"s1", subs[0].ino, b"s1", 0)
    assert (await fs.vfs.getattr(fs.d)).nlink == 5
    assert (await fs.vfs.getattr(subs[0].ino)).nlink == 4
    await fs.vfs.rmdir(fs.d, b"s2")
    assert (await fs.vfs.getattr(fs.d)).nlink == 4
    ents = {n: a for n, a, _ in await _dots(fs, fs.d)}
    assert ents[b"."].nlink == 4


async def test_a_setgid_directory_gives_its_group(fs):
    sub = await fs.mkdir(b"sg")
    group = GID + 4242
    st = await fs.vfs.setattr(sub.ino, {"mode": 0o2775, "gid": group})
    assert st.mode & stat.S_ISGID and st.gid == group
    d2 = await fs.mkdir(b"d", parent=sub.ino)
    f = await fs.write(b"f", parent=sub.ino)
    link = await fs.vfs.symlink(sub.ino, b"l", b"f", UID, GID)
    node = await fs.vfs.mknod(sub.ino, b"p", stat.S_IFIFO | 0o644, 0, UID, GID)
    for a in (d2, f, link, node):
        assert (await fs.vfs.getattr(a.ino)).gid == group, a
    assert (await fs.vfs.getattr(d2.ino)).mode & stat.S_ISGID  # directories carry it on
    assert not (await fs.vfs.getattr(f.ino)).mode & stat.S_ISGID
    plain = await fs.write(b"plain")  # outside: the caller's group
    assert plain.gid == GID and not plain.mode & stat.S_ISGID
