"""The shard's side of directory write leases (daemon/meta/leases.py), spoken to as a mount
would: one session at a time holds a directory; another client's change of its names recalls
the lease and runs once it is given back (or taken back); a batch commits files with the inode
numbers the lease reserved and refuses any other; a session whose calls stop loses its leases;
a session that believes it holds a lease the shard does not is told at once; and malformed
requests get clear errors while the shard serves on."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import trio

from jpfs import config
from jpfs.client.wire.meta import MetaClient
from jpfs.errors import JPFSError
from jpfs.placement import make_ino, shard_of


@pytest.fixture(scope="module")
def cluster(meta_cluster):
    return config.load(meta_cluster)


def _run(cluster, scenario):
    async def main():
        async with trio.open_nursery() as nursery:
            meta = MetaClient(nursery, cluster)
            try:
                await scenario(meta, nursery)
            finally:
                meta.close()
                nursery.cancel_scope.cancel()
    trio.run(main)


async def _dir(meta: MetaClient, name: str) -> int:
    return (await meta.mkdir(1, name.encode(), 0o755)).attr.ino


async def _leased_dir(meta: MetaClient, name: str) -> tuple[int, bytes, int]:
    """A new directory, a session holding its lease, and the lease's first inode number."""
    d = await _dir(meta, name)
    me = os.urandom(16)
    lease = await meta.lease(d, me)
    assert lease.granted
    return d, me, make_ino(shard_of(d), lease.first)


def _entry(name: str, ino: int, t: int = 1_700_000_000_000_000_000) -> list:
    return [name.encode(), ino, stat.S_IFREG | 0o644, 0, 0, t]


def test_a_lease_reserves_inodes_and_a_batch_makes_the_files(cluster):
    async def scenario(meta: MetaClient, nursery):
        d = await _dir(meta, "lease-batch")
        await meta.create(d, b"before", 0o644)
        me = os.urandom(16)
        lease = await meta.lease(d, me)
        assert lease.granted and lease.names == [b"before"] and lease.n_inodes > 0
        assert not (await meta.lease(d, os.urandom(16))).granted  # one holder at a time
        inos = [make_ino(shard_of(d), lease.first + i) for i in range(3)]
        got = await meta.create_batch(d, me, [_entry("a", inos[0]), _entry("b", inos[1]),
                                              _entry("before", inos[2])])
        assert [g.ino for g in got[:2]] == inos[:2] and got[0].mode == stat.S_IFREG | 0o644
        assert isinstance(got[2], OSError) and got[2].errno == errno.EEXIST
        # a retry of an entry already made answers its attributes (the answer was lost)
        again = await meta.create_batch(d, me, [_entry("a", inos[0])])
        assert again[0].ino == inos[0]
        # inode numbers the shard never reserved, malformed entries, other file types
        bad = await meta.create_batch(d, me, [
            _entry("c", make_ino(shard_of(d), lease.first + lease.n_inodes + 10_000)),
            [b"d"], _entry("e", inos[1]),
            [b"f", inos[2], stat.S_IFLNK | 0o777, 0, 0, 1], _entry("x/y", inos[2]),
            [b"a", inos[1]], [b"nothing", inos[2]], [b"a", "x"]])
        assert [e.errno for e in bad] == [errno.EINVAL, errno.EINVAL, errno.EEXIST,
                                          errno.EINVAL, errno.EINVAL,
                                          errno.ENOENT, errno.ENOENT, errno.EINVAL]
        assert sorted(e.name for e in await _listing(meta, d)) == [b"a", b"b", b"before"]
        # the first commit of a file can go with its create; removes go ahead of creates
        blobs = await meta.create_batch(d, me, [_entry("g", inos[2]) + [0, []]])
        assert blobs[0].size == 0 and blobs[0].version == 1
        gone = await meta.create_batch(d, me, [[b"b", inos[1]]])
        assert gone[0].nlink == 0
        assert sorted(e.name for e in await _listing(meta, d)) == [b"a", b"before", b"g"]
        assert await meta.lease_return(d, me) and not await meta.lease_return(d, me)

    _run(cluster, scenario)


