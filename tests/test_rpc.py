"""The wire protocol: multiplexing, payloads, errors, deadlines, auth, abuse, reconnects."""

from __future__ import annotations

import errno
import functools
import os
import socket
import struct
import threading
from typing import Any, NamedTuple

import msgpack
import pytest
import trio

from jpfs.errors import AuthError, DeadlineError, JPFSError, Unavailable
from jpfs.rpc import (
    Defer,
    FileSegment,
    Handler,
    Later,
    Limits,
    Method,
    Pool,
    Reply,
    Service,
    method_table,
    serve,
)
from jpfs.rpc import frame as F
from jpfs.rpc.client import connect

SECRET = b"s3cret"

class AnyArg(NamedTuple):
    x: Any


class TwoInts(NamedTuple):
    a: int
    b: int


class Name(NamedTuple):
    name: str


class Seconds(NamedTuple):
    seconds: float


class NoArgs(NamedTuple):
    pass


class FileReq(NamedTuple):
    path: str
    offset: int
    length: int


METHODS = method_table(
    Method(1, "echo", AnyArg, idempotent=True),
    Method(2, "add", TwoInts, int, idempotent=True, inline=True),
    Method(3, "fail", Name),
    Method(4, "nap", Seconds, float, idempotent=True, inline=True),
    Method(5, "blob", NoArgs, int, payload=True),
    Method(6, "file", FileReq, int),
    Method(7, "crash", NoArgs),
)


def loose(spec: Method, n: int, payload: bool = False) -> Method:
    """``spec`` as a client that sends ``n`` arguments of any type would declare it."""
    rec = NamedTuple("Loose", [(f"a{i}", Any) for i in range(n)])
    return Method(spec.id, spec.name, rec, payload=payload)


class Echo:
    def __init__(self):
        self.calls = 0

    def handlers(self) -> dict:
        m = METHODS
        return {m["echo"]: Handler(self.echo), m["add"]: Handler(self.add, self.add_now),
                m["fail"]: Handler(self.fail), m["nap"]: Handler(self.nap, self.nap_now),
                m["blob"]: Handler(self.blob), m["file"]: Handler(self.file),
                m["crash"]: Handler(self.crash)}

    async def echo(self, x):
        self.calls += 1
        return x

    async def add(self, a, b):
        return a + b

    def add_now(self, a, b):  # answered inline by the server
        self.calls += 1
        return a + b

    def nap_now(self, seconds):  # cannot answer without waiting: defers to nap()
        raise Defer

    async def fail(self, name):
        raise JPFSError(getattr(errno, name), f"asked to fail with {name}")

    async def nap(self, seconds):
        await trio.sleep(seconds)
        return seconds

    async def blob(self, payload):
        return Reply(len(payload), [bytes(payload[::-1])])

    async def file(self, path, offset, length):
        fd = os.open(path, os.O_RDONLY)
        return Reply(length, [FileSegment(fd, offset, length)], on_sent=lambda: os.close(fd))

    async def crash(self):
        raise RuntimeError("bug in handler")


async def start(nursery, secret=SECRET, port=0, limits=Limits()):
    svc = Service("test", METHODS, Echo().handlers())
    port = await nursery.start(functools.partial(serve, limits=limits), svc, "127.0.0.1", port,
                               secret)
    return port, svc


@pytest.fixture
async def server(nursery):
    port, svc = await start(nursery)
    return port


@pytest.fixture
async def pool(nursery, server):
    p = Pool(nursery, [f"127.0.0.1:{server}"], SECRET, role="test", retry_for=2.0)
    yield p
    p.close()


async def test_call_and_many_in_flight(pool):
    assert await pool.call(0, METHODS["add"], [2, 3]) == 5
    results = {}

    async def one(i):
        results[i] = await pool.call(0, METHODS["echo"], [[i, b"x" * i, "s"]])

    async with trio.open_nursery() as n:
        for i in range(200):
            n.start_soon(one, i)
    assert all(results[i] == [i, b"x" * i, "s"] for i in range(200))
    assert len(pool._conns[0]) == 1  # all of it on one multiplexed connection


