"""Directory write leases and write-behind, with the VFS called directly as the FUSE adapter
calls it (no kernel), between several VFS objects on one cluster (several mounts): a VFS filling
a directory answers its creates from the lease and commits them behind, and still every other
VFS sees the files (at once after an fsync of the file or the directory, a closed file with its
bytes at once without write-behind, within moments otherwise); another VFS's change recalls
the lease and loses nothing; two VFS filling one directory make every file; a VFS that ends
commits everything, and one killed loses no file it had closed (without write-behind)."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import trio
from vfs_harness import (
    CHUNK,
    CREAT,
    GID,
    LEASE_WARMUP,
    RDONLY,
    UID,
    Fs,
    cluster,  # noqa: F401
    cluster_dir,  # noqa: F401
    eventually,
    exists,
    expect,
    fresh_dir,
    names,
    open_fs,
    open_vfs,
    read_file,
    write_all,
)

from jpfs.placement import shard_of

EXCL = os.O_CREAT | os.O_EXCL | os.O_WRONLY
BATCH = 512
"""Entries one lease batch carries at most (``jpfs.client.vfs.leases.BATCH_MAX``)."""


class Killed(Exception):
    """Raised inside ``open_vfs`` to end a VFS as a killed mount ends: nothing committed at the
    end, its tasks cancelled, its connections closed."""


def _payload(name: bytes) -> bytes:
    return b"payload:" + name


async def _fill(vfs, d: int, names_: list[bytes], with_data: bool = False) -> None:
    for n in names_:
        f, _ = await vfs.create(d, n, stat.S_IFREG | 0o640, EXCL, UID, GID)
        if with_data:
            await vfs.write(f.fh, 0, _payload(n))
        await vfs.flush(f.fh)
        await vfs.release(f.fh)


def _leases(vfs) -> dict:
    return vfs.snapshot()["leases"]


# ---- one VFS filling a directory -----------------------------------------------------------------

async def test_a_directory_filled_under_a_lease_is_what_every_vfs_sees(cluster):  # noqa: F811
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a)
        empty = [b"e%03d" % i for i in range(150)]
        full = [b"f%03d" % i for i in range(150)]
        await _fill(a, d, empty)
        await _fill(a, d, full, with_data=True)
        leases = _leases(a)
        assert leases["granted"] >= 1 and leases["answered"] >= 250 and leases["failed"] == 0
        # the VFS itself: every name, its type and mode, its bytes, O_EXCL still exclusive
        assert await names(a, d) == sorted(empty + full)
        st = await a.getattr((await a.lookup(d, b"f007")).ino)
        assert st.mode == stat.S_IFREG | 0o640 and st.size == len(_payload(b"f007"))
        assert await read_file(a, st.ino) == _payload(b"f007")
        await expect(errno.EEXIST, a.create(d, b"e000", stat.S_IFREG | 0o644, EXCL, UID, GID))
        # a file written and closed is committed by its close, name and bytes together
        await _fill(a, d, [b"late"], with_data=True)
        assert await read_file(b, (await b.lookup(d, b"late")).ino) == _payload(b"late")
        # after an fsync of the directory every name is there for everyone
        await a.fsyncdir(d)
        assert await names(b, d) == sorted(empty + full + [b"late"])
        assert await read_file(b, (await b.lookup(d, b"f042")).ino) == _payload(b"f042")
        assert (await b.getattr((await b.lookup(d, b"e042")).ino)).size == 0
        assert (await b.getattr(d)).nlink == (await a.getattr(d)).nlink == 2


async def test_unlinks_and_renames_answered_from_the_lease_reach_the_shard(cluster):  # noqa: F811
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        made = [b"m%02d" % i for i in range(20)]
        await _fill(a, d, made, with_data=True)
        await a.fsyncdir(d)
        for n in made[:5]:
            await a.lookup(d, n)
            await a.unlink(d, n)
        for n in made[5:10]:
            await a.rename(d, n, d, n + b".renamed", 0)
        await a.rename(d, made[10], d, made[11], 0)  # over another file of the lease
        want = sorted(made[12:] + [n + b".renamed" for n in made[5:10]] + [made[11]])
        assert await names(a, d) == want
        assert _leases(a)["removes"] >= 5 and _leases(a)["renames_answered"] >= 6
        await a.fsyncdir(d)
        assert await names(b, d) == want
        for n in (b"m05.renamed", made[11]):
            src = n.removesuffix(b".renamed") if n.endswith(b".renamed") else made[10]
            assert await read_file(b, (await b.lookup(d, n)).ino) == _payload(src)


async def test_another_vfs_change_recalls_the_lease_and_loses_nothing(cluster):  # noqa: F811
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a)
        mine = [b"m%03d" % i for i in range(100)]
        await _fill(a, d, mine)
        assert _leases(a)["held"] >= 1
        f, _ = await b.create(d, b"theirs", stat.S_IFREG | 0o644, EXCL, UID, GID)  # recalls it
        await b.write(f.fh, 0, b"theirs")
        await b.release(f.fh)
        assert await names(b, d) == sorted(mine + [b"theirs"])
        await eventually(lambda: _held_none(a), "the lease given back")
        assert _leases(a)["recalled"] >= 1
        await expect(errno.EEXIST, a.create(d, b"theirs", stat.S_IFREG | 0o644, EXCL, UID,
                                            GID))
        assert await read_file(a, (await a.lookup(d, b"theirs")).ino) == b"theirs"
        # their removal and rename of files this VFS made under the lease
        await b.unlink(d, b"m000")
        await b.rename(d, b"m001", d, b"renamed", 0)
        await eventually(lambda: _not(exists(a, d, b"m000")), "their removal seen")
        await eventually(lambda: exists(a, d, b"renamed"), "their rename seen")
        # and this VFS's own changes in the directory
        more = [b"n%03d" % i for i in range(40)]
        await _fill(a, d, more)
        await a.lookup(d, b"n000")
        await a.unlink(d, b"n000")
        await a.rename(d, b"n001", d, b"n001.r", 0)
        await a.mkdir(d, b"sub", 0o755, UID, GID)
        want = sorted(set(mine) - {b"m000", b"m001"} | {b"theirs", b"renamed", b"n001.r",
                                                         b"sub"} | set(more) - {b"n000", b"n001"})
        assert await names(b, d) == want
        assert await names(a, d) == want
        assert _leases(a)["failed"] == 0


async def _held_none(vfs) -> bool:
    return _leases(vfs)["held"] == 0


async def _not(aw) -> bool:
    return not await aw


async def test_two_vfs_filling_one_directory_make_every_file(cluster):  # noqa: F811
    async with open_vfs(cluster) as a, open_vfs(cluster) as b:
        d = await fresh_dir(a)

        async def writer(vfs, prefix: bytes) -> None:
            for i in range(150):
                name = b"%s%03d" % (prefix, i)
                f, _ = await vfs.create(d, name, stat.S_IFREG | 0o644, CREAT, UID, GID)
                if i % 3 == 0:
                    await vfs.write(f.fh, 0, name)
                await vfs.release(f.fh)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer, a, b"a")
            nursery.start_soon(writer, b, b"b")
        await a.fsyncdir(d)
        await b.fsyncdir(d)
        async with open_vfs(cluster, dir_leases=False) as c:
            want = sorted(b"%s%03d" % (p, i) for p in (b"a", b"b") for i in range(150))
            assert await names(c, d) == want
            for n in (b"a000", b"b003", b"a147"):
                assert await read_file(c, (await c.lookup(d, n)).ino) == n
        assert _leases(a)["failed"] == _leases(b)["failed"] == 0


# ---- write-behind --------------------------------------------------------------------------------

async def test_write_behind_closes_lose_nothing_once_fsynced(cluster):  # noqa: F811
    data = {b"w%02d" % i: os.urandom(1000 + i * 997) for i in range(40)}
    async with open_vfs(cluster, write_behind=True) as a, \
            open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        for n, v in data.items():
            f, _ = await a.create(d, n, stat.S_IFREG | 0o644, EXCL, UID, GID)
            await write_all(a, f.fh, 0, v)
            await a.flush(f.fh)
            await a.release(f.fh)
        for n, v in data.items():  # this VFS reads its own files at once, bytes and all
            ino = (await a.lookup(d, n)).ino
            assert (await a.getattr(ino)).size == len(v)
            assert await read_file(a, ino) == v
        await a.fsyncdir(d)
        assert await names(b, d) == sorted(data)
        for n, v in data.items():
            assert await read_file(b, (await b.lookup(d, n)).ino) == v
        assert a.snapshot()["closes_behind"] >= 1
        assert a.snapshot()["closes_behind_failed"] == 0


async def test_write_behind_files_reach_other_vfs_without_an_fsync(cluster):  # noqa: F811
    async with open_vfs(cluster, write_behind=True) as a, \
            open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        big = os.urandom(3 * CHUNK + 11)
        f, _ = await a.create(d, b"big", stat.S_IFREG | 0o644, EXCL, UID, GID)
        await write_all(a, f.fh, 0, big)
        await a.release(f.fh)
        await eventually(lambda: exists(b, d, b"big"), "a file closed behind, seen elsewhere")
        assert await read_file(b, (await b.lookup(d, b"big")).ino) == big  # with its bytes


async def test_write_behind_fsync_of_a_file_makes_it_visible_at_once(cluster):  # noqa: F811
    async with open_vfs(cluster, write_behind=True) as a, \
            open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        f, attr = await a.create(d, b"f", stat.S_IFREG | 0o644, EXCL, UID, GID)
        await a.write(f.fh, 0, b"synced")
        await a.fsync(f.fh)
        assert await read_file(b, (await b.lookup(d, b"f")).ino) == b"synced"
        await a.release(f.fh)


@pytest.mark.parametrize("mode", ["leased", "write-behind"])
async def test_a_vfs_that_ends_commits_everything(cluster, mode):  # noqa: F811
    async with open_fs(cluster, mode) as fs:
        d = fs.d
        await _fill(fs.vfs, d, [b"e%02d" % i for i in range(30)])
        await _fill(fs.vfs, d, [b"f%02d" % i for i in range(30)], with_data=True)
        await fs.vfs.lookup(d, b"e00")
        await fs.vfs.unlink(d, b"e00")
        await fs.vfs.rename(d, b"e01", d, b"e01.r", 0)
    async with open_vfs(cluster, dir_leases=False) as b:
        want = sorted([b"e%02d" % i for i in range(2, 30)] + [b"e01.r"]
                      + [b"f%02d" % i for i in range(30)])
        assert await names(b, d) == want
        for i in (0, 17, 29):
            n = b"f%02d" % i
            assert await read_file(b, (await b.lookup(d, n)).ino) == _payload(n)


async def test_a_killed_vfs_loses_no_file_it_closed(cluster):  # noqa: F811
    """Without write-behind a close returns once the file (its create with it) is
    committed."""
    made = [b"k%02d" % i for i in range(50)]
    try:
        async with open_fs(cluster, "leased") as fs:
            d = fs.d
            await _fill(fs.vfs, d, made, with_data=True)
            raise Killed
    except* Killed:
        pass
    async with open_vfs(cluster, dir_leases=False) as b:
        assert await names(b, d) == made
        for n in made:
            assert await read_file(b, (await b.lookup(d, n)).ino) == _payload(n)


# ---- what the lease's batches must not change ----------------------------------------------------

MANY = 5 * BATCH + 40
"""More creates than several lease batches carry."""


async def test_readdir_right_after_many_creates_lists_them_all(cluster):  # noqa: F811
    async with open_fs(cluster, "leased") as fs:
        made = [b"e%04d" % i for i in range(MANY)]
        await _fill(fs.vfs, fs.d, made)
        assert len(await fs.names()) == len(made)


async def test_fsyncdir_commits_every_create_before_it_returns(cluster):  # noqa: F811
    made = [b"e%04d" % i for i in range(MANY)]
    try:
        async with open_fs(cluster, "leased") as fs:
            d = fs.d
            await _fill(fs.vfs, d, made)
            await fs.vfs.fsyncdir(d)
            raise Killed
    except* Killed:
        pass
    async with open_vfs(cluster, dir_leases=False) as b:
        assert len(await names(b, d)) == len(made)


async def _unsent_file(fs: Fs) -> tuple[int, int]:
    """A file made under the lease of a write-behind VFS and still open for writing: its
    create is held back from the batch (for ``HOLD_OPEN``) so that it goes with its bytes."""
    fh, attr = await fs.create(b"f", flags=EXCL)
    return fh, attr.ino


async def test_a_file_not_committed_yet_is_not_a_directory(cluster):  # noqa: F811
    async with open_fs(cluster, "write-behind") as fs:
        fh, ino = await _unsent_file(fs)
        await expect(errno.ENOTDIR, fs.vfs.lookup(ino, b"x"))
        await expect(errno.ENOTDIR, fs.create(b"x", parent=ino))
        await expect(errno.ENOTDIR, fs.mkdir(b"x", parent=ino))
        await expect(errno.ENOTDIR, fs.vfs.rename(fs.d, b"f", ino, b"x", 0))
        await fs.vfs.release(fh)
        assert await fs.names() == [b"f"]


async def test_a_rename_of_a_file_not_committed_yet_moves_its_ctime(cluster):  # noqa: F811
    async with open_fs(cluster, "write-behind") as fs:
        fh, ino = await _unsent_file(fs)
        before = await fs.vfs.getattr(ino)
        await fs.vfs.rename(fs.d, b"f", fs.d, b"g", 0)
        after = await fs.vfs.getattr(ino)
        await fs.vfs.release(fh)
        assert after.ctime_ns > before.ctime_ns


async def test_a_file_not_committed_yet_is_what_this_vfs_made(cluster):  # noqa: F811
    """What the same VFS sees of a file whose create is still held back: its name, its
    attributes, its bytes through another handle, xattrs, a hard link, a removal."""
    async with open_fs(cluster, "write-behind") as fs:
        fh, ino = await _unsent_file(fs)
        await fs.vfs.write(fh, 0, b"held back")
        assert (await fs.lookup(b"f")).ino == ino
        assert (await fs.vfs.getattr(ino)).size == 9
        r = await fs.vfs.open(ino, RDONLY)
        assert bytes(await fs.vfs.read(r.fh, 0, 100)) == b"held back"
        await fs.vfs.setxattr(ino, b"user.k", b"v")
        assert await fs.vfs.getxattr(ino, b"user.k") == b"v"
        await fs.vfs.release(r.fh)
        await fs.vfs.release(fh)
        await fs.vfs.link(ino, fs.d, b"g")
        assert (await fs.vfs.getattr(ino)).nlink == 2
        await fs.vfs.unlink(fs.d, b"f")
        assert await fs.names() == [b"g"]
        assert await fs.read(ino) == b"held back"


# ---- directories made under a lease --------------------------------------------------------------

async def test_directories_made_under_a_lease_are_what_every_vfs_sees(cluster):  # noqa: F811
    """mkdirs in a leased directory are answered at once and committed behind, those placed
    on the directory's shard with its batch and those placed on the other shard in one
    cross-shard transaction per batch: after an fsync of the directory every other VFS sees
    each with its mode, owner, link count and parent; the parent's link count counts them."""
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        made = [b"sub%04d" % i for i in range(BATCH + 100)]
        attrs = {n: await a.mkdir(d, n, 0o750, UID, GID) for n in made}
        leases = _leases(a)
        assert leases["mkdirs"] == len(made) and leases["failed"] == 0, leases
        shards = {shard_of(a_.ino) for a_ in attrs.values()}
        assert len(shards) == 2  # placed over both shards, as a mkdir through the shard is
        await expect(errno.EEXIST, a.mkdir(d, made[3], 0o755, UID, GID))
        await a.fsyncdir(d)
        assert await names(b, d) == made
        for n in made[::37]:
            st = await b.getattr((await b.lookup(d, n)).ino)
            assert (st.ino, st.mode, st.nlink, st.uid, st.gid) == (
                attrs[n].ino, stat.S_IFDIR | 0o750, 2, UID, GID)
            assert await names(b, st.ino) == []
        assert (await b.getattr(d)).nlink == 2 + len(made)
        assert (await a.getattr(d)).nlink == 2 + len(made)


