"""Directory write leases: one mount at a time may answer creates in a directory from memory.

A mount filling a directory (``cp -r``, a dataset being written, a training run's checkpoints)
pays a metadata round trip per create. With a lease on the directory it knows the directory's
names for certain and holds a range of inode numbers of this shard, so it answers CREATE at
once and commits the new entries behind, many per transaction (``create_batch``;
``jpfs/client/vfs/leases.py``); new directories placed on other shards (inode numbers
``reserve``d there) go in one cross-shard transaction per batch (``dir_batch``).

What makes that safe is that nobody else changes the directory's names while the lease is held:
every change that adds or removes a name here (``Txn.check_lease``: a create, mknod, symlink,
mkdir, link, unlink, rmdir, rename, bulk create or 2PC prepare, from any client or shard) first
*recalls* the lease and waits for it, as it waits for a cross-shard transaction's lock
(``Leased`` is a ``Locked``): the holder commits what it has pending, gives the lease back, and
the change runs. A holder that does not give it back within ``RECALL_GRACE`` loses it. The
holder's own rename, rmdir and ``dir_batch``, sent with its session, pass (``Txn.holder``; in
a two-phase plan on every shard, its prepares carry the holder). A directory the holder makes
in a batch is leased to it from birth (``Txn.lease_new_dir``), and one it removes so is no
longer (``Txn.end_lease``).
Reads never wait: other clients see a new name once its batch commits (milliseconds).

A lease lives in this process's memory and belongs to a *session* (a mount), which is alive
while it has a ``lease_wait`` call in flight (the call through which recalls reach it) or had
one within ``SESSION_GRACE``: a killed mount's connection closes, the call is cancelled, and its
leases go a few seconds later. A restarted shard has none. A holder that lost its lease still
sends its pending entries; each is made if its name is still free (per-entry answers), which
is the usual case. On a replicated shard the leader grants leases; a copy that stops leading
ends them all (``clear``), telling every session through its ``lease_wait``, and a new leader
starts with none: a holder learns it at its next ``lease_wait`` (which names the leases it
believes it holds), gives them back, and its files go to the new leader as above.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from .txn import Locked

log = logging.getLogger(__name__)

LEASE_INODES = 1024
"""Inode numbers granted with a lease (and with each renewal that asks for more)."""
LEASE_MAX_NAMES = 20_000
"""A directory with more names than this is not leased (the grant carries its names)."""
RECALL_GRACE = 5.0
"""Seconds a holder has to give a recalled lease back before it is taken."""
SESSION_GRACE = 5.0
"""Seconds a session with no ``lease_wait`` in flight keeps its leases."""
WAIT_MAX = 10.0
"""The longest a ``lease_wait`` waits for a recall before it answers none."""


def lease_txid(parent: int) -> bytes:
    """The id a change waiting for ``parent``'s lease waits on (as on a transaction's)."""
    return b"lease" + parent.to_bytes(8, "big")


class Leased(Locked):
    """Raised inside an operation that would change the names of a directory leased to
    another session; the operation waits for the lease to come back and runs again."""

    def __init__(self, parent: int):
        super().__init__(lease_txid(parent))
        self.parent = parent


@dataclass
class Session:
    """A mount that holds (or may hold) leases on this shard."""

    sid: bytes
    leases: set[int] = field(default_factory=set)
    recalled: set[int] = field(default_factory=set)
    """Leases recalled and not yet given back."""
    told: set[int] = field(default_factory=set)
    """Recalls a ``lease_wait`` already answered."""
    wake: trio.Event = field(default_factory=trio.Event)
    waiting: int = 0
    idle: int = 0
    """Bumped when the last wait ends: an expiry timer started then acts only if unchanged."""


class Leases:
    """This shard's directory leases (see the module docstring), made by the shard's ``Store``
    (``store.leases``, which ``Txn.check_lease`` asks); ``start`` gives it the nursery its
    timers run in. ``begun(txid)`` and ``resolved(txid)`` are the store's ``tx_begun`` and
    ``tx_resolved``: a change recalling a lease waits on it as on a transaction's lock."""

    def __init__(self, begun: Callable[[bytes], None], resolved: Callable[[bytes], None]):
        self._begun = begun
        self._resolved = resolved
        self.held: dict[int, bytes] = {}
        """Directory -> the session holding its lease."""
        self.sessions: dict[bytes, Session] = {}
        self._nursery: trio.Nursery | None = None
        self._grants = 0
        self._grant_of: dict[int, int] = {}
        """Directory -> the number of its current grant (a late timer acts on its own only)."""
        self.stats = {"granted": 0, "recalled": 0, "given_back": 0, "revoked": 0}

    async def start(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the leases' timers until cancelled (``nursery.start``)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep(math.inf)
        finally:
            self._nursery = None

    # ---- checked inside transactions (no awaits)

    def check(self, parent: int, holder: bytes | None) -> None:
        """Raise ``Leased`` if ``parent`` is leased to a session other than ``holder``, and
        recall the lease (once per recall)."""
        sid = self.held.get(parent)
        if sid is None or sid == holder:
            return
        s = self.sessions[sid]
        if parent not in s.recalled:
            s.recalled.add(parent)
            s.wake.set()
            self.stats["recalled"] += 1
            if self._nursery is not None:
                self._nursery.start_soon(self._take_back_late, parent, self._grant_of[parent])
        raise Leased(parent)

    # ---- the handlers' side

    def grant(self, sid: bytes, parent: int) -> bool:
        """Lease ``parent`` to ``sid`` unless another session holds it or it is being
        recalled. The caller checked that it is a directory of this shard."""
        holder = self.held.get(parent)
        if holder is not None:
            return holder == sid and parent not in self.sessions[sid].recalled
        s = self._session(sid)
        self.held[parent] = sid
        self._grants += 1
        self._grant_of[parent] = self._grants
        s.leases.add(parent)
        s.recalled.discard(parent)  # told before, of an earlier lease
        s.told.discard(parent)
        self._begun(lease_txid(parent))  # what a recalled change waits on
        self.stats["granted"] += 1
        return True

    def give_back(self, sid: bytes, parent: int) -> bool:
        """The holder is done with ``parent`` (or was recalled and committed what it had)."""
        if self.held.get(parent) != sid:
            return False
        self._end(parent)
        self.stats["given_back"] += 1
        return True

    async def wait(self, sid: bytes, held: list[int], seconds: float) -> list[int]:
        """A session's long call: the directories recalled from it since the last answer,
        once there are any or after ``seconds`` (at most ``WAIT_MAX``); at once, those of
        ``held`` (what the session believes it holds) that it does not hold (this process
        restarted, or took them back)."""
        s = self._session(sid)
        gone = [p for p in held if self.held.get(p) != sid]
        if gone:
            return sorted(gone)
        s.waiting += 1
        try:
            with trio.move_on_after(min(max(seconds, 0.0), WAIT_MAX)):
                while not s.recalled - s.told:
                    s.wake = trio.Event()
                    await s.wake.wait()
            out = sorted(s.recalled - s.told)
            s.told |= set(out)
            ended = {p for p in out if self.held.get(p) != sid}  # no give-back to wait for
            s.recalled -= ended
            s.told -= ended
            return out
        finally:
            s.waiting -= 1
            if s.waiting == 0:
                s.idle += 1
                if self._nursery is not None:
                    self._nursery.start_soon(self._expire_late, s, s.idle)

    def clear(self) -> None:
        """This copy stopped leading: every lease ends, and each session is told (its
        ``lease_wait`` answers them as recalled) so it gives them back to the next leader."""
        for s in self.sessions.values():
            s.recalled |= s.leases
            s.leases.clear()
            s.wake.set()
        for parent in list(self.held):
            self._resolved(lease_txid(parent))
        self.stats["revoked"] += len(self.held)
        self.held.clear()
        self._grant_of.clear()

    def _session(self, sid: bytes) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Session(sid)
            if self._nursery is not None:  # no wait may ever come: it expires unless one does
                self._nursery.start_soon(self._expire_late, s, s.idle)
        return s

    def _end(self, parent: int) -> None:
        sid = self.held.pop(parent, None)
        if sid is None:
            return
        del self._grant_of[parent]
        s = self.sessions.get(sid)
        if s is not None:
            s.leases.discard(parent)
            s.recalled.discard(parent)
            s.told.discard(parent)
        self._resolved(lease_txid(parent))  # the waiting changes run again

    async def _take_back_late(self, parent: int, grant: int) -> None:
        await trio.sleep(RECALL_GRACE)
        if self._grant_of.get(parent) == grant:
            log.warning("a mount did not give back its lease on directory %#x within %g s of "
                        "its recall: taken back", parent, RECALL_GRACE)
            self.stats["revoked"] += 1
            self._end(parent)

    async def _expire_late(self, s: Session, idle: int) -> None:
        await trio.sleep(SESSION_GRACE)
        if s.waiting or s.idle != idle or self.sessions.get(s.sid) is not s:
            return
        del self.sessions[s.sid]
        if s.leases:
            log.info("a mount's session ended (no lease_wait for %g s): %d leases taken back",
                     SESSION_GRACE, len(s.leases))
        for parent in list(s.leases):
            self.stats["revoked"] += 1
            self._end(parent)

    def info(self) -> dict:
        """The lease counts for the shard's status (``leases``, ``lease_sessions``,
        ``leases_*``)."""
        return {"leases": len(self.held), "lease_sessions": len(self.sessions),
                **{f"leases_{k}": v for k, v in self.stats.items()}}
