"""The scrubber: re-read every live blob at a bounded rate and check it against its xxh3.

One task per storage node walks the ``byvol`` index in disk order (volume, offset), a step of
about ``STEP`` bytes at a time: the reads and the hashing run in one worker thread of its own (a
``CapacityLimiter(1)``, so it never takes the threads client reads warm cold pages with), and
after each step it sleeps until the step's bytes fit the rate (``--scrub-rate``, bytes/s). Bad
blobs (checksum mismatch, cut short, unreadable, past the end of a short volume) are marked in
the index's ``bad`` table through the writer, like every other index change, and the server
then refuses to serve them, so clients fail over at once. A repair is a ``put_blobs`` of the
same id from a good replica (``jpfs scrub repair``, ``jpfs/client/scrub.py``).

Progress (passes, position, bytes, times) is saved every ``SAVE_EVERY`` seconds and at the end
of a pass, so a restarted node resumes its pass where it was; the next pass starts ``pause``
seconds after the last one finished (wall clock, saved: a restart does not reset the schedule),
or at once on ``scrub_start``. Nothing a file or the index holds can end the task: a failure of
one step is logged and the pass goes on after a short wait.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import trio

from jpfs.proto.storage import ScrubStatus

from .ops import ScrubOp
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_RATE = 32 << 20
DEFAULT_PAUSE = 3600.0
STEP = 1 << 20
"""Bytes read per step (at least one blob): one thread hop and one pacing sleep per step."""
STEP_BLOBS = 512
SAVE_EVERY = 5.0
MIN_PAUSE = 1.0
"""The shortest pause between passes: an empty node with ``--scrub-pause 0`` must not spin."""
RETRY_AFTER = 5.0


class Scrubber:
    """The scrub task of one storage node.

    Args:
        store: the node's volumes and index.
        submit: the writer's ``submit`` (the single owner of index writes).
        rate: bytes/s at most; 0 turns scrubbing off.
        pause: seconds from the end of a pass to the start of the next.
    """

    def __init__(self, store: Store, submit, *, rate: float = DEFAULT_RATE,
                 pause: float = DEFAULT_PAUSE):
        self.store = store
        self.submit = submit
        self.rate = max(0.0, float(rate))
        self.pause = max(MIN_PAUSE, float(pause))
        self._limiter = trio.CapacityLimiter(1)
        self._kick = trio.Event()
        self.scrubbing = False
        self.pass_elapsed = 0.0
        # the progress, saved as JSON: counts, times (float), the position (hex key or None)
        self.s: dict[str, Any] = {"passes": 0, "pos": None, "pass_started": None, "pass_bytes": 0,
                  "pass_blobs": 0, "pass_total": 0, "pass_elapsed": 0.0, "last_finished": None,
                  "bytes_verified": 0, "blobs_verified": 0, "bad_found": 0}
        raw = store.scrub_state()
        if raw:
            try:
                saved = json.loads(raw)
                if isinstance(saved, dict):
                    self.s.update({k: v for k, v in saved.items() if k in self.s})
            except ValueError:
                log.error("scrub: saved progress is unreadable; starting afresh")
        if not (self.s["pos"] is None or isinstance(self.s["pos"], str)):
            self.s["pos"] = None

    @property
    def enabled(self) -> bool:
        """Whether scrubbing is on (a rate above 0)."""
        return self.rate > 0

    def start_now(self) -> bool:
        """Start a pass now unless one runs; False when one was running already."""
        if self.scrubbing:
            return False
        self.scrubbing = True  # the answer already says so; the task starts at its next turn
        self._kick.set()
        return True

    def status(self, repaired: int) -> ScrubStatus:
        """The progress, with ``repaired`` (the index's count of copies repaired, ever)."""
        s = self.s
        waiting = s["pos"] is None and not self.scrubbing
        pos = None
        if s["pos"]:
            key = bytes.fromhex(s["pos"])
            pos = [int.from_bytes(key[:4], "big"), int.from_bytes(key[4:12], "big")]
        nxt = None
        if self.enabled and waiting:
            nxt = (s["last_finished"] or 0.0) + self.pause
        total = s["pass_total"]
        if s["pos"] is None:
            progress = 1.0 if waiting else 0.0
        else:
            progress = min(1.0, s["pass_bytes"] / total) if total else 0.0
        elapsed = self.pass_elapsed
        return ScrubStatus(
            enabled=self.enabled,
            state="off" if not self.enabled else "waiting" if waiting else "scrubbing",
            rate_limit=self.rate, pause=self.pause, passes=s["passes"],
            pass_started=s["pass_started"], pass_bytes=s["pass_bytes"],
            pass_blobs=s["pass_blobs"], pass_total=total, progress=progress,
            position=pos,
            bytes_per_s=s["pass_bytes"] / elapsed if elapsed > 0 else 0.0,
            last_finished=s["last_finished"], next_pass=nxt,
            bytes_verified=s["bytes_verified"], blobs_verified=s["blobs_verified"],
            bad_found=s["bad_found"], bad_blobs=len(self.store.bad_ids), repaired=repaired,
        )

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Scrub pass after pass until cancelled; returns at once when scrubbing is off."""
        task_status.started()
        if not self.enabled:
            return
        while True:
            try:
                await self._wait_for_pass()
                await self._pass()
            except Exception:  # noqa: BLE001 - a daemon never dies of its scrubber
                log.exception("scrub: a step failed; going on in %.0f s", RETRY_AFTER)
                self.scrubbing = False
                await trio.sleep(RETRY_AFTER)

    async def _wait_for_pass(self) -> None:
        if self.s["pos"] is not None:
            return  # a pass was under way when the node stopped: resume it
        delay = (self.s["last_finished"] or 0.0) + self.pause - time.time()
        if delay > 0:
            with trio.move_on_after(delay):
                await self._kick.wait()
        self._kick = trio.Event()

    async def _pass(self) -> None:
        s = self.s
        store = self.store
        self.scrubbing = True
        if s["pos"] is None:
            recs = await trio.to_thread.run_sync(store.volume_records, limiter=self._limiter)
            s.update(pos="", pass_started=time.time(), pass_bytes=0, pass_blobs=0,
                     pass_total=sum(r.live_bytes for r in recs.values()), pass_elapsed=0.0)
            log.info("scrub: pass %d starts (%d live bytes, at most %.0f bytes/s)",
                     s["passes"] + 1, s["pass_total"], self.rate)
        self.pass_elapsed = float(s.get("pass_elapsed") or 0.0)
        saved_at = last = due = trio.current_time()
        while True:
            after = bytes.fromhex(s["pos"])
            entries = await trio.to_thread.run_sync(store.scrub_entries, after, STEP_BLOBS,
                                                    limiter=self._limiter)
            if not entries:
                break
            step: list[tuple[bytes, int, int, int, int]] = []
            size = 0
            for e in entries:
                if step and size + e[3] > STEP:
                    break
                step.append(e)
                size += e[3]
            t0 = trio.current_time()
            bad = await trio.to_thread.run_sync(store.verify, step, limiter=self._limiter)
            prev, s["pos"] = s["pos"], step[-1][0].hex()
            if bad:
                try:
                    s["bad_found"] += await self.submit(ScrubOp(bad, self._state()))
                except BaseException:
                    s["pos"] = prev  # not recorded: read this step again
                    raise
                saved_at = trio.current_time()
            # Pace: the step's bytes at the rate, from when the last step was due.
            due = max(due, t0) + size / self.rate
            await trio.sleep_until(due)
            now = trio.current_time()
            self.pass_elapsed += now - last  # wall time of the pass, lookups included
            last = now
            s["pass_bytes"] += size  # counted with the time they took, so the rate is true
            s["pass_blobs"] += len(step)
            s["bytes_verified"] += size
            s["blobs_verified"] += len(step)
            s["pass_elapsed"] = self.pass_elapsed
            if now - saved_at >= SAVE_EVERY:
                await self.submit(ScrubOp([], self._state()))
                saved_at = now
        s["passes"] += 1
        s["pos"] = None
        s["last_finished"] = time.time()
        await self.submit(ScrubOp([], self._state()))
        self.scrubbing = False
        took = self.pass_elapsed
        log.info("scrub: pass %d done: %d blobs, %d bytes in %.1f s (%.0f bytes/s), %d bad "
                 "blobs on the node", s["passes"], s["pass_blobs"], s["pass_bytes"], took,
                 s["pass_bytes"] / took if took > 0 and math.isfinite(took) else 0.0,
                 len(store.bad_ids))

    def _state(self) -> bytes:
        return json.dumps(self.s).encode()