async def test_payload_both_ways_and_into(pool):
    data = os.urandom(3 << 20)
    n, payload = await pool.call_payload(0, METHODS["blob"], [], [data[:1000], data[1000:]])
    assert n == len(data) and bytes(payload) == data[::-1]
    dest = memoryview(bytearray(len(data)))
    _, got = await pool.call_payload(0, METHODS["blob"], [], [data], into=dest)
    assert got.obj is dest.obj and bytes(dest) == data[::-1]


async def test_sendfile_payload(pool, tmp_path):
    p = tmp_path / "f"
    data = os.urandom(5 << 20)
    p.write_bytes(data)
    n, payload = await pool.call_payload(0, METHODS["file"], [str(p), 12345, 4 << 20])
    assert bytes(payload) == data[12345:12345 + (4 << 20)]


async def test_errors_carry_errno(pool):
    with pytest.raises(FileNotFoundError) as info:
        await pool.call(0, METHODS["fail"], ["ENOENT"])
    assert info.value.errno == errno.ENOENT and "ENOENT" in info.value.strerror
    with pytest.raises(JPFSError) as info:
        await pool.call(0, Method(99, "nope", NoArgs), [])
    assert info.value.errno == errno.ENOSYS
    with pytest.raises(JPFSError) as info:
        await pool.call(0, loose(METHODS["add"], 2), ["a", 1])
    assert info.value.errno == errno.EINVAL
    with pytest.raises(JPFSError) as info:
        await pool.call(0, loose(METHODS["add"], 1), [1])
    assert info.value.errno == errno.EINVAL
    with pytest.raises(JPFSError) as info:
        await pool.call(0, METHODS["crash"], [])
    assert info.value.errno == errno.EIO and "RuntimeError" in info.value.strerror
    assert await pool.call(0, METHODS["add"], [1, 1]) == 2  # still serving


async def test_inline_handlers_and_deferral(nursery):
    impl = Echo()
    port = await nursery.start(serve, Service("test", METHODS, impl.handlers()), "127.0.0.1", 0,
                               SECRET)
    p = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test")
    assert await p.call(0, METHODS["add"], [40, 2]) == 42 and impl.calls == 1  # inline
    with pytest.raises(JPFSError) as info:
        await p.call(0, METHODS["add"], ["x", 2])  # argument checks apply inline too
    assert info.value.errno == errno.EINVAL
    assert await p.call(0, METHODS["nap"], [0.01]) == 0.01  # deferred to the async handler


async def test_deadline(pool):
    # whichever side notices first (the client's deadline or the server's copy of it)
    with pytest.raises(DeadlineError):
        await pool.call(0, METHODS["nap"], [5], timeout=0.2)
    assert await pool.call(0, METHODS["nap"], [0.01]) == 0.01


class Later_:
    """Answers from callbacks (``Later``), as a metadata shard answers writes from its group
    commit; ``settle`` decides when, or never."""

    def __init__(self):
        self.waiting: list[tuple[Later, object]] = []

    def echo_now(self, x):
        later = Later()
        self.waiting.append((later, x))
        return later

    def settle(self, fail: bool = False):
        for later, x in self.waiting:
            if fail:
                later.settle(None, JPFSError(errno.EROFS, "asked to fail"))
            else:
                later.settle(x)
        self.waiting.clear()


