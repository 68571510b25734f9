"""What a mount answered from the directory leases it holds and has not committed yet: the local
half of ``leases.py`` (which talks to the shards), with no call of its own.

New directories are queued as creates with a directory's mode (``add_dir``), and removed ones
as removes (``remove_dir``); those placed on another shard than the directory's go in batches
of their own (``elsewhere``). Unlinks and plain
renames of files in a leased directory are answered the same way as creates
when the lease's names (as granted, then as this mount changed them) give each name the inode
the kernel names and those live on the directory's shard: the batch carries the changes in the
order they were answered (``LeasedDir.queue``), and a file not sent yet is just dropped
(unlinked) or made under its new name (renamed). A lookup of a name the lease's names hold, of
an inode the VFS knows, needs no call either.

On a ``--write-behind`` mount a batch leaves out a new file still open for writing (for up to
``HOLD_OPEN``), so that its close usually finds its create unsent, and a file closed before its
bytes are stored (``store_behind``) holds its create, and everything queued after it, until the
store has ended, so nobody sees it without its bytes.

Until its batch commits, a change exists in this mount only. Whatever would show the shard that
it is missing waits for the batch first (``settle``): the file's own metadata calls (its first
commit, getattr, setattr, open, xattrs) and this mount's listings of the directory.
"""

from __future__ import annotations

import errno
import stat
import time
from collections import deque
from collections.abc import Callable

import trio

from ...errors import error
from ...placement import shard_of
from ...types import Attr

BATCH_MAX = 512
"""Entries per ``create_batch``."""
HOLD_OPEN = 0.02
"""Seconds at most a batch leaves out a new file that is still open for writing (and what was
queued after it), so that its first commit goes with its create, unless something waits."""


class NewFile:
    """A file answered from a lease and not committed yet; ``chunks`` and ``size`` once its
    first commit is to go with it, ``answer`` what the shard said then; ``seq`` its place in
    the directory's queue (a file renamed before it was sent takes a new place); ``stored``,
    for a file closed before its bytes were stored (``store_behind``), set once they are (or
    could not be): until then its create, and what was queued after it, wait."""

    __slots__ = ("attr", "chunks", "size", "answer", "seq", "stored", "made")

    def __init__(self, attr: Attr):
        self.attr = attr
        self.made = time.monotonic()
        self.chunks: list | None = None
        self.size = 0
        self.answer: Attr | OSError | None = None
        self.seq = 0
        self.stored: trio.Event | None = None

    def entry(self, name: bytes) -> list:
        """The file's entry of a ``create_batch`` under ``name`` (with its ctime apart where a
        rename before it was sent moved it)."""
        a = self.attr
        e = [name, a.ino, a.mode, a.uid, a.gid, a.mtime_ns]
        if self.chunks is not None:  # the first commit: the shard's time for mtime and ctime
            e += [self.size, [c.to_wire() for c in self.chunks]]
        elif a.ctime_ns != a.mtime_ns:
            e.append(a.ctime_ns)
        return e


class GiveBack(Exception):
    """The lease is being given back: unlink through the shard instead."""


