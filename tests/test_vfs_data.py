"""The VFS's file data, called directly as the FUSE adapter calls it (no kernel): open, create,
read, write, flush, fsync, release, fallocate and setattr (truncate, mode, owner, times), with
their errnos; reads of a file's own writes within a handle and across handles; O_TRUNC and
O_APPEND opens; holes; close-to-open consistency between two VFS objects on one cluster (two
mounts); two writers' commits; and random operations checked against a shadow copy in memory.

Each test runs under the three configurations of ``vfs_harness.MODES``: changes through the
shard, under a directory lease, and with writes behind the close of new files."""

from __future__ import annotations

import errno
import os
import random
import stat

import pytest
from vfs_harness import (
    CHUNK,
    CREAT,
    GID,
    RDONLY,
    RDWR,
    UID,
    WRONLY,
    Fs,
    cluster,  # noqa: F401
    cluster_dir,  # noqa: F401
    errno_of,
    eventually,
    exists,
    expect,
    open_fs,
    open_vfs,
    read_at,
    read_file,
    write_all,
)

from jpfs.client.vfs.core import FALLOC_FL_KEEP_SIZE
from jpfs.errors import JPFSError

FALLOC_FL_PUNCH_HOLE = 0x02
SIZES = {"empty": 0, "small": 1000, "one chunk": CHUNK, "chunks": 3 * CHUNK + 5}


@pytest.fixture(params=["plain", "leased", "write-behind"])
async def fs(request, cluster):  # noqa: F811
    async with open_fs(cluster, request.param) as f:
        yield f


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


async def _seen_by(other, fs: Fs, name: bytes, *, at_once: bool) -> bytes:
    """What another VFS reads of ``name`` in the test directory: at once (a committed file), or
    once its commit behind the close reached the shard (write-behind)."""
    if not at_once:
        await eventually(lambda: exists(other, fs.d, name), f"{name!r} seen by the other VFS")
    return await read_file(other, (await other.lookup(fs.d, name)).ino)


# ---- read after write ----------------------------------------------------------------------------

@pytest.mark.parametrize("size", list(SIZES))
async def test_a_handle_reads_its_own_writes_before_any_commit(fs, size):
    data = _data(SIZES[size])
    fh, attr = await fs.create(b"f", flags=os.O_CREAT | RDWR)
    await write_all(fs.vfs, fh, 0, data, piece=7000)  # pieces across chunk boundaries
    assert await read_at(fs.vfs, fh, 0, len(data) + 10) == data
    assert (await fs.vfs.getattr(attr.ino)).size == len(data)
    for off in (0, 1, CHUNK - 3, CHUNK, 2 * CHUNK + 1):
        assert await read_at(fs.vfs, fh, off, CHUNK + 9) == data[off:off + CHUNK + 9]
    await fs.vfs.release(fh)
    assert await fs.read(attr.ino) == data


async def test_handles_of_one_file_share_what_is_written(fs):
    fh_w, attr = await fs.create(b"f", flags=os.O_CREAT | RDWR)
    await write_all(fs.vfs, fh_w, 0, b"a" * (2 * CHUNK))
    reader = await fs.vfs.open(attr.ino, RDONLY)
    other = await fs.vfs.open(attr.ino, RDWR)
    assert await read_at(fs.vfs, reader.fh, CHUNK - 2, 4) == b"aaaa"  # not committed yet
    await fs.vfs.write(other.fh, CHUNK - 1, b"BB")
    assert await read_at(fs.vfs, fh_w, CHUNK - 2, 4) == b"aBBa"
    assert await read_at(fs.vfs, reader.fh, CHUNK - 2, 4) == b"aBBa"
    await fs.vfs.release(other.fh)  # a handle's close commits both handles' bytes
    await fs.vfs.write(fh_w, 0, b"Z")
    await fs.vfs.release(fh_w)
    assert await read_at(fs.vfs, reader.fh, 0, 2) == b"Za"
    await fs.vfs.release(reader.fh)
    want = b"Z" + b"a" * (CHUNK - 2) + b"BB" + b"a" * (CHUNK - 1)
    assert await fs.read(attr.ino) == want


async def test_reads_at_and_past_the_end(fs):
    data = _data(3 * CHUNK + 5)
    f = await fs.write(b"f", data)
    h = await fs.vfs.open(f.ino, RDONLY)
    assert bytes(await fs.vfs.read(h.fh, len(data), 100)) == b""
    assert bytes(await fs.vfs.read(h.fh, len(data) + CHUNK, 100)) == b""
    assert bytes(await fs.vfs.read(h.fh, len(data) - 3, 100)) == data[-3:]
    assert bytes(await fs.vfs.read(h.fh, 0, 0)) == b""
    await fs.vfs.release(h.fh)


async def test_holes_read_as_zeros(fs):
    fh, attr = await fs.create(b"sparse", flags=os.O_CREAT | RDWR)
    await fs.vfs.write(fh, 3 * CHUNK + 5, b"end")
    await fs.vfs.write(fh, 10, b"start")
    await fs.vfs.release(fh)
    got = await fs.read(attr.ino)
    want = bytearray(3 * CHUNK + 8)
    want[10:15] = b"start"
    want[-3:] = b"end"
    assert got == bytes(want)
    assert (await fs.vfs.getattr(attr.ino)).size == len(want)


async def test_a_file_removed_while_open_for_writing_reads_back_what_was_written(fs):
    fh, attr = await fs.create(b"f", flags=os.O_CREAT | RDWR)
    await fs.vfs.write(fh, 0, b"before ")
    await fs.vfs.flush(fh)
    await fs.vfs.unlink(fs.d, b"f")
    await fs.vfs.write(fh, 7, b"after")
    await fs.vfs.flush(fh)  # nothing to commit it to: dropped, as the last close drops it
    assert await read_at(fs.vfs, fh, 0, 100) == b"before after"
    await fs.vfs.release(fh)
    await expect(errno.ENOENT, fs.lookup(b"f"))


# ---- opens ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("access", [WRONLY, RDWR, RDONLY])
async def test_o_trunc_empties_the_file_at_open(fs, cluster, access):  # noqa: F811
    f = await fs.write(b"f", _data(3 * CHUNK))
    h = await fs.vfs.open(f.ino, access | os.O_TRUNC)  # Linux truncates with O_RDONLY too
    assert (await fs.vfs.getattr(f.ino)).size == 0
    async with open_vfs(cluster) as other:
        assert await read_file(other, f.ino) == b""  # the truncate is committed at open
    if access != RDONLY:
        await fs.vfs.write(h.fh, 0, b"new")
    await fs.vfs.release(h.fh)
    assert await fs.read(f.ino) == (b"" if access == RDONLY else b"new")


async def test_an_open_without_o_trunc_keeps_the_bytes(fs):
    data = _data(2 * CHUNK + 1)
    f = await fs.write(b"f", data)
    h = await fs.vfs.open(f.ino, WRONLY)
    await fs.vfs.write(h.fh, 5, b"XY")
    await fs.vfs.release(h.fh)
    assert await fs.read(f.ino) == data[:5] + b"XY" + data[7:]


async def test_o_append_writes_at_the_end(fs):
    f = await fs.write(b"log", b"line 1\n")
    for i in (2, 3):
        h = await fs.vfs.open(f.ino, WRONLY | os.O_APPEND)
        size = (await fs.vfs.getattr(f.ino)).size  # the kernel writes O_APPEND at i_size
        await fs.vfs.write(h.fh, size, b"line %d\n" % i)
        await fs.vfs.release(h.fh)
    assert await fs.read(f.ino) == b"line 1\nline 2\nline 3\n"


async def test_open_errors(fs):
    sub = await fs.mkdir(b"sub")
    for flags in (WRONLY, RDWR, RDONLY | os.O_TRUNC):
        await expect(errno.EISDIR, fs.vfs.open(sub.ino, flags))
    f = await fs.write(b"f", b"x")
    await fs.vfs.unlink(fs.d, b"f")
    fs.vfs.forget([(f.ino, 1 << 20)])
    await expect(errno.ENOENT, fs.vfs.open(f.ino, RDONLY))