async def test_later_answers_arrive_when_settled_and_deadlines_end_unanswered_calls(nursery):
    impl = Later_()
    table = method_table(Method(1, "echo", AnyArg, inline=True))
    service = Service("test", table, {table["echo"]: Handler(now=impl.echo_now)})
    port = await nursery.start(serve, service, "127.0.0.1", 0, SECRET)
    p = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test")
    got: list = []

    async def call(x, timeout=10.0):
        try:
            got.append(await p.call(0, table["echo"], [x], timeout=timeout))
        except JPFSError as e:
            got.append(e.errno)

    async with trio.open_nursery() as calls:
        for i in range(50):
            calls.start_soon(call, i)
        while len(impl.waiting) < 50:
            await trio.sleep(0.01)
        assert got == []  # nothing is answered before it is settled
        impl.settle()
    assert sorted(got) == list(range(50))
    got.clear()
    # a server that never answers: the client's own deadline ends each call, the short one
    # first even though a longer one was already waiting
    with trio.fail_after(5):
        async with trio.open_nursery() as calls:
            calls.start_soon(call, "long", 3.0)
            await trio.sleep(0.05)
            calls.start_soon(call, "short", 0.2)
            await trio.sleep(1.0)
            assert got == [errno.ETIMEDOUT]
    assert got == [errno.ETIMEDOUT, errno.ETIMEDOUT]
    impl.settle()  # late answers to abandoned calls are dropped; the connection lives on
    async with trio.open_nursery() as calls:
        calls.start_soon(call, "x")
        while not impl.waiting:
            await trio.sleep(0.01)
        impl.settle(fail=True)  # an error settles as an error answer
    assert got[-1] == errno.EROFS


async def test_wrong_secret_is_refused(nursery, server):
    bad = Pool(nursery, [f"127.0.0.1:{server}"], b"wrong", role="test", retry_for=0)
    with pytest.raises(AuthError) as info:
        await bad.call(0, METHODS["add"], [1, 2])
    assert info.value.errno == errno.EACCES


async def test_server_without_secret_is_refused_by_client(nursery):
    port, _ = await start(nursery, secret=b"other")
    p = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test", retry_for=0)
    with pytest.raises(AuthError):
        await p.call(0, METHODS["add"], [1, 2])


def _raw_session(port: int, secret: bytes = SECRET) -> socket.socket:
    """A blocking socket that completed the handshake by hand."""
    import hashlib
    import hmac

    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    head = _recv_exact(s, F.HEADER_SIZE)
    _, _, kind, blen, _ = F.HEADER.unpack(head)
    _, server_nonce, _ = msgpack.unpackb(_recv_exact(s, blen))
    cn = b"c" * 16
    mac = hmac.new(secret, b"jpfs-client" + server_nonce + cn, hashlib.sha256).digest()
    body = msgpack.packb([cn, mac])
    s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.AUTH, len(body), 0) + body)
    head = _recv_exact(s, F.HEADER_SIZE)
    _recv_exact(s, F.HEADER.unpack(head)[3])
    return s


def _recv_exact(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def _read_error(s):
    head = _recv_exact(s, F.HEADER_SIZE)
    _, _, kind, blen, plen = F.HEADER.unpack(head)
    assert kind == F.ERROR
    return msgpack.unpackb(_recv_exact(s, blen))


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,  # bad magic
        F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 1 << 31, 0),  # oversize body
        F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 10, 1 << 40),  # oversize payload
        F.HEADER.pack(F.MAGIC, 99, F.REQUEST, 1, 0) + b"\x90",  # unknown version
        F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 3, 0) + b"\xc1\xc1\xc1",  # bad msgpack
        F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 2, 0) + msgpack.packb("x"),  # not a list
    ],
)
async def test_garbage_after_auth_closes_only_that_connection(pool, server, garbage):
    def abuse():
        s = _raw_session(server)
        s.sendall(garbage)
        err = _read_error(s)
        assert err[1] == "EPROTO"
        assert s.recv(1) == b""  # closed by the server
        s.close()

    await trio.to_thread.run_sync(abuse)
    assert await pool.call(0, METHODS["add"], [20, 22]) == 42


async def test_a_server_of_another_protocol_version_is_refused_by_name(nursery):
    """A daemon of a release with the next wire protocol: the client refuses it with a message
    that names both versions and says what to do (a daemon refusing such a client: the
    garbage test's unknown version)."""
    async def newer_server(stream: trio.SocketStream) -> None:
        body = msgpack.packb([F.VERSION + 1, b"n" * 32, "test"])
        await stream.send_all(F.HEADER.pack(F.MAGIC, F.VERSION + 1, F.HELLO, len(body), 0)
                              + body)
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"),
                                    newer_server, 0)
    port = listeners[0].socket.getsockname()[1]
    p = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test", retry_for=0.0)
    try:
        with pytest.raises(JPFSError) as got:
            await p.call(0, METHODS["add"], [1, 2])
    finally:
        p.close()
    msg = str(got.value)
    assert f"protocol version {F.VERSION + 1}" in msg and f"speaks {F.VERSION}" in msg, msg
    assert "run one release on both" in msg and f"127.0.0.1:{port}" in msg, msg