class LeasedDir:
    """A directory this mount holds the lease of."""

    __slots__ = ("parent", "shard", "inos", "pending", "queue", "queued", "seq", "sending",
                 "in_flight", "idle", "ending", "lost", "renewing", "gone", "kick", "next_done",
                 "sent_done", "used", "names", "urgent", "look", "queued_total",
                 "taken_total", "answered_total", "times", "changed_ns", "batch_ns", "sent_ns")

    def __init__(self, parent: int):
        self.parent = parent
        self.shard = shard_of(parent)
        self.inos: deque[int] = deque()
        """Reserved inode numbers not used yet."""
        self.pending: dict[bytes, NewFile] = {}
        """Files answered and not sent yet, by name."""
        self.queue: deque = deque()
        """The changes answered and not sent yet, in the order they were answered (the shard
        applies a batch in its order): ``(seq, name, NewFile)`` a create (skipped when the
        name no longer holds that file at that place: removed or renamed before it was sent),
        ``[name, ino]`` a remove, ``[old, new, ino, replaced or 0]`` a rename."""
        self.queued: set[int] = set()
        """The inodes the queue changes."""
        self.times: deque[int] = deque()
        """When each change of ``queue`` was answered: the directory's mtime and ctime after
        it, as this mount told the kernel."""
        self.changed_ns = 0
        """The directory's mtime and ctime after the last change answered from the lease."""
        self.batch_ns = 0
        """... after the last change of the batch ``take_batch`` took: its shard sets them so
        (what this mount told the kernel, not the time the batch commits)."""
        self.sent_ns = 0
        """... as the last batch sent set them (a batch with no change left to send, after an
        unlink dropped a create not sent yet, still sets them)."""
        self.queued_total = 0
        """Changes ever queued here; with ``answered_total``, a change's place in the queue's
        history (``settle`` of the directory waits for the changes queued before it)."""
        self.taken_total = 0
        """Changes taken from the head of the queue: sent, or skipped (a create whose file was
        removed or renamed before it was sent)."""
        self.answered_total = 0
        """... and answered: ``taken_total`` once their batch has its answer."""
        self.seq = 0
        self.sending: dict[bytes, NewFile] = {}
        """Files in the batch in flight."""
        self.in_flight: set[int] = set()
        """The inodes the batch in flight changes."""
        self.names: dict[bytes, int] = {}
        """The directory's names and their inodes: as granted, then as this VFS changed them
        (nobody else does while the lease is held)."""
        self.kick = trio.Event()
        """Set to wake the sender: somebody waits for queued changes (``urgent``: send them
        now), or the rest of a full batch is to go at once."""
        self.urgent: set[int | None] = set()
        """The files somebody waits for (None: all that is queued)."""
        self.look = trio.Event()
        """Set when a create the sender holds back may go: somebody waits, its file was closed
        or its store ended."""
        self.next_done = trio.Event()
        """Set once the batch that takes the pending files has its answer."""
        self.sent_done = trio.Event()
        """... and the batch in flight."""
        self.sent_done.set()
        self.used = time.monotonic()
        """When a create last used the lease."""
        self.idle = trio.Event()
        """Set while nothing is pending or in flight."""
        self.idle.set()
        self.ending = False
        """Being given back (or lost): no more creates from memory."""
        self.lost = False
        self.renewing: trio.Event | None = None
        self.gone = trio.Event()
        """Set once the lease has ended."""

    def entry(self, name: bytes) -> Attr | None:
        """A file answered under ``name`` and not committed yet (one renamed away after it was
        sent is not under its old name any more)."""
        f = self.pending.get(name) or self.sending.get(name)
        return f.attr if f is not None and self.names.get(name) == f.attr.ino else None

    def done_event(self, ino: int | None) -> trio.Event | None:
        """What to wait on for the changes of ``ino`` (None: everything now queued or in
        flight) to be answered; None when nothing is."""
        if ino is None:
            if self.queue:
                self.urgent.add(None)
                self.kick.set()
                self.look.set()
                return self.next_done
            return None if self.sent_done.is_set() else self.sent_done
        if ino in self.queued:
            self.urgent.add(ino)
            self.kick.set()
            self.look.set()
            return self.next_done
        if ino in self.in_flight:
            return self.sent_done
        return None


