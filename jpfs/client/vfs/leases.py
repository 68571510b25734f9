"""A mount's directory write leases, as spoken with the shards: asked for, renewed, recalled,
given back, and what was answered under them committed behind in batches.

A create through the mount costs a metadata round trip in the FUSE request's path. A mount that
holds a directory's *lease* (``daemon/meta/leases.py``: nobody else changes its names until it
gives the lease back) knows the directory's names for certain and holds a range of inode numbers
of the directory's shard, so it answers a create at once (the VFS checks the name against
``KnownDirs``, pinned while leased) and commits the new entries behind with ``create_batch``,
one transaction for the changes of the next few milliseconds (``SEND_DELAY``). What was answered
and not sent, and the unlinks and renames answered the same way, are the local bookkeeping of
``lease_book.py`` (``DirLeases.book``); this module makes the calls.

A plain rename of a file the lease's names cannot vouch for (the kernel's view of a name is
older than the lease's) is sent to the shard as the holder's (``session``: the shard lets it
pass) once what is pending has committed, and the lease's names follow it (``renamed``). A
mkdir is answered the same way as a create, with an inode number of the shard the new
directory is placed on (``dir_ino``: the lease's range, or numbers reserved there ahead), and
so is an rmdir of a directory this mount holds the lease of too, empty by its names (nobody
else can add one); those placed on another shard are committed in a ``dir_batch`` of their
own, one two-phase commit per batch. An rmdir the leases cannot answer is sent as the holder's
once what is pending has committed. Any other change of the directory's names by this mount
(link, other renames, an unlink the lease cannot answer) gives the lease back first
(``give_back``); another client's
change recalls it (the shard answers ``lease_wait``), and the shard runs that change once the
lease is back. A killed mount loses the changes it had not sent (as a local filesystem loses
those its journal had not committed); ``fsync`` of the file or the directory and unmount send
them first.

A lease is asked for once a directory saw ``LEASE_AFTER`` creates, mkdirs, unlinks or renames
answered by the shard, and not again for ``RETRY_AFTER`` seconds after a refusal or a recall
(so two mounts writing one directory settle on round trips rather than trade the lease).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable

import trio

from ...errors import JPFSError
from ...placement import make_ino, new_dir_shard, shard_of
from ...types import Attr
from ..wire.meta import MetaClient
from .lease_book import BATCH_MAX, GiveBack, LeaseBook, LeasedDir, elsewhere, inos_of

log = logging.getLogger(__name__)

LEASE_AFTER = 3
"""Creates or unlinks answered by the shard in a directory before the mount asks for its
lease."""
RETRY_AFTER = 2.0
"""Seconds after a refusal, a recall or a give-back before a directory's lease is asked again."""
SEND_DELAY = 0.005
"""Seconds new files wait for more to share their batch, and for their first commit to go with
them (a file written and closed at once: one metadata call for both), unless something waits
for them (``settle``)."""
WAIT_SECONDS = 5.0
"""How long one ``lease_wait`` waits for a recall before it answers none (and is sent again)."""
IDLE_RETURN = 5.0
"""A lease no create used for this long is given back (when its shard's ``lease_wait``
answers), so a mount holds leases only on directories it is filling."""
MAX_LEASES = 4096
"""Leases one mount holds at most (a tree being made holds one per new directory until it goes
idle)."""
RESERVE_INODES = 256
"""Inode numbers reserved on a shard at a time for the new directories this mount places there
from its leases (``dir_ino``); those a mount never uses are never used."""


