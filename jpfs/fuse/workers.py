"""A mount served by worker processes (``jpfs mount --engine jpfs``).

One Python process serves one core's worth of requests: the GIL lets a single interpreter run at
a time, however many threads read the descriptor. So this mount is a supervisor and worker
processes. The supervisor mounts, answers the kernel's INIT, and forks the workers; each clones
the session's descriptor (the clones share the kernel's queue of requests), connects a VFS of
its own to the cluster, and serves with an ``Engine``. The kernel's page cache is the cache they
share; each has a slice of the memory and disk caches.

This suits a read-only mount, where any worker can serve any request: FUSE inode numbers are
JPFS's, the kernel opens files and directories itself (so no request names a handle another
worker made), and a READ of an inode a worker never looked up fetches its attributes by number.
Worker 0 alone fetches ahead; the others tell it what they serve (``relay.py``), and every
worker tells the others of the inodes the kernel forgot (``ForgetRelay``).
A read-write mount keeps per-handle state (writers, leases), so the engine serves read-only
mounts only; pyfuse3 serves the rest.

The supervisor restarts a worker that dies; the others go on serving meanwhile, and since the
supervisor holds the session's first descriptor, the kernel keeps the mount (the requests the
dead worker held fail, ``ECONNABORTED``; nothing else does). It exits once unmounted (the
workers see ENODEV and end) or on SIGTERM, SIGINT or SIGHUP, after unmounting. Workers die with
it (``PR_SET_PDEATHSIG``), so a killed supervisor leaves a mount that reports ENOTCONN and that
the next mount or ``jpfs umount`` clears, as a killed pyfuse3 daemon does.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import time
from collections.abc import Callable

import trio

from ..errors import error
from . import hints, kernel, relay
from .engine import Engine, EngineNotifier, EngineReads
from .mount import (
    FSNAME,
    MountOptions,
    Share,
    check_mountpoint,
    control_snapshots,
    fuse_options,
    is_jpfs_mount,
    mount_parts,
    prepare_daemon,
    ready_callback,
    state_file,
    tune_readahead,
)
from .operations import Operations

log = logging.getLogger(__name__)

MAX_WORKERS = 16
"""Workers by default: one per core, at most this many."""
START_TIMEOUT = 60.0
"""Seconds each worker has to connect to the cluster before the mount gives up."""
RESTARTS_PER_MINUTE = 10
"""A worker that dies more often than this is not started again (the others go on serving)."""
PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    """One worker per core this process may run on, at most ``MAX_WORKERS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


class _Stop(Exception):
    """A signal asked the supervisor to unmount."""


def run_foreground(opts: MountOptions, ready_fd: int | None = None) -> int:
    """Serve in this process and its workers (``--foreground``); ``ready_fd`` gets "ok" once
    every worker serves."""
    prepare_daemon(opts)
    return run(opts, ready_callback(ready_fd))


def run(opts: MountOptions, ready: Callable[[], None] | None = None) -> int:
    """Mount ``opts.mountpoint`` and serve it with worker processes until unmounted or signalled;
    ``ready`` is called once every worker serves."""
    if not opts.read_only:
        raise error(errno.EINVAL, "the jpfs engine serves read-only mounts (--read-only); "
                    "read-write mounts use the pyfuse3 engine", opts.mountpoint)
    mp = os.path.abspath(opts.mountpoint)
    check_mountpoint(mp, opts.nonempty)
    n = opts.workers or default_workers()
    session = kernel.Session.mount(mp, FSNAME, fuse_options(opts))
    sf = state_file(mp)
    sup = Supervisor(session, opts, n)
    previous = {s: signal.signal(s, sup.stop) for s in (signal.SIGTERM, signal.SIGINT,
                                                        signal.SIGHUP)}
    try:
        session.init()
        tune_readahead(mp, opts.read_ahead)
        sup.start_all()
        sf.parent.mkdir(parents=True, exist_ok=True)
        sf.write_text(json.dumps({"pid": os.getpid(), "mountpoint": mp,
                                  "cluster": str(opts.cluster), "log_file": opts.log_file,
                                  "engine": "jpfs", "workers": sup.pids(),
                                  "started": time.time()}))
        log.info("mounted %s at %s (read-only, jpfs engine, %d workers, prefetch %s)",
                 opts.cluster, mp, n, "on" if opts.prefetch else "off")
        if ready is not None:
            ready()
        sup.watch()
    except _Stop:
        pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        kernel.unmount(mp)
        sup.end()
        session.close()
        try:
            if json.loads(sf.read_text()).get("pid") == os.getpid():
                sf.unlink()
        except (OSError, ValueError):
            pass
        shutil.rmtree(control_snapshots(mp), ignore_errors=True)
        log.info("unmounted %s", mp)
    return 0


