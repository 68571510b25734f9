"""``BlockingCalls``: short blocking calls (a fast disk's fsync) run on the event loop, long
ones in a worker thread, and a kind of call moves with its own recent durations."""

from __future__ import annotations

import threading
import time

from jpfs_daemon.common import BlockingCalls


def _where(pause: float = 0.0) -> int:
    time.sleep(pause)
    return threading.get_ident()


async def test_short_calls_run_on_the_loop_and_slow_ones_move_to_a_thread():
    loop = threading.get_ident()
    calls = BlockingCalls(inline_below=0.002)
    assert await calls.run(_where) == loop
    assert await calls.run(_where, 0.05) == loop  # not known to be slow yet
    # averaged in, the slow call sends the next calls to a thread, where they are timed too
    assert await calls.run(_where) != loop
    for _ in range(20):
        if await calls.run(_where) == loop:
            break  # fast calls brought the average back down
    else:
        raise AssertionError(f"calls stayed in a thread (average {calls.average:.4f} s)")
    assert calls.inline >= 3 and calls.threaded >= 1


async def test_calls_known_to_be_long_go_to_a_thread_and_leave_the_average_alone():
    loop = threading.get_ident()
    calls = BlockingCalls(inline_below=0.002)
    assert await calls.run(_where, 0.05, eligible=False) != loop
    assert calls.average == 0.0
    assert await calls.run(_where) == loop
