"""POSIX conformance of a real mount, measured against ext4 in the same run.

Every case of ``posix_cases.py`` (open, creat, mkdir, mknod, mkfifo, link, symlink, unlink, rmdir,
rename of every type pair and with RENAME_NOREPLACE/EXCHANGE, chmod, chown and the setuid/setgid
bits, truncate, ftruncate, utimensat with UTIME_NOW/UTIME_OMIT, name and path limits, sticky
directories, fallocate) runs on a local ext4 directory and on the mount, as root and as an
unprivileged user, and must give the same outcome, errno and resulting attributes (type, mode,
nlink, size, owner, device, and which mtimes/ctimes moved) read right after the change.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fuse_support import mounted, requires_fuse

from jpfs import localcluster

pytestmark = [requires_fuse, pytest.mark.fuse]

CASES = Path(__file__).with_name("posix_cases.py")
NOBODY = 65534


@pytest.fixture(scope="module")
def places():
    """(ext4 directory, mount point), both reachable by an unprivileged user."""
    base = Path(tempfile.mkdtemp(prefix="jpfs-posix-", dir="/tmp"))
    base.chmod(0o755)
    cluster = base / "cluster"
    localcluster.up(cluster, meta_shards=2, storage_nodes=2, chunk_size=1 << 20, sync=False)
    try:
        with mounted(cluster, base / "mnt", "--allow-other") as m:
            m.path.chmod(0o755)
            yield base / "ext4", m.path
    finally:
        localcluster.down(cluster, timeout=5)
        shutil.rmtree(base, ignore_errors=True)


def _run(root: Path, uid: int) -> dict:
    root.mkdir(parents=True)
    root.chmod(0o755)
    res = subprocess.run([sys.executable, str(CASES), str(root), str(uid)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.mark.parametrize("uid", [0, NOBODY], ids=["root", "unprivileged"])
def test_every_case_matches_ext4(places, uid):
    ext4, mnt = places
    want = _run(ext4 / f"u{uid}", uid)
    got = _run(mnt / f"u{uid}", uid)
    assert want.keys() == got.keys()
    diffs = [f"{name}:\n  ext4: {want[name]}\n  jpfs: {got[name]}"
             for name in want if want[name] != got[name]]
    assert not diffs, f"{len(diffs)} of {len(want)} cases differ from ext4:\n" + "\n".join(diffs)
