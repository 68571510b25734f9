"""Client connections: one multiplexed connection per server, pooled, with deadlines and retry.

A ``Connection`` sends requests with fresh ids and a single reader task matches answers to
callers, so one TCP connection carries many calls in flight. A ``Pool`` keeps connections to a
list of servers, reconnects after a server restart, and retries calls that are safe to repeat
(idempotent methods, or any call that never left this host).

Failures are answered quickly: a refused connection is an answer (nothing listens there), so it
fails the call at once, and the caller (the storage client) tries another replica; a peer that
does not answer at all is given ``peer_timeout`` seconds (the cluster file's
``cluster.peer_timeout``), retries included. Errors name the server by role and index.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import socket as _socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..config import DEFAULT_PEER_TIMEOUT, parse_address
from ..errors import AuthError, DeadlineError, JPFSError, ProtocolError, Unavailable, error
from . import frame as F
from .auth import HANDSHAKE_TIMEOUT, client_handshake
from .service import Method

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0
"""Per-call deadline when the caller gives none."""

DEFAULT_RETRY_FOR = DEFAULT_PEER_TIMEOUT
"""How long a call keeps retrying an unreachable (not refusing) server before giving up."""

ROLE_NAMES = {"meta": "metadata shard", "storage": "storage node"}
"""How errors name a server of each role (``metadata shard 1 (127.0.0.1:7301)``)."""


class Refused(Unavailable):
    """The server's host answered that nothing listens on its port (ECONNREFUSED): the daemon
    is not running there. Never retried: another replica is tried, or the call fails."""


class Silent(Unavailable):
    """The server did not answer within the deadline (connect, handshake or a liveness probe):
    a hung daemon, or a host that is gone."""

_SEND_TIMEOUT = 60.0


@dataclass
class _Pending:
    into: memoryview | list[memoryview] | None
    method: str
    deadline: float
    done: trio.Event = field(default_factory=trio.Event)
    result: object = None
    payload: memoryview | list[memoryview] | None = None
    exc: BaseException | None = None


class Connection:
    """One authenticated connection; ``call`` may be used by many tasks at once."""

    def __init__(self, fs: F.FrameSocket, address: str, role: str, nursery: trio.Nursery,
                 peer_timeout: float = DEFAULT_PEER_TIMEOUT):
        self.fs = fs
        self.address = address
        self.role = role
        self._nursery = nursery
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self.broken: JPFSError | None = None
        self._sweep_at = math.inf
        self._sweep_wake = trio.Event()
        self._outbox: list = []
        self._flush_soon = False
        self.peer_timeout = peer_timeout
        self._heard = 0.0
        """When the server last showed it is alive (a frame read, or the first call after a
        quiet spell: time without calls proves nothing either way)."""
        self._ping_at: float | None = None  # when the probe now out was sent

    @property
    def alive(self) -> bool:
        """Whether the connection still works (nothing has broken it, nor has it been closed)."""
        return self.broken is None

    @property
    def in_flight(self) -> int:
        """How many calls are waiting for their answer."""
        return len(self._pending)

    async def reader(self) -> None:
        """Match answers to callers until the connection ends; then fail what is left."""
        try:
            while True:
                kind, body, payload = await self.fs.read_frame(self._choose_dest)
                self._heard = trio.current_time()
                if kind not in (F.RESPONSE, F.ERROR) or not isinstance(body, list) or not body:
                    raise ProtocolError(f"unexpected frame from {self.address}")
                if kind == F.ERROR and body[0] == 0:
                    raise F.decode_error(body)  # the server is closing the connection
                call = self._pending.pop(body[0], None)
                if call is None:
                    continue  # the caller gave up (deadline); its answer is dropped
                if kind == F.ERROR:
                    call.exc = F.decode_error(body)
                elif len(body) != 2:
                    call.exc = ProtocolError(f"malformed response from {self.address}")
                else:
                    call.result, call.payload = body[1], payload
                call.done.set()
        except EOFError:
            self._fail(Unavailable(f"{self.role} server {self.address} closed the connection"))
        except JPFSError as e:
            self._fail(e if isinstance(e, Unavailable) else Unavailable(
                f"connection to {self.role} server {self.address} failed: {e.strerror}"))
        finally:
            self._fail(Unavailable(f"connection to {self.address} closed"))

    async def sweeper(self) -> None:
        """Fail calls whose deadline has passed, and probe a server that has gone quiet with
        calls in flight. One timer per connection instead of a cancel scope per call (entering
        and leaving one was a fifth of a small call's client CPU): it sleeps until the earliest
        deadline or probe time it knows of and is woken only by a call due sooner."""
        due = math.inf
        while self.broken is None:
            now = trio.current_time()
            expired = [(rid, c) for rid, c in self._pending.items() if c.deadline <= now]
            for rid, call in expired:
                del self._pending[rid]
                call.exc = DeadlineError(f"{call.method} to {self.role} server {self.address}: "
                                         "deadline exceeded")
                call.done.set()
            late = now - due > self.peer_timeout / 2  # our own loop stalled: judge nothing yet
            due = self._sweep_at = min(
                min((c.deadline for c in self._pending.values()), default=math.inf),
                self._liveness(now, late))
            self._sweep_wake = trio.Event()
            with trio.move_on_at(self._sweep_at):
                await self._sweep_wake.wait()

    def _liveness(self, now: float, late: bool) -> float:
        """Probe a server that has said nothing for half of ``peer_timeout`` while calls wait
        on it; fail the connection (every call on it, as a lost connection does) if the probe
        hears nothing for ``peer_timeout`` more: the daemon is hung or its host is gone. Long
        calls are fine: a live server answers the probe on its request loop at once. Returns
        when to look again."""
        if not self._pending or self.peer_timeout <= 0:
            self._ping_at = None
            return math.inf
        quiet = self.peer_timeout / 2
        if self._ping_at is not None and self._heard >= self._ping_at:
            self._ping_at = None  # the server spoke since the probe went out
        if self._ping_at is None:
            if now - self._heard < quiet:
                return self._heard + quiet
            self._ping_at = now
            self._nursery.start_soon(self._ping)
            return now + self.peer_timeout
        if late:  # give the reader a turn before judging the server
            return now + quiet
        if now - self._ping_at < self.peer_timeout:
            return self._ping_at + self.peer_timeout
        waited = now - self._heard
        self._fail(Silent(f"{self.role} server {self.address} stopped answering: nothing heard "
                          f"for {waited:.1f} s with {len(self._pending)} calls in flight"))
        return math.inf

    async def _ping(self) -> None:
        """Send one liveness probe (its answer only moves ``_heard``)."""
        if self.broken is not None:
            return
        req_id = next(self._ids)
        self._pending[req_id] = _Pending(None, "ping", trio.current_time() + 2 * self.peer_timeout)
        try:
            await self._send(self.fs.frame_parts(F.REQUEST, [req_id, F.PING, [], None]))
        except JPFSError as e:
            self._fail(e if isinstance(e, Unavailable) else Unavailable(str(e)))

    def _choose_dest(self, kind: int, body: object, length: int
                     ) -> memoryview | list[memoryview] | None:
        if isinstance(body, list) and body:
            call = self._pending.get(body[0])
            into = call.into if call is not None else None
            if into is not None and (sum(map(len, into)) if isinstance(into, list)
                                     else len(into)) == length:
                return into
        return None

    def _fail(self, exc: JPFSError) -> None:
        if self.broken is None:
            self.broken = exc
        self.fs.close()
        pending, self._pending = self._pending, {}
        for call in pending.values():
            call.exc = exc
            call.done.set()
        self._sweep_wake.set()  # the sweeper ends with the connection

    def close(self) -> None:
        """Close the socket; calls still waiting fail with Unavailable (EHOSTUNREACH)."""
        self._fail(Unavailable(f"connection to {self.address} closed"))

    async def _finish_send(self, parts: list) -> None:
        """Send the rest of a frame. A frame half-sent would corrupt the stream for everyone:
        never cancel mid-frame, but give up on a peer that stops reading."""
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_SEND_TIMEOUT) as scope:
                await self.fs.send_parts(parts)
            if scope.cancelled_caught:
                raise Unavailable(f"sending to {self.address} timed out")

    async def _flush(self) -> None:
        """Send the queued requests; a failure fails every call on the connection."""
        self._flush_soon = False
        parts, self._outbox = self._outbox, []
        if not parts or self.broken is not None:
            return
        try:
            await self._send(parts)
        except JPFSError as e:
            self._fail(e if isinstance(e, Unavailable) else Unavailable(str(e)))

    async def _send(self, parts: list) -> None:
        """Send whole frames; no await at all when the socket takes them at once."""
        lock = self.fs.send_lock
        if not lock.locked():
            lock.acquire_nowait()
            try:
                parts = self.fs.send_parts_nowait(parts)
                if parts:
                    await self._finish_send(parts)
            finally:
                lock.release()
        else:
            with trio.CancelScope(shield=True):
                async with lock:
                    await self._finish_send(parts)

    async def call(
        self,
        method: Method,
        args: Sequence[Any],
        payload: F.Payload = (),
        *,
        deadline: float,
        into: memoryview | list[memoryview] | None = None,
    ) -> tuple[object, memoryview | list[memoryview] | None]:
        """Send one request and wait for its answer until ``deadline`` (trio.current_time)."""
        if self.broken is not None:
            raise self.broken
        req_id = next(self._ids)
        call = _Pending(into, method.name, deadline)
        if not self._pending:
            self._heard = trio.current_time()  # quiet until now proves nothing
        self._pending[req_id] = call
        if deadline < self._sweep_at:
            self._sweep_wake.set()
        remaining_ms = max(1, int((deadline - trio.current_time()) * 1000)) \
            if math.isfinite(deadline) else None
        try:
            parts = self.fs.frame_parts(F.REQUEST, [req_id, method.id, args, remaining_ms],
                                        payload)
            if len(self._pending) > 1 and not payload:
                # other calls are in flight: more requests are likely issued in this same
                # scheduler pass (tasks woken by answers that arrived together); one task then
                # sends them all with one sendmsg. (Payloads are caller memory: never queued.)
                self._outbox.extend(parts)
                if not self._flush_soon:
                    try:
                        self._nursery.start_soon(self._flush)
                    except RuntimeError:  # the client is closing
                        raise Unavailable(f"connection to {self.address} closed") from None
                    self._flush_soon = True
            else:
                await self._send(parts)
        except JPFSError as e:
            self._pending.pop(req_id, None)
            broken = e if isinstance(e, Unavailable) else Unavailable(str(e))
            self._fail(broken)
            raise _Sent(self.broken or broken) from None
        try:
            await call.done.wait()  # set by the reader, by _fail, or by the sweeper's deadline
        except BaseException:
            self._pending.pop(req_id, None)
            raise
        if call.exc is not None:
            if isinstance(call.exc, Unavailable):
                raise _Sent(call.exc)
            raise call.exc
        return call.result, call.payload


class _Sent(Exception):
    """Internal: the connection failed after the request may have reached the server."""

    def __init__(self, cause: JPFSError):
        super().__init__(str(cause))
        self.cause = cause


async def connect(
    address: str, secret: bytes, nursery: trio.Nursery, *, limits: F.Limits = F.Limits(),
    timeout: float = 5.0, peer_timeout: float = DEFAULT_PEER_TIMEOUT,
) -> Connection:
    """Open, authenticate and start the reader of one connection."""
    host, port = parse_address(address)
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    sock = _socket.socket(family, _socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        with trio.fail_after(max(timeout, 0.001)):
            err = sock.connect_ex((host, port))
            if err in (errno.EINPROGRESS, errno.EAGAIN):
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            fs = F.FrameSocket(sock, limits)
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                role = await client_handshake(fs, secret)
    except trio.TooSlowError:
        _close(sock)
        raise Silent(f"{address} did not answer within {timeout:.3g} s") from None
    except EOFError:
        _close(sock)
        raise Unavailable(f"{address} closed the connection during the handshake") from None
    except OSError as e:
        _close(sock)
        if isinstance(e, (ProtocolError, AuthError)):  # name the server that spoke so
            raise type(e)(f"{address}: {e.strerror}") from None
        if isinstance(e, JPFSError):
            raise
        if e.errno == errno.ECONNREFUSED:
            raise Refused(f"{address} refused the connection") from None
        raise Unavailable(f"cannot connect to {address}: {e.strerror or e}") from None
    except BaseException:
        _close(sock)
        raise
    conn = Connection(fs, address, role, nursery, peer_timeout)
    nursery.start_soon(conn.reader)
    nursery.start_soon(conn.sweeper)
    return conn


def _close(sock: _socket.socket) -> None:
    try:
        trio.lowlevel.notify_closing(sock)
    except RuntimeError:
        pass
    sock.close()


class Pool:
    """Connections to an ordered list of servers of one role (shards or storage nodes).

    Calls name a server by index. A broken connection is replaced on the next call; a call that
    fails because the server is unreachable is retried with backoff for ``retry_for`` seconds when
    that is safe: always if the request never left, and for idempotent methods otherwise. A
    refused connection is not retried (the daemon is not running); a connection attempt gets
    ``peer_timeout`` seconds at most, and ``retry_for`` defaults to it. ``refused_retry_for``
    (default 0) is for callers that would rather ride out a restart than answer at once.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        addresses: list[str],
        secret: bytes,
        *,
        role: str,
        limits: F.Limits = F.Limits(),
        connections_per_server: int = 1,
        retry_for: float | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        refused_retry_for: float = 0.0,
    ):
        self.nursery = nursery
        self.addresses = list(addresses)
        self.secret = secret
        self.role = role
        self.limits = limits
        self.per_server = connections_per_server
        self.peer_timeout = peer_timeout
        self.retry_for = peer_timeout if retry_for is None else retry_for
        self.refused_retry_for = refused_retry_for
        self.timeout = timeout
        self._conns: list[list[Connection]] = [[] for _ in addresses]
        self._locks = [trio.Lock() for _ in addresses]
        self._rr = itertools.count()

    def __len__(self) -> int:
        return len(self.addresses)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Follow a new cluster map: servers are appended, or move to another address (their
        connections close; calls in flight on them fail and retry by the usual rules).
        Indices keep their meaning, so the list never shrinks."""
        if len(addresses) < len(self.addresses):
            raise ValueError(f"{self.role} servers never go away: {len(addresses)} addresses "
                             f"for {len(self.addresses)} indices")
        for i, address in enumerate(addresses):
            if i >= len(self.addresses):
                self.addresses.append(address)
                self._conns.append([])
                self._locks.append(trio.Lock())
            elif address != self.addresses[i]:
                self.addresses[i] = address
                for c in self._conns[i]:
                    c.close()
                self._conns[i] = []

    def name(self, index: int) -> str:
        """How errors name server ``index``: ``storage node 1 (127.0.0.1:7402)``."""
        role = ROLE_NAMES.get(self.role, f"{self.role} server")
        return f"{role} {index} ({self.addresses[index]})"

    async def _connection(self, index: int, deadline: float) -> Connection:
        conns = self._conns[index]
        live = [c for c in conns if c.alive]
        if len(live) != len(conns):
            self._conns[index] = conns = live
        if len(conns) >= self.per_server:
            return min(conns, key=lambda c: c.in_flight)
        # the slow path only: waiting for another task's connection attempt counts too. An
        # attempt gets peer_timeout (within the call's deadline) whatever the retry window is.
        left = min(deadline - trio.current_time(), self.peer_timeout)
        with trio.move_on_after(max(left, 0.001)):
            async with self._locks[index]:
                conns = self._conns[index] = [c for c in self._conns[index] if c.alive]
                if len(conns) < self.per_server and (not conns or conns[0].in_flight):
                    conn = await connect(self.addresses[index], self.secret, self.nursery,
                                         limits=self.limits,
                                         timeout=max(left, 0.001),
                                         peer_timeout=self.peer_timeout)
                    conns.append(conn)
                    return conn
                return min(conns, key=lambda c: c.in_flight)
        raise Silent(f"{self.addresses[index]} did not answer within {self.peer_timeout:.3g} s")

    def _named(self, index: int, e: JPFSError) -> JPFSError:
        """``e`` reworded to name the server by role and index (the address alone says little
        to a user who has to find the daemon)."""
        address = self.addresses[index]
        if isinstance(e, Refused):
            return Refused(f"{self.name(index)} refused the connection (not running?)")
        if isinstance(e, Silent):
            return Silent(f"{self.name(index)} did not answer within "
                          f"{self.peer_timeout:.3g} s")
        if type(e) not in (Unavailable, DeadlineError):
            return e
        text = (e.strerror or str(e)).replace(f"{self.role} server {address}", "the server")
        message = f"{self.name(index)}: {text.replace(address, 'the server')}"
        return Unavailable(message) if type(e) is Unavailable else DeadlineError(message)

    async def call(self, index: int, method: Method, args: Sequence[Any],
                   payload: F.Payload = (), **kw) -> object:
        """Call ``method`` on server ``index`` and return its result."""
        result, _ = await self.call_payload(index, method, args, payload, **kw)
        return result

    async def call_payload(
        self,
        index: int,
        method: Method,
        args: Sequence[Any],
        payload: F.Payload = (),
        *,
        timeout: float | None = None,
        into: memoryview | list[memoryview] | None = None,
        retry_for: float | None = None,
    ) -> tuple[object, memoryview | list[memoryview] | None]:
        """Call ``method`` on server ``index``; returns (result, reply payload or None).

        ``into`` receives the reply payload when its size matches (no copy; a list of buffers
        is filled in order and returned as the payload); ``timeout`` bounds
        the whole call including retries, ``retry_for`` how long an unreachable server is retried.
        """
        if not 0 <= index < len(self.addresses):
            raise error(errno.EINVAL, f"no {self.role} server number {index}")
        now = trio.current_time()
        deadline = now + (self.timeout if timeout is None else timeout)
        give_up = min(deadline, now + (self.retry_for if retry_for is None else retry_for))
        delay = 0.02
        last: JPFSError
        while True:
            try:
                conn = await self._connection(index, deadline)
                return await conn.call(method, args, payload, deadline=deadline, into=into)
            except Refused as e:  # an answer: nothing listens there
                if trio.current_time() + delay >= min(deadline, now + self.refused_retry_for):
                    raise self._named(index, e) from None
                last = e
            except Unavailable as e:  # never reached the server: always safe to retry
                last = e
            except _Sent as e:
                if not method.idempotent:
                    raise self._named(index, e.cause) from None
                last = e.cause
            except DeadlineError as e:
                raise self._named(index, e) from None
            if trio.current_time() + delay >= give_up:
                raise self._named(index, last)
            log.debug("%s server %s unavailable (%s); retrying", self.role,
                      self.addresses[index], last.strerror)
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def close(self) -> None:
        """Close every connection to every server; a later call connects afresh."""
        for conns in self._conns:
            for c in conns:
                c.close()
        self._conns = [[] for _ in self.addresses]