class LeaseBook:
    """The leased directories and what was answered there and not committed, by file.

    ``DirLeases`` owns it: it adds and ends the directories, sends the queues and records the
    shard's answers; everything here is answered from memory.

    Args:
        stats: the leases' counters (shared with ``DirLeases``, which counts its calls there).
        writing: whether a file is open for writing on this mount, so that a batch holds its
            create back for its close (a ``--write-behind`` mount's VFS answers it).
    """

    def __init__(self, stats: dict[str, int], writing: Callable[[int], bool] | None = None):
        self.stats = stats
        self.writing: Callable[[int], bool] = writing or (lambda ino: False)
        self.dirs: dict[int, LeasedDir] = {}
        self.unsent: dict[int, tuple[int, bytes]] = {}
        """Inode -> (directory, name), for files answered whose batch has not committed."""
        self.changing: dict[int, int] = {}
        """Inode -> directory, for every file with a change answered and not committed (a
        create, remove or rename)."""

    def add(self, ld: LeasedDir, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """A new regular file in ``ld``, answered now and committed behind: its attributes."""
        now = time.time_ns()
        attr = Attr(ld.inos.popleft(), stat.S_IFREG | (mode & 0o7777), 1, uid, gid, 0,
                    now, now, now)
        ld.names[name] = attr.ino
        ld.used = time.monotonic()
        self.unsent[attr.ino] = (ld.parent, name)
        self.stats["answered"] += 1
        self._queue_create(ld, name, NewFile(attr))
        return attr

    def add_dir(self, ld: LeasedDir, name: bytes, mode: int, uid: int, gid: int, ino: int
                ) -> Attr:
        """A new directory in ``ld`` (inode ``ino``: from the lease's range when it is placed
        on the directory's shard, else reserved on the shard it is placed on), answered now
        and committed behind: its attributes."""
        now = time.time_ns()
        attr = Attr(ino, stat.S_IFDIR | (mode & 0o7777), 2, uid, gid, 0, now, now, now)
        ld.names[name] = ino
        ld.used = time.monotonic()
        self.unsent[ino] = (ld.parent, name)
        self.stats["answered"] += 1
        self.stats["mkdirs"] += 1
        self._queue_create(ld, name, NewFile(attr))
        return attr

    def _queue_create(self, ld: LeasedDir, name: bytes, f: NewFile) -> None:
        ld.seq += 1
        f.seq = ld.seq
        ld.pending[name] = f
        self._queue(ld, (f.seq, name, f), f.attr.ino, at=f.attr.ctime_ns)

    def _queue(self, ld: LeasedDir, change: tuple | list, *inos: int, at: int = 0) -> None:
        """Queue ``change`` (of files ``inos``), made at ``at`` (default now: the directory's
        new mtime and ctime, ``LeasedDir.changed_ns``); ``DirLeases`` starts the sender
        after."""
        ld.changed_ns = max(at or time.time_ns(), ld.changed_ns)
        ld.queue.append(change)
        ld.times.append(ld.changed_ns)
        ld.queued_total += 1
        for ino in inos:
            ld.queued.add(ino)
            self.changing[ino] = ld.parent

    def _cancel(self, ld: LeasedDir, name: bytes, ino: int) -> bool:
        """Forget the create of ``name`` (file ``ino``) if it has not been sent: True if so
        (its queued create is skipped)."""
        f = ld.pending.get(name)
        if f is None or f.attr.ino != ino:
            return False
        del ld.pending[name]
        self.unsent.pop(ino, None)
        self.changing.pop(ino, None)  # a file not sent has no other change queued
        f.answer = error(errno.ENOENT, "removed before it was committed")
        self.stats["cancelled"] += 1
        return True

    @staticmethod
    def removable(ld: LeasedDir, name: bytes, ino: int) -> bool:
        """Whether an unlink of ``name`` (file ``ino``, as the kernel knows it) can be answered
        from ``ld``: the lease's names say so, and the inode lives on the directory's
        shard."""
        return not ld.ending and shard_of(ino) == ld.shard and ld.names.get(name) == ino

    @staticmethod
    def movable(ld: LeasedDir, old: bytes, ino: int, new: bytes, replaced: int | None) -> bool:
        """Whether a rename of ``old`` (file ``ino``) to ``new`` (naming the regular file
        ``replaced``, or nothing) can be answered from ``ld``: the lease's names say so, and
        both inodes live on the directory's shard (one transaction there)."""
        return LeaseBook.removable(ld, old, ino) and ld.names.get(new) == replaced and (
            replaced is None or shard_of(replaced) == ld.shard)

    def rename(self, ld: LeasedDir, old: bytes, new: bytes) -> None:
        """Rename ``old`` to ``new`` in ``ld`` (``movable``), answered now and committed behind.
        A file not sent yet is made under its new name instead; a file ``new`` named that was
        not sent yet is never sent."""
        ino = ld.names[old]
        replaced = ld.names.get(new)
        ld.used = time.monotonic()
        self.stats["renames"] += 1
        self.stats["renames_answered"] += 1
        if replaced == ino:
            return  # two names of one file: rename(2) does nothing
        del ld.names[old]
        ld.names[new] = ino
        if replaced is not None and self._cancel(ld, new, replaced):
            replaced = None
        f = ld.pending.get(old)
        if f is not None and f.attr.ino == ino:  # not sent yet: made under its new name
            del ld.pending[old]
            f.attr = f.attr.with_(ctime_ns=max(time.time_ns(), f.attr.ctime_ns + 1))
            if replaced is not None:
                self._queue(ld, [new, replaced], replaced)
            self.unsent[ino] = (ld.parent, new)
            self._queue_create(ld, new, f)
        elif replaced is not None:
            self._queue(ld, [old, new, ino, replaced], ino, replaced)
        else:
            self._queue(ld, [old, new, ino, 0], ino)

    def renamed(self, ld: LeasedDir, old: bytes, new: bytes) -> None:
        """This mount renamed ``old`` to ``new`` in ``ld`` through the shard, as the holder:
        the lease's names follow (whatever ``new`` named is replaced)."""
        ino = ld.names.get(old)
        if ino is not None and ld.names.get(new) != ino:  # else a no-op, as rename(2)'s
            del ld.names[old]
            ld.names[new] = ino
        ld.used = time.monotonic()
        self.stats["renames"] += 1

    def remove_dir(self, ld: LeasedDir, name: bytes, ino: int) -> None:
        """Remove the empty directory ``name`` (``ino``, whose lease this mount holds) from
        ``ld``, answered now and committed behind."""
        del ld.names[name]
        ld.used = time.monotonic()
        self.stats["rmdirs"] += 1
        self._queue(ld, [name, ino], ino)

    async def remove(self, ld: LeasedDir, name: bytes, ino: int) -> None:
        """Unlink ``name`` (file ``ino``) in ``ld``, answered now and committed behind; a file
        answered and not sent yet is just never sent."""
        ld.names.pop(name, None)
        if self._cancel(ld, name, ino):
            ld.changed_ns = max(time.time_ns(), ld.changed_ns)
            return
        if ino in ld.in_flight:
            await ld.sent_done.wait()  # the shard must have it before it can remove it
            if ld.ending:
                raise GiveBack
        ld.used = time.monotonic()
        self.stats["removes"] += 1
        self._queue(ld, [name, ino], ino)

    def entry(self, parent: int, name: bytes) -> Attr | None:
        """A file answered in ``parent`` and not committed yet, by name."""
        ld = self.dirs.get(parent)
        return ld.entry(name) if ld is not None else None

    def named(self, parent: int, name: bytes) -> int | None:
        """The inode ``name`` in ``parent`` names, when this mount holds ``parent``'s lease
        (nobody else changes its names meanwhile); None when it does not, or no such name."""
        ld = self.dirs.get(parent)
        return ld.names.get(name) if ld is not None and not ld.ending else None

    def absent(self, parent: int, name: bytes) -> bool:
        """Whether this mount holds ``parent``'s lease and its names do not hold ``name``
        (which the shard may still show, until a change answered from the lease is sent)."""
        ld = self.dirs.get(parent)
        return ld is not None and not ld.ending and name not in ld.names

    async def settle(self, *inos: int) -> None:
        """Return once the files ``inos`` (and directories, for their entries) are known to
        the shard: what this mount answered there has committed (for a directory: every
        change queued there before the call, however many batches that takes; not those
        queued meanwhile, so a directory being filled cannot hold a listing back for ever)."""
        for ino in inos:
            if ino not in self.changing and ino in self.dirs:
                await self._settle_dir(self.dirs[ino])
                continue
            while True:
                parent = self.changing.get(ino)
                ld = self.dirs.get(parent) if parent is not None else None
                ev = ld.done_event(ino) if ld is not None else None
                if ev is None or ev.is_set():
                    break
                await ev.wait()

    async def _settle_dir(self, ld: LeasedDir) -> None:
        """Wait until the changes queued in ``ld`` so far are answered (or the lease ended)."""
        upto = ld.queued_total
        while ld.answered_total < upto and self.dirs.get(ld.parent) is ld:
            ev = ld.done_event(None)
            if ev is None:
                break
            await ev.wait()

    def busy(self, parent: int) -> bool:
        """Whether a leased directory has changes not committed yet (its attributes on the
        shard are behind)."""
        ld = self.dirs.get(parent)
        return ld is not None and not ld.idle.is_set()

    async def settle_all(self) -> None:
        """Every change answered from a lease committed (before a listing: the shard's
        attributes of a leased directory are behind until then)."""
        for parent in [p for p, ld in self.dirs.items() if not ld.idle.is_set()]:
            await self.settle(parent)

    def store_behind(self, ino: int) -> trio.Event | None:
        """The file ``ino``, answered from a lease and not sent yet, was closed and its bytes
        are to be stored behind the close: its create waits in the queue for its first commit
        (``attach``) so that nobody sees it without its bytes. The event to set once the store
        has ended, whatever its outcome (then the create goes, with or without them); None when
        the file is not waiting to be sent (commit it before the close is answered)."""
        where = self.unsent.get(ino)
        ld = self.dirs.get(where[0]) if where is not None else None
        f = ld.pending.get(where[1]) if ld is not None and where is not None else None
        if f is None or ld is None or ld.ending or f.chunks is not None or (
                f.stored is not None and not f.stored.is_set()):
            return None
        f.stored = trio.Event()
        ld.look.set()  # a batch holding it back for its close looks again
        return f.stored

    def closed(self, ino: int) -> None:
        """The file ``ino`` is no longer open for writing: a batch holding its create back for
        its first commit need not wait any longer."""
        where = self.unsent.get(ino)
        ld = self.dirs.get(where[0]) if where is not None else None
        if ld is not None:
            ld.look.set()

    async def attach(self, ino: int, chunks: list, size: int) -> Attr | None:
        """The first commit of a file answered from a lease and not sent yet: it goes with the
        file's create, in one batch. The file's attributes after it, or None when the file
        is no longer waiting (commit it as usual, after ``settle``)."""
        where = self.unsent.get(ino)
        if where is None:
            return None
        parent, name = where
        ld = self.dirs.get(parent)
        f = ld.pending.get(name) if ld is not None else None
        if f is None or ld is None:
            return None
        f.chunks, f.size = chunks, size
        if f.stored is not None:
            f.stored.set()  # the queue may go on past it
        while f.answer is None:
            ev = ld.done_event(ino)
            if ev is None or ev.is_set():
                break
            await ev.wait()
        answer = f.answer
        if answer is None:
            raise error(errno.EIO, "the mount stopped before the file was committed")
        if isinstance(answer, OSError):
            raise answer
        return answer

    def take_batch(self, ld: LeasedDir) -> tuple[list, trio.Event | None, float]:
        """The next batch from the head of ``ld``'s queue: up to ``BATCH_MAX`` changes, ending
        before a create that must wait (its file's bytes are being stored behind its close; or
        it is open for writing, young, and nobody waits for it or what follows it), or before
        a change whose order against one already taken matters across the batch's two calls.
        The changes of directories placed on other shards (``elsewhere``) go in a
        ``dir_batch``, the others in a ``create_batch``, and the shard applies each in its
        order but not one before the other: so a name taken in one of them ends the batch
        where the other would take it too, and a ``dir_batch`` takes a name once (no
        directory is made and removed in one two-phase commit). With no change to send: what
        to wait for, and until when, before looking again."""
        urgent, ld.urgent = ld.urgent, set()
        if ld.ending:
            urgent.add(None)
        changes: list = []
        ld.batch_ns = 0
        named: dict[bytes, bool] = {}  # name -> taken by a change elsewhere
        now = time.monotonic()
        while ld.queue and len(changes) < BATCH_MAX:
            c = ld.queue[0]
            far = elsewhere(ld, c) is not None
            names = names_of(c)
            if any(n in named and (far or named[n]) for n in names):
                break
            if isinstance(c, tuple):  # a create: still that file under that name?
                f: NewFile = c[2]
                if ld.pending.get(c[1]) is not f or f.seq != c[0]:
                    ld.queue.popleft()
                    ld.batch_ns = max(ld.batch_ns, ld.times.popleft())
                    ld.taken_total += 1
                    continue
                if f.stored is not None and not f.stored.is_set():
                    return changes, (None if changes else f.stored), float("inf")
                if f.chunks is None and now - f.made < HOLD_OPEN and None not in urgent and \
                        self.writing(f.attr.ino) and not (
                            urgent and urgent & {i for q in ld.queue for i in inos_of(q)}):
                    return changes, (None if changes else ld.look), f.made + HOLD_OPEN
                del ld.pending[c[1]]
            for n in names:
                named[n] = far
            changes.append(ld.queue.popleft())
            ld.batch_ns = max(ld.batch_ns, ld.times.popleft())
            ld.taken_total += 1
        if not ld.queue:  # (an unlink that dropped a create not sent yet queued nothing)
            ld.batch_ns = max(ld.batch_ns, ld.changed_ns)
        return changes, None, 0.0


def names_of(change: tuple | list) -> tuple[bytes, ...]:
    """The names a queued change is about (see ``LeasedDir.queue``)."""
    if isinstance(change, tuple):
        return (change[1],)
    return (change[0],) if len(change) == 2 else (change[0], change[1])


def elsewhere(ld: LeasedDir, change: tuple | list) -> str | None:
    """What a queued change does to a directory placed on another shard than ``ld``'s ("mkdir",
    "rmdir": a ``dir_batch``'s), or None (a ``create_batch``'s). A remove of a file answered
    from a lease is always of an inode on the directory's shard."""
    if isinstance(change, tuple):
        a = change[2].attr
        return "mkdir" if a.is_dir and shard_of(a.ino) != ld.shard else None
    if len(change) == 2 and shard_of(change[1]) != ld.shard:
        return "rmdir"
    return None


def inos_of(change: tuple | list) -> tuple[int, ...]:
    """The files a queued change is about (see ``LeasedDir.queue``)."""
    if isinstance(change, tuple):
        return (change[2].attr.ino,)
    if len(change) == 2:
        return (change[1],)
    return (change[2], change[3]) if change[3] else (change[2],)


__all__ = ["BATCH_MAX", "GiveBack", "LeaseBook", "LeasedDir", "NewFile", "elsewhere", "inos_of",
           "names_of"]
