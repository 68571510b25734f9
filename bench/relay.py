"""The delaying TCP relay of one simulated host (``bench/netns.py``'s fallback where the kernel
has no netem): ``python -m jpfs_bench.relay --owner PID --delay-file F --map LISTEN=TARGET ...``.

Every TCP stream accepted on a ``LISTEN`` address is forwarded to its ``TARGET``, each piece held
for the one-way delay in the delay file (seconds; re-read on SIGHUP) by a writer thread sleeping
to a deadline. The relay exits by itself once the owner process is gone.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

from jpfs.localcluster import pid_alive

MODULE = "jpfs_bench.relay"
"""What the relay runs as (``python -m``): how leftover relays are recognised."""


def relay_main(args: argparse.Namespace) -> None:
    """Forward each ``--map LISTEN=TARGET`` TCP stream, holding every piece for the delay in
    ``--delay-file`` (seconds, one way; re-read on SIGHUP). Exits when ``--owner`` is gone."""
    delay = [_read_delay(args.delay_file)]

    def reload(signum, frame) -> None:
        delay[0] = _read_delay(args.delay_file)

    signal.signal(signal.SIGHUP, reload)
    for m in args.map:
        listen, _, target = m.partition("=")
        lh, _, lp = listen.rpartition(":")
        th, _, tp = target.rpartition(":")
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((lh, int(lp)))
        ls.listen(256)
        threading.Thread(target=_accept_loop, args=(ls, (th, int(tp)), delay), daemon=True,
                         name=f"accept-{lp}").start()
    while pid_alive(args.owner):
        time.sleep(0.5)
    os._exit(0)


def _read_delay(path: str) -> float:
    try:
        return max(0.0, float(Path(path).read_text().strip() or 0))
    except (OSError, ValueError):
        return 0.0


def _accept_loop(ls: socket.socket, target: tuple[str, int], delay: list[float]) -> None:
    while True:
        conn, _ = ls.accept()
        try:
            up = socket.create_connection(target, timeout=10)
        except OSError:
            conn.close()
            continue
        up.settimeout(None)
        for s in (conn, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        done = threading.Semaphore(0)
        threading.Thread(target=_pump, args=(conn, up, delay, done), daemon=True).start()
        threading.Thread(target=_pump, args=(up, conn, delay, done), daemon=True).start()
        threading.Thread(target=_closer, args=(conn, up, done), daemon=True).start()


def _closer(a: socket.socket, b: socket.socket, done: threading.Semaphore) -> None:
    done.acquire()
    done.acquire()
    a.close()
    b.close()


def _pump(src: socket.socket, dst: socket.socket, delay: list[float],
          done: threading.Semaphore) -> None:
    """Copy src to dst, each piece sent no earlier than its arrival + delay (bounded queue)."""
    q: queue.Queue = queue.Queue(maxsize=64)

    def writer() -> None:
        try:
            while (item := q.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            while q.get() is not None:  # let the reader finish
                pass
        finally:
            done.release()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        while data := src.recv(1 << 20):
            q.put((time.monotonic() + delay[0], data))
    except OSError:
        pass
    q.put(None)


def main(argv: list[str] | None = None) -> None:
    """Parse the relay's arguments and forward until the owner is gone."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--owner", type=int, required=True)
    p.add_argument("--delay-file", required=True)
    p.add_argument("--map", action="append", default=[], metavar="LISTEN=TARGET")
    relay_main(p.parse_args(argv))


if __name__ == "__main__":
    main()
