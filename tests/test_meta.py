"""Every metadata operation and its errors, end to end against 3 real shard processes."""

from __future__ import annotations

import errno
import itertools
import stat
import uuid

import pytest

from jpfs import localcluster
from jpfs.placement import new_dir_shard, shard_of
from jpfs.proto.meta import RENAME_EXCHANGE, RENAME_NOREPLACE, XATTR_CREATE, XATTR_REPLACE


def _errno(excinfo) -> int:
    return excinfo.value.errno


@pytest.fixture
def base(client):
    d = f"/t-{uuid.uuid4().hex[:8]}"
    client.mkdir(d)
    return d


def names_on_shards(client, parent: str, shards=3):
    """Directory names under ``parent`` that land on each shard (cross-shard cases)."""
    pino = client.stat(parent).ino
    found = {}
    for i in itertools.count():
        name = f"d{i}"
        found.setdefault(new_dir_shard(pino, name.encode(), shards), name)
        if len(found) == shards:
            return found


def test_root_and_mkdir_spread_over_shards(client, base):
    assert client.stat("/").is_dir and client.stat("/").ino == 1
    names = names_on_shards(client, base)
    for shard, name in names.items():
        attr = client.mkdir(f"{base}/{name}")
        assert shard_of(attr.ino) == shard and attr.is_dir and attr.nlink == 2
    assert sorted(client.listdir(base)) == sorted(names.values())
    assert client.stat(base).nlink == 2 + 3
    with pytest.raises(FileExistsError):
        client.mkdir(f"{base}/{names[0]}")
    with pytest.raises(FileNotFoundError):
        client.mkdir(f"{base}/missing/x")


def test_create_files_live_with_their_parent(client, base):
    sub = names_on_shards(client, base)
    for shard, name in sub.items():
        client.mkdir(f"{base}/{name}")
        attr = client.create(f"{base}/{name}/f", 0o640)
        assert shard_of(attr.ino) == shard
        assert attr.is_reg and attr.size == 0 and attr.nlink == 1
        assert stat.S_IMODE(attr.mode) == 0o640 & ~client.aclient.umask
    with pytest.raises(FileExistsError):
        client.create(f"{base}/{sub[0]}/f")
    client.create(f"{base}/{sub[0]}/f", exclusive=False)  # O_CREAT without O_EXCL
    with pytest.raises(NotADirectoryError):
        client.create(f"{base}/{sub[0]}/f/g")


@pytest.mark.parametrize("bad,err", [
    ("a/b", errno.ENOENT),
    ("x" * 256, errno.ENAMETOOLONG),
])
def test_invalid_names(client, base, bad, err):
    with pytest.raises(OSError) as e:
        client.mkdir(f"{base}/{bad}")
    assert _errno(e) == err


def test_names_checked_by_the_server(client, base):
    meta = client.aclient.meta
    parent = client.stat(base).ino
    for bad, err in ((b".", errno.EINVAL), (b"..", errno.EINVAL), (b"a\0b", errno.EINVAL),
                     (b"a/b", errno.EINVAL), (b"", errno.EINVAL), (b"y" * 256,
                                                                     errno.ENAMETOOLONG)):
        with pytest.raises(OSError) as e:
            client.run(lambda ac, n=bad: ac.meta.mkdir(parent, n))
        assert _errno(e) == err, bad
        with pytest.raises(OSError) as e:
            client.run(lambda ac, n=bad: ac.meta.create(parent, n, 0o644))
        assert _errno(e) == err, bad
    assert meta is not None


def test_unlink_and_rmdir_errors(client, base):
    client.mkdir(f"{base}/d")
    client.create(f"{base}/d/f")
    with pytest.raises(OSError) as e:
        client.remove(f"{base}/d")
    assert _errno(e) == errno.EISDIR
    with pytest.raises(OSError) as e:
        client.rmdir(f"{base}/d")
    assert _errno(e) == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        client.rmdir(f"{base}/d/f")
    with pytest.raises(FileNotFoundError):
        client.remove(f"{base}/d/nope")
    client.remove(f"{base}/d/f")
    client.rmdir(f"{base}/d")
    assert client.listdir(base) == []
    assert client.stat(base).nlink == 2