def test_a_lease_holder_makes_and_removes_directories_on_every_shard_in_batches(cluster):
    """Directories a lease holder answered: those placed on the directory's shard go in its
    ``create_batch``, those placed on another shard (inode numbers ``reserve``d there) in one
    cross-shard ``dir_batch``, each leased to the session from birth, and so are removals of
    empty ones; a retry answers what was
    done; bad entries are refused one by one, an inode number never reserved or a directory
    not empty fails the batch, and nothing half-done is left."""
    async def scenario(meta: MetaClient, nursery):
        d, me, first = await _leased_dir(meta, "lease-mkdir")
        here = shard_of(d)
        other = (here + 1) % meta.n_shards  # the module's cluster has three
        t = 1_700_000_000_000_000_000
        made = await meta.create_batch(d, me, [[b"near", first, stat.S_IFDIR | 0o750, 7, 8, t]])
        assert (made[0].mode, made[0].nlink, made[0].uid, made[0].gid) == (
            stat.S_IFDIR | 0o750, 2, 7, 8)
        start = await meta.reserve(other, 4)
        far = [make_ino(other, start + i) for i in range(4)]
        got = await meta.dir_batch(d, me, [
            [b"far", far[0], stat.S_IFDIR | 0o700, 7, 8, t],
            [b"near", far[1], stat.S_IFDIR | 0o700, 7, 8, t],   # the name is taken
            [b"bad", first, stat.S_IFDIR | 0o700, 7, 8, t],     # placed on this shard
            [b"file", far[2], stat.S_IFREG | 0o644, 7, 8, t],   # not a directory
            [b"x/y", far[2], stat.S_IFDIR | 0o700, 7, 8, t],    # not a name
            [b"short"]])
        assert got[0].ino == far[0] and got[0].mode == stat.S_IFDIR | 0o700
        assert [g.errno for g in got[1:]] == [errno.EEXIST, errno.EINVAL, errno.EINVAL,
                                              errno.EINVAL, errno.EINVAL]
        again = await meta.dir_batch(d, me, [[b"far", far[0], stat.S_IFDIR | 0o700, 7, 8, t]])
        assert again[0].ino == far[0]  # a retry after a lost answer
        with pytest.raises(JPFSError) as e:  # never reserved there: nothing of it is made
            await meta.dir_batch(d, me, [
                [b"new", far[3], stat.S_IFDIR | 0o700, 7, 8, t],
                [b"unreserved", make_ino(other, start + 100_000), stat.S_IFDIR, 7, 8, t]])
        assert e.value.errno == errno.EINVAL
        for n in (0, 1 << 20, "4"):
            with pytest.raises(JPFSError) as e:
                await meta.reserve(other, n)
            assert e.value.errno == errno.EINVAL
        assert sorted(e.name for e in await _listing(meta, d)) == [b"far", b"near"]
        assert (await meta.getattr(d)).nlink == 4
        assert (await meta.getattr(far[0])).nlink == 2
        for new in (first, far[0]):  # leased to their maker from birth, on their own shards
            assert not (await meta.lease(new, os.urandom(16))).granted
            assert await meta.lease_return(new, me)
        await meta.mkdir(far[0], b"inside")  # a directory like any other
        # removals: one found not empty fails its batch whole
        with pytest.raises(JPFSError) as e:
            await meta.dir_batch(d, me, [[b"far", far[0]]])
        assert e.value.errno == errno.ENOTEMPTY
        bad = await meta.create_batch(d, me, [[b"far", far[0]]])  # not on this shard
        assert bad[0].errno == errno.EXDEV
        await meta.rmdir(far[0], b"inside")
        gone = await meta.dir_batch(d, me, [[b"far", far[0]], [b"near", far[1]],
                                            [b"near", first]])
        assert gone[0].ino == d and gone[0].nlink == 3
        assert [g.errno for g in gone[1:]] == [errno.ENOENT, errno.EINVAL]
        assert (await meta.dir_batch(d, me, [[b"far", far[0]]]))[0].ino == d  # a retry
        here_gone = await meta.create_batch(d, me, [[b"near", first]])
        assert here_gone[0].ino == d and here_gone[0].nlink == 2
        assert await _listing(meta, d) == []
        for ino in (far[0], first):
            with pytest.raises(JPFSError) as e:
                await meta.getattr(ino)
            assert e.value.errno == errno.ENOENT
        # a lease given back on the session's next lease_wait (as idle ones are)
        assert (await meta.lease(d, me)).granted
        assert await meta.lease_wait(here, me, [], 0.01, [d]) == []
        assert (await meta.lease(d, os.urandom(16))).granted and here != other

    _run(cluster, scenario)


