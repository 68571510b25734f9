"""A mount keeps reading while the cluster moves its data: files held open across a rebalance
that moved every copy of their chunks (replicas 1) read on, from the new nodes."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from fuse_support import mounted, requires_fuse

import jpfs
from jpfs import localcluster

pytestmark = [requires_fuse, pytest.mark.fuse,
              pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")]

CHUNK = 256 << 10


def test_open_files_read_on_after_the_rebalance_moved_their_only_copies(tmp_path):
    d = tmp_path / "c"
    localcluster.up(d, etcd=True, meta_shards=1, storage_nodes=1, replicas=1,
                    chunk_size=CHUNK, sync=False,
                    extra_args={"meta": ["--heal-interval", "0.5"]})
    try:
        files = {f"/m/f{i}": os.urandom(3 * CHUNK + i) for i in range(12)}
        with jpfs.connect(d) as c:
            c.makedirs("/m")
            for p, b in files.items():
                c.write_bytes(p, b)
        mp = tmp_path / "mnt"
        with mounted(d, mp, "--read-only", "--no-prefetch", "--small-file", "64K") as m:
            # read before the move, a page each (no read-ahead): the kernel opens files itself
            # on a read-only mount, so the mount opens each at its first READ, with the layout
            # of then, and keeps that handle while the file is not read whole
            held = {p: open(mp / p.lstrip("/"), "rb") for p in files}  # noqa: SIM115
            for p, f in held.items():
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                assert os.pread(f.fileno(), 4096, 0) == files[p][:4096]
            try:
                localcluster.up(d, storage_nodes=2)  # a new node: the rebalance moves chunks
                with jpfs.connect(d) as c:
                    deadline = time.monotonic() + 120
                    while True:
                        on_new = sum(1 in ch.nodes for p in files for ch in c.layout(p).chunks)
                        if on_new >= 6:
                            break
                        assert time.monotonic() < deadline, on_new
                        time.sleep(0.3)
                time.sleep(6)  # the old copies are deleted 5 s after their records changed
                for p, f in held.items():
                    assert f.read() == files[p], p
            finally:
                for f in held.values():
                    f.close()
            stats = json.loads((mp / ".jpfs" / "stats").read_text())
            assert stats["fuse"]["layouts_refreshed"] >= 1
            assert m.pid
    finally:
        localcluster.down(d)