async def test_handle_errors(fs):
    f = await fs.write(b"f", b"data")
    ro = await fs.vfs.open(f.ino, RDONLY)
    await expect(errno.EBADF, fs.vfs.write(ro.fh, 0, b"x"))
    await expect(errno.EBADF, fs.vfs.fallocate(ro.fh, 0, 0, 10))
    await fs.vfs.release(ro.fh)
    await expect(errno.EBADF, fs.vfs.read(ro.fh, 0, 10))
    await expect(errno.EBADF, fs.vfs.write(ro.fh, 0, b"x"))
    await expect(errno.EBADF, fs.vfs.flush(ro.fh))
    await expect(errno.EBADF, fs.vfs.fsync(ro.fh))
    dh = fs.vfs.opendir(fs.d)
    await expect(errno.EBADF, fs.vfs.read(dh, 0, 10))
    fs.vfs.releasedir(dh)
    assert await fs.read(f.ino) == b"data"


# ---- commits and what another VFS sees -----------------------------------------------------------

@pytest.mark.parametrize("how", ["release", "flush", "fsync"])
async def test_another_vfs_sees_what_is_committed(fs, cluster, how):  # noqa: F811
    data = _data(2 * CHUNK + 77)
    async with open_vfs(cluster) as other:
        fh, attr = await fs.create(b"f")
        await write_all(fs.vfs, fh, 0, data)
        await getattr(fs.vfs, how)(fh)
        # write-behind: a new file's close goes behind it, its fsync does not
        at_once = fs.mode != "write-behind" or how == "fsync"
        assert await _seen_by(other, fs, b"f", at_once=at_once) == data
        if how != "release":
            await fs.vfs.release(fh)