class Supervisor:
    """Starts, watches and restarts the workers of one session."""

    def __init__(self, session: kernel.Session, opts: MountOptions, count: int):
        self.session = session
        self.opts = opts
        self.count = count
        self.workers: dict[int, int] = {}
        """pid -> worker index."""
        self.deaths: list[float] = []
        self.stopping = False

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return sorted(self.workers)

    def stop(self, signum: int, frame) -> None:
        """A signal handler: unmount and end (raised out of whatever the supervisor waits on)."""
        log.info("signal %s: unmounting", signal.Signals(signum).name)
        if not self.stopping:
            self.stopping = True
            raise _Stop()

    def start_all(self) -> None:
        """Start every worker and wait until each serves (or raise what stopped one)."""
        try:  # each worker clones the descriptor: say plainly if it cannot
            os.close(self.session.clone())
        except PermissionError:
            raise error(errno.EACCES, "the jpfs engine's workers open /dev/fuse, which this "
                        "user may not (most distributions make it mode 0666); mount as root, "
                        "or use --engine pyfuse3", self.opts.mountpoint) from None
        pipes = {i: self._start(i, report=True) for i in range(self.count)}
        deadline = time.monotonic() + START_TIMEOUT
        try:
            for i, r in pipes.items():
                got = b""
                while b"\n" not in got:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise error(errno.ETIMEDOUT, f"worker {i} did not start in "
                                    f"{START_TIMEOUT:.0f} s", self.opts.mountpoint)
                    ready = _wait_readable(r, left)
                    piece = os.read(r, 4096) if ready else b""
                    if ready and not piece:
                        raise error(errno.EIO, f"worker {i} failed to start (its log says "
                                    "why)", self.opts.mountpoint)
                    got += piece
        finally:
            for r in pipes.values():
                os.close(r)

    def _start(self, index: int, *, report: bool) -> int:
        """Fork worker ``index``; returns the pipe it says "ready" on (``report``), else -1."""
        r, w = os.pipe() if report else (-1, -1)
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                if r >= 0:
                    os.close(r)
                code = _worker(self.session, self.opts, Share(index, self.count), w)
            except BaseException:  # noqa: BLE001 - reported, and the process ends here
                log.exception("worker %d failed", index)
            finally:
                logging.shutdown()
                os._exit(code)
        if w >= 0:
            os.close(w)
        self.workers[pid] = index
        return r

    def watch(self) -> None:
        """Wait on the workers: restart one that dies while the mount is live; return once the
        mount is gone and every worker has ended."""
        while self.workers:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return
            index = self.workers.pop(pid, None)
            if index is None:
                continue
            if not is_jpfs_mount(self.session.mountpoint) or self.stopping:
                continue  # unmounted: the others end too
            now = time.monotonic()
            self.deaths = [t for t in self.deaths if now - t < 60] + [now]
            how = f"exit status {os.waitstatus_to_exitcode(status)}"
            if len(self.deaths) > RESTARTS_PER_MINUTE:
                log.error("worker %d ended (%s); not restarted: %d deaths within a minute",
                          index, how, len(self.deaths))
                continue
            log.warning("worker %d ended (%s); starting it again", index, how)
            self._start(index, report=False)  # the others serve meanwhile: no need to wait

    def end(self) -> None:
        """Stop every worker (after the unmount they end by themselves; SIGTERM makes sure)."""
        deadline = time.monotonic() + 10
        for pid in list(self.workers):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        while self.workers and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)
                continue
            self.workers.pop(pid, None)
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_readable(fd: int, timeout: float) -> bool:
    r, _, _ = select.select([fd], [], [], timeout)
    return bool(r)