def test_a_batch_renames_files_in_order_and_refuses_what_no_longer_matches(cluster):
    """Renames answered from a lease reach the shard in a batch, in the order they were made:
    a rename that replaces a file takes a link from it, one whose names no longer match what
    the holder saw is refused (the rest of the batch still applies), and a retry of a rename
    already made answers its attributes."""
    async def scenario(meta: MetaClient, nursery):
        d, me, first = await _leased_dir(meta, "lease-rename-order")
        a, b, c = first, first + 1, first + 2
        made = await meta.create_batch(d, me, [_entry("a", a), _entry("b", b), _entry("c", c)])
        assert [m.ino for m in made] == [a, b, c]
        got = await meta.create_batch(d, me, [
            [b"a", b"t", a, 0],  # a swap through a temporary name, then a chain
            [b"b", b"a", b, 0],
            [b"t", b"b", a, 0],
            [b"c", b"x", c, 0],
            [b"x", b"a", c, b],  # over a file: b loses its only link
            _entry("c", first + 3)])  # the old name made again after it left
        assert [g.ino for g in got] == [a, b, a, c, c, first + 3], got
        assert sorted((e.name, e.ino) for e in await _listing(meta, d)) == [
            (b"a", c), (b"b", a), (b"c", first + 3)]
        with pytest.raises(JPFSError) as e:
            await meta.getattr(b)
        assert e.value.errno == errno.ENOENT
        # a retry of a rename already made (its answer was lost) answers its attributes
        assert (await meta.create_batch(d, me, [[b"x", b"a", c, b]]))[0].ino == c
        bad = await meta.create_batch(d, me, [
            [b"b", b"z", c, 0],  # b is not c
            [b"b", b"a", a, 0],  # a exists and the holder did not say so
            [b"b", b"zz", a, c],  # zz is not c
            [b"b", b"b", a, 0], [b"b", b"q", a], [b"b", b"x/y", a, 0], [b"b", b"q", "a", 0],
            [b"b", b"q", a, 0]])  # and one that still applies
        assert [x.errno if isinstance(x, OSError) else x.ino for x in bad] == [
            errno.ENOENT, errno.EEXIST, errno.ENOENT, errno.EINVAL, errno.EINVAL, errno.EINVAL,
            errno.EINVAL, a]
        assert await meta.lease_return(d, me)
        sub = await meta.mkdir(d, b"sub", 0o755)
        me2 = os.urandom(16)
        assert (await meta.lease(d, me2)).granted
        nodir = await meta.create_batch(d, me2, [[b"sub", b"s2", sub.attr.ino, 0],
                                                 [b"q", b"sub", a, sub.attr.ino]])
        assert [x.errno for x in nodir] == [errno.EINVAL, errno.EISDIR]
        assert sorted(e.name for e in await _listing(meta, d)) == [b"a", b"c", b"q", b"sub"]

    _run(cluster, scenario)


async def _listing(meta: MetaClient, d: int) -> list:
    out = []
    async for e in meta.readdir(d, plus=False, page=100):
        out.append(e)
    return out


def test_another_clients_change_recalls_the_lease_and_waits_for_it(cluster):
    async def scenario(meta: MetaClient, nursery):
        d, me, ino = await _leased_dir(meta, "lease-recall")
        made = trio.Event()

        async def theirs():
            await meta.create(d, b"theirs", 0o644)
            made.set()

        nursery.start_soon(theirs)
        with trio.fail_after(5):
            assert await meta.lease_wait(shard_of(d), me, [d], 5.0) == [d]
        await trio.sleep(0.05)
        assert not made.is_set()  # it waits while the holder commits what it has
        assert (await meta.create_batch(d, me, [_entry("mine", ino)]))[0].ino == ino
        await meta.lease_return(d, me)
        with trio.fail_after(5):
            await made.wait()
        assert sorted(e.name for e in await _listing(meta, d)) == [b"mine", b"theirs"]
        # a session that believes it holds a lease the shard does not is told at once
        with trio.fail_after(2):
            assert await meta.lease_wait(shard_of(d), me, [d], 5.0) == [d]
        # and with nothing recalled a wait ends empty after its time
        assert await meta.lease_wait(shard_of(d), me, [], 0.1) == []

    _run(cluster, scenario)