async def test_a_directory_not_committed_yet_can_be_filled_listed_and_removed(
        cluster):  # noqa: F811
    """What the VFS that made a directory under a lease does with it at once: look it up,
    fill it (its create goes first), list it, make a directory in it, remove it; nothing is
    lost or doubled on the shard."""
    async with open_fs(cluster, "leased") as fs:
        v = fs.vfs
        new = [await fs.mkdir(b"n%d" % i) for i in range(6)]
        assert _leases(v)["mkdirs"] == 6
        assert (await fs.lookup(b"n0")).ino == new[0].ino
        assert await names(v, new[1].ino) == []
        await fs.write(b"inside", b"bytes", parent=new[2].ino)
        assert await names(v, new[2].ino) == [b"inside"]
        deeper = await fs.mkdir(b"deeper", parent=new[3].ino)
        assert (await v.getattr(new[3].ino)).nlink == 3
        assert (await v.lookup(new[3].ino, b"deeper")).ino == deeper.ino
        await v.rmdir(fs.d, b"n4")
        await expect(errno.ENOTEMPTY, v.rmdir(fs.d, b"n2"))
        await v.rename(fs.d, b"n5", fs.d, b"n5.moved", 0)
        assert await fs.names() == [b"n0", b"n1", b"n2", b"n3", b"n5.moved"]
    async with open_vfs(cluster, dir_leases=False) as b:
        assert await names(b, fs.d) == [b"n0", b"n1", b"n2", b"n3", b"n5.moved"]
        got = await b.lookup(fs.d, b"n2")
        assert await read_file(b, (await b.lookup(got.ino, b"inside")).ino) == b"bytes"
        assert (await b.getattr(fs.d)).nlink == 2 + 5