@pytest.mark.parametrize("size", ["small", "chunks"])
async def test_close_to_open_between_two_vfs(fs, cluster, size):  # noqa: F811
    n = SIZES[size]
    v1, v2, v3 = _data(n, 1), _data(n + 3, 2), _data(n // 2, 3)
    f = await fs.write(b"f", v1)
    async with open_vfs(cluster) as other:
        got = await _seen_by(other, fs, b"f", at_once=fs.mode != "write-behind")
        assert got == v1
        ino = (await other.lookup(fs.d, b"f")).ino
        held = await other.open(ino, RDONLY)  # open before the change: not asked to see it
        h = await fs.vfs.open(f.ino, WRONLY | os.O_TRUNC)
        await write_all(fs.vfs, h.fh, 0, v2)
        await fs.vfs.release(h.fh)
        assert await read_file(other, ino) == v2  # a new open sees the new bytes
        h = await other.open(ino, RDWR | os.O_TRUNC)  # and the other way round
        await write_all(other, h.fh, 0, v3)
        await other.flush(h.fh)
        assert await fs.read(f.ino) == v3
        await other.release(h.fh)
        await other.release(held.fh)
    assert await fs.read(f.ino) == v3


async def test_two_writers_on_two_vfs_do_not_lose_a_commit(fs, cluster):  # noqa: F811
    f = await fs.write(b"f", b"original")
    async with open_vfs(cluster) as other:
        mine = await fs.vfs.open(f.ino, RDWR)
        theirs = await other.open(f.ino, RDWR)
        await other.write(theirs.fh, 0, b"THEIRS")
        await other.release(theirs.fh)
        await fs.vfs.write(mine.fh, 0, b"mine")
        await expect(errno.ESTALE, fs.vfs.flush(mine.fh))  # theirs committed since our open
        try:
            await fs.vfs.release(mine.fh)
        except JPFSError as e:
            assert e.errno == errno.ESTALE
        assert await read_file(other, f.ino) == b"THEIRSal"  # nothing mixed, nothing lost
        again = await fs.vfs.open(f.ino, RDWR)  # reopened, it writes over the new version
        await fs.vfs.write(again.fh, 0, b"mine")
        await fs.vfs.release(again.fh)
        assert await read_file(other, f.ino) == b"mine" + b"THEIRSal"[4:]


async def test_fsync_returns_once_durable_and_visible(fs, cluster):  # noqa: F811
    async with open_vfs(cluster) as other:
        fh, attr = await fs.create(b"f")
        await fs.vfs.write(fh, 0, b"durable")
        await fs.vfs.fsync(fh)
        assert await read_file(other, (await other.lookup(fs.d, b"f")).ino) == b"durable"
        await fs.vfs.write(fh, 7, b"!")
        await fs.vfs.fsync(fh)
        assert await read_file(other, attr.ino) == b"durable!"
        await fs.vfs.release(fh)
        ro = await fs.vfs.open(attr.ino, RDONLY)
        await fs.vfs.fsync(ro.fh)  # nothing to commit: no error
        await fs.vfs.release(ro.fh)
        await fs.vfs.fsyncdir(fs.d)


# ---- setattr -------------------------------------------------------------------------------------

@pytest.mark.parametrize("open_writer", [False, True], ids=["closed", "open"])
async def test_truncate_down_and_up(fs, open_writer):
    data = _data(3 * CHUNK + 100)
    f = await fs.write(b"f", data)
    h = await fs.vfs.open(f.ino, RDWR) if open_writer else None
    for size in (2 * CHUNK + 10, CHUNK - 1, 5, 0):
        st = await fs.vfs.setattr(f.ino, {}, size)
        assert st.size == size and (await fs.vfs.getattr(f.ino)).size == size
        assert await fs.read(f.ino) == data[:size]
    st = await fs.vfs.setattr(f.ino, {}, 2 * CHUNK)  # up again: zeros, not the old bytes
    assert st.size == 2 * CHUNK
    assert await fs.read(f.ino) == bytes(2 * CHUNK)
    await fs.vfs.setattr(f.ino, {}, 0)
    if h is not None:
        await fs.vfs.write(h.fh, 0, b"abc")
        await fs.vfs.setattr(f.ino, {}, CHUNK + 1)  # ftruncate of written, uncommitted bytes
        assert await read_at(fs.vfs, h.fh, 0, CHUNK + 10) == b"abc" + bytes(CHUNK - 2)
        await fs.vfs.setattr(f.ino, {}, 2)
        await fs.vfs.release(h.fh)
        assert await fs.read(f.ino) == b"ab"


async def test_truncate_then_write_past_the_cut(fs):
    data = _data(2 * CHUNK)
    f = await fs.write(b"f", data)
    await fs.vfs.setattr(f.ino, {}, 10)
    h = await fs.vfs.open(f.ino, WRONLY)
    await fs.vfs.write(h.fh, 20, b"X")
    await fs.vfs.release(h.fh)
    assert await fs.read(f.ino) == data[:10] + bytes(10) + b"X"


async def test_truncate_errors(fs):
    f = await fs.write(b"f", b"abc")
    await expect(errno.EINVAL, fs.vfs.setattr(f.ino, {}, -1))
    sub = await fs.mkdir(b"sub")
    assert await errno_of(fs.vfs.setattr(sub.ino, {}, 0)) in (errno.EISDIR, errno.EINVAL)
    assert await fs.read(f.ino) == b"abc"


async def test_chmod_chown(fs):
    f = await fs.write(b"f", b"x")
    for mode in (0o600, 0o4711, 0o2755, 0o1777, 0o000):
        st = await fs.vfs.setattr(f.ino, {"mode": mode})
        assert st.mode == stat.S_IFREG | mode and (await fs.vfs.getattr(f.ino)).mode == st.mode
    st = await fs.vfs.setattr(f.ino, {"uid": 1234, "gid": 5678})
    assert (st.uid, st.gid) == (1234, 5678)
    st = await fs.vfs.setattr(f.ino, {"gid": GID})
    assert (st.uid, st.gid) == (1234, GID)
    sub = await fs.mkdir(b"sub")
    st = await fs.vfs.setattr(sub.ino, {"mode": 0o1777})
    assert st.mode == stat.S_IFDIR | 0o1777
    link = await fs.vfs.symlink(fs.d, b"l", b"f", UID, GID)
    st = await fs.vfs.setattr(link.ino, {"uid": 4321})  # lchown
    assert st.uid == 4321 and stat.S_ISLNK(st.mode)
    assert await fs.read(f.ino) == b"x"


async def test_times(fs):
    f = await fs.write(b"f", b"x")
    before = await fs.vfs.getattr(f.ino)
    st = await fs.vfs.setattr(f.ino, {"atime_ns": 1_000_000_001, "mtime_ns": 2_000_000_002})
    assert (st.atime_ns, st.mtime_ns) == (1_000_000_001, 2_000_000_002)
    assert st.ctime_ns > before.ctime_ns  # a change of the inode
    st2 = await fs.vfs.setattr(f.ino, {"mtime_ns": 3_000_000_000})  # atime omitted: kept
    assert (st2.atime_ns, st2.mtime_ns) == (1_000_000_001, 3_000_000_000)
    st3 = await fs.vfs.setattr(f.ino, {})  # chown(f, -1, -1): nothing, and ctime moves
    assert st3.ctime_ns > st2.ctime_ns and st3.mtime_ns == 3_000_000_000
    got = await fs.vfs.getattr(f.ino)
    assert (got.atime_ns, got.mtime_ns, got.ctime_ns) == (st3.atime_ns, st3.mtime_ns,
                                                          st3.ctime_ns)


async def test_times_set_before_close_stay(fs, cluster):  # noqa: F811
    """cp -p, rsync, tar: write, set the times through the open file, then close."""
    fh, attr = await fs.create(b"f")
    await write_all(fs.vfs, fh, 0, _data(CHUNK + 1))
    await fs.vfs.setattr(attr.ino, {"atime_ns": 5_000_000_000, "mtime_ns": 6_000_000_000})
    await fs.vfs.release(fh)
    st = await fs.vfs.getattr(attr.ino)
    assert (st.atime_ns, st.mtime_ns, st.size) == (5_000_000_000, 6_000_000_000, CHUNK + 1)
    async with open_vfs(cluster) as other:
        st = await other.getattr(attr.ino)
        assert (st.mtime_ns, st.size) == (6_000_000_000, CHUNK + 1)
        assert await read_file(other, attr.ino) == _data(CHUNK + 1)


async def test_a_write_moves_mtime(fs):
    f = await fs.write(b"f", b"x")
    await fs.vfs.setattr(f.ino, {"mtime_ns": 1_000_000_000})
    h = await fs.vfs.open(f.ino, WRONLY)
    await fs.vfs.write(h.fh, 0, b"y")
    await fs.vfs.release(h.fh)
    st = await fs.vfs.getattr(f.ino)
    assert st.mtime_ns > 1_000_000_000 and st.ctime_ns >= st.mtime_ns


async def test_setattr_of_nothing_there(fs):
    f = await fs.write(b"f", b"x")
    await fs.vfs.unlink(fs.d, b"f")
    fs.vfs.forget([(f.ino, 1 << 20)])
    await expect(errno.ENOENT, fs.vfs.setattr(f.ino, {"mode": 0o600}))


# ---- fallocate -----------------------------------------------------------------------------------

async def test_fallocate(fs):
    fh, attr = await fs.create(b"f", flags=os.O_CREAT | RDWR)
    await fs.vfs.write(fh, 0, b"abc")
    await fs.vfs.fallocate(fh, 0, 0, 2 * CHUNK)  # grows, reading zeros
    assert (await fs.vfs.getattr(attr.ino)).size == 2 * CHUNK
    await fs.vfs.fallocate(fh, FALLOC_FL_KEEP_SIZE, 0, 5 * CHUNK)
    assert (await fs.vfs.getattr(attr.ino)).size == 2 * CHUNK
    await fs.vfs.fallocate(fh, 0, 1, 2)  # inside: nothing changes
    assert (await fs.vfs.getattr(attr.ino)).size == 2 * CHUNK
    for off, n in ((0, 0), (-1, 10), (0, -5)):
        await expect(errno.EINVAL, fs.vfs.fallocate(fh, 0, off, n))
    await expect(errno.EOPNOTSUPP,
                 fs.vfs.fallocate(fh, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 1))
    await fs.vfs.release(fh)
    assert await fs.read(attr.ino) == b"abc" + bytes(2 * CHUNK - 3)


# ---- random operations against a shadow ----------------------------------------------------------

MAX_SIZE = 6 * CHUNK + 777


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_operations_match_a_shadow(fs, seed):
    """fsx style: each step changes the file through the VFS and a bytearray alike; every read,
    and the size after every step, must match (tests/test_fuse_random_ops.py, without the
    kernel)."""
    rng = random.Random(seed)
    fh, attr = await fs.create(b"f", flags=os.O_CREAT | RDWR)
    ino = attr.ino
    shadow = bytearray()
    reader = (await fs.vfs.open(ino, RDONLY)).fh
    log: list[str] = []
    try:
        for _ in range(250):
            op = rng.choices(["write", "read", "read other", "truncate", "fallocate", "flush",
                              "fsync", "reopen"], [30, 20, 8, 8, 4, 4, 3, 5])[0]
            off = rng.randrange(MAX_SIZE)
            n = rng.choice([1, 7, 511, 4096, CHUNK - 3, CHUNK + 9, rng.randrange(1, 3 * CHUNK)])
            n = max(1, min(n, MAX_SIZE - off))
            log.append(f"{op} off={off} n={n} size={len(shadow)}")
            if op == "write":
                data = rng.randbytes(n)
                assert await fs.vfs.write(fh, off, data) == n
                if off > len(shadow):
                    shadow.extend(bytes(off - len(shadow)))
                shadow[off:off + n] = data
            elif op in ("read", "read other"):
                got = bytes(await fs.vfs.read(fh if op == "read" else reader, off, n))
                assert got == bytes(shadow[off:off + n]), f"read {n} at {off}"
            elif op == "truncate":
                await fs.vfs.setattr(ino, {}, off)
                del shadow[off:]
                shadow.extend(bytes(off - len(shadow)))
            elif op == "fallocate":
                keep = rng.random() < 0.5
                await fs.vfs.fallocate(fh, FALLOC_FL_KEEP_SIZE if keep else 0, off, n)
                if not keep and off + n > len(shadow):
                    shadow.extend(bytes(off + n - len(shadow)))
            elif op == "flush":
                await fs.vfs.flush(fh)
            elif op == "fsync":
                await fs.vfs.fsync(fh)
            else:
                await fs.vfs.release(fh)
                fh = (await fs.vfs.open(ino, RDWR)).fh
            assert (await fs.vfs.getattr(ino)).size == len(shadow)
        await fs.vfs.release(fh)
        await fs.vfs.release(reader)
        assert await fs.read(ino) == bytes(shadow)
    except AssertionError as e:
        raise AssertionError(f"{e}\nlast steps:\n" + "\n".join(log[-12:])) from None


async def test_the_same_bytes_through_every_kind_of_open(fs, cluster):  # noqa: F811
    """Creates made with CREAT, RDWR and O_EXCL, and a file read back whole and in pieces."""
    data = _data(4 * CHUNK + 3)
    for i, flags in enumerate((CREAT, os.O_CREAT | RDWR, os.O_CREAT | os.O_EXCL | WRONLY)):
        fh, attr = await fs.create(b"f%d" % i, flags=flags)
        await write_all(fs.vfs, fh, 0, data)
        await fs.vfs.release(fh)
    await fs.vfs.fsyncdir(fs.d)
    async with open_vfs(cluster) as other:
        for i in range(3):
            ino = (await other.lookup(fs.d, b"f%d" % i)).ino
            assert await read_file(other, ino) == data
            h = await other.open(ino, RDONLY)
            pieces = [await read_at(other, h.fh, off, 4096) for off in range(0, len(data), 4096)]
            await other.release(h.fh)
            assert b"".join(pieces) == data