def _worker(session: kernel.Session, opts: MountOptions, share: Share, ready_fd: int) -> int:
    """A worker process's life: its own descriptor and VFS, served until the session ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the supervisor died before the line above
        return 1
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the supervisor
    fd = session.clone()
    session.close()
    trio.run(_serve_worker, opts, fd, share, ready_fd)
    return 0


class ForgetRelay:
    """Tells a session's other workers which inodes the kernel forgot, and hears of theirs.

    The kernel counts the lookups of an inode over every worker's answers and sends the FORGET
    of an evicted inode to whichever worker reads next; without word of it, the worker that
    answered the lookups would keep the node (attributes, layout) for good. Each worker binds a
    datagram socket in the abstract namespace, named by the supervisor's pid and its index, and
    feeds each other worker from a queue of its own through a socket connected to that
    worker's: a connected datagram socket waits while the receiver's queue is full (at most
    ``net.unix.max_dgram_qlen`` datagrams, 10 by default) where an unconnected one would drop
    the datagram, and what piles up meanwhile goes in one datagram. Only a worker that is
    starting again misses what was sent to it, and it starts with no nodes.
    """

    PER_DATAGRAM = 8192
    """Inode numbers per datagram (64 KiB)."""

    def __init__(self, tag: str, index: int, count: int):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                  | socket.SOCK_CLOEXEC)
        self.sock.bind(self._name(tag, index))
        self._queues = [(self._name(tag, i), trio.open_memory_channel[list[int]](float("inf")))
                        for i in range(count) if i != index]

    @staticmethod
    def _name(tag: str, index: int) -> bytes:
        return f"\0jpfs-forget-{tag}-{index}".encode()

    def send(self, inos: list[int]) -> None:
        """Tell the other workers (queued: never blocks)."""
        for _, (put, _) in self._queues:
            put.send_nowait(inos)

    async def run(self, engine: Engine) -> None:
        """Feed the other workers and forget what they were told to, until cancelled."""
        async with trio.open_nursery() as nursery:
            for peer, (_, take) in self._queues:
                nursery.start_soon(self._feed, peer, take)
            sock = trio.socket.from_stdlib_socket(self.sock)
            while True:
                data = await sock.recv(self.PER_DATAGRAM * 8)
                engine.forget_all(list(struct.unpack(f"<{len(data) // 8}Q", data)))

    async def _feed(self, peer: bytes, take: trio.MemoryReceiveChannel[list[int]]) -> None:
        sock: trio.socket.SocketType | None = None
        async for first in take:
            batch = list(first)
            while len(batch) < self.PER_DATAGRAM:  # what piled up goes in one datagram
                try:
                    batch += take.receive_nowait()
                except trio.WouldBlock:
                    break
            for k in range(0, len(batch), self.PER_DATAGRAM):
                chunk = batch[k:k + self.PER_DATAGRAM]
                try:
                    if sock is None:
                        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                        await sock.connect(peer)
                    await sock.send(struct.pack(f"<{len(chunk)}Q", *chunk))
                except OSError as e:  # the worker is starting again: it holds no nodes yet
                    log.debug("telling a worker of %d forgotten inodes: %s", len(chunk), e)
                    if sock is not None:
                        sock.close()
                    sock = None


async def _serve_worker(opts: MountOptions, fd: int, share: Share, ready_fd: int) -> None:
    notifier = EngineNotifier(fd, os.path.abspath(opts.mountpoint))
    async with trio.open_nursery() as nursery:
        reads = EngineReads()
        async with mount_parts(opts, nursery, notifier, reads, share) as (ops, _):
            ops.init()
            ops.serving = {"engine": "jpfs", "worker": share.index, "workers": share.count}
            tag = str(os.getppid())
            forgets = ForgetRelay(tag, share.index, share.count) if share.count > 1 else None
            link = await _prefetch_relay(nursery, ops, notifier, tag, share) \
                if share.count > 1 and opts.prefetch else None
            engine = Engine(ops, fd, reads, max_tasks=opts.max_tasks,
                            forgotten=forgets.send if forgets is not None else None,
                            before_reply=link.flush if link is not None else None)
            if forgets is not None:
                nursery.start_soon(forgets.run, engine)
            if ops.control.hint_socket:
                await nursery.start(hints.serve, ops.control.hint_socket,
                                    ops.control.submit_hints)
            nursery.start_soon(_on_sigterm, nursery.cancel_scope)
            if ready_fd >= 0:  # a worker started again reports to nobody
                os.write(ready_fd, b"ready\n")
                os.close(ready_fd)
            try:
                await engine.serve()
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await notifier.close()


async def _prefetch_relay(nursery: trio.Nursery, ops: Operations, notifier: EngineNotifier,
                          tag: str, share: Share) -> relay.Link | None:
    """Worker 0 prefetches for the mount and hears the others' evidence on its desk; each
    other worker links to it (``relay.py``). Returns the link (None in worker 0)."""
    if share.index == 0:
        try:
            desk = relay.Desk(ops.vfs, tag)
        except OSError as e:  # the name is taken: prefetch sees only this worker's requests
            log.warning("prefetch hears only worker 0's requests: %s", e.strerror)
            return None
        await nursery.start(desk.run)
        notifier.introduced = desk.drain
        ops.serving["relay"] = desk.counters
        return None
    link = relay.Link(tag)
    ops.vfs.attach_owner(link)
    nursery.start_soon(link.run)
    ops.serving["relay"] = link.counters
    return link


async def _on_sigterm(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


__all__ = ["MAX_WORKERS", "default_workers", "run", "run_foreground"]