async def test_a_killed_vfs_keeps_every_directory_it_fsynced(cluster):  # noqa: F811
    made = [b"k%04d" % i for i in range(300)]
    try:
        async with open_fs(cluster, "leased") as fs:
            d = fs.d
            for n in made:
                await fs.mkdir(n)
            await fs.vfs.fsyncdir(d)
            raise Killed
    except* Killed:
        pass
    async with open_vfs(cluster, dir_leases=False) as b:
        assert await names(b, d) == made
        assert (await b.getattr(d)).nlink == 2 + len(made)


async def test_rmdirs_of_emptied_leased_directories_are_answered_from_the_lease(
        cluster):  # noqa: F811
    """``rm -r`` as the kernel sends it: unlinks in each subdirectory (answered from its lease),
    then the rmdir of each (answered from the parent's lease, the subdirectory's lease vouching
    that nobody else can add a name to it): every VFS sees the tree gone after an fsync, with
    the parent's link count; an rmdir the leases cannot answer (a subdirectory never leased)
    goes to the shard as the holder's and keeps the parent's lease."""
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        subs = [b"s%02d" % i for i in range(24)]
        inos = {}
        for n in subs:
            inos[n] = (await a.mkdir(d, n, 0o755, UID, GID)).ino
            await _fill(a, inos[n], [b"f%d" % k for k in range(LEASE_WARMUP + 2)])
        await a.mkdir(d, b"never-leased", 0o755, UID, GID)
        await a.fsyncdir(d)
        await expect(errno.ENOTEMPTY, a.rmdir(d, subs[0]))
        for n in subs:
            for k in range(LEASE_WARMUP + 2):
                await a.lookup(inos[n], b"f%d" % k)
                await a.unlink(inos[n], b"f%d" % k)
            await a.rmdir(d, n)
        leases = _leases(a)
        assert leases["rmdirs"] >= len(subs) - 1 and leases["failed"] == 0, leases
        assert {shard_of(i) for i in inos.values()} == {0, 1}  # local and cross-shard ones
        await a.rmdir(d, b"never-leased")
        assert _leases(a)["held"] >= 1  # the parent's lease kept
        assert await names(a, d) == []
        assert (await a.getattr(d)).nlink == 2
        await a.fsyncdir(d)
        assert await names(b, d) == []
        assert (await b.getattr(d)).nlink == 2
        for n in subs:
            await expect(errno.ENOENT, b.getattr(inos[n]))
        # the removed directories' leases went back: another VFS may make them again
        await b.mkdir(d, subs[0], 0o755, UID, GID)
        assert await names(a, d) == [subs[0]]