class DirLeases:
    """This mount's leases (see the module docstring); what was answered under them is
    ``book``'s.

    Args:
        meta: the metadata client.
        nursery: runs the batches and the per-shard ``lease_wait`` loops.
        granted: called with (directory, its names) when a lease is granted: the VFS pins its
            known names of the directory.
        ended: called with (directory, lost) when a lease ends: the VFS lets the names age as
            usual (or forgets them, if the lease was lost).
        failed: called with (directory, name, attr, error, change) for a change the shard
            refused (attr: the new file's, for a create; else None, and ``change`` says
            which).
        writing: whether a file is open for writing on this mount, so that a batch holds its
            create back for its close (the VFS answers it on a ``--write-behind`` mount; by
            default nothing is held back).
    """

    def __init__(self, meta: MetaClient, nursery: trio.Nursery,
                 granted: Callable[[int, list[bytes]], None],
                 ended: Callable[[int, bool], None],
                 failed: Callable[[int, bytes, Attr | None, OSError, str], None],
                 writing: Callable[[int], bool] | None = None):
        self.meta = meta
        self.nursery = nursery
        self.session = os.urandom(16)
        self.stats = {"granted": 0, "refused": 0, "recalled": 0, "given_back": 0, "lost": 0,
                      "idle_returned": 0, "answered": 0, "removes": 0, "cancelled": 0,
                      "lookups": 0, "renames": 0, "renames_answered": 0, "batches": 0,
                      "failed": 0, "mkdirs": 0, "rmdirs": 0, "reserved": 0, "born": 0}
        self.book = LeaseBook(self.stats, writing)
        """The directories held and what was answered there (``lease_book.py``)."""
        self.dirs = self.book.dirs
        self._granted, self._ended, self._failed = granted, ended, failed
        self._creates: dict[int, int] = {}
        self._not_before: dict[int, float] = {}
        self._asking: dict[int, trio.Event] = {}
        self._waiting: set[int] = set()
        self._inflight: dict[int, int] = {}
        """Directory -> creates and unlinks sent to the shard and not answered yet."""
        self._drained: dict[int, trio.Event] = {}
        self._spare: dict[int, deque[int]] = {}
        """Shard -> inode numbers reserved there for new directories placed on it."""
        self._reserving: dict[int, trio.Event] = {}
        self._returning: dict[int, list[int]] = {}
        """Shard -> leases given back that ride on its next ``lease_wait``."""

    # ---- creates, unlinks and renames

    async def hold(self, parent: int) -> LeasedDir | None:
        """The lease on ``parent``: held, or asked for now (after ``LEASE_AFTER`` changes
        there); None to change it through the shard."""
        ld = self.dirs.get(parent)
        if ld is None:
            if not await self._ask(parent):
                return None
            ld = self.dirs.get(parent)
        return ld if ld is not None and not ld.ending else None

    async def take(self, parent: int) -> LeasedDir | None:
        """The lease on ``parent`` with an inode number free, for a create."""
        ld = await self.hold(parent)
        while ld is not None and not ld.ending and not ld.inos:
            await self._renew(ld)
            ld = self.dirs.get(parent)
        return ld if ld is not None and not ld.ending else None

    async def dir_ino(self, ld: LeasedDir, name: bytes) -> int | None:
        """An inode number for a new directory ``name`` in ``ld`` on the shard it is placed on
        (``new_dir_shard``): the lease's own range for the directory's shard, else one
        reserved on that shard ahead (``RESERVE_INODES`` at a time); None when none can be
        had (make it through the shard)."""
        shard = new_dir_shard(ld.parent, name, self.meta.n_shards)
        if shard == ld.shard:
            while not ld.inos and not ld.ending:
                await self._renew(ld)
            return ld.inos.popleft() if ld.inos and not ld.ending else None
        spare = self._spare.setdefault(shard, deque())
        while not spare:
            busy = self._reserving.get(shard)
            if busy is not None:
                await busy.wait()
                continue
            busy = self._reserving[shard] = trio.Event()
            try:
                first = await self.meta.reserve(shard, RESERVE_INODES)
            except JPFSError as e:
                log.info("could not reserve inode numbers on metadata shard %d: %s", shard,
                         e.strerror)
                return None
            finally:
                del self._reserving[shard]
                busy.set()
            self.stats["reserved"] += RESERVE_INODES
            spare.extend(make_ino(shard, c) for c in range(first, first + RESERVE_INODES))
        return spare.popleft()

    def add_dir(self, ld: LeasedDir, name: bytes, mode: int, uid: int, gid: int, ino: int
                ) -> Attr:
        """A new directory in ``ld`` with inode ``ino`` (``dir_ino``), answered now and
        committed behind (``LeaseBook.add_dir``)."""
        attr = self.book.add_dir(ld, name, mode, uid, gid, ino)
        self._start(ld)
        return attr

    def remove_dir(self, ld: LeasedDir, name: bytes, gone: LeasedDir) -> None:
        """Remove the empty directory ``name`` from ``ld``: ``gone``, whose lease this mount
        holds (so nobody else can add a name to it), answered now and committed behind; its
        lease goes back once that has committed."""
        gone.ending = True  # no more changes answered there
        self.book.remove_dir(ld, name, gone.parent)
        self._start(ld)
        self.nursery.start_soon(self._retire, gone)

    async def _retire(self, gone: LeasedDir) -> None:
        """End the lease of a directory removed under its parent's lease once the removal has
        committed (before, another client's change there would find it still there). The
        removal ended it on the shard; it rides on the next ``lease_wait`` all the same, in
        case the removal failed."""
        try:
            await self.book.settle(gone.parent)
            await gone.idle.wait()
            self._return_later(gone.shard, gone.parent)
            self.stats["given_back"] += 1
        finally:
            self._end(gone)

    def add(self, ld: LeasedDir, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """A new regular file in ``ld``, answered now and committed behind: its attributes
        (``LeaseBook.add``)."""
        attr = self.book.add(ld, name, mode, uid, gid)
        self._start(ld)
        return attr

    def rename(self, ld: LeasedDir, old: bytes, new: bytes) -> None:
        """Rename ``old`` to ``new`` in ``ld``, answered now and committed behind
        (``LeaseBook.rename``)."""
        self.book.rename(ld, old, new)
        self._start(ld)

    async def remove(self, ld: LeasedDir, name: bytes, ino: int) -> None:
        """Unlink ``name`` (file ``ino``) in ``ld``, answered now and committed behind
        (``LeaseBook.remove``; ``GiveBack`` when the lease is being given back meanwhile)."""
        await self.book.remove(ld, name, ino)
        self._start(ld)

    def _start(self, ld: LeasedDir) -> None:
        """Send ``ld``'s queue, unless a sender is at it already."""
        if ld.queue and ld.idle.is_set():
            ld.idle = trio.Event()
            self.nursery.start_soon(self._send, ld)

    async def give_back(self, parent: int) -> None:
        """Commit what is pending in ``parent`` and give its lease back (before this mount
        changes the directory's names itself, or when the shard recalls it)."""
        ld = self.dirs.get(parent)
        if ld is None:
            return
        if ld.ending:
            await ld.gone.wait()  # another call is giving it back
            return
        ld.ending = True
        ld.kick.set()  # what is pending goes now
        ld.look.set()
        self._hold_off(parent)
        try:
            await ld.idle.wait()
            if not ld.lost:
                try:
                    await self.meta.lease_return(parent, self.session)
                except JPFSError as e:  # the shard takes it back when the session ends
                    log.info("could not give back the lease on directory %#x: %s", parent,
                             e.strerror)
            self.stats["given_back"] += 1
        finally:
            self._end(ld)

    async def close(self) -> None:
        """Commit everything pending and give every lease back (before an unmount)."""
        async with trio.open_nursery() as nursery:
            for parent in list(self.dirs):
                nursery.start_soon(self.give_back, parent)
        async with trio.open_nursery() as nursery:
            for parents in self._returning.values():
                for parent in parents:
                    nursery.start_soon(self._return_unheld, parent)
        self._returning.clear()

    def _end_idle(self, ld: LeasedDir) -> None:
        """``give_back`` of a lease nothing used for ``IDLE_RETURN`` and with nothing pending,
        at once (a tree of thousands of new directories goes idle together: no task each); it
        rides on the shard's next ``lease_wait``."""
        self.stats["idle_returned"] += 1
        self.stats["given_back"] += 1
        ld.ending = True
        self._hold_off(ld.parent)
        if not ld.lost:
            self._return_later(ld.shard, ld.parent)
        self._end(ld)

    def _return_later(self, shard: int, parent: int) -> None:
        """Give ``parent``'s lease back on ``shard``'s next ``lease_wait``."""
        self._returning.setdefault(shard, []).append(parent)
        self._listen(shard)

    def _listen(self, shard: int) -> None:
        """Keep a ``lease_wait`` in flight to ``shard`` (``_wait_loop``)."""
        if shard not in self._waiting:
            self._waiting.add(shard)
            self.nursery.start_soon(self._wait_loop, shard)

    def as_dict(self) -> dict:
        """The lease counters, with the leases held and the files made under them not sent yet."""
        return {**self.stats, "held": len(self.dirs), "unsent": len(self.book.unsent)}

    def begin(self, parent: int) -> None:
        """A create or unlink in ``parent`` was sent to the shard (a lease is not asked for
        until it is answered: it would meet the lease and recall it)."""
        self._inflight[parent] = self._inflight.get(parent, 0) + 1

    def end(self, parent: int) -> None:
        """The create or unlink ``begin`` counted has been answered; the last one in ``parent`` lets
        a lease request that waited for them go on."""
        n = self._inflight.pop(parent) - 1
        if n:
            self._inflight[parent] = n
        else:
            ev = self._drained.pop(parent, None)
            if ev is not None:
                ev.set()

    # ---- the lease's life

    async def _ask(self, parent: int) -> bool:
        asking = self._asking.get(parent)
        if asking is not None:
            await asking.wait()
            return parent in self.dirs
        n = self._creates.get(parent, 0) + 1
        if n < LEASE_AFTER or time.monotonic() < self._not_before.get(parent, 0.0) or \
                len(self.dirs) >= MAX_LEASES:
            if len(self._creates) > 4096:
                self._creates.clear()
            self._creates[parent] = n
            return False
        self._creates.pop(parent, None)
        done = self._asking[parent] = trio.Event()
        try:
            if self._inflight.get(parent):
                drained = self._drained.setdefault(parent, trio.Event())
                await drained.wait()
            ld = LeasedDir(parent)
            self._listen(ld.shard)
            try:
                lease = await self.meta.lease(parent, self.session)
            except JPFSError as e:
                log.debug("no lease on directory %#x: %s", parent, e.strerror)
                lease = None
            if lease is None or not lease.granted:
                self.stats["refused"] += 1
                self._hold_off(parent)
                return False
            ld.inos.extend(make_ino(ld.shard, c) for c in range(lease.first,
                                                                lease.first + lease.n_inodes))
            ld.names = dict(zip(lease.names, lease.inos, strict=True))
            self.dirs[parent] = ld
            self.stats["granted"] += 1
            self._granted(parent, lease.names)
            return True
        finally:
            del self._asking[parent]
            done.set()

    def _born(self, ino: int) -> None:
        """A directory this mount made from a lease has committed, leased to this mount from
        birth (the shard granted it with the batch): held, with no names and no inode numbers
        yet (the first create there asks for them), or given back past ``MAX_LEASES``."""
        if ino in self.dirs:
            return
        if len(self.dirs) >= MAX_LEASES:
            self.nursery.start_soon(self._return_unheld, ino)
            return
        ld = self.dirs[ino] = LeasedDir(ino)
        self.stats["born"] += 1
        self._listen(ld.shard)
        self._granted(ino, [])

    async def _return_unheld(self, ino: int) -> None:
        try:
            await self.meta.lease_return(ino, self.session)
        except JPFSError as e:
            log.info("could not give back the lease on directory %#x: %s", ino, e.strerror)

    async def _renew(self, ld: LeasedDir) -> None:
        """More inode numbers for ``ld`` (the same call renews the lease)."""
        if ld.renewing is not None:
            await ld.renewing.wait()
            return
        ld.renewing = trio.Event()
        try:
            lease = await self.meta.lease(ld.parent, self.session)
            if lease.granted and lease.renewed:
                ld.inos.extend(make_ino(ld.shard, c) for c in range(lease.first,
                                                                    lease.first + lease.n_inodes))
            else:  # recalled meanwhile, or lost (granted afresh: the names may have changed)
                if lease.granted:
                    log.info("the lease on directory %#x had ended unnoticed; giving it back",
                             ld.parent)
                    self.stats["lost"] += 1
                self.nursery.start_soon(self.give_back, ld.parent)
                await ld.gone.wait()
        except JPFSError as e:
            log.info("could not renew the lease on directory %#x: %s", ld.parent, e.strerror)
            self.nursery.start_soon(self.give_back, ld.parent)
            await ld.gone.wait()
        finally:
            ld.renewing.set()
            ld.renewing = None

    async def _wait_loop(self, shard: int) -> None:
        """Hear the shard's recalls while this mount holds (or asks for) leases there."""
        try:
            while any(ld.shard == shard for ld in self.dirs.values()) or any(
                    shard_of(p) == shard for p in self._asking) or self._returning.get(shard):
                held = [p for p, ld in self.dirs.items() if ld.shard == shard and not ld.ending]
                returned = self._returning.pop(shard, [])
                recalled = await self.meta.lease_wait(shard, self.session, held, WAIT_SECONDS,
                                                      returned)
                for parent in recalled:
                    self.stats["recalled"] += 1
                    if parent in self.dirs:
                        self.nursery.start_soon(self.give_back, parent)
                    else:  # ended here already (a removed directory's): say so at once
                        self._return_later(shard, parent)
                idle = time.monotonic() - IDLE_RETURN
                for ld in list(self.dirs.values()):
                    if ld.shard == shard and ld.used < idle and not ld.ending and ld.idle.is_set():
                        self._end_idle(ld)
        except JPFSError as e:
            mine = [ld for ld in self.dirs.values() if ld.shard == shard]
            if mine:
                log.warning("lost the leases on %d directories of metadata shard %d (%s); "
                            "their new files are sent without them", len(mine), shard,
                            e.strerror)
            for ld in mine:
                ld.lost = True
                self.stats["lost"] += 1
                self.nursery.start_soon(self.give_back, ld.parent)
        finally:
            self._waiting.discard(shard)

    def _hold_off(self, parent: int) -> None:
        """Do not ask for ``parent``'s lease again for a while."""
        now = time.monotonic()
        if len(self._not_before) > 4096:
            self._not_before = {p: t for p, t in self._not_before.items() if t > now}
        self._not_before[parent] = now + RETRY_AFTER

    def _end(self, ld: LeasedDir) -> None:
        ld.gone.set()
        if self.dirs.get(ld.parent) is ld:
            del self.dirs[ld.parent]
            self._ended(ld.parent, ld.lost)

    # ---- batches

    async def _send(self, ld: LeasedDir) -> None:
        """Commit ``ld``'s queued changes, a batch at a time, until none is left."""
        try:
            while ld.queue:
                if not ld.ending:
                    with trio.move_on_after(SEND_DELAY):
                        await ld.kick.wait()
                while True:
                    ld.kick = trio.Event()
                    ld.look = trio.Event()
                    changes, wait, until = self.book.take_batch(ld)
                    if changes or wait is None:
                        break
                    with trio.move_on_after(until - time.monotonic()):
                        await wait.wait()  # a store ends, a held file is closed, or a waiter
                ld.queued = {ino for c in ld.queue for ino in inos_of(c)}
                ld.sending = {c[1]: c[2] for c in changes if isinstance(c, tuple)}
                ld.in_flight = {ino for c in changes for ino in inos_of(c)}
                done = ld.sent_done = ld.next_done
                ld.next_done = trio.Event()
                taken = ld.taken_total
                if len(changes) >= BATCH_MAX:  # more than a batch: the rest goes at once
                    ld.kick.set()
                if changes or ld.batch_ns > ld.sent_ns:  # (or only the times moved)
                    await self._commit(ld, changes, ld.batch_ns)
                ld.answered_total = taken
                for ino in ld.in_flight:
                    if ino not in ld.queued and self.book.changing.get(ino) == ld.parent:
                        del self.book.changing[ino]
                ld.sending = {}
                ld.in_flight = set()
                done.set()
        finally:
            ld.idle.set()
            ld.sent_done.set()
            ld.next_done.set()  # who waits for a file dropped meanwhile looks again
            ld.next_done = trio.Event()

    async def _commit(self, ld: LeasedDir, changes: list, time_ns: int) -> None:
        """Commit ``changes`` (see ``LeasedDir.queue``; ``LeaseBook.take_batch`` made them
        safe to split): those of directories placed on other shards in a ``dir_batch``, the
        others in a ``create_batch``, both at once, each setting the directory's times to
        ``time_ns`` (as this mount answered them); then their answers."""
        results: list = [None] * len(changes)
        here = [i for i, c in enumerate(changes) if elsewhere(ld, c) is None]
        far = [i for i, c in enumerate(changes) if elsewhere(ld, c) is not None]

        async def call(method, which: list[int]) -> None:
            entries = [changes[i][2].entry(changes[i][1]) if isinstance(changes[i], tuple)
                       else changes[i] for i in which]
            try:
                got: list = await method(ld.parent, self.session, entries, time_ns)
            except JPFSError as e:
                got = [e] * len(entries)
            for i, r in zip(which, got, strict=True):
                results[i] = r

        async with trio.open_nursery() as nursery:
            if here or not far:  # (no change at all: the times alone)
                nursery.start_soon(call, self.meta.create_batch, here)
            if far:
                nursery.start_soon(call, self.meta.dir_batch, far)
        ld.sent_ns = max(ld.sent_ns, time_ns)
        self.stats["batches"] += 1
        for c, r in zip(changes, results, strict=True):
            if isinstance(c, tuple):
                f = c[2]
                self.book.unsent.pop(f.attr.ino, None)
                f.answer = r
                if isinstance(r, OSError):
                    self.stats["failed"] += 1
                    self._failed(ld.parent, c[1], f.attr, r, "create")
                elif f.attr.is_dir:
                    self._born(f.attr.ino)
            elif isinstance(r, OSError):
                self.stats["failed"] += 1
                self._failed(ld.parent, c[0], None, r, "remove" if len(c) == 2 else
                             f"rename to {c[1].decode(errors='replace')!r}")


__all__ = ["DirLeases", "GiveBack", "LeasedDir"]
