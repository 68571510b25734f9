"""Directory write leases, as users see them: a mount filling a directory answers its creates at
once and commits them behind, and still every other client sees the files (at once after an
fsync of the directory, within milliseconds otherwise), another client's change in the
directory waits only for the lease to come back, two mounts writing one directory lose
nothing, and a killed mount's lease does not block the directory for long."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
from fuse_support import jpfs_cli, mounted, requires_fuse
from test_fuse_requests import _eventually

import jpfs
from jpfs import localcluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("leasecluster")
    localcluster.up(d, meta_shards=2, storage_nodes=1, sync=False)
    yield d
    localcluster.down(d, timeout=5)


def _fill(d, names, data: bytes = b"") -> None:
    for n in names:
        fd = os.open(d / n, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
        try:
            if data:
                os.write(fd, data + n.encode())
        finally:
            os.close(fd)


def _fsync_dir(d) -> None:
    """Return once every change in ``d`` is committed and durable (fsync of the directory)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@requires_fuse
def test_a_directory_filled_through_a_lease_is_what_every_client_sees(cluster, tmp_path):
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "fill"
        d.mkdir()
        empty = [f"e{i:03d}" for i in range(150)]
        full = [f"f{i:03d}" for i in range(150)]
        _fill(d, empty)
        _fill(d, full, b"payload:")
        leases = m.stats()["leases"]
        assert leases["granted"] >= 1 and leases["answered"] >= 250, leases
        # the mount itself: every name, its type and mode, its bytes, O_EXCL still exclusive
        assert sorted(os.listdir(d)) == sorted(empty + full)
        st = os.stat(d / "f007")
        assert st.st_mode == 0o100640 and st.st_size == len(b"payload:f007")
        assert (d / "f149").read_bytes() == b"payload:f149"
        with pytest.raises(FileExistsError):
            os.open(d / "e000", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        # after an fsync of the directory every name is committed, for every client
        _fsync_dir(d)
        assert sorted(c.listdir("/fill")) == sorted(empty + full)
        assert c.read_bytes("/fill/f042") == b"payload:f042"
        assert c.stat("/fill/e042").size == 0
        # a file written and closed is committed by its close, name and bytes together
        _fill(d, ["late"], b"closed:")
        assert c.read_bytes("/fill/late") == b"closed:late"
        # the directory's own attributes agree across clients once settled
        assert os.stat(d).st_nlink == c.stat("/fill").nlink


@requires_fuse
def test_another_clients_change_recalls_the_lease_and_loses_nothing(cluster, tmp_path):
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "shared"
        d.mkdir()
        mine = [f"m{i:03d}" for i in range(100)]
        _fill(d, mine)
        assert m.stats()["leases"]["held"] >= 1
        t0 = time.monotonic()
        c.write_bytes("/shared/theirs", b"theirs")  # waits for the lease to come back
        assert time.monotonic() - t0 < 5.0
        assert set(c.listdir("/shared")) == set(mine) | {"theirs"}
        m.wait_for(lambda s: s["leases"]["recalled"] >= 1 and s["leases"]["held"] == 0,
                   what="the lease given back")
        with pytest.raises(FileExistsError):
            os.open(d / "theirs", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        # their removal and rename of files this mount made under the lease
        c.remove("/shared/m000")
        c.rename("/shared/m001", "/shared/renamed")
        _eventually(lambda: not (d / "m000").exists(), "their removal is seen")
        _eventually(lambda: (d / "renamed").exists(), "their rename is seen")
        # and this mount's own changes in a leased directory: it gives the lease back first
        more = [f"n{i:03d}" for i in range(40)]
        _fill(d, more)
        os.unlink(d / "n000")
        os.rename(d / "n001", d / "n001.r")
        os.mkdir(d / "sub")
        assert sorted(c.listdir("/shared")) == sorted(
            set(mine) - {"m000", "m001"} | {"theirs", "renamed", "n001.r", "sub"}
            | set(more) - {"n000", "n001"})
        assert m.stats()["leases"]["failed"] == 0


@requires_fuse
def test_two_mounts_filling_one_directory_make_every_file(cluster, tmp_path):
    with mounted(cluster, tmp_path / "a") as a, mounted(cluster, tmp_path / "b") as b, \
            jpfs.connect(cluster, dir_cache_ttl=0) as c:
        (a / "both").mkdir()
        _eventually(lambda: (b / "both").is_dir(), "the directory is seen by the other mount")
        errors: list[BaseException] = []

        def writer(m, prefix: str) -> None:
            try:
                for i in range(300):
                    p = m / "both" / f"{prefix}{i:03d}"
                    with open(p, "wb") as f:
                        if i % 3 == 0:
                            f.write(p.name.encode())
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(a, "a")),
                   threading.Thread(target=writer, args=(b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for m in (a, b):
            _fsync_dir(m / "both")
        want = {f"{p}{i:03d}" for p in "ab" for i in range(300)}
        assert set(c.listdir("/both")) == want
        assert c.read_bytes("/both/b150") == b"b150" and c.read_bytes("/both/a297") == b"a297"
        assert a.stats()["leases"]["failed"] == 0 and b.stats()["leases"]["failed"] == 0


@requires_fuse
def test_a_killed_mounts_lease_does_not_hold_the_directory(cluster, tmp_path):
    with jpfs.connect(cluster, dir_cache_ttl=0) as c:
        with mounted(cluster, tmp_path / "m") as m:
            d = m / "orphan"
            d.mkdir()
            _fill(d, [f"k{i:03d}" for i in range(50)], b"kept:")  # closed: committed
            assert m.stats()["fuse"]["closes_behind"] == 0  # (not with --write-behind)
            assert m.stats()["leases"]["held"] >= 1
            os.kill(m.pid, signal.SIGKILL)
            t0 = time.monotonic()
            c.write_bytes("/orphan/after", b"after")  # the shard takes the lease back
            assert time.monotonic() - t0 < 20.0
        names = set(c.listdir("/orphan"))
        assert {f"k{i:03d}" for i in range(50)} | {"after"} <= names
        assert c.read_bytes("/orphan/k049") == b"kept:k049"


@requires_fuse
def test_unmount_commits_what_a_lease_answered_and_idle_leases_go_back(cluster, tmp_path):
    with jpfs.connect(cluster, dir_cache_ttl=0) as c:
        with mounted(cluster, tmp_path / "m") as m:
            (m / "idle").mkdir()
            _fill(m / "idle", [f"i{i:02d}" for i in range(20)])
            assert m.stats()["leases"]["held"] >= 1
            # a lease nobody uses goes back within seconds: another client then waits for
            # nothing
            m.wait_for(lambda s: s["leases"]["held"] == 0, timeout=20.0,
                       what="the idle lease given back")
            assert m.stats()["leases"]["idle_returned"] >= 1
            (m / "last").mkdir()
            names = [f"u{i:03d}" for i in range(200)]
            _fill(m / "last", names)
            jpfs_cli("umount", str(m.path))  # right away: what is pending is sent first
        assert sorted(c.listdir("/last")) == names
        assert len(c.listdir("/idle")) == 20


@requires_fuse
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_leases_on_replicated_shards_survive_a_leader_kill(tmp_path):
    """Shards in 3 copies: the leader grants the lease; killed with -9 while the mount fills
    the directory, the next leader knows no lease, the mount learns it and gives it back, and
    every file written and closed is there, whoever writes next."""
    from test_meta_replication import _leader

    c = tmp_path / "c"
    localcluster.up(c, meta_shards=1, storage_nodes=1, etcd=True, meta_replicas=3)
    try:
        with mounted(c, tmp_path / "m") as m, jpfs.connect(c, dir_cache_ttl=0) as other:
            d = m / "rep"
            d.mkdir()
            first = [f"a{i:03d}" for i in range(100)]
            _fill(d, first, b"one:")
            assert m.stats()["leases"]["granted"] >= 1
            victim = _leader(other, 0)
            localcluster.stop(c, "meta", 0, sig=signal.SIGKILL, replica=victim)
            assert _leader(other, 0) != victim
            second = [f"b{i:03d}" for i in range(100)]
            _fill(d, second, b"two:")  # through the failover
            other.write_bytes("/rep/theirs", b"theirs")
            _fsync_dir(d)
            assert set(other.listdir("/rep")) == set(first) | set(second) | {"theirs"}
            assert other.read_bytes("/rep/b099") == b"two:b099"
            assert m.stats()["leases"]["failed"] == 0
            localcluster.start(c, "meta", 0, replica=victim)
    finally:
        localcluster.down(c, timeout=5)


@requires_fuse
def test_removes_under_a_lease_are_what_every_client_sees(cluster, tmp_path):
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "rm"
        d.mkdir()
        names = [f"r{i:03d}" for i in range(120)]
        _fill(d, names, b"x:")
        for n in names[::2]:
            os.unlink(d / n)
        _fill(d, names[:20:2], b"again:")  # made again, after their removes
        # removed while open: still readable through the descriptor, nlink 0
        fd = os.open(d / "r001", os.O_RDONLY)
        try:
            os.unlink(d / "r001")
            assert os.fstat(fd).st_nlink == 0 and os.read(fd, 100) == b"x:r001"
        finally:
            os.close(fd)
        st = m.stats()["leases"]
        assert st["removes"] + st["cancelled"] >= 50 and st["failed"] == 0, st
        want = sorted(set(names[1::2]) - {"r001"} | set(names[:20:2]))
        assert sorted(os.listdir(d)) == want
        _fsync_dir(d)
        assert sorted(c.listdir("/rm")) == want
        assert c.read_bytes("/rm/r010") == b"again:r010"
        # rm -r of a tree another client wrote: listed, then removed from a lease
        c.makedirs("/theirs")
        for i in range(60):
            c.write_bytes(f"/theirs/t{i:02d}", b"t")
        for p in sorted((m / "theirs").iterdir()):
            p.unlink()
        (m / "theirs").rmdir()
        assert not c.exists("/theirs")
        assert m.stats()["leases"]["failed"] == 0


@requires_fuse
def test_names_under_a_lease_are_looked_up_from_it_with_attributes_as_old_as_they_are(
        cluster, tmp_path):
    """Once the kernel's entries expire, a name in a leased directory is looked up from the
    lease (no metadata call: what makes `rm` of many files fast), and the attributes it comes
    with are only as fresh as they are: another client's write shows in the next stat."""
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "lk"
        d.mkdir()
        names = [f"k{i:02d}" for i in range(12)]
        _fill(d, names, b"k:")
        _fsync_dir(d)
        c.write_bytes("/lk/k05", b"grown by another client")
        time.sleep(1.3)  # past the kernel's entry and attribute timeouts (1 s)
        before = m.stats()["leases"]["lookups"]
        assert os.stat(d / "k05").st_size == len(b"grown by another client")
        assert (d / "k05").read_bytes() == b"grown by another client"
        for n in names[6:]:
            os.unlink(d / n)
        st = m.stats()["leases"]
        assert st["lookups"] - before >= 7 and st["failed"] == 0, st
        _fsync_dir(d)
        assert sorted(c.listdir("/lk")) == names[:6]


@requires_fuse
def test_renames_in_a_leased_directory_keep_the_lease_and_every_client_sees_them(
        cluster, tmp_path):
    """The write-then-rename pattern (a file written under a temporary name, renamed over
    the real one) in a directory this mount holds the lease of: the renames go to the shard
    as the holder's (no recall, the lease stays), the lease's names follow them, and another
    client sees each final name with its final content."""
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "rn"
        d.mkdir()
        _fill(d, [f"e{i:02d}" for i in range(10)], b"old:")
        before = m.stats()["leases"]
        for i in range(10):
            (d / f"e{i:02d}.tmp").write_bytes(b"new:%d" % i)
            os.rename(d / f"e{i:02d}.tmp", d / f"e{i:02d}")  # replaces the old file
        os.rename(d / "e01", d / "moved")
        st = m.stats()["leases"]
        assert st["renames"] - before["renames"] == 11, st
        assert st["recalled"] == before["recalled"] and st["given_back"] == before["given_back"]
        os.unlink(d / "moved")  # answered from the lease's names, as the rename left them
        assert m.stats()["leases"]["removes"] == st["removes"] + 1
        os.link(d / "e00", d / "same")  # (a link gives the lease back: the shard's path)
        os.rename(d / "e00", d / "same")  # two links of one file: nothing happens
        want = sorted([f"e{i:02d}" for i in range(10) if i != 1] + ["same"])
        assert sorted(os.listdir(d)) == want
        assert (d / "e05").read_bytes() == b"new:5"
        _fsync_dir(d)
        assert sorted(c.listdir("/rn")) == want
        assert c.read_bytes("/rn/e05") == b"new:5" and c.read_bytes("/rn/same") == b"new:0"
        assert m.stats()["leases"]["failed"] == 0


@requires_fuse
def test_renames_answered_from_the_lease_land_in_the_order_they_were_made(cluster, tmp_path):
    """Renames, creates and unlinks answered from a lease reach the shard in the order the
    mount answered them: a chain of renames, a swap through a temporary name, a name renamed
    away and made again, a new file renamed over an old one, a file renamed and then removed,
    files renamed before they were committed. Another client then sees exactly the tree this
    mount shows, contents included, and the lease was never recalled."""
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "order"
        d.mkdir()
        _fill(d, [f"a{i}" for i in range(6)], b"v1:")
        _fsync_dir(d)
        before = m.stats()["leases"]
        os.rename(d / "a0", d / "b0")
        os.rename(d / "b0", d / "c0")
        os.rename(d / "a1", d / "tmp")
        os.rename(d / "a2", d / "a1")
        os.rename(d / "tmp", d / "a2")
        os.rename(d / "a3", d / "x")
        _fill(d, ["a3"], b"v2:")
        _fill(d, ["new"], b"v3:")
        os.rename(d / "new", d / "a4")
        os.rename(d / "a5", d / "gone")
        os.unlink(d / "gone")
        _fill(d, ["p", "q"])  # empty: not committed at their close
        os.rename(d / "q", d / "p")
        os.rename(d / "p", d / "r")
        local = {p.name: p.read_bytes() for p in d.iterdir()}
        assert local == {"c0": b"v1:a0", "a1": b"v1:a2", "a2": b"v1:a1", "x": b"v1:a3",
                         "a3": b"v2:a3", "a4": b"v3:new", "r": b""}
        st = m.stats()["leases"]
        assert st["renames_answered"] - before["renames_answered"] == 10, st
        assert st["recalled"] == before["recalled"] and st["failed"] == 0, st
        _fsync_dir(d)
        assert {n: c.read_bytes(f"/order/{n}") for n in c.listdir("/order")} == local
        assert os.stat(d / "a4").st_nlink == 1 and os.stat(d / "c0").st_size == 5


@requires_fuse
def test_write_behind_answers_closes_at_once_and_no_client_sees_a_file_without_its_bytes(
        cluster, tmp_path):
    """``--write-behind``: files written and closed in a leased directory are stored and
    committed behind their close. This mount reads each back at once; another client sees a
    file within milliseconds and never without its bytes; a rename and an unlink right after
    a close land in order; an fsync of the directory, and an unmount right after the closes,
    commit every file. A default mount (the kill test above) commits at close."""
    payload = {f"w{i:03d}": os.urandom(1000 + 37 * i) for i in range(200)}
    with jpfs.connect(cluster, dir_cache_ttl=0) as c:
        with mounted(cluster, tmp_path / "m", "--write-behind") as m:
            assert m.stats()["mount"]["write_behind"] is True
            d = m / "wb"
            d.mkdir()
            for name, data in payload.items():
                (d / name).write_bytes(data)
            assert (d / "w199").read_bytes() == payload["w199"]  # this mount, at once
            os.rename(d / "w000", d / "renamed")
            os.unlink(d / "w001")
            seen = []

            def whole_or_missing() -> bool:
                try:
                    seen.append(c.read_bytes("/wb/w198"))
                except FileNotFoundError:
                    return False
                return True

            _eventually(whole_or_missing, "another client sees a file closed behind")
            assert seen == [payload["w198"]]
            _fsync_dir(d)
            got = {n: c.read_bytes(f"/wb/{n}") for n in c.listdir("/wb")}
            want = {("renamed" if n == "w000" else n): v for n, v in payload.items()
                    if n != "w001"}
            assert got == want
            fuse = m.stats()["fuse"]
            assert fuse["closes_behind"] >= 150 and fuse["closes_behind_failed"] == 0, (
                fuse, m.stats()["leases"])
            (m / "wb-last").mkdir()
            for name, data in payload.items():
                (m / "wb-last" / name).write_bytes(data)
            jpfs_cli("umount", str(m.path))  # at once: what is behind is committed first
        assert {n: c.read_bytes(f"/wb-last/{n}") for n in c.listdir("/wb-last")} == payload


@requires_fuse
def test_write_behind_logs_a_store_that_fails_after_the_close_and_the_mount_goes_on(tmp_path):
    """With ``--write-behind`` a close is answered before the file's bytes are stored: when
    the store then fails (the only storage node is down) the mount logs it, counts it, keeps
    serving, still commits the file's name (without the bytes it could not store), and the
    next fsync of the directory fails with EIO, once; once the node is back, files written
    again are whole."""
    d = tmp_path / "c"
    localcluster.up(d, meta_shards=1, storage_nodes=1, sync=False)
    try:
        with mounted(d, tmp_path / "m", "--write-behind") as m, \
                jpfs.connect(d, dir_cache_ttl=0) as c:
            w = m / "w"
            w.mkdir()
            _fill(w, [f"ok{i}" for i in range(5)], b"stored:")  # the lease is taken here
            _fsync_dir(w)  # their closes were answered first: this waits for their bytes
            localcluster.stop(d, "storage", 0)
            (w / "late").write_bytes(b"not stored")  # close answered: the store fails behind
            m.wait_for(lambda s: s["fuse"]["closes_behind_failed"] >= 1, timeout=60.0,
                       what="the failed store counted")
            assert "could not store" in (tmp_path / "m.log").read_text()
            with pytest.raises(OSError) as lost:
                _fsync_dir(w)
            assert lost.value.errno == errno.EIO
            _fsync_dir(w)  # reported once
            assert sorted(os.listdir(w)) == sorted([f"ok{i}" for i in range(5)] + ["late"])
            assert c.stat("/w/late").size == 0  # its name without the bytes
            localcluster.start(d, "storage", 0, sync=False)
            _eventually(lambda: _writes(w / "again", b"again"), "the node is back")
            assert c.read_bytes("/w/again") == b"again"
            assert c.read_bytes("/w/ok4") == b"stored:ok4"
    finally:
        localcluster.down(d, timeout=5)


def _writes(path, data: bytes) -> bool:
    """Write ``path`` and fsync it before the close (so a failed store is this call's error,
    not one logged behind the close)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True


@requires_fuse
def test_directories_made_through_a_lease_are_what_every_client_sees(cluster, tmp_path):
    """``mkdir`` in a directory the mount holds the lease of is answered at once and committed
    behind, each new directory on the shard its name places it on; after an fsync of the
    parent every client sees the tree, link counts included, and a tree filled at once (the
    new directories' own creates first send them) lands whole."""
    with mounted(cluster, tmp_path / "m") as m, jpfs.connect(cluster, dir_cache_ttl=0) as c:
        d = m / "dirs"
        d.mkdir()
        _fill(d, ["a", "b", "c"])  # the lease
        names = [f"d{i:04d}" for i in range(600)]
        for n in names:
            (d / n).mkdir(mode=0o750)
        leases = m.stats()["leases"]
        assert leases["mkdirs"] >= 590 and leases["failed"] == 0, leases
        for n in names[:40]:  # filled at once, as tar -x does
            (d / n / "sub").mkdir()
            (d / n / "sub" / "f").write_bytes(n.encode())
        assert os.stat(d).st_nlink == 2 + len(names)
        _fsync_dir(d)
        assert sorted(c.listdir("/dirs")) == sorted(names + ["a", "b", "c"])
        assert c.stat("/dirs").nlink == 2 + len(names)
        st = c.stat("/dirs/d0007")
        assert stat.S_ISDIR(st.mode) and stat.S_IMODE(st.mode) == 0o750 & ~0o022
        assert st.nlink == 3
        assert c.read_bytes("/dirs/d0039/sub/f") == b"d0039"
        assert c.listdir("/dirs/d0500") == []
    res = jpfs_cli("--cluster", str(cluster), "fsck")
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr


@requires_fuse
def test_a_mount_killed_mid_mkdir_flood_leaves_fsck_clean(cluster, tmp_path):
    """Crash safety: a mount killed with -9 while a process makes directories through its
    lease loses at most those not yet committed (as a local filesystem loses what its journal
    had not), keeps every one an fsync of the parent covered, and leaves no half-made
    directory: fsck finds the namespace clean."""
    with jpfs.connect(cluster, dir_cache_ttl=0) as c:
        with mounted(cluster, tmp_path / "m") as m:
            d = m / "flood"
            d.mkdir()
            _fill(d, ["a", "b", "c"])
            synced = [f"s{i:04d}" for i in range(300)]
            for n in synced:
                (d / n).mkdir()
            _fsync_dir(d)
            script = ("import os, sys\n"
                      "for i in range(100000):\n"
                      "    os.mkdir(os.path.join(sys.argv[1], 'k%06d' % i))\n")
            proc = subprocess.Popen([sys.executable, "-c", script, str(d)],
                                    stderr=subprocess.DEVNULL)
            try:
                m.wait_for(lambda s: s["leases"]["mkdirs"] >= 2000, timeout=60.0,
                           what="the flood under way")
                os.kill(m.pid, signal.SIGKILL)
            finally:
                proc.wait(timeout=60)
            assert proc.returncode != 0  # it saw the mount go away
        got = set(c.listdir("/flood"))
        assert set(synced) <= got
        assert c.stat("/flood").nlink == 2 + len(got) - 3
    res = jpfs_cli("--cluster", str(cluster), "fsck")
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr
