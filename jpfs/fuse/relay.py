"""Prefetch in a mount served by several worker processes: the others' evidence reaches worker 0.

Worker 0 alone prefetches (``mount.Share``): it sweeps a directory that a shuffled epoch reads,
hands the files to the kernel's page cache, and holds back the last page of one in
``HAND_SAMPLE`` so that the READ of it says how far the readers are (``vfs/handoff.py``). The
kernel sends each request to whichever worker reads its queue first, so without word from the
others worker 0 would know of a fraction of the entries the kernel holds (a hand-off gives the
kernel only files whose inode it holds), see a fraction of the opens, and miss most held-back
pages (another worker would fetch the file again, and the sweep would stall at ``kernel_ahead``).

Each other worker therefore keeps a stream connection to worker 0 (``Link``, the VFS's
``PrefetchOwner``), over which it sends

- ``NAMED``: the entries it hands the kernel (lookups and READDIRPLUS entries, with their
  attributes), sent before the answer that hands them, so that worker 0, which lists a
  directory through the mount before a hand-off, finds them once the listing returns
  (``Desk.drain``);
- ``READ``: the first READ of a file the kernel opened itself. One at offset 0 is only told
  (it opens the file for prefetch, and ends any hand-off); one past it may be a held-back page,
  so the worker waits for worker 0's answer: the page, or nil, and then reads the file itself.

Worker 0 answers on its ``Desk``, to its siblings only: the socket's name is open to every
process of the host, and a held-back page is a file's bytes. Prefetch is a hint: a link that
is down (worker 0 starting again) or an answer later than ``ANSWER_WITHIN`` costs only a
fetch, never a failed READ.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Callable

import msgpack
import trio

from ..client.vfs.core import VFS
from ..types import Attr

log = logging.getLogger(__name__)

NAMED, READ = 1, 2
"""Message kinds (the first element of each msgpack array)."""
ANSWER_WITHIN = 2.0
"""Seconds a worker waits for worker 0's answer to a READ before fetching the file itself."""
BACKLOG_MAX = 64 << 20
"""Bytes queued to a peer that does not read them before the connection is dropped."""
MESSAGE_MAX = 16 << 20
"""The longest message either side accepts."""
RECONNECT_AFTER = (0.05, 2.0)
"""First and longest wait between attempts to reach worker 0 (doubling)."""


def address(tag: str) -> bytes:
    """Worker 0's socket, in the abstract namespace (``tag``: the supervisor's pid)."""
    return f"\0jpfs-prefetch-{tag}".encode()


class _Stream:
    """A non-blocking stream socket that sends at once from the loop (``send_now``) and queues
    what the socket does not take, for ``flush_queued`` to send as it can."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.closed = False
        self._queued = bytearray()
        self._more = trio.Event()

    def send_now(self, data: bytes) -> None:
        if self.closed:
            return
        if not self._queued:
            try:
                n = self.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                self.close()
                return
            if n == len(data):
                return
            data = data[n:]
        self._queued += data
        if len(self._queued) > BACKLOG_MAX:
            log.warning("a prefetch peer is not reading: dropping its connection")
            self.close()
        self._more.set()

    async def flush_queued(self) -> None:
        """Send what ``send_now`` queued, until closed."""
        while not self.closed:
            await self._more.wait()
            self._more = trio.Event()
            while self._queued and not self.closed:
                if not await _ready(trio.lowlevel.wait_writable, self.sock):
                    return
                try:
                    n = self.sock.send(self._queued)
                except BlockingIOError:
                    continue
                except OSError:
                    self.close()
                    return
                del self._queued[:n]

    def recv_some(self) -> bytes | None:
        """What the socket holds now: b"" if nothing yet, None once the peer is gone."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        return data or None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._more.set()
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()


async def _ready(wait, sock: socket.socket) -> bool:
    """``wait(sock)``; False if the socket was closed meanwhile (by the other task)."""
    try:
        await wait(sock)
    except (trio.ClosedResourceError, OSError, ValueError):
        return False
    return True


def _is_sibling(sock: socket.socket) -> bool:
    """Whether the peer is a worker of this mount (a child of our supervisor, as this user):
    the socket's name is open to every process of the host, and a held-back page is a file's
    bytes."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize("3i")))
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = -1
    if uid == os.getuid() and ppid == os.getppid():
        return True
    log.warning("refused a prefetch link from pid %d (uid %d): not a worker of this mount",
                pid, uid)
    return False


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, max_buffer_size=MESSAGE_MAX)


class Desk:
    """Worker 0's side: takes the other workers' connections and acts on what they send."""

    def __init__(self, vfs: VFS, tag: str):
        self.vfs = vfs
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                                      | socket.SOCK_CLOEXEC)
        self.listener.bind(address(tag))
        self.listener.listen(64)
        self._peers: dict[_Stream, msgpack.Unpacker] = {}
        self.counters = {"peers": 0, "entries": 0, "reads": 0, "pages": 0}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Take connections and serve each, until cancelled (start it with ``nursery.start``)."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            try:
                while True:
                    await trio.lowlevel.wait_readable(self.listener)
                    try:
                        sock, _ = self.listener.accept()
                    except BlockingIOError:
                        continue
                    except OSError as e:  # out of descriptors, say: the desk waits, not dies
                        log.warning("taking a prefetch link: %s", e.strerror)
                        await trio.sleep(0.1)
                        continue
                    try:
                        sibling = _is_sibling(sock)
                    except OSError as e:
                        log.warning("checking a prefetch link's peer: %s", e.strerror)
                        sibling = False
                    if not sibling:
                        sock.close()
                        continue
                    sock.setblocking(False)
                    peer = _Stream(sock)
                    self._peers[peer] = _unpacker()
                    self.counters["peers"] = len(self._peers)
                    nursery.start_soon(self._serve, peer)
                    nursery.start_soon(peer.flush_queued)
            finally:
                self.listener.close()

    async def _serve(self, peer: _Stream) -> None:
        try:
            while not peer.closed and await _ready(trio.lowlevel.wait_readable, peer.sock):
                self._take(peer)
        finally:
            peer.close()
            self._peers.pop(peer, None)
            self.counters["peers"] = len(self._peers)

    def drain(self) -> None:
        """Act on everything the peers have sent so far (after a listing through the mount:
        the entries its READDIRPLUS answers handed the kernel are in the sockets by then)."""
        for peer in list(self._peers):
            self._take(peer)

    def _take(self, peer: _Stream) -> None:
        unpacker = self._peers.get(peer)
        while unpacker is not None and not peer.closed:
            data = peer.recv_some()
            if not data:
                if data is None:
                    peer.close()
                return
            try:
                unpacker.feed(data)
                for msg in unpacker:
                    self._act(peer, msg)
            except Exception:  # noqa: BLE001 - the boundary: a peer's bad stream ends only it
                log.exception("a prefetch message from a worker failed; dropping its link")
                peer.close()

    def _act(self, peer: _Stream, msg: list) -> None:
        kind = msg[0]
        if kind == NAMED:
            entries = [(Attr.from_wire(wire), parent, name) for wire, parent, name in msg[1]]
            if not all(isinstance(p, int) and isinstance(n, bytes) for _, p, n in entries):
                raise ValueError("an entry's parent or name is of the wrong type")
            remember = self.vfs.inodes.remember
            for attr, parent, name in entries:
                remember(attr, parent, name)
            self.counters["entries"] += len(msg[1])
        elif kind == READ:
            _, ask, ino, off, size, stream = msg
            page = self.vfs.peer_read(ino, off, size, stream)
            self.counters["reads"] += 1
            if page is not None:
                self.counters["pages"] += 1
            if ask:
                peer.send_now(msgpack.packb([ask, page]))
        else:
            raise ValueError(f"unknown prefetch message kind {kind!r}")


class Link:
    """Another worker's side: the VFS's ``PrefetchOwner``, a connection to worker 0 kept up
    (``run``), and the entries to send before the next answer to the kernel (``flush``)."""

    def __init__(self, tag: str):
        self.address = address(tag)
        self._stream: _Stream | None = None
        self._entries: list[tuple[list, int, bytes]] = []
        self._asked: dict[int, list] = {}
        self._next = 1
        self.counters = {"connected": False, "entries": 0, "reads": 0, "pages": 0,
                         "unanswered": 0}

    def named(self, attr: Attr, parent: int, name: bytes) -> None:
        """An entry handed to the kernel: sent with the next ``flush``."""
        if self._stream is not None or len(self._entries) < 100_000:
            self._entries.append((attr.to_wire(), parent, name))

    def flush(self) -> None:
        """Send the entries named since the last flush (the engine calls it before each
        answer, so worker 0 hears of entries before the kernel can use them)."""
        s = self._stream
        if self._entries and s is not None:
            s.send_now(msgpack.packb([NAMED, self._entries]))
            self.counters["entries"] += len(self._entries)
            self._entries = []

    async def first_read(self, ino: int, off: int, size: int, stream: int) -> bytes | None:
        """``PrefetchOwner.first_read``."""
        s = self._stream
        if s is None:
            return None
        self.flush()
        self.counters["reads"] += 1
        if off == 0:  # not a held-back page: worker 0 need only know
            s.send_now(msgpack.packb([READ, 0, ino, off, size, stream]))
            return None
        ask = self._next
        self._next += 1
        slot: list = [trio.Event(), None]
        self._asked[ask] = slot
        try:
            s.send_now(msgpack.packb([READ, ask, ino, off, size, stream]))
            with trio.move_on_after(ANSWER_WITHIN) as waited:
                await slot[0].wait()
            if waited.cancelled_caught:
                self.counters["unanswered"] += 1
        finally:
            self._asked.pop(ask, None)
        if slot[1] is not None:
            self.counters["pages"] += 1
        return slot[1]

    async def run(self, *, connected: Callable[[], None] | None = None) -> None:
        """Reach worker 0 and take its answers, again whenever the connection ends (worker 0
        was started again), until cancelled."""
        wait = RECONNECT_AFTER[0]
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                                 | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self.address)
            except OSError:  # not listening yet (starting), or its backlog is full
                sock.close()
                await trio.sleep(wait)
                wait = min(wait * 2, RECONNECT_AFTER[1])
                continue
            wait = RECONNECT_AFTER[0]
            stream = self._stream = _Stream(sock)
            self.counters["connected"] = True
            self.flush()
            if connected is not None:
                connected()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream.flush_queued)
                    await self._answers(stream)
                    nursery.cancel_scope.cancel()
            finally:
                self._stream = None
                self.counters["connected"] = False
                stream.close()
                for slot in self._asked.values():  # fetched here instead
                    slot[0].set()
            log.info("the link to worker 0 (prefetch) ended; reconnecting")

    async def _answers(self, stream: _Stream) -> None:
        unpacker = _unpacker()
        while not stream.closed and await _ready(trio.lowlevel.wait_readable, stream.sock):
            data = stream.recv_some()
            if data is None:
                return
            try:
                unpacker.feed(data)
                for ask, page in unpacker:
                    slot = self._asked.get(ask)
                    if slot is not None:
                        slot[1] = page
                        slot[0].set()
            except Exception:  # noqa: BLE001 - the boundary: a bad answer ends only the link
                log.exception("an answer from worker 0 (prefetch) failed; reconnecting")
                return


__all__ = ["ANSWER_WITHIN", "Desk", "Link", "address"]
