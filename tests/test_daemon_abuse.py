"""Bad input against real daemon processes: every case gets an error or a closed connection,
the daemon keeps serving, and nothing stored is lost."""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import socket

import msgpack
import pytest

import jpfs
from jpfs import config, localcluster
from jpfs.rpc import frame as F


@pytest.fixture(scope="module")
def cluster_dir(meta_cluster):
    return meta_cluster


def _address(d, role="meta", index=0):
    c = config.load(localcluster.cluster_file(d))
    return (c.meta if role == "meta" else c.storage)[index].host_port, c.secret


def _recv_exact(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def _frame(s):
    kind, blen, plen = F.HEADER.unpack(_recv_exact(s, F.HEADER_SIZE))[2:]
    body = msgpack.unpackb(_recv_exact(s, blen))
    _recv_exact(s, plen)
    return kind, body


def _session(addr, secret):
    s = socket.create_connection(addr, timeout=10)
    _, (_, server_nonce, role) = _frame(s)
    cn = os.urandom(16)
    mac = hmac.new(secret, b"jpfs-client" + server_nonce + cn, hashlib.sha256).digest()
    body = msgpack.packb([cn, mac])
    s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.AUTH, len(body), 0) + body)
    kind, _ = _frame(s)
    assert kind == F.AUTH_OK
    return s


def _call(s, req_id, method, args):
    raw = msgpack.packb([req_id, method, args, None])
    s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, len(raw), 0) + raw)
    return _frame(s)


def _alive(d):
    return all(x.alive for x in localcluster.status(d))


def test_wrong_secret_is_refused_and_nothing_leaks(cluster_dir):
    addr, _ = _address(cluster_dir)
    s = socket.create_connection(addr, timeout=10)
    _, (_, server_nonce, _) = _frame(s)
    cn = os.urandom(16)
    mac = hmac.new(b"not the secret", b"jpfs-client" + server_nonce + cn,
                   hashlib.sha256).digest()
    body = msgpack.packb([cn, mac])
    s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.AUTH, len(body), 0) + body)
    kind, err = _frame(s)
    assert kind == F.ERROR and err[1] == "EACCES"
    assert s.recv(1) == b""
    with pytest.raises(PermissionError):
        bad = config.Cluster(meta=config.load(localcluster.cluster_file(cluster_dir)).meta,
                             secret=b"wrong")
        jpfs.connect(bad).stat("/")
    assert _alive(cluster_dir)


@pytest.mark.parametrize("method,args,err", [
    ("lookup", ["1", b"x"], "EINVAL"),
    ("lookup", [1, "x"], "EINVAL"),
    ("lookup", [1], "EINVAL"),
    ("getattr", [-5], "EXDEV"),
    ("getattr", [(1 << 64) - 1], "EXDEV"),
    ("batch_getattr", [["x", None]], "EINVAL"),
    ("mkdir", [1, b"a/b", 0o755, 0, 0], "EINVAL"),
    ("create", [1, b"", 0o644, 0, 0, True], "EINVAL"),
    ("setattr", [1, {"color": 3}], "EINVAL"),
    ("setattr", [1, {"size": -1}], "EINVAL"),
    ("tx_prepare", [b"short", 0, []], "EINVAL"),
    ("tx_prepare", [b"x" * 16, 0, [["drop_everything"]]], "EINVAL"),
    ("tx_prepare", [b"x" * 16, 0, [["nlink", "a", 1]]], "EINVAL"),
    ("scan", ["secrets", b"", 10], "EINVAL"),
    ("repair", ["format_disk", []], "EINVAL"),
    ("write_chunks", [1, [[0, b"short", [0], 1, 1, 0]], 1, None], "EISDIR"),
    ("bulk_create", [1, [["bad"]], False], None),
    ("no_such_method", [], "ENOSYS"),
    (999, [], "ENOSYS"),
    (True, [1], "ENOSYS"),  # not method id 1
    (3, [(1 << 64) - 1], "EXDEV"),  # by id: getattr
    (4, [[1, True]], "EINVAL"),  # batch_getattr: every element checked
])
def test_bad_requests_get_errors(cluster_dir, client, method, args, err):
    client.makedirs("/keep/me")
    addr, secret = _address(cluster_dir)
    s = _session(addr, secret)
    kind, body = _call(s, 7, method, args)
    if err is None:  # per-entry errors inside a good answer
        assert kind == F.RESPONSE and body[1] == ["EINVAL"]
    else:
        assert kind == F.ERROR and body[0] == 7 and body[1] == err, body
    kind, body = _call(s, 8, "getattr", [1])  # the same connection still works
    assert kind == F.RESPONSE and body[0] == 8
    s.close()
    assert _alive(cluster_dir)
    assert client.isdir("/keep/me")


@pytest.mark.parametrize("garbage", [
    os.urandom(4096),
    F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 0xFFFFFFFF, 0),
    F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 16, 1 << 62) + b"\x00" * 16,
    F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 100, 0) + b"\x93\x01",  # truncated, then hang up
])
def test_garbage_and_truncation_after_auth(cluster_dir, client, garbage):
    addr, secret = _address(cluster_dir)
    s = _session(addr, secret)
    s.sendall(garbage)
    s.close()
    s = socket.create_connection(addr, timeout=10)  # and before auth
    s.sendall(garbage)
    s.close()
    assert _alive(cluster_dir)
    assert client.stat("/").is_dir


def test_many_idle_and_half_open_connections(cluster_dir, client):
    addr, _ = _address(cluster_dir)
    socks = [socket.create_connection(addr, timeout=10) for _ in range(50)]
    assert client.stat("/").is_dir  # the server is not stuck behind them
    for s in socks:
        s.close()
    assert _alive(cluster_dir)


def test_errors_name_the_errno(client):
    with pytest.raises(FileNotFoundError) as e:
        client.stat("/definitely/not/here")
    assert e.value.errno == errno.ENOENT and e.value.filename == "/definitely/not/here"


def test_a_flooding_client_does_not_starve_others(make_cluster):
    """One connection keeps thousands of pipelined requests in flight (its socket never runs
    dry, so the shard's reads never wait); another client's calls are still served meanwhile,
    not after the flood."""
    import threading

    from jpfs_bench.meta import drive_pipelined

    d = make_cluster(meta_shards=1)
    cluster = config.load(localcluster.cluster_file(d))
    with jpfs.connect(d, dir_cache_ttl=0) as c:
        c.mkdir("/flood")
        ino = c.stat("/flood").ino
        frames = [b"".join(bytes(p) for p in F.FrameSocket.frame_parts(
            F.REQUEST, [i + 1, "getattr", [ino], None])) for i in range(200_000)]
        flood = threading.Thread(target=drive_pipelined,
                                 args=(cluster.meta[0].address, cluster.secret, frames, 4096))
        flood.start()
        try:
            served_during_flood = 0
            for _ in range(20):
                c.stat("/flood")
                if flood.is_alive():
                    served_during_flood += 1
        finally:
            flood.join()
    assert served_during_flood == 20, "calls waited for the flood to end"
