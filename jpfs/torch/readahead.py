"""Background read-ahead of the shards a worker will need next, bounded in bytes.

The partition functions tell a worker its whole future, so the shards it needs are known in
first-use order. A thread fetches them in batches through the source's store (on ``jpfs://`` the
client's batched multi-file read; on a local or mounted path, plain reads that also warm the
mount's cache and feed its prefetcher) and decodes them with pyarrow, which releases the GIL.
Bytes held (fetched or decoded, not yet released by the consumer) stay under ``budget``; a shard
the consumer is blocked on is always fetched, so one shard larger than the budget cannot stall.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from .shards import Shard, ShardDecoder, ShardTable
from .store import BytesLike, Store

log = logging.getLogger(__name__)

HINT_FILE = os.path.join(".jpfs", "prefetch")  # the mount's control file (jpfs/fuse/control.py)
SOCKET_FILE = os.path.join(".jpfs", "socket")  # names the hint socket (read-only mounts)


class ReadAhead:
    """Fetch and decode ``schedule`` (shard indices in first-use order) ahead of the consumer."""

    def __init__(self, store: Store, shards: Sequence[Shard], schedule: Sequence[int],
                 decode: ShardDecoder, *, budget: int = 256 << 20,
                 batch_files: int = 32, hint: Callable[[list[str]], None] | None = None):
        self.store = store
        self.shards = shards
        self.schedule = list(schedule)
        self.decode = decode
        self.budget = max(int(budget), 1)
        self.batch_files = max(int(batch_files), 1)
        self.hint = hint
        self._cond = threading.Condition()
        self._ready: dict[int, ShardTable] = {}
        self._held: dict[int, int] = {}  # shard -> bytes counted against the budget
        self._wanted: int | None = None
        self._released: set[int] = set()
        self._error: BaseException | None = None
        self._closed = False
        self.fetched_files = 0
        self.fetched_bytes = 0
        self.fetch_calls = 0
        self._thread = threading.Thread(target=self._run, name="jpfs-readahead", daemon=True)
        self._thread.start()

    # consumer side -------------------------------------------------------------------------

    def get(self, shard: int) -> ShardTable:
        """The decoded shard, waiting for the background thread if it is not there yet."""
        with self._cond:
            while shard not in self._ready:
                if shard in self._released:
                    raise RuntimeError(f"shard {shard} was already released")
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise RuntimeError("read-ahead closed")
                self._wanted = shard
                self._cond.notify_all()
                self._cond.wait(0.5)
            self._wanted = None
            return self._ready[shard]

    def release(self, shard: int) -> None:
        """The consumer is done with ``shard``: its bytes leave the budget."""
        with self._cond:
            self._ready.pop(shard, None)
            self._held.pop(shard, None)
            self._released.add(shard)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the background thread and drop what it holds."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._held.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.decode.close()
            self.store.close()

    # background side -----------------------------------------------------------------------

    def _cost(self, shard: int) -> int:
        return max(self.shards[shard].nbytes, 1)

    def _next_batch(self, pos: int) -> list[int]:
        """Shards starting at ``pos`` that fit the budget now (at least one if it is wanted)."""
        with self._cond:
            while True:
                if self._closed:
                    return []
                used = sum(self._held.values())
                batch: list[int] = []
                total = 0
                for s in self.schedule[pos:pos + self.batch_files]:
                    cost = self._cost(s)
                    if used + total + cost > self.budget and (batch or self._held):
                        if not (not batch and self._wanted == s):
                            break
                    batch.append(s)
                    total += cost
                if batch:
                    for s in batch:
                        self._held[s] = self._cost(s)
                    return batch
                self._cond.wait(0.5)

    def _run(self) -> None:
        pos = 0
        try:
            while pos < len(self.schedule):
                batch = self._next_batch(pos)
                if not batch:
                    return
                pos += len(batch)
                if self.hint is not None:
                    self.hint([self.shards[s].path for s in self.schedule[pos:pos + 64]])
                for s, data in zip(batch, self._fetch(batch), strict=True):
                    table = self.decode(s, data)
                    self.fetched_files += 1
                    self.fetched_bytes += len(data) if data is not None else self.shards[s].nbytes
                    with self._cond:
                        if self._closed:
                            return
                        self._ready[s] = table
                        self._held[s] = max(self._held.get(s, 0), table.nbytes)
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer by get()
            log.debug("read-ahead failed: %r", e)
            with self._cond:
                self._error = e
                self._cond.notify_all()


    def _fetch(self, batch: list[int]) -> list[BytesLike | None]:
        """The bytes of ``batch``: whole files in one multi-file read, row-group spans in one
        multi-range read (on ``jpfs://``: the client's ``read_many`` and ``read_ranges``, one
        round trip per directory and per storage node)."""
        fetch = [s for s in batch if self.decode.wants_bytes(self.shards[s])]
        whole = [s for s in fetch if self.shards[s].row_groups is None]
        ranged = [s for s in fetch if self.shards[s].row_groups is not None]
        got: dict[int, BytesLike | None] = {}
        if whole:
            got.update(zip(whole, self.store.read_many([self.shards[s].path for s in whole]),
                           strict=True))
            self.fetch_calls += 1
        if ranged:
            sh = [self.shards[s] for s in ranged]
            got.update(zip(ranged, self.store.read_ranges([x.path for x in sh],
                                                          [x.start for x in sh],
                                                          [x.stop for x in sh]), strict=True))
            self.fetch_calls += 1
        return [got.get(s) for s in batch]


def mount_hint(root: str) -> Callable[[list[str]], None] | None:
    """A hint function for a path inside a JPFS mount that offers a prefetch control file.

    Looks for ``.jpfs/prefetch`` at the mount root (walking up from ``root``); writing paths to
    it, one per line, asks the mount to fetch them ahead. On a read-only mount (the kernel
    refuses every write there) the same lines go to the Unix socket named by ``.jpfs/socket``.
    None when there is no such file.
    """
    if "://" in root:
        return None
    d = os.path.abspath(root)
    while True:
        candidate = os.path.join(d, HINT_FILE)
        if os.path.exists(candidate):
            break
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
    sent: set[str] = set()
    conn: dict[int, socket.socket] = {}  # by pid: DataLoader workers fork

    def to_socket(text: bytes) -> None:
        s = conn.get(os.getpid())
        if s is None:
            with open(os.path.join(d, SOCKET_FILE)) as f:
                where = f.read().strip()
            if not where:
                raise OSError(errno.EROFS, "read-only mount without a hint socket")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(where)
            conn.clear()
            conn[os.getpid()] = s
        try:
            s.sendall(text)
        except OSError:
            conn.pop(os.getpid(), None)
            s.close()
            raise

    def hint(paths: list[str]) -> None:
        new = [p for p in paths if p not in sent]
        if not new:
            return
        sent.update(new)
        text = "".join(p + "\n" for p in new)
        try:
            if os.getpid() in conn:
                to_socket(text.encode())
                return
            try:
                with open(candidate, "a") as f:
                    f.write(text)
            except OSError as e:
                if e.errno != errno.EROFS:
                    raise
                to_socket(text.encode())
        except OSError as e:
            log.debug("prefetch hint to %s failed: %s", candidate, e)

    return hint
