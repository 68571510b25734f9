"""``serve()``: accept connections, authenticate, and run requests concurrently.

One connection carries many requests in flight (each answered by request id, in completion order).
Bad input never takes the server down: a malformed frame or a failed handshake closes that one
connection (after telling the peer why, where the stream still allows it); a bad request inside a
good frame gets an error answer and the connection stays up.
"""

from __future__ import annotations

import errno
import logging
import socket as _socket

import trio

from ..errors import JPFSError, ProtocolError, Unavailable, error
from . import frame as F
from .auth import HANDSHAKE_TIMEOUT, server_handshake
from .service import Bound, Defer, Later, Reply, Service, as_error

log = logging.getLogger(__name__)

_PREAUTH_LIMITS = F.Limits(max_body=4096, max_payload=0)
_SEND_TIMEOUT = 60.0
_FAIR_EVERY = 64
"""Requests a connection handles before it lets other tasks run."""


async def serve(
    service: Service,
    host: str,
    port: int,
    secret: bytes,
    *,
    limits: F.Limits = F.Limits(),
    max_inflight: int = 256,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``service`` on ``host:port`` until cancelled; ``task_status.started(port)``.

    Start it with ``port = await nursery.start(serve, ...)``; port 0 picks a free port.
    """
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    listener = _socket.socket(family, _socket.SOCK_STREAM)
    listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    listener.setblocking(False)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    listener.listen(1024)
    bound = listener.getsockname()[1]
    log.info("%s server listening on %s:%d", service.role, host, bound)
    task_status.started(bound)
    try:
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    sock, peer = listener.accept()
                except (BlockingIOError, InterruptedError):
                    await trio.lowlevel.wait_readable(listener)
                    continue
                except OSError as e:  # EMFILE and friends: back off, keep serving
                    log.warning("accept failed: %s", e)
                    await trio.sleep(0.1)
                    continue
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
                nursery.start_soon(_connection, sock, peer, service, secret, limits, max_inflight)
    finally:
        trio.lowlevel.notify_closing(listener)
        listener.close()


async def _connection(sock, peer, service: Service, secret: bytes, limits, max_inflight) -> None:
    fs = F.FrameSocket(sock, _PREAUTH_LIMITS)
    where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT):
            await server_handshake(fs, secret, service.role)
    except (JPFSError, EOFError, trio.TooSlowError) as e:
        if isinstance(e, JPFSError):
            reason = e
        elif isinstance(e, trio.TooSlowError):
            reason = ProtocolError("handshake timed out")
        else:
            reason = ProtocolError("closed during handshake")
        # a bare TCP probe (health check) closes before the handshake: not worth a warning
        log.log(logging.DEBUG if isinstance(e, EOFError) else logging.WARNING,
                "rejected connection from %s: %s", where, reason.strerror)
        await _send_final_error(fs, reason)
        fs.close()
        return
    fs.limits = limits
    try:
        async with trio.open_nursery() as nursery:
            await _request_loop(fs, where, service, nursery, trio.Semaphore(max_inflight))
            nursery.cancel_scope.cancel()
    finally:
        fs.close()


async def _request_loop(fs: F.FrameSocket, where: str, service: Service, nursery, slots) -> None:
    outbox = _Outbox(fs, nursery)
    handled = 0
    while True:
        if outbox.parts and not fs.frame_buffered():
            await outbox.flush()  # the answers to everything that arrived together, in one send
        handled += 1
        if handled % _FAIR_EVERY == 0:
            # a client that keeps the socket full must not starve the rest (the committer,
            # other connections): reads that find data buffered never wait
            await outbox.flush()
            await trio.lowlevel.checkpoint()
        try:
            kind, body_len, payload_len = await fs.read_header()
            if kind != F.REQUEST:
                raise ProtocolError(f"expected a request frame, got kind {kind}")
            body = await fs.read_body(body_len)
        except EOFError:
            return
        except Unavailable:
            return
        except ProtocolError as e:
            log.warning("closing connection from %s: %s", where, e.strerror)
            await outbox.flush()
            await _send_final_error(fs, e)
            return
        req_id, method, args, deadline = _parse_request(body)
        if method == F.PING and type(method) is int and req_id is not None and not payload_len:
            outbox.add(F.FrameSocket.frame_parts(F.RESPONSE, [req_id, None]))  # I am alive
            continue
        bound = service.lookup(method)
        spec = bound.spec if bound is not None else None
        if spec is not None:
            service.requests[spec.name] += 1
        problem: JPFSError | None = None
        if req_id is None:
            problem = ProtocolError("malformed request: expected [id, method, args, deadline]")
        elif spec is None:
            problem = error(errno.ENOSYS, f"unknown method {method!r} for a {service.role} server")
        elif payload_len and not spec.payload:
            problem = error(errno.EINVAL, f"{spec.name}: takes no payload")
        try:
            payload = None
            if problem is None and spec is not None and spec.payload:
                payload = await fs.read_payload(payload_len, service.buffers.take(payload_len)
                                                if bound is not None and bound.recycles else None)
            elif payload_len:
                await fs.skip_payload(payload_len)
        except (ProtocolError, Unavailable):
            return
        if problem is not None or spec is None or bound is None:
            problem = problem or error(errno.ENOSYS, "unknown method")
            if req_id is None:
                await outbox.flush()
                await _send_final_error(fs, problem)
                return
            outbox.add(_answer_parts(service, req_id, None, problem, spec, where))
            continue
        # the one check of the request against its declaration; handlers trust their arguments
        try:
            spec.check(args)
        except JPFSError as e:
            outbox.add(_answer_parts(service, req_id, None, e, spec, where))
            continue
        now = bound.now
        if now is not None:
            try:
                result = now(*args)
            except Defer:
                pass
            except Exception as e:  # as in _run: every failure becomes an answer
                outbox.add(_answer_parts(service, req_id, None, e, spec, where))
                continue
            else:
                if isinstance(result, Later):
                    # answered from the callback; the slot bounds what one connection queues
                    await _take(slots)
                    result.on_settled(_Answer(outbox, where, service, bound, req_id, args,
                                              deadline, slots))
                else:
                    outbox.add(_answer_parts(service, req_id, result, None, spec, where))
                continue
        await _take(slots)
        nursery.start_soon(_run, fs, where, service, bound, req_id, args, deadline, payload, slots)


async def _take(slots: trio.Semaphore) -> None:
    """Take a request slot, waiting (a scheduler pass) only when none is free."""
    try:
        slots.acquire_nowait()
    except trio.WouldBlock:
        await slots.acquire()


class _Outbox:
    """Answers waiting to go out on one connection, sent together: the request loop flushes
    when it has handled every request that arrived in one read, and answers settled by
    callbacks (a group commit settles many at once) are flushed by one task. One ``sendmsg``
    then carries many answers instead of one each."""

    __slots__ = ("fs", "nursery", "parts", "_task")

    def __init__(self, fs: F.FrameSocket, nursery) -> None:
        self.fs, self.nursery, self._task = fs, nursery, False
        self.parts: list = []

    def add(self, parts: list) -> None:
        """Queue an answer; the request loop sends it before it next waits for input."""
        self.parts.extend(parts)

    def add_soon(self, parts: list) -> None:
        """Queue an answer from outside the request loop; a task sends it."""
        if self.fs.closed:
            return
        self.parts.extend(parts)
        if not self._task:
            try:
                self.nursery.start_soon(self._flush_task)
            except RuntimeError:  # the connection is ending
                self.fs.close()
                return
            self._task = True

    async def _flush_task(self) -> None:
        self._task = False
        await self.flush()

    async def flush(self) -> None:
        parts, self.parts = self.parts, []
        if parts:
            await _send_parts(self.fs, parts)


class _Answer:
    """Turns a ``Later``'s outcome into an answer in the connection's outbox, or, settled with
    ``Defer``, runs the request's async handler. Never raises into the settling code."""

    __slots__ = ("outbox", "where", "service", "bound", "req_id", "args", "deadline", "slots")

    def __init__(self, outbox: _Outbox, where, service, bound, req_id, args, deadline,
                 slots) -> None:
        self.outbox, self.where, self.service, self.bound = outbox, where, service, bound
        self.req_id, self.args, self.deadline, self.slots = req_id, args, deadline, slots

    def __call__(self, result: object, exc: BaseException | None) -> None:
        if isinstance(exc, Defer):
            try:  # the async handler keeps the slot and releases it when done
                self.outbox.nursery.start_soon(
                    _run, self.outbox.fs, self.where, self.service, self.bound, self.req_id,
                    self.args, self.deadline, None, self.slots)
                return
            except RuntimeError:  # the connection is ending
                self.slots.release()
                return
        self.slots.release()
        self.outbox.add_soon(_answer_parts(self.service, self.req_id, result, exc,
                                          self.bound.spec, self.where))


def _answer_parts(service: Service, req_id: int, result: object, exc: BaseException | None,
                  spec, where: str) -> list:
    """The frame answering ``req_id``: its result, or the error ``exc`` becomes."""
    try:
        if exc is None:
            return F.FrameSocket.frame_parts(F.RESPONSE, [req_id, result])
        err = exc if isinstance(exc, JPFSError) else _failure(exc, spec, where) \
            if isinstance(exc, Exception) else error(errno.EIO, f"{spec.name}: {exc!r}")
        service.count_error(err)
        return F.FrameSocket.frame_parts(F.ERROR, F.encode_error(req_id, err))
    except Exception as e:  # noqa: BLE001 - an answer msgpack cannot carry
        name = spec.name if spec is not None else "request"
        log.exception("%s from %s: cannot encode the answer", name, where)
        return F.FrameSocket.frame_parts(F.ERROR, F.encode_error(
            req_id, error(errno.EIO, f"{name}: unencodable answer: {e}")))


def _parse_request(body: object) -> tuple:
    if (
        isinstance(body, list)
        and len(body) == 4
        and isinstance(body[0], int)
        and not isinstance(body[0], bool)
        and 0 <= body[0] < (1 << 63)
        and (body[3] is None or isinstance(body[3], (int, float)))
    ):
        return body[0], body[1], body[2], body[3]
    return None, None, None, None


async def _run(fs, where, service: Service, bound: Bound, req_id, args, deadline, payload,
               slots) -> None:
    spec = bound.spec
    try:
        try:
            fn = bound.run
            if fn is None:
                raise error(errno.EIO, f"{spec.name}: deferred, but there is no async handler")
            kwargs = {"payload": payload} if spec.payload else {}
            with trio.move_on_after(deadline / 1000 if deadline else float("inf")) as scope:
                result = await fn(*args, **kwargs)
            if scope.cancelled_caught:
                raise error(errno.ETIMEDOUT, f"{spec.name}: deadline exceeded on the server")
        except Exception as e:  # every failure becomes an answer; the server lives on
            err = _failure(e, spec, where)
            service.count_error(err)
            await _send(fs, F.ERROR, F.encode_error(req_id, err))
            return
        if bound.recycles and isinstance(payload, memoryview):
            service.buffers.give(payload)  # the handler returned: nothing holds it
        if isinstance(result, Reply):
            try:
                await _send(fs, F.RESPONSE, [req_id, result.result], result.payload)
            finally:
                on_sent = result.on_sent
                if callable(on_sent):
                    on_sent()
        else:
            await _send(fs, F.RESPONSE, [req_id, result])
    finally:
        slots.release()


def _failure(e: Exception, spec, where: str) -> JPFSError:
    err = as_error(e)
    if err is None:
        log.exception("%s from %s failed", spec.name, where)
        err = error(errno.EIO, f"{spec.name}: internal server error: {type(e).__name__}: {e}")
    return err


async def _send(fs: F.FrameSocket, kind: int, body, payload=()) -> None:
    """Send one frame."""
    if not fs.closed:
        await _send_parts(fs, fs.frame_parts(kind, body, payload))


async def _send_parts(fs: F.FrameSocket, parts: list) -> None:
    """Send whole frames; a failure mid-frame leaves the stream unusable, so close it.

    Fast path: when nobody else is sending and the socket takes everything at once, no await
    happens at all."""
    if fs.closed:
        return
    try:
        lock = fs.send_lock
        if not lock.locked():
            lock.acquire_nowait()
            try:
                parts = fs.send_parts_nowait(parts)
                if parts:
                    with trio.fail_after(_SEND_TIMEOUT):
                        await fs.send_parts(parts)
            finally:
                lock.release()
            return
        async with lock:
            if fs.closed:
                return
            with trio.fail_after(_SEND_TIMEOUT):
                await fs.send_parts(parts)
    except (JPFSError, trio.TooSlowError, OSError) as e:
        log.info("dropping connection: send failed: %s", e)
        fs.close()


async def _send_final_error(fs: F.FrameSocket, exc: JPFSError) -> None:
    """Best effort: tell the peer why we are closing."""
    with trio.move_on_after(1.0):
        try:
            async with fs.send_lock:
                await fs.send_frame(F.ERROR, F.encode_error(0, exc))
        except (JPFSError, OSError):
            pass