def test_rmdir_of_directory_on_another_shard(client, base):
    for name in names_on_shards(client, base).values():
        client.mkdir(f"{base}/{name}")
        client.mkdir(f"{base}/{name}/inner")
        with pytest.raises(OSError) as e:
            client.rmdir(f"{base}/{name}")
        assert _errno(e) == errno.ENOTEMPTY
        client.rmdir(f"{base}/{name}/inner")
        client.rmdir(f"{base}/{name}")
    assert client.listdir(base) == [] and client.stat(base).nlink == 2


def test_rename_files_within_and_across_shards(client, base):
    dirs = names_on_shards(client, base)
    for name in dirs.values():
        client.mkdir(f"{base}/{name}")
    src = f"{base}/{dirs[0]}/f"
    ino = client.create(src).ino
    here = dirs[0]
    for a, b in itertools.permutations(dirs.values(), 2):
        client.rename(f"{base}/{here}/f", f"{base}/{a}/f")
        client.rename(f"{base}/{a}/f", f"{base}/{b}/f")
        assert client.stat(f"{base}/{b}/f").ino == ino
        assert not client.exists(f"{base}/{a}/f")
        client.rename(f"{base}/{b}/f", f"{base}/{dirs[0]}/f")
    client.rename(src, f"{base}/{dirs[0]}/g")  # same directory
    assert client.listdir(f"{base}/{dirs[0]}") == ["g"]


def test_rename_replaces_as_posix_says(client, base):
    client.mkdir(f"{base}/a")
    client.mkdir(f"{base}/b")
    client.create(f"{base}/a/f")
    victim = client.create(f"{base}/b/f").ino
    client.rename(f"{base}/a/f", f"{base}/b/f")  # replaces the file; victim's inode goes
    assert client.listdir(f"{base}/a") == [] and client.listdir(f"{base}/b") == ["f"]
    assert client.stat(f"{base}/b/f").ino != victim
    with pytest.raises(OSError) as e:
        client.run(lambda ac: ac.meta.getattr(victim))
    assert _errno(e) == errno.ENOENT
    client.mkdir(f"{base}/a/d")
    client.mkdir(f"{base}/b/d")
    client.rename(f"{base}/a/d", f"{base}/b/d")  # an empty directory may be replaced
    assert client.listdir(f"{base}/a") == [] and client.stat(f"{base}/a").nlink == 2
    assert client.stat(f"{base}/b").nlink == 3
    client.mkdir(f"{base}/a/d")
    client.create(f"{base}/b/d/x")
    with pytest.raises(OSError) as e:
        client.rename(f"{base}/a/d", f"{base}/b/d")
    assert _errno(e) == errno.ENOTEMPTY
    with pytest.raises(OSError) as e:
        client.rename(f"{base}/a/d", f"{base}/b/f")
    assert _errno(e) == errno.ENOTDIR
    with pytest.raises(OSError) as e:
        client.rename(f"{base}/b/f", f"{base}/a/d")
    assert _errno(e) == errno.EISDIR
    with pytest.raises(FileNotFoundError):
        client.rename(f"{base}/a/nope", f"{base}/b/x")
    with pytest.raises(FileNotFoundError):
        client.rename(f"{base}/b/f", f"{base}/nope/x")