def test_the_holders_own_rename_passes_its_lease_and_anothers_recalls_it(cluster):
    async def scenario(meta: MetaClient, nursery):
        d, me, ino = await _leased_dir(meta, "lease-rename")
        assert (await meta.create_batch(d, me, [_entry("a", ino)]))[0].ino == ino
        with trio.fail_after(2):  # no recall: answered at once
            await meta.rename(d, b"a", d, b"b", session=me)
        assert await meta.lease_wait(shard_of(d), me, [d], 0.1) == []  # still held
        moved = trio.Event()

        async def theirs():
            await meta.rename(d, b"b", d, b"c", session=os.urandom(16))
            moved.set()

        nursery.start_soon(theirs)
        with trio.fail_after(5):
            assert await meta.lease_wait(shard_of(d), me, [d], 5.0) == [d]
        assert not moved.is_set()
        await meta.lease_return(d, me)
        with trio.fail_after(5):
            await moved.wait()
        assert [e.name for e in await _listing(meta, d)] == [b"c"]

    _run(cluster, scenario)


def test_a_session_that_stops_calling_loses_its_leases(cluster):
    async def scenario(meta: MetaClient, nursery):
        d = await _dir(meta, "lease-orphan")
        gone = os.urandom(16)
        assert (await meta.lease(d, gone)).granted  # and never a lease_wait
        with trio.fail_after(20):
            await meta.create(d, b"after", 0o644)  # waits until the session expires
        assert (await meta.lease(d, os.urandom(16))).granted

    _run(cluster, scenario)


def test_bad_lease_requests_get_clear_errors(cluster):
    async def scenario(meta: MetaClient, nursery):
        d = await _dir(meta, "lease-bad")
        f = (await meta.create(d, b"file", 0o644))[0].ino
        with pytest.raises(JPFSError) as e:
            await meta.lease(f, os.urandom(16))
        assert e.value.errno == errno.ENOTDIR
        with pytest.raises(JPFSError) as e:
            await meta.create_batch(f, os.urandom(16), [])
        assert e.value.errno == errno.ENOTDIR
        for raw in (["not bytes", [], 1.0], [b"s", "not a list", 1.0], [b"s", [b"x"], 1.0],
                    [b"s", []], [b"s", [], 1.0, [b"x"]], [b"s", [], 1.0, "not a list"]):
            with pytest.raises(JPFSError) as e:
                await meta.call(shard_of(d), "lease_wait", *raw)
            assert e.value.errno == errno.EINVAL
        with pytest.raises(JPFSError) as e:
            await meta.call(shard_of(d), "rename", d, b"file", d, b"other", 0, None, "str")
        assert e.value.errno == errno.EINVAL
        assert (await meta.getattr(d)).ino == d  # the shard serves on

    _run(cluster, scenario)


def test_lease_traffic_under_concurrency_and_dropped_connections_leaves_the_shard_whole(
        cluster, meta_cluster):
    """Many sessions asking for the same directories, batching files and directories (placed on
    other shards, some removed again), waiting and returning at once, ordinary creates
    recalling them, malformed batches, and clients whose connections drop with a
    ``lease_wait`` in flight: every call gets an answer or an error, the shard serves on, every
    file any call reported made is there exactly once, and every directory is whole (its
    inode there, the parent's link count right)."""
    async def scenario(meta: MetaClient, nursery):
        dirs = [await _dir(meta, f"lease-stress-{i}") for i in range(3)]
        made: set[tuple[int, bytes]] = set()
        errors: list[str] = []

        async def holder(k: int) -> None:
            me = os.urandom(16)
            for round_ in range(15):
                d = dirs[(k + round_) % len(dirs)]
                try:
                    lease = await meta.lease(d, me)
                    if lease.granted:
                        names = [f"h{k}-{round_}-{i}".encode() for i in range(3)]
                        entries = [[n, make_ino(shard_of(d), lease.first + i),
                                    stat.S_IFREG | 0o600, 0, 0, 1] for i, n in enumerate(names)]
                        entries.append([b"bad"])  # malformed: its own error only
                        got = await meta.create_batch(d, me, entries)
                        for n, g in zip(names, got, strict=False):
                            if not isinstance(g, OSError):
                                made.add((d, n))
                        assert isinstance(got[-1], OSError) and got[-1].errno == errno.EINVAL
                        # a directory on another shard, then removed again or kept
                        other = (shard_of(d) + 1) % meta.n_shards
                        far = make_ino(other, await meta.reserve(other, 1))
                        name = f"hd{k}-{round_}".encode()
                        got = await meta.dir_batch(d, me, [[name, far, stat.S_IFDIR | 0o700,
                                                            0, 0, 1], [b"bad"]])
                        if not isinstance(got[0], OSError):
                            made.add((d, name))
                            if round_ % 2:
                                gone = await meta.dir_batch(d, me, [[name, far]])
                                if not isinstance(gone[0], OSError):
                                    made.discard((d, name))
                        assert isinstance(got[-1], OSError) and got[-1].errno == errno.EINVAL
                    await meta.lease_wait(shard_of(d), me, [d] if lease.granted else [], 0.01)
                    await meta.lease_return(d, me)
                except JPFSError as e:
                    errors.append(f"holder {k}: {e}")

        async def creator(k: int) -> None:
            for i in range(20):
                d = dirs[i % len(dirs)]
                n = f"c{k}-{i}".encode()
                await meta.create(d, n, 0o644)  # recalls whoever holds d
                made.add((d, n))

        async def dropper(k: int) -> None:
            for _ in range(5):
                async with trio.open_nursery() as inner:
                    other = MetaClient(inner, cluster)
                    me = os.urandom(16)
                    d = dirs[k % len(dirs)]
                    await other.lease(d, me)
                    with trio.move_on_after(0.05):
                        await other.lease_wait(shard_of(d), me, [d], 5.0)
                    other.close()  # the connection drops; the shard takes the lease back
                    inner.cancel_scope.cancel()

        async def garbage() -> None:
            for raw in (["create_batch", dirs[0], b"s", "x"], ["lease", dirs[0]],
                        ["lease_wait", b"s", [dirs[0]], -1.0],
                        ["create_batch", dirs[0], b"s", [[b"n", 2 ** 64 - 1, 0, 0, 0, 0]]],
                        ["dir_batch", dirs[0], b"s", "x"], ["reserve", -1], ["reserve", "x"],
                        ["dir_batch", dirs[0], b"s", [[b"n", 2 ** 64 - 1]]],
                        ["dir_batch", dirs[0], b"s", [[b"n", 1, stat.S_IFDIR, 0, 0, 0]] * 5000]):
                try:
                    await meta.call(shard_of(dirs[0]), *raw)
                except JPFSError:
                    pass

        with trio.fail_after(120):
            async with trio.open_nursery() as crowd:
                for k in range(6):
                    crowd.start_soon(holder, k)
                for k in range(3):
                    crowd.start_soon(creator, k)
                for k in range(3):
                    crowd.start_soon(dropper, k)
                crowd.start_soon(garbage)
        assert not errors, errors[:5]
        for d in dirs:
            listing = await _listing(meta, d)
            names = [e.name for e in listing]
            assert len(names) == len(set(names))
            assert {n for dd, n in made if dd == d} <= set(names)
            subdirs = [e for e in listing if e.is_dir]
            for e in subdirs:  # each made whole: its inode on its shard, an empty directory
                assert (await meta.getattr(e.ino)).nlink == 2
            assert (await meta.getattr(d)).nlink == 2 + len(subdirs)
        info = await meta.shard_info(0)
        assert info.leases_granted >= 1 and (await meta.getattr(1)).ino == 1

    _run(cluster, scenario)
    for log in (meta_cluster / "logs").glob("meta-*.log"):
        assert "Traceback" not in log.read_text(), log  # every failure was an answer