async def test_bad_requests_in_good_frames_keep_the_connection(server):
    def abuse():
        s = _raw_session(server)
        for body in ([7, "nope", [], None], [8, "add", ["x", 1], None], [9, "add", [1], None],
                     [10, 999, [], None], [11, True, [1, 2], None], [12, 2.0, [1, 2], None],
                     [13, 2, [True, 1], None], [14, None, [], None]):
            raw = msgpack.packb(body)
            s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, len(raw), 0) + raw)
            err = _read_error(s)
            assert err[0] == body[0] and err[1] in ("ENOSYS", "EINVAL")
        for req_id, method in ((15, "add"), (16, 2)):  # by name (hand-written frames) or id
            raw = msgpack.packb([req_id, method, [1, 2], None])
            s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, len(raw), 0) + raw)
            head = _recv_exact(s, F.HEADER_SIZE)
            assert msgpack.unpackb(_recv_exact(s, F.HEADER.unpack(head)[3])) == [req_id, 3]
        s.close()

    await trio.to_thread.run_sync(abuse)


async def test_truncated_frames_and_silent_peers(pool, server):
    def abuse():
        # garbage before the handshake, a truncated frame, and a hang-up mid-payload
        s = socket.create_connection(("127.0.0.1", server))
        s.sendall(os.urandom(100))
        s.close()
        s = _raw_session(server)
        raw = msgpack.packb([1, "blob", [], None])
        s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, len(raw), 1000) + raw + b"ab")
        s.close()
        s = _raw_session(server)
        s.sendall(F.HEADER.pack(F.MAGIC, F.VERSION, F.REQUEST, 50, 0)[:7])
        s.close()

    await trio.to_thread.run_sync(abuse)
    assert await pool.call(0, METHODS["add"], [1, 2]) == 3


async def test_reconnects_after_restart_and_retries_idempotent(nursery):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scope = trio.CancelScope()

    async def run_server(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            await serve(Service("test", METHODS, Echo().handlers()), "127.0.0.1", port, SECRET,
                        task_status=task_status)

    await nursery.start(run_server)
    # refused connections fail at once by default; a caller may choose to ride out a restart
    p = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test", retry_for=10,
             refused_retry_for=10)
    assert await p.call(0, METHODS["add"], [1, 2]) == 3
    scope.cancel()
    await trio.sleep(0.05)

    async def restart_later():
        await trio.sleep(0.3)
        scope2 = trio.CancelScope()
        nonlocal scope
        scope = scope2
        await nursery.start(run_server)

    nursery.start_soon(restart_later)
    assert await p.call(0, METHODS["add"], [3, 4]) == 7  # retried until the server was back
    scope.cancel()


async def test_unreachable_server_gives_up(nursery):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = Pool(nursery, [f"127.0.0.1:{port}"], SECRET, role="test", retry_for=0.3)
    with pytest.raises(Unavailable):
        await p.call(0, METHODS["add"], [1, 2])


def test_header_is_sixteen_bytes():
    assert F.HEADER_SIZE == 16 == struct.calcsize("!2sBBIQ")


def test_declarations_check_what_the_request_record_says():
    class Req(NamedTuple):
        ino: int
        inos: list[int]
        ttl: float
        version: int | None = None

    m = Method(40, "m", Req, int)
    assert m.check([1, [2, 3], 1]) == [1, [2, 3], 1]  # an int is a float
    assert m.check([1, [], 0.5, None]) and m.check([1, [], 0.5, 7])
    for bad in ([True, [], 1.0], [1, [2, "3"], 1.0], [1, [True], 1.0], [1, [], "1"], [1, []],
                [1, [], 1.0, 2, 3], (1, [], 1.0), [1 << 64, [], 1.0]):
        with pytest.raises(JPFSError) as info:
            m.check(bad)
        assert info.value.errno == errno.EINVAL
    assert m.decode(5) == 5
    with pytest.raises(JPFSError):
        m.decode("five")  # an answer of the wrong type is the server's protocol error


