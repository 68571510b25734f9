"""A shard leader's lease renewals, sent from a thread of their own.

The leader's event loop serves requests, ships log entries and sends snapshots; on a host whose
cores are taken by a training job's DataLoader workers it can fall behind by a second or more.
Renewals sent from that loop were late with it, and a renewal later than the lease's TTL ended
a leadership that was never in doubt: a spurious step-down, then an election that chose the
same copy again. Here a thread sends them on time. It needs the interpreter for a few
microseconds a second, which a busy one hands over every switch interval (5 ms).

The thread only talks to etcd; what an answer means is decided on the loop: a confirmed renewal
extends how long the leader may answer (counted from the renewal's *send* time, so a slow
answer never extends it past what etcd granted), and a lease that is gone, or none confirmed
within the TTL, ends the leadership. So the loop may stall for longer than the TTL (an fsync
stuck behind other writers on a shared disk, run on the loop while fsyncs were fast) and lead
on afterwards: it answers nothing past its last confirmed renewal's validity meanwhile, as
ever, but no election follows, and every copy sharing that disk would have stalled too. A loop
that has not run for ``WEDGED`` TTLs is taken for wedged, not slow: the renewals stop, so a
copy that cannot serve does not keep the others from leading for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import trio

from jpfs.coord.etcd import EtcdError, LeaseKeepalive

log = logging.getLogger(__name__)

WEDGED = 3
"""TTLs the event loop may go without running before the renewals stop."""


class Renewals:
    """Renew ``lease`` every ``renew`` seconds from ``granted`` (trio's clock: when the grant
    was asked for) until it is lost; ``where`` names the copy in log lines."""

    def __init__(self, endpoints: tuple[str, ...], lease: int, *, ttl: float, renew: float,
                 granted: float, where: str):
        self.endpoints = endpoints
        self.lease = lease
        self.ttl = ttl
        self.renew = renew
        self.granted = granted
        self.where = where
        self._tick = time.perf_counter()
        """When the loop last ran this object's task (``perf_counter``), for the thread."""

    async def run(self, on_renewed: Callable[[float, float], None]) -> str:
        """Renew until the lease is lost, calling ``on_renewed(sent, left)`` on the loop for each
        confirmed renewal (``sent``: its send time on trio's clock; ``left``: the seconds etcd
        says the lease has); returns why the lease was lost. Cancelling stops the thread."""
        token = trio.lowlevel.current_trio_token()
        offset = trio.current_time() - time.perf_counter()
        lost = trio.Event()
        why: list[str] = []
        stop = threading.Event()

        def renewed(sent: float, left: float) -> None:  # on the loop
            if not (lost.is_set() or stop.is_set()):  # (one queued as the leadership ended)
                try:
                    on_renewed(sent + offset, left)
                except Exception:  # never into trio's system task
                    log.exception("%s: handling a lease renewal failed", self.where)

        def gone(reason: str) -> None:  # on the loop
            why.append(reason)
            lost.set()

        def renewing() -> None:  # the thread
            keeper = LeaseKeepalive(self.endpoints, self.lease)
            confirmed = sent = self.granted - offset
            try:
                while not stop.wait(max(0.0, sent + self.renew - time.perf_counter())):
                    sent = time.perf_counter()
                    left: float | None = None
                    reason = "not renewed within its TTL"
                    if sent - self._tick > WEDGED * self.ttl:
                        reason = (f"this copy's event loop has not run for "
                                  f"{sent - self._tick:.3g} s")
                    else:
                        try:
                            left = keeper.renew(timeout=max(0.1, confirmed + self.ttl - sent))
                        except EtcdError as e:
                            log.warning("%s: lease renewal failed: %s", self.where, e.strerror)
                        if left is not None and left > 0:
                            confirmed = sent
                            token.run_sync_soon(renewed, sent, left)
                            continue
                    if left == 0 or time.perf_counter() >= confirmed + self.ttl:
                        token.run_sync_soon(gone, "gone" if left == 0 else reason)
                        return
            except trio.RunFinishedError:
                pass  # the daemon is stopping
            finally:
                keeper.close()

        thread = threading.Thread(target=renewing, name=f"lease {self.lease:x}", daemon=True)
        thread.start()
        try:
            while not lost.is_set():
                self._tick = time.perf_counter()
                with trio.move_on_after(self.renew):
                    await lost.wait()
            return why[0]
        finally:
            stop.set()