async def test_directories_made_under_a_lease_are_leased_from_birth(cluster):  # noqa: F811
    """A directory made from a lease is leased to its maker from birth, on whichever shard it
    lives: it is filled from its lease from the first create, removed empty from the parent's
    lease (as ``mdtest`` and ``rm -r`` of a fresh tree do), and another VFS's change in it
    recalls the lease and waits for nothing more."""
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        subs = [b"b%03d" % i for i in range(60)]
        inos = [(await a.mkdir(d, n, 0o755, UID, GID)).ino for n in subs]
        await a.fsyncdir(d)
        leases = _leases(a)
        assert leases["born"] == len(subs) and leases["held"] >= len(subs), leases
        answered = leases["answered"]
        await _fill(a, inos[0], [b"x", b"y"])
        assert _leases(a)["answered"] == answered + 2  # no warm-up in a born directory
        for n in subs[10:]:
            await a.rmdir(d, n)
        assert _leases(a)["rmdirs"] == len(subs) - 10
        f, _ = await b.create(inos[1], b"theirs", stat.S_IFREG | 0o644, EXCL, UID, GID)
        await b.release(f.fh)
        assert await names(a, inos[1]) == [b"theirs"]
        await a.fsyncdir(d)
        assert await names(b, d) == subs[:10]
        assert await names(b, inos[0]) == [b"x", b"y"]
        assert (await b.getattr(d)).nlink == 2 + 10