def test_every_declared_method_needs_exactly_one_handler():
    impl = Echo()
    handlers = impl.handlers()
    del handlers[METHODS["crash"]]
    with pytest.raises(TypeError, match="crash"):
        Service("test", METHODS, handlers)
    handlers = impl.handlers()
    handlers[METHODS["echo"]] = Handler(impl.echo, impl.add_now)  # echo is not declared inline
    with pytest.raises(TypeError, match="echo"):
        Service("test", METHODS, handlers)
    with pytest.raises(TypeError, match="nope"):
        Service("test", METHODS, {**impl.handlers(), Method(99, "nope", NoArgs): Handler()})
    with pytest.raises(ValueError):
        method_table(Method(1, "a", NoArgs), Method(1, "b", NoArgs))


async def test_a_long_call_on_a_live_server_is_not_taken_for_a_hang(nursery, server):
    """Calls that hear nothing for a while are probed, not failed: the live server answers the
    probe on its request loop while the handler still runs."""
    p = Pool(nursery, [f"127.0.0.1:{server}"], SECRET, role="test", peer_timeout=0.2)
    try:
        assert await p.call(0, METHODS["nap"], [1.2]) == 1.2  # six probe periods
    finally:
        p.close()


async def test_a_probe_is_answered_before_any_method(nursery, server):
    conn = await connect(f"127.0.0.1:{server}", SECRET, nursery)
    try:
        parts = conn.fs.frame_parts(F.REQUEST, [7, F.PING, [], None])
        await conn.fs.send_parts(parts)
        with trio.fail_after(5):
            while conn._heard == 0.0:
                await trio.sleep(0.01)
    finally:
        conn.close()


async def test_a_big_payload_received_in_a_thread_stops_at_cancel_and_at_close():
    """Payloads of a MiB or more are received in a worker thread: a deadline still ends the
    receive while the peer stalls mid-payload, and closing the socket under a receiving thread
    wakes it and closes the descriptor only once the thread let go of it."""
    a, b = socket.socketpair()
    fs = F.FrameSocket(a)
    sender = threading.Thread(target=b.sendall, args=(b"x" * (1 << 20),))
    sender.start()  # a quarter of what the reader waits for, then silence
    dest = memoryview(bytearray(4 << 20))
    start = trio.current_time()
    with trio.move_on_after(0.5) as scope:
        await fs.read_payload(len(dest), dest)
    sender.join()
    assert scope.cancelled_caught and trio.current_time() - start < 2.0
    assert bytes(dest[:1 << 20]) == b"x" * (1 << 20)

    c, d = socket.socketpair()
    fs2 = F.FrameSocket(c)
    fd = c.fileno()
    failed: list[BaseException] = []

    async def reader():
        try:
            await fs2.read_payload(4 << 20, memoryview(bytearray(4 << 20)))
        except (JPFSError, EOFError) as e:
            failed.append(e)

    async with trio.open_nursery() as n:
        n.start_soon(reader)
        await trio.sleep(0.2)
        assert fs2._threads == 1 and c.fileno() == fd  # a thread holds it open
        fs2.close()
    assert failed and c.fileno() == -1  # the reader saw the end; the descriptor is closed
    fs.close()
    for s in (b, d):
        s.close()


async def test_a_scattered_payload_of_many_parts_arrives_whole(pool):
    parts = [os.urandom(n) for n in (100, 70 << 10, 3 << 20, 0, 5000, 2 << 20, 1)]
    data = b"".join(parts)
    into = [memoryview(bytearray(len(p))) for p in parts[::-1]]
    _, got = await pool.call_payload(0, METHODS["blob"], [], [data], into=into)
    assert b"".join(bytes(v) for v in got) == data[::-1]
