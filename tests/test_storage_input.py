"""Bad input to a real storage daemon: clear errno errors, and the server lives on."""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import socket
from typing import Any, NamedTuple

import msgpack
import pytest
import trio
import xxhash
from storage_cluster import storage_cluster  # noqa: F401

from jpfs.errors import JPFSError
from jpfs.proto import storage as P
from jpfs.rpc import Method, Pool
from jpfs.rpc import frame as F


def loose(spec: Method, n: int) -> Method:
    """``spec`` as a client that sends ``n`` arguments of any type would declare it."""
    rec = NamedTuple("Loose", [(f"a{i}", Any) for i in range(n)])
    return Method(spec.id, spec.name, rec, payload=spec.payload)


@pytest.fixture
async def node(storage_cluster, nursery):  # noqa: F811
    sc = storage_cluster(n=1, replicas=1)
    pool = Pool(nursery, [sc.cluster.storage[0].address], sc.cluster.secret, role="storage",
                retry_for=1.0)
    yield sc, pool
    pool.close()


async def expect(pool, method, args, payload=(), err=errno.EINVAL, words=()):
    with pytest.raises(JPFSError) as info:
        await pool.call(0, method, args, payload)
    assert info.value.errno == err, info.value
    for w in words:
        assert w in info.value.strerror, info.value.strerror
    return info.value


async def test_bad_arguments_get_clear_errors(node):
    sc, pool = node
    bid = os.urandom(16)
    data = os.urandom(1000)
    xxh = xxhash.xxh3_64_intdigest(data)
    put, get = P.PUT_BLOBS, P.GET_BLOBS
    # wrong types at the top level (checked against the method table)
    await expect(pool, loose(P.PUT_BLOBS, 1), ["x"], [data],
                 words=["argument 0"])
    await expect(pool, loose(P.GET_BLOBS, 1), [5])
    await expect(pool, loose(P.GET_BLOBS, 2), [[], 1], words=["arguments"])
    # wrong shapes inside
    await expect(pool, put, [[bid, 1000, xxh]], [data], words=["entries", "bytes"])
    await expect(pool, put, [[[bid, 1000]]], [data], words=["[id, length, xxh]"])
    await expect(pool, put, [[[b"short", 1000, xxh]]], [data], words=["16 bytes"])
    await expect(pool, put, [[[bid, "1000", xxh]]], [data], words=["bad length"])
    await expect(pool, put, [[[bid, -1, xxh]]], [data])
    await expect(pool, put, [[[bid, 999, xxh]]], [data], words=["payload"])
    await expect(pool, get, [[bid, 17]], words=["16 bytes"])
    await expect(pool, P.LIST_BLOBS, [b"x" * 17, 10])
    await expect(pool, P.LIST_BLOBS, [b"", -1])
    await expect(pool, P.COMPACT, [2.0])
    await expect(pool, loose(P.STATS, 1), [1])
    await expect(pool, loose(P.GET_BLOBS, 0), [], payload=[b"x"], words=["payload"])
    # corrupted in transit: refused, nothing stored
    e = await expect(pool, put, [[[bid, 1000, xxh ^ 1]]], [data], err=errno.EIO,
                     words=["checksum", bid.hex()])
    assert isinstance(e, OSError)
    # too many at once
    many = [os.urandom(16) for _ in range(P.MAX_BATCH_BLOBS + 1)]
    await expect(pool, get, [many], err=errno.E2BIG)
    await expect(pool, P.DELETE_BLOBS, [many], err=errno.E2BIG)
    # unknown method
    await expect(pool, Method(99, "format_disk", P.NoArgs), [], err=errno.ENOSYS)
    # still serving, and none of it stored anything
    assert P.STATS.decode(await pool.call(0, P.STATS, [])).blobs == 0
    assert await pool.call(0, put, [[[bid, 1000, xxh]]], [data]) == [1, 0]
    statuses, payload = await pool.call_payload(0, get, [[bid, os.urandom(16)]])
    assert statuses == [[1000, xxh], "ENOENT"] and bytes(payload) == data
    assert sc.procs[0].poll() is None


def _session(port: int, secret: bytes) -> socket.socket:
    """A blocking socket that did the handshake by hand."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = _recv(s, F.HEADER_SIZE)
    _, _, _, blen, _ = F.HEADER.unpack(head)
    _, server_nonce, _ = msgpack.unpackb(_recv(s, blen))
    cn = os.urandom(16)
    mac = hmac.new(secret, b"jpfs-client" + server_nonce + cn, hashlib.sha256).digest()
    body = msgpack.packb([cn, mac])
    s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.AUTH, len(body), 0) + body)
    head = _recv(s, F.HEADER_SIZE)
    _recv(s, F.HEADER.unpack(head)[3])
    return s


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise EOFError
        out += got
    return out


async def test_oversize_put_is_refused_before_it_is_read(node):
    sc, pool = node
    port = sc.cluster.storage[0].host_port[1]

    def abuse() -> list:
        s = _session(port, sc.cluster.secret)
        body = msgpack.packb([1, "put_blobs", [[[os.urandom(16), 1 << 30, 0]]], None])
        s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, len(body), 1 << 30) + body)
        head = _recv(s, F.HEADER_SIZE)
        _, _, kind, blen, _ = F.HEADER.unpack(head)
        err = msgpack.unpackb(_recv(s, blen))
        s.close()
        return [kind, err]

    kind, err = await trio.to_thread.run_sync(abuse)
    assert kind == F.ERROR and err[1] == "EPROTO" and "exceeds the limit" in err[2]
    assert P.STATS.decode(await pool.call(0, P.STATS, [])).blobs == 0
    assert sc.procs[0].poll() is None
