"""A rolling restart, as an operator upgrades a cluster: every daemon stopped (SIGTERM) and started
again, one at a time (each copy of each metadata shard, each storage node, then etcd), while
two processes write files, read back files written earlier and rename them, one through the
native client and one through a kernel mount. Not one call fails, and every file reads back as
written.

Real daemons, real etcd: two shards of three copies, three storage nodes with two replicas of
every chunk (a write meets at most one node down and still finds two). Every wait is on a state
(the daemon answering again, copies that follow one leader, loops that made progress).
"""

from __future__ import annotations

import contextlib
import shutil
import time

import pytest
import repl_support as rs
from fuse_support import mounted, requires_fuse

import jpfs
from jpfs import localcluster

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow, pytest.mark.fuse]

SHARDS = 2
COPIES = 3
NODES = 3

# One loop per process: write a new file (its bytes a function of its index), read back one
# written earlier and compare, and every third round rename one. A failed call, or bytes that
# differ, is recorded and ends the loop.
WORKER = r"""
import json, os, random, sys, time, traceback
import jpfs
from repl_support import LoopProgress

cluster_file, top, stop_file, out, where = sys.argv[1:6]
rnd = random.Random(top)
client = jpfs.connect(cluster_file) if where == "native" else None

def data(i):
    return random.Random(i).randbytes(1000 + (i * 7919) % 200_000)

def write(path, b):
    if client is not None:
        client.write_bytes(path, b)
    else:
        with open(where + path, "wb") as f:
            f.write(b)

def read(path):
    if client is not None:
        return client.read_bytes(path)
    with open(where + path, "rb") as f:
        return f.read()

def rename(src, dst):
    (client.rename if client is not None else os.rename)(
        *((src, dst) if client is not None else (where + src, where + dst)))

names = {}
done = LoopProgress(out)

i = 0
try:
    while not os.path.exists(stop_file):
        names[i] = f"{top}/f{i}"
        write(names[i], data(i))
        done.calls += 1
        k = rnd.randrange(i + 1)
        got = read(names[k])
        done.calls += 1
        if got != data(k):
            raise AssertionError(f"{names[k]}: {len(got)} bytes read, not the "
                                 f"{len(data(k))} written")
        if i % 3 == 2:
            rename(names[k], f"{top}/r{k}")
            names[k] = f"{top}/r{k}"
            done.calls += 1
        i += 1
        done.write()
except (OSError, AssertionError) as e:
    done.failures.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
finally:
    done.write()
    with open(out, "w") as fh:
        json.dump({"calls": done.calls, "files": {v: k for k, v in names.items()},
                   "failures": done.failures}, fh)
    if client is not None:
        client.close()
"""


def _data(i: int) -> bytes:
    import random

    return random.Random(i).randbytes(1000 + (i * 7919) % 200_000)


@requires_fuse
def test_a_rolling_restart_of_every_daemon_fails_no_call(tmp_path):
    d = tmp_path / "cluster"
    c = localcluster.up(d, meta_shards=SHARDS, storage_nodes=NODES, replicas=2, etcd=True,
                        meta_replicas=COPIES)
    mount = contextlib.ExitStack()
    try:
        mp = mount.enter_context(mounted(localcluster.cluster_file(d), tmp_path / "mnt")).path
        client = jpfs.connect(c)
        tops = ["/native", "/mount"]
        for top in tops:
            client.mkdir(top)
        rs.steady(c)
        loops = mount.enter_context(rs.Loops(WORKER, d, tops, ["native", str(mp)]))
        loops.made_progress(20)
        daemons = ([("meta", shard, copy) for shard in range(SHARDS) for copy in range(COPIES)]
                   + [("storage", node, 0) for node in range(NODES)] + [("etcd", 0, 0)])
        for role, index, copy in daemons:
            t0 = time.monotonic()
            assert localcluster.stop(d, role, index, replica=copy), (role, index, copy)
            if role == "etcd":
                localcluster.start_etcd(d)
            else:
                localcluster.start(d, role, index, replica=copy)
            rs.steady(c)
            loops.made_progress(10)
            print(f"{localcluster.daemon_name(role, index, copy)} restarted: "
                  f"{time.monotonic() - t0:.1f} s, {loops.progress()}")
        results = loops.stop()
        mount.close()  # unmounted: every change it answered is committed
        assert [r["failures"] for r in results] == [[], []]
        for top, r in zip(tops, results, strict=True):
            assert r["calls"] > 0
            found = {f"{where}/{name}" for where, _, files in client.walk(top) for name in files}
            assert found == set(r["files"]), (sorted(found ^ set(r["files"]))[:10])
            for path, i in r["files"].items():
                assert client.read_bytes(path) == _data(i), path
        client.close()
    finally:
        mount.close()
        localcluster.down(d)
