"""Transparent retries: elections again and again (a shard's leader killed with SIGKILL and
restarted, a leader SIGSTOPped until another copy leads, etcd SIGSTOPped until every leader has
let its lease go) while two processes create, unlink, mkdir, rmdir and rename, across shards
(two-phase commits) and within them. Not one call fails, and the tree at the end is exactly
what the loops say it is.

Real daemons, real etcd, a real kernel mount: three copies of each of two shards; one loop calls
the native client, the other makes the same system calls through the mount. Every wait is on a
state (a new leader, copies that follow it, loops that made progress) with a deadline that
prints it; the faults last until the state they are there to cause has come about.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import pytest
import repl_support as rs
from fuse_support import mounted, requires_fuse

import jpfs
from jpfs import localcluster
from jpfs.placement import new_dir_shard

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow]

SHARDS = 2
COPIES = 3
ETCD_OUTAGE = 12.0
"""How long etcd stays stopped once every leader has stepped down (a fault's length, not a
wait: no shard can elect a leader meanwhile)."""

# One loop of changes per process, in its own tree /wN with a directory on each shard (a on
# shard 0, b on shard 1): a file's entry lives on its directory's shard, a new directory's
# inode on the shard its name hashes to, so half the mkdirs and rmdirs and every rename from a
# to b are two-phase commits; a directory moved between parents also takes shard 0's rename
# lock. Every call counts; a failed one is recorded and ends the loop (what it did is unknown).
WORKER = r"""
import json, os, sys, time, traceback
import jpfs
from repl_support import LoopProgress

cluster_file, top, stop_file, out, where = sys.argv[1:6]
if where == "native":
    client = jpfs.connect(cluster_file)
    root = ""
    mkdir, create, rename = client.mkdir, client.create, client.rename
    rmdir, unlink = client.rmdir, client.unlink
else:  # through the mount at ``where``: the calls a program makes
    client = None
    root = where
    mkdir, rename, rmdir, unlink = os.mkdir, os.rename, os.rmdir, os.unlink

    def create(path):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

a, b = f"{top}/a", f"{top}/b"
expect = set()
done = LoopProgress(out)
slowest = [0.0, ""]

def call(what, fn, *args):
    t0 = time.monotonic()
    fn(*(root + arg for arg in args))
    took = time.monotonic() - t0
    done.calls += 1
    if took > slowest[0]:
        slowest[:] = [took, f"{what} {args[0]}"]

i = 0
try:
    while not os.path.exists(stop_file):
        d, f, g = f"{a}/d{i}", f"{b}/f{i}", f"{a}/g{i}"
        call("mkdir", mkdir, d)
        call("create", create, f"{d}/x")
        call("rename", rename, f"{d}/x", f)          # out of d: often across shards
        call("rename", rename, d, f"{b}/d{i}")       # a directory between parents
        call("rmdir", rmdir, f"{b}/d{i}")
        if i % 3 == 0:
            call("unlink", unlink, f)
        else:
            expect.add(f)
        call("create", create, g)
        if i % 2:
            call("unlink", unlink, g)
        else:
            expect.add(g)
        i += 1
        done.write()
except OSError as e:
    done.failures.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
finally:
    done.write()
    with open(out, "w") as fh:
        json.dump({"calls": done.calls, "loops": i, "failures": done.failures,
                   "expect": sorted(expect), "slowest": slowest}, fh)
    if client is not None:
        client.close()
"""


@requires_fuse
@pytest.mark.fuse
def test_elections_again_and_again_fail_no_call(tmp_path):
    d = tmp_path / "cluster"
    c = localcluster.up(d, meta_shards=SHARDS, storage_nodes=1, etcd=True,
                        meta_replicas=COPIES)
    etcd = rs.pid(d, "etcd")
    stopped: list[int] = []
    mount = contextlib.ExitStack()
    try:
        mp = mount.enter_context(mounted(localcluster.cluster_file(d), tmp_path / "mnt")).path
        client = jpfs.connect(c)
        tops = ["/w0", "/w1"]
        for top in tops:
            ino = client.mkdir(top).ino
            # a's entries on shard 0, b's on shard 1 (a directory's inode: its name's hash)
            for want, stem in ((0, "a"), (1, "b")):
                name = next(f"{stem}{k}" for k in range(1000)
                            if new_dir_shard(ino, f"{stem}{k}".encode(), SHARDS) == want)
                client.mkdir(f"{top}/{name}")
                client.rename(f"{top}/{name}", f"{top}/{stem}")
        rs.steady(c)
        before = rs.elections(d)
        # one loop through the native client, one through the mount
        loops = mount.enter_context(rs.Loops(WORKER, d, tops, ["native", str(mp)]))
        loops.made_progress(20)

        def kill_leader(shard: int) -> None:
            victim, _ = rs.leader(c, shard)
            localcluster.kill(d, "meta", shard, replica=victim)
            rs.leader(c, shard, other_than=victim)
            localcluster.start(d, "meta", shard, replica=victim)

        def pause_leader(shard: int) -> None:
            victim, _ = rs.leader(c, shard)
            pid = rs.pid(d, localcluster.daemon_name("meta", shard, victim))
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            try:
                rs.leader(c, shard, other_than=victim)  # the others elected one without it
            finally:
                os.kill(pid, signal.SIGCONT)
                stopped.remove(pid)

        def pause_etcd() -> None:
            os.kill(etcd, signal.SIGSTOP)
            stopped.append(etcd)
            try:
                # no leader may answer past its lease: every one of them steps down
                seen: list = []

                def check():
                    seen[:] = [s for shard in range(SHARDS) for s in rs.statuses(c, shard)]
                    return all(s is not None and s.role != "leader" for s in seen)

                rs.wait("every leader stepping down with etcd stopped", check, lambda: seen)
                # and no election for a while longer: the loops' calls wait it out
                time.sleep(ETCD_OUTAGE)
            finally:
                os.kill(etcd, signal.SIGCONT)
                stopped.remove(etcd)

        faults = [(kill_leader, 0), (pause_leader, 1), (pause_etcd,), (kill_leader, 1),
                  (pause_leader, 0), (kill_leader, 0)]
        for fault, *args in faults:
            t0 = time.monotonic()
            fault(*args)
            rs.steady(c)
            loops.made_progress(10)
            print(f"{fault.__name__}{tuple(args)}: {time.monotonic() - t0:.1f} s, "
                  f"{loops.progress()}")
        results = loops.stop()
        mount.close()  # unmounted: every change it answered is committed
        elections = rs.elections(d) - before
        calls = sum(r["calls"] for r in results)
        print(f"{elections} elections, {calls} calls, "
              f"{sum(len(r['failures']) for r in results)} failed; slowest: "
              f"{[r['slowest'] for r in results]}")
        assert [r["failures"] for r in results] == [[], []]
        assert elections >= len(faults) + SHARDS - 1  # etcd's pause: one per shard
        for top, r in zip(tops, results, strict=True):
            found = {f"{where}/{name}" for where, dirs, files in client.walk(top)
                     for name in dirs + files}
            want = set(r["expect"]) | {f"{top}/a", f"{top}/b"}
            assert found == want, (sorted(found - want), sorted(want - found))
            assert r["loops"] > 0
        client.close()
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        mount.close()
        localcluster.down(d)