def test_rename_directory_into_itself_is_refused(client, base):
    client.makedirs(f"{base}/a/b/c")
    for target in (f"{base}/a/x", f"{base}/a/b/x", f"{base}/a/b/c/x"):
        if target == f"{base}/a/x":
            continue
        with pytest.raises(OSError) as e:
            client.rename(f"{base}/a", target)
        assert _errno(e) == errno.EINVAL
    client.rename(f"{base}/a/b/c", f"{base}/c")  # moving up is fine
    client.rename(f"{base}/a", f"{base}/c/a")    # and into a sibling
    assert client.listdir(f"{base}/c/a") == ["b"]
    assert client.stat(f"{base}/c").nlink == 3 and client.stat(f"{base}").nlink == 3


def test_rename_flags(client, base):
    client.create(f"{base}/f")
    client.mkdir(f"{base}/d")
    with pytest.raises(FileExistsError):
        client.rename(f"{base}/f", f"{base}/d", flags=RENAME_NOREPLACE)
    fi, di = client.stat(f"{base}/f").ino, client.stat(f"{base}/d").ino
    client.rename(f"{base}/f", f"{base}/d", flags=RENAME_EXCHANGE)
    assert client.stat(f"{base}/f").ino == di and client.stat(f"{base}/d").ino == fi
    assert client.stat(f"{base}/f").is_dir
    with pytest.raises(FileNotFoundError):
        client.rename(f"{base}/f", f"{base}/none", flags=RENAME_EXCHANGE)
    with pytest.raises(OSError) as e:
        client.rename(f"{base}/f", f"{base}/d", flags=RENAME_EXCHANGE | RENAME_NOREPLACE)
    assert _errno(e) == errno.EINVAL
    client.rename(f"{base}/d", f"{base}/d")  # onto itself: nothing happens
    assert client.stat(f"{base}/d").ino == fi


def test_hard_links_count_across_shards(client, base):
    dirs = list(names_on_shards(client, base).values())
    for name in dirs:
        client.mkdir(f"{base}/{name}")
    ino = client.create(f"{base}/{dirs[0]}/f").ino
    for i, name in enumerate(dirs):
        attr = client.link(f"{base}/{dirs[0]}/f", f"{base}/{name}/l{i}")
        assert attr.ino == ino and attr.nlink == i + 2
    client.remove(f"{base}/{dirs[0]}/f")
    assert client.stat(f"{base}/{dirs[1]}/l1").nlink == 3
    with pytest.raises(PermissionError):
        client.link(f"{base}/{dirs[1]}", f"{base}/dl")
    with pytest.raises(FileExistsError):
        client.link(f"{base}/{dirs[1]}/l1", f"{base}/{dirs[2]}/l2")
    for i, name in enumerate(dirs):
        client.remove(f"{base}/{name}/l{i}")
    with pytest.raises(OSError) as e:
        client.run(lambda ac: ac.meta.getattr(ino))
    assert _errno(e) == errno.ENOENT


def test_symlinks(client, base):
    client.mkdir(f"{base}/real")
    client.create(f"{base}/real/f")
    client.symlink("real", f"{base}/rel")
    client.symlink(f"{base}/real/f", f"{base}/abs")
    assert client.readlink(f"{base}/rel") == "real"
    assert client.stat(f"{base}/rel/f").is_reg          # followed mid-path
    assert client.stat(f"{base}/abs").is_reg            # followed at the end
    assert client.lstat(f"{base}/abs").is_link
    assert client.lstat(f"{base}/abs").size == len(f"{base}/real/f")
    client.symlink("loop2", f"{base}/loop1")
    client.symlink("loop1", f"{base}/loop2")
    with pytest.raises(OSError) as e:
        client.stat(f"{base}/loop1")
    assert _errno(e) == errno.ELOOP
    with pytest.raises(OSError) as e:
        client.readlink(f"{base}/real")
    assert _errno(e) == errno.EINVAL


def test_setattr(client, base):
    client.create(f"{base}/f", 0o600)
    assert stat.S_IMODE(client.chmod(f"{base}/f", 0o4751).mode) == 0o4751
    assert stat.S_ISREG(client.stat(f"{base}/f").mode)
    a = client.chown(f"{base}/f", 1234, 5678)
    assert (a.uid, a.gid) == (1234, 5678)
    a = client.utime(f"{base}/f", (1_000_000_000, 2_000_000_000))
    assert (a.atime_ns, a.mtime_ns) == (1_000_000_000, 2_000_000_000)
    before = client.stat(f"{base}/f")
    a = client.truncate(f"{base}/f", 12345)
    assert a.size == 12345 and a.version == before.version + 1
    client.mkdir(f"{base}/d")
    with pytest.raises(IsADirectoryError):
        client.truncate(f"{base}/d", 1)


def test_xattrs(client, base):
    client.create(f"{base}/f")
    client.setxattr(f"{base}/f", "user.a", b"1")
    client.setxattr(f"{base}/f", "user.b", b"\x00\xff" * 100)
    assert client.getxattr(f"{base}/f", "user.b") == b"\x00\xff" * 100
    assert sorted(client.listxattr(f"{base}/f")) == ["user.a", "user.b"]
    with pytest.raises(FileExistsError):
        client.setxattr(f"{base}/f", "user.a", b"2", XATTR_CREATE)
    with pytest.raises(OSError) as e:
        client.setxattr(f"{base}/f", "user.c", b"2", XATTR_REPLACE)
    assert _errno(e) == errno.ENODATA
    client.removexattr(f"{base}/f", "user.a")
    with pytest.raises(OSError) as e:
        client.getxattr(f"{base}/f", "user.a")
    assert _errno(e) == errno.ENODATA
    with pytest.raises(OSError) as e:
        client.setxattr(f"{base}/f", "user.big", b"x" * (65 << 10))
    assert _errno(e) == errno.E2BIG


def test_readdir_pages_and_readdirplus(client, base):
    client.mkdir(f"{base}/many")
    parent = client.stat(f"{base}/many").ino
    names = [f"file-{i:05d}".encode() for i in range(2500)]
    for start in range(0, len(names), 1000):
        entries = [[n, 0o644, 0, 0, 0, 0, []] for n in names[start:start + 1000]]
        got = client.run(lambda ac, e=entries: ac.meta.bulk_create(parent, e))
        assert all(not isinstance(g, Exception) for g in got)
    for name in names_on_shards(client, f"{base}/many").values():
        client.mkdir(f"{base}/many/{name}")

    async def pages(ac):
        out = []
        async for e in ac.meta.readdir(parent, plus=True, page=700):
            out.append(e)
        return out

    entries = client.run(pages)
    listed = [e.name for e in entries]
    assert listed == sorted(listed) and len(listed) == 2503
    assert all(e.attr is not None and e.attr.ino == e.ino for e in entries)  # remote inodes too
    assert {shard_of(e.ino) for e in entries if e.attr.is_dir} == {0, 1, 2}


def test_stat_many_and_statfs(client, base):
    for i in range(10):
        client.create(f"{base}/f{i}")
    got = client.stat_many([f"{base}/f{i}" for i in range(10)] + [f"{base}/none", "/nope/x"])
    assert all(a.is_reg for a in got[:10])
    assert isinstance(got[10], FileNotFoundError) and isinstance(got[11], FileNotFoundError)
    totals = client.statfs()
    assert totals["inodes"] >= 11 and totals["dentries"] >= 11


def test_fsck_clean_after_everything(client, meta_cluster):
    from jpfs.client.tools.fsck import fsck

    report = client.run(lambda ac: fsck(ac.meta))
    assert report.clean, report.problems


def test_daemon_restart_keeps_namespace(make_cluster):
    import jpfs

    d = make_cluster(meta_shards=2, sync=True)
    with jpfs.connect(d) as c:
        c.makedirs("/x/y/z")
        c.create("/x/y/z/f")
    localcluster.down(d)
    localcluster.up(d)
    with jpfs.connect(d) as c:
        assert c.stat("/x/y/z/f").is_reg
        assert c.listdir("/x/y") == ["z"]
