"""Length-prefixed frames over a trio socket.

A frame is a 16-byte header, a msgpack body, then an optional raw payload::

    magic "JP" | version u8 | kind u8 | body length u32 | payload length u64   (network order)

The payload carries bulk bytes (file data) outside msgpack, so they are never copied through the
codec: the sender hands over buffers or ``sendfile`` segments, the receiver reads straight into a
buffer it chose (``recv_into``). Every length is checked against ``Limits`` before anything is
allocated, so a hostile peer cannot make us allocate gigabytes.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket as _socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import trio

from ..errors import JPFSError, ProtocolError, Unavailable, errno_name, from_name

MAGIC = b"JP"
VERSION = 1
HEADER = struct.Struct("!2sBBIQ")
HEADER_SIZE = HEADER.size

# Frame kinds.
REQUEST = 1
RESPONSE = 2
ERROR = 3
HELLO = 4
AUTH = 5
AUTH_OK = 6
KINDS = frozenset({REQUEST, RESPONSE, ERROR, HELLO, AUTH, AUTH_OK})

PING = 0
"""The method id of a liveness probe: every server answers it on its request loop, before any
service's methods (whose ids start at 1), so an answer proves the daemon's loop runs."""

def _uninitialized_bytearray() -> Callable[[int], bytearray]:
    """CPython's ``PyByteArray_FromStringAndSize(NULL, n)``: a bytearray whose bytes are not
    zeroed first (``bytearray(n)`` writes n zeros), or plain ``bytearray`` elsewhere."""
    try:
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:
        return bytearray
    make.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
    make.restype = ctypes.py_object
    return lambda n: make(None, n) if n > 0 else bytearray()


receive_buffer = _uninitialized_bytearray()
"""A buffer of n bytes for a receive to fill whole: zeroing it first would only cost a pass
over memory (3% of the mount's CPU in a cold epoch). Its bytes are whatever the allocator
had until the receive writes them; callers that may not fill it must use ``bytearray``."""

_RECV_BUFFER = 256 << 10
_SCATTER_DIRECT = 64 << 10
"""Scatter-receive parts at least this big go straight from the socket into their buffer."""
_IOV_MAX = 64
"""Buffers per ``recvmsg_into`` of a threaded receive."""
_THREAD_RECV = 1 << 20
"""Payload parts of at least this many bytes are received in a worker thread: the copy out of
the socket (and the first touch of fresh buffer pages) then runs in the kernel beside the event
loop, on another core, not on the loop. Below it the thread hop costs more than the copy."""


@dataclass(frozen=True)
class Limits:
    """The largest frame parts a peer may send us."""

    max_body: int = 64 << 20
    max_payload: int = 1 << 30


@dataclass(frozen=True, slots=True)
class FileSegment:
    """``length`` bytes of open file ``fd`` from ``offset``: sent with ``os.sendfile``."""

    fd: int
    offset: int
    length: int


Payload = Sequence["bytes | bytearray | memoryview | FileSegment"]


def payload_length(parts: Payload) -> int:
    """Bytes a payload of byte views and file segments puts on the wire."""
    return sum(p.length if isinstance(p, FileSegment) else len(p) for p in parts)


def pack_body(obj) -> bytes:
    """A frame body as msgpack (bytes stay bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack_body(data) -> object:
    """A frame body from msgpack; malformed input is a ProtocolError."""
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame body: {e}") from None


def _why(e: BaseException) -> str:
    if isinstance(e, trio.ClosedResourceError):
        return "closed locally"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def encode_error(req_id: int, exc: JPFSError) -> list:
    """The body of an ERROR frame: [request id, errno name, message]."""
    return [req_id, errno_name(exc.errno or 5), exc.strerror or str(exc)]


def decode_error(body: object) -> JPFSError:
    """Rebuild the exception an ERROR frame carries."""
    if isinstance(body, list) and len(body) == 3 and isinstance(body[1], str):
        return from_name(body[1], body[2] if isinstance(body[2], str) else None)
    return ProtocolError("malformed error frame")


def _recv_exact_blocking(sock: _socket.socket, dests: list[memoryview]) -> int:
    """Fill ``dests`` in order from the non-blocking ``sock``, waiting in poll(2); for a worker
    thread (the socket calls drop the GIL while the kernel copies). Returns the bytes received,
    short only at the end of the stream; gives up when the calling task is cancelled."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    total = 0
    k = 0
    while k < len(dests):
        try:
            got = sock.recvmsg_into(dests[k:k + _IOV_MAX])[0]
        except BlockingIOError:
            trio.from_thread.check_cancelled()
            poller.poll(100)
            continue
        except InterruptedError:
            continue
        if not got:
            break
        total += got
        while got:  # advance past what this call filled
            n = len(dests[k])
            if got >= n:
                got -= n
                k += 1
            else:
                dests[k] = dests[k][got:]
                got = 0
    return total


class FrameSocket:
    """One connected, non-blocking socket that reads and writes frames under trio.

    Reads are buffered (many small frames per ``recv``); writes are scatter-gather (``sendmsg``)
    plus ``sendfile`` for file segments. Every syscall is tried at once and only waits (trio's
    ``wait_readable``/``wait_writable``) when it would block: a request/response round trip then
    costs a few syscalls instead of several scheduler passes per socket call, which is what
    bounds one-call-at-a-time metadata rates. One task reads and one task at a time writes;
    callers serialise writes with ``send_lock``.
    """

    def __init__(self, sock: _socket.socket, limits: Limits = Limits()):
        sock.setblocking(False)
        self.sock = sock
        self.limits = limits
        self.send_lock = trio.Lock()
        self._buf = bytearray(_RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._threads = 0  # receives running in worker threads
        self.closed = False

    # ---------------------------------------------------------------- receiving

    async def _recv_into(self, view: memoryview) -> int:
        while True:
            try:
                return self.sock.recv_into(view)
            except BlockingIOError:
                pass
            except InterruptedError:
                continue
            except OSError as e:
                raise Unavailable(f"connection lost: {_why(e)}") from None
            try:
                await trio.lowlevel.wait_readable(self.sock)
            except (trio.ClosedResourceError, OSError) as e:
                raise Unavailable(f"connection lost: {_why(e)}") from None

    async def _fill(self, need: int) -> None:
        """Ensure ``need`` bytes are buffered (need <= buffer size)."""
        if self._end - self._start >= need:
            return
        if self._start and len(self._buf) - self._start < need:
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        while self._end - self._start < need:
            got = await self._recv_into(self._view[self._end:])
            if not got:
                if self._end == self._start:
                    raise EOFError
                raise ProtocolError("connection closed in the middle of a frame")
            self._end += got

    async def _read_exact_into(self, dest: memoryview) -> None:
        """Fill ``dest``: first from the buffer, then straight from the socket."""
        have = min(self._end - self._start, len(dest))
        if have:
            dest[:have] = self._view[self._start:self._start + have]
            self._start += have
        pos = have
        if len(dest) - pos >= _THREAD_RECV:
            pos += await self._recv_in_thread([dest[pos:]])
            if pos < len(dest):
                raise ProtocolError("connection closed in the middle of a frame")
        while pos < len(dest):
            got = await self._recv_into(dest[pos:])
            if not got:
                raise ProtocolError("connection closed in the middle of a frame")
            pos += got

    async def _recv_in_thread(self, dests: list[memoryview]) -> int:
        """Fill ``dests`` in a worker thread; the bytes received (short at end of stream).

        While the thread runs, ``close`` only shuts the socket down (the thread then sees the
        end of the stream) and the descriptor is closed when it returns, so the thread never
        reads from a number the kernel gave to another file.
        """
        self._threads += 1
        try:
            return await trio.to_thread.run_sync(_recv_exact_blocking, self.sock, dests)
        except OSError as e:
            raise Unavailable(f"connection lost: {_why(e)}") from None
        finally:
            self._threads -= 1
            if self.closed and not self._threads:
                self.sock.close()

    def frame_buffered(self) -> bool:
        """Whether a whole frame is already buffered (reading it won't wait)."""
        have = self._end - self._start
        if have < HEADER_SIZE:
            return False
        _, _, _, body_len, payload_len = HEADER.unpack_from(self._buf, self._start)
        return have >= HEADER_SIZE + body_len + payload_len

    async def read_header(self) -> tuple[int, int, int]:
        """Read and check one header: (kind, body length, payload length); EOFError at clean end."""
        await self._fill(HEADER_SIZE)
        magic, version, kind, body_len, payload_len = HEADER.unpack_from(self._buf, self._start)
        self._start += HEADER_SIZE
        if magic != MAGIC:
            raise ProtocolError("not a JPFS frame (bad magic)")
        if version != VERSION:
            raise ProtocolError(
                f"unsupported protocol version {version} (this side speaks {VERSION}: the peer "
                "runs a JPFS release with another wire protocol; run one release on both)")
        if kind not in KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        if body_len > self.limits.max_body:
            raise ProtocolError(
                f"frame body of {body_len} bytes exceeds the limit of {self.limits.max_body}")
        if payload_len > self.limits.max_payload:
            raise ProtocolError(
                f"frame payload of {payload_len} bytes exceeds the limit of "
                f"{self.limits.max_payload}")
        return kind, body_len, payload_len

    async def read_body(self, body_len: int) -> object:
        """Read a frame body of ``body_len`` bytes and unpack it; ProtocolError if it is not
        msgpack."""
        if body_len <= len(self._buf):
            await self._fill(body_len)
            body = unpack_body(self._view[self._start:self._start + body_len])
            self._start += body_len
            return body
        big = bytearray(body_len)
        await self._read_exact_into(memoryview(big))
        return unpack_body(big)

    async def read_payload(
        self, length: int, dest: memoryview | list[memoryview] | None = None
    ) -> memoryview | list[memoryview]:
        """Read a payload into ``dest`` (if given and the right size) or a fresh buffer.

        ``dest`` may be a list of byte buffers filled one after the other (scatter receive);
        it is used only if their sizes add up to ``length``, and then returned as it is.
        """
        if isinstance(dest, list):
            if sum(len(d) for d in dest) == length:
                await self._scatter_into(dest)
                return dest
            dest = None
        if dest is None or len(dest) != length:
            dest = memoryview(receive_buffer(length))
        if length:
            await self._read_exact_into(dest)
        return dest

    async def _scatter_into(self, parts: list[memoryview]) -> None:
        """Fill ``parts`` in order: big ones straight from the socket, small ones copied out of
        the stream buffer (one recv serves many; no await while they are buffered)."""
        view = self._view
        if sum(map(len, parts)) - (self._end - self._start) >= _THREAD_RECV:
            rest = self._drain_into(parts)
            want = sum(map(len, rest))
            if await self._recv_in_thread(rest) < want:
                raise ProtocolError("connection closed in the middle of a frame")
            return
        for d in parts:
            n = len(d)
            if n >= _SCATTER_DIRECT:
                await self._read_exact_into(d)
                continue
            if self._end - self._start < n:
                await self._fill(n)
            start = self._start
            d[:] = view[start:start + n]
            self._start = start + n

    def _drain_into(self, parts: list[memoryview]) -> list[memoryview]:
        """Copy what is buffered into the first of ``parts``; the views still to fill."""
        rest: list[memoryview] = []
        for d in parts:
            have = min(self._end - self._start, len(d))
            if have:
                d[:have] = self._view[self._start:self._start + have]
                self._start += have
            if have < len(d):
                rest.append(d[have:])
        return rest

    async def skip_payload(self, length: int) -> None:
        """Read and discard ``length`` payload bytes (a payload nobody wants), 1 MiB at a time."""
        scratch = memoryview(bytearray(min(length, 1 << 20)))
        while length:
            n = min(length, len(scratch))
            await self._read_exact_into(scratch[:n])
            length -= n

    async def read_frame(
        self, choose_dest: Callable[[int, object, int], memoryview | list[memoryview] | None]
        | None = None
    ) -> tuple[int, object, memoryview | list[memoryview] | None]:
        """Read one whole frame: (kind, body, payload or None)."""
        kind, body_len, payload_len = await self.read_header()
        body = await self.read_body(body_len)
        payload = None
        if payload_len:
            dest = choose_dest(kind, body, payload_len) if choose_dest else None
            payload = await self.read_payload(payload_len, dest)
        return kind, body, payload

    # ---------------------------------------------------------------- sending

    @staticmethod
    def frame_parts(kind: int, body: object, payload: Payload = ()) -> list:
        """A frame as a list of byte views and FileSegments, ready for ``send_parts``."""
        raw = pack_body(body)
        head = HEADER.pack(MAGIC, VERSION, kind, len(raw), payload_length(payload))
        parts: list = [memoryview(head), memoryview(raw)]
        for part in payload:
            if isinstance(part, FileSegment):
                if part.length:
                    parts.append(part)
            elif len(part):
                parts.append(memoryview(part).cast("B"))
        return parts

    def send_parts_nowait(self, parts: list) -> list:
        """Send what the socket takes now, without waiting; returns the parts still to send
        (empty when all went out). Stops at a FileSegment, which ``send_parts`` sends. A
        non-empty answer means a partial frame is on the wire: finish it before anyone else
        sends (hold ``send_lock``)."""
        while parts and not isinstance(parts[0], FileSegment):
            n = 0
            while n < len(parts) and n < 64 and not isinstance(parts[n], FileSegment):
                n += 1
            try:
                sent = self.sock.sendmsg(parts[:n])
            except (BlockingIOError, InterruptedError):
                return parts
            except OSError as e:
                raise Unavailable(f"connection lost: {_why(e)}") from None
            while sent:
                if sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                else:
                    parts[0] = parts[0][sent:]
                    sent = 0
        return parts

    async def send_parts(self, parts: list) -> None:
        """Send every part, waiting for the socket as needed. The caller holds ``send_lock``."""
        while parts:
            parts = self.send_parts_nowait(parts)
            if not parts:
                return
            if isinstance(parts[0], FileSegment):
                await self._sendfile_all(parts.pop(0))
                continue
            try:
                await trio.lowlevel.wait_writable(self.sock)
            except (trio.ClosedResourceError, OSError) as e:
                raise Unavailable(f"connection lost: {_why(e)}") from None

    async def send_frame(self, kind: int, body: object, payload: Payload = ()) -> None:
        """Send one frame. The caller holds ``send_lock``."""
        await self.send_parts(self.frame_parts(kind, body, payload))

    async def _sendfile_all(self, seg: FileSegment) -> None:
        offset, left = seg.offset, seg.length
        fileno = self.sock.fileno()
        while left:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                sent = os.sendfile(fileno, seg.fd, offset, left)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(self.sock)
                except (trio.ClosedResourceError, OSError) as e:
                    raise Unavailable(f"connection lost: {_why(e)}") from None
                continue
            except OSError as e:
                raise Unavailable(f"connection lost: {_why(e)}") from None
            if sent == 0:
                raise ProtocolError("file segment shorter than announced (file truncated?)")
            offset += sent
            left -= sent

    def close(self) -> None:
        """Close the socket (idempotent), waking any trio task or receiving thread blocked on it."""
        if not self.closed:
            self.closed = True
            try:
                trio.lowlevel.notify_closing(self.sock)  # wake any task waiting on it
            except RuntimeError:  # not inside trio: nobody can be waiting
                pass
            if self._threads:  # wake the receiving thread; it closes the socket on return
                try:
                    self.sock.shutdown(_socket.SHUT_RDWR)
                except OSError:
                    pass
            else:
                self.sock.close()
