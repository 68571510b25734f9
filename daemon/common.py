"""What every JPFS daemon shares: its command line, logging, pid file and signal handling.

A daemon is started as ``jpfs-meta --cluster FILE --index I`` (or ``jpfs-storage ...``): it reads
its own address and data directory from the cluster file, writes ``<role>-<index>.pid`` when asked,
and stops cleanly (finishing the transaction in hand) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from jpfs import config

log = logging.getLogger(__name__)


GIL_SWITCH_INTERVAL = 0.0002

INLINE_BELOW = 0.0003
"""Seconds: a kind of blocking call whose recent runs took less than this runs on the event
loop (``BlockingCalls``)."""

EXIT_ADDRESS_IN_USE = 98
"""Exit status when the listen address is taken (``jpfs cluster up`` then picks another)."""

_FAULTS: dict[str, int] | None = None


def fault_point(name: str) -> None:
    """Crash-test hook: ``JPFS_FAULTS="name[:n],..."`` makes this process die like ``kill -9``
    the n-th time (default first) it passes point ``name``. Costs one dict lookup otherwise."""
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = {}
        for item in filter(None, os.environ.get("JPFS_FAULTS", "").split(",")):
            point, _, count = item.partition(":")
            _FAULTS[point.strip()] = int(count or 1)
    if name in _FAULTS:
        _FAULTS[name] -= 1
        if _FAULTS[name] <= 0:
            log.warning("fault point %s reached: exiting abruptly", name)
            logging.shutdown()
            os._exit(137)


_STALLS: dict[str, list[float]] | None = None


def stall_point(name: str) -> None:
    """Slow-disk test hook: ``JPFS_STALLS="name:seconds[:n],..."`` blocks the calling thread for
    ``seconds`` the n-th time (default first) it passes point ``name``, as an fsync that stalls
    on a contended disk blocks the event loop it runs on. Costs one dict lookup otherwise."""
    global _STALLS
    if _STALLS is None:
        _STALLS = {}
        for item in filter(None, os.environ.get("JPFS_STALLS", "").split(",")):
            point, seconds, *count = item.split(":")
            _STALLS[point.strip()] = [float(seconds), int(count[0]) if count else 1]
    stall = _STALLS.get(name)
    if stall is not None:
        stall[1] -= 1
        if stall[1] == 0:
            log.warning("stall point %s reached: blocking for %.3g s", name, stall[0])
            time.sleep(stall[0])


class BlockingCalls:
    """One kind of blocking call (an fsync, a storage group commit), run on the event loop
    while its recent runs were short, in a worker thread otherwise.

    A round trip through a worker thread costs 0.1-0.3 ms of latency and CPU on a 2-core VM
    (the GIL hand-off, the wake-up through trio's socket pair, the other core's wake-up), more
    than the fsync of a few pages on a fast disk; a slow disk's fsync, though, must not stall
    the loop. Which way a call goes follows an exponential average of the kind's own durations,
    measured where the calls run, so calls move to the thread when the disk slows down and come
    back when it recovers. Calls of one kind must not overlap (one task makes them: a syncer,
    a committer)."""

    def __init__(self, inline_below: float = INLINE_BELOW):
        self.inline_below = inline_below
        self.average = 0.0
        """Seconds a call took, averaged (each new call weighs 1/5)."""
        self.inline = 0
        self.threaded = 0

    def _timed(self, fn: Callable, args: tuple):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.average += (time.perf_counter() - start - self.average) / 5

    async def run(self, fn: Callable, *args, eligible: bool = True):
        """``fn(*args)``, inline or in a thread. ``eligible=False``: in a thread, and not
        counted in the average (a call known to be long, such as a commit of many MiB)."""
        if not eligible:
            self.threaded += 1
            return await trio.to_thread.run_sync(fn, *args)
        if self.average < self.inline_below:
            self.inline += 1
            return self._timed(fn, args)
        self.threaded += 1
        return await trio.to_thread.run_sync(self._timed, fn, args)


def parser(role: str, description: str) -> argparse.ArgumentParser:
    """The command-line parser every ``jpfs-<role>`` daemon starts from (cluster file, index, data
    directory, listen address, pid and log files, log level, metrics address)."""
    p = argparse.ArgumentParser(prog=f"jpfs-{role}", description=description)
    p.add_argument("--cluster", help="cluster file (default: $JPFS_CLUSTER)")
    p.add_argument("--index", type=int, required=True,
                   help=f"which {role} server this is (0-based)")
    p.add_argument("--data", help="data directory (default: from the cluster file)")
    p.add_argument("--listen", help="host:port to bind (default: this server's cluster address)")
    p.add_argument("--pid-file", help="write the process id here while running")
    p.add_argument("--log-file", help="log here instead of stderr")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: the "
                        "daemon's `metrics` entry in the cluster file, if any)")
    return p


def setup_logging(level: str, log_file: str | None) -> None:
    """Log at ``level`` (a name: ``INFO``, ...) to ``log_file``, or to stderr, replacing any
    handlers already set."""
    handler: logging.Handler = (
        logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler], force=True)


def resolve(args: argparse.Namespace, role: str) -> tuple[config.Cluster, Path, str, int]:
    """The cluster, data directory and listen address for this daemon."""
    cluster = config.load(args.cluster)
    servers = cluster.meta if role == "meta" else cluster.storage
    if not 0 <= args.index < len(servers):
        raise SystemExit(f"jpfs-{role}: --index {args.index} but the cluster file lists "
                         f"{len(servers)} {role} servers")
    data = Path(args.data).resolve() if args.data else cluster.data_dir(role, args.index)
    host, port = config.parse_address(args.listen or servers[args.index].address)
    return cluster, data, host, port


def metrics_address(args: argparse.Namespace, cluster: config.Cluster, role: str) -> str | None:
    """Where to serve Prometheus metrics: ``--metrics``, else this daemon's ``metrics`` entry
    in the cluster file, else nowhere."""
    servers = cluster.meta if role == "meta" else cluster.storage
    return args.metrics or servers[args.index].metrics


def run(args: argparse.Namespace, main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` under trio until it returns or a SIGTERM/SIGINT arrives."""
    # Worker threads (commits, fsyncs, hashing) hand results back to a busy event loop; with the
    # default 5 ms GIL switch interval each hand-back can wait that long.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    pid_file = Path(args.pid_file) if args.pid_file else None
    if pid_file:
        pid_file.write_text(f"{os.getpid()}\n")

    async def supervised() -> None:
        async with trio.open_nursery() as nursery:
            async def stop_on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for sig in signals:
                        log.info("received %s: shutting down", signal.Signals(sig).name)
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(stop_on_signal)
            await main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(supervised)
    except BaseException as exc:
        e = _address_in_use(exc)
        if e is None:
            raise
        log.error("cannot listen: %s", e)
        print(f"{sys.argv[0]}: cannot listen: {e}", file=sys.stderr)
        raise SystemExit(EXIT_ADDRESS_IN_USE) from None
    finally:
        if pid_file:
            try:
                if pid_file.read_text().strip() == str(os.getpid()):
                    pid_file.unlink()
            except OSError:
                pass
        log.info("stopped")


def _address_in_use(exc: BaseException) -> OSError | None:
    """The EADDRINUSE error in ``exc``, also inside the exception groups trio nurseries raise
    (a server bound in ``nursery.start``), or None."""
    if isinstance(exc, OSError):
        return exc if exc.errno == errno.EADDRINUSE else None
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _address_in_use(sub)
            if found is not None:
                return found
    return None