async def test_a_leased_directorys_times_are_what_the_shard_keeps(cluster):  # noqa: F811
    """Changes answered from a lease set the directory's mtime and ctime in this VFS, and their
    batch sets the same on the shard (not the time it commits): a stat after the attributes
    expire, or from another VFS, shows no change that did not happen."""
    async with open_vfs(cluster) as a, open_vfs(cluster, dir_leases=False) as b:
        d = await fresh_dir(a, warm=True)
        for step in range(4):
            await _fill(a, d, [b"f%d" % step])
            sub = await a.mkdir(d, b"d%d" % step, 0o755, UID, GID)
            await a.lookup(d, b"f%d" % step)
            await a.rename(d, b"f%d" % step, d, b"g%d" % step, 0)
            if step % 2:
                await a.rmdir(d, b"d%d" % step)
            else:
                await _fill(a, sub.ino, [b"inside"])  # the new directory's batch goes first
            mine = await a.getattr(d)
            await a.fsyncdir(d)
            theirs = await b.getattr(d)
            assert (theirs.mtime_ns, theirs.ctime_ns, theirs.nlink) == (
                mine.mtime_ns, mine.ctime_ns, mine.nlink), step


async def test_a_create_dropped_before_it_was_sent_still_moves_the_times(cluster):  # noqa: F811
    """A file made and removed before its batch left is never sent, but the directory's mtime and
    ctime moved in this VFS all the same: the shard gets them too."""
    async with open_fs(cluster, "write-behind") as fs:
        a = fs.vfs
        await a.fsyncdir(fs.d)  # nothing else on its way
        fh, _ = await fs.create(b"brief", flags=EXCL)  # held back while open for writing
        await a.lookup(fs.d, b"brief")
        await a.unlink(fs.d, b"brief")
        await a.release(fh)
        mine = await a.getattr(fs.d)
        await a.fsyncdir(fs.d)
        assert _leases(a)["cancelled"] >= 1
        async with open_vfs(cluster, dir_leases=False) as b:
            theirs = await b.getattr(fs.d)
        assert (theirs.mtime_ns, theirs.ctime_ns) == (mine.mtime_ns, mine.ctime_ns)
