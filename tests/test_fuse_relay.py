"""The prefetch relay of a mount served by several workers (``jpfs.fuse.relay``): worker 0's
desk and another worker's link, each over a real VFS on a real cluster, talking over real
sockets (no kernel: the engine's tests read through a real mount). What the other worker hands
the kernel reaches worker 0's VFS, a bad peer ends only its own link, and a process that is not
a worker of the mount is refused."""

from __future__ import annotations

import os
import socket
import stat
import sys
import uuid
from functools import partial

import msgpack
import pytest
import trio
from vfs_harness import (
    CREAT,
    GID,
    UID,
    cluster,  # noqa: F401
    cluster_dir,  # noqa: F401
    open_vfs,
    write_all,
)

from jpfs import config
from jpfs.fuse import relay
from jpfs.types import ROOT_INO


@pytest.fixture(scope="module")
def vfs_cluster(cluster: config.Cluster) -> config.Cluster:  # noqa: F811 - the harness's
    return cluster


async def _make_files(where: config.Cluster, names: list[bytes]) -> tuple[str, int]:
    """A directory holding ``names`` (a few KB each): its name and inode."""
    dname = f"relay-{uuid.uuid4().hex[:8]}"
    async with open_vfs(where) as vfs:
        d = (await vfs.mkdir(ROOT_INO, dname.encode(), 0o755, UID, GID)).ino
        for n in names:
            f, _ = await vfs.create(d, n, stat.S_IFREG | 0o644, CREAT, UID, GID)
            await write_all(vfs, f.fh, 0, os.urandom(6000))
            await vfs.flush(f.fh)
            await vfs.release(f.fh)
        return dname, d


async def _linked(nursery: trio.Nursery, owner, other, tag: str) -> tuple[relay.Desk,
                                                                         relay.Link]:
    desk = relay.Desk(owner, tag)
    await nursery.start(desk.run)
    link = relay.Link(tag)
    other.attach_owner(link)
    connected = trio.Event()
    nursery.start_soon(partial(link.run, connected=connected.set))
    await connected.wait()
    return desk, link


async def test_what_another_worker_hands_the_kernel_reaches_worker_0(vfs_cluster):
    dname, d = await _make_files(vfs_cluster, [b"a", b"b"])
    tag = f"test-{uuid.uuid4().hex}"
    async with open_vfs(vfs_cluster, read_only=True) as owner, \
            open_vfs(vfs_cluster, read_only=True) as other, trio.open_nursery() as nursery:
        desk, link = await _linked(nursery, owner, other, tag)
        await other.lookup(ROOT_INO, dname.encode())
        a = await other.lookup(d, b"a")  # the other worker answers the kernel's lookups
        assert owner.inodes.get(a.ino) is None
        # a READ past the first page waits for worker 0's answer, which comes after it has
        # taken the entries sent before it: none of its hand-offs holds this file
        assert await link.first_read(a.ino, 4096, 4096, stream=7) is None
        node = owner.inodes.get(a.ino)
        assert node is not None and (node.parent, node.name) == (d, b"a")
        assert owner.inodes.path(node) == f"/{dname}/a"
        assert await link.first_read(a.ino, 0, 4096, stream=7) is None  # told, not asked
        b = await other.lookup(d, b"b")
        assert await link.first_read(b.ino, 8192, 4096, stream=7) is None
        assert desk.counters["reads"] == 3 and desk.counters["entries"] >= 2, desk.counters
        assert link.counters["unanswered"] == 0 and link.counters["pages"] == 0
        nursery.cancel_scope.cancel()


async def _refused(tag: str, data: bytes) -> bytes:
    """Connect to the desk, send ``data``, and return what comes back before it closes."""
    s = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with s:
        await s.connect(relay.address(tag))
        try:
            with trio.fail_after(30):
                view = memoryview(data)
                while view:
                    view = view[await s.send(view):]
                return await s.recv(1)
        except (BrokenPipeError, ConnectionResetError):  # dropped while it sent
            return b""


async def test_a_bad_peer_ends_only_its_own_link(vfs_cluster):
    _, d = await _make_files(vfs_cluster, [b"a"])
    tag = f"test-{uuid.uuid4().hex}"
    async with open_vfs(vfs_cluster, read_only=True) as owner, \
            open_vfs(vfs_cluster, read_only=True) as other, trio.open_nursery() as nursery:
        desk, link = await _linked(nursery, owner, other, tag)
        assert await _refused(tag, b"\xc1\xc1\xc1") == b""  # a byte msgpack never uses
        assert await _refused(tag, msgpack.packb([99, 1])) == b""  # an unknown kind
        assert await _refused(tag, msgpack.packb([relay.READ, 5])) == b""  # too short
        oversize = b"\xc6" + (1 << 30).to_bytes(4, "big") + bytes(relay.MESSAGE_MAX + 4096)
        assert await _refused(tag, oversize) == b""
        a = await other.lookup(d, b"a")
        assert await link.first_read(a.ino, 4096, 4096, stream=1) is None  # still served
        assert owner.inodes.get(a.ino) is not None
        assert desk.counters["peers"] == 1, desk.counters
        nursery.cancel_scope.cancel()


async def test_a_process_that_is_not_a_worker_of_the_mount_is_refused(vfs_cluster):
    """The desk's name is open to every process of the host: a held-back page is a file's
    bytes, so only the mount's own workers (children of its supervisor, as its user) are
    answered; here the test's own process stands for a sibling, and its child for a stranger."""
    tag = f"test-{uuid.uuid4().hex}"
    async with open_vfs(vfs_cluster, read_only=True) as owner, trio.open_nursery() as nursery:
        desk = relay.Desk(owner, tag)
        await nursery.start(desk.run)
        code = "\n".join([
            "import socket, sys, msgpack",
            "s = socket.socket(socket.AF_UNIX)",
            f"s.connect({relay.address(tag)!r})",
            "s.settimeout(10)",
            "try:",
            f"    s.sendall(msgpack.packb([{relay.READ}, 1, 1, 4096, 4096, 0]))",
            "    got = s.recv(100)",
            "except (BrokenPipeError, ConnectionResetError):",
            "    got = b''",
            "sys.stdout.write(repr(got))"])
        out = await trio.run_process([sys.executable, "-c", code], capture_stdout=True)
        assert out.stdout.decode() == "b''"
        assert desk.counters["reads"] == 0 and desk.counters["peers"] == 0
        nursery.cancel_scope.cancel()
