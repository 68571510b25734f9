"""Short-circuit reads: a client on a storage node's host reads the node's volume files itself.

Over loopback a blob still costs the node a lookup and a ``sendfile`` into a socket, and the
client a receive: two copies, the loopback's work and both processes' CPU on the same cores
(a third of the daemons' CPU per cold MiB, docs/design-notes.md, "Mount speed"). A client that
finds a node on its own host asks it only where the blobs lie (``locate_blobs``) and ``preadv``s
them from the volume files into its receive buffers: one copy, from the page cache. Each blob is
then checked against the chunk's xxh3 as every read is. Anything else (a volume it cannot open,
a short read, a checksum mismatch, a place the node refuses) is left to the socket, which fails
over and reports bad copies as before. HDFS calls these short-circuit local reads.

"Same host" is decided once per node (``host_info``): the same boot id and network namespace
(so nodes of simulated hosts, in namespaces of their own, stay remote) and the node's volumes
directory is the same directory here (same device and inode: the same filesystem view, not a
container's look-alike). Reading the files needs the permission to open them; a client without
it reads over the socket.

Volume ids are never reused and a volume's bytes never change once written (compaction writes
a new volume and unlinks the old), so a descriptor held open stays right. The client tends the
descriptors every ``CHECK_EVERY`` seconds whether or not it reads (``StorageClient``): those of
volumes that were unlinked are closed, so a compaction's space is freed under an idle client
too, and so are those no read used for ``IDLE_CLOSE`` seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from ...proto import storage as P

KEEP = 64
"""Volume descriptors one node's ``LocalVolumes`` keeps open at most (least recently used go
first, unless a read is using them)."""
CHECK_EVERY = 10.0
"""Seconds between looks for held volumes that were unlinked (compacted away) or idle."""
IDLE_CLOSE = 60.0
"""Seconds a volume descriptor no read used stays open."""
INLINE_MAX = 256 << 10
"""Batches up to this many bytes are first read on the caller's thread with ``RWF_NOWAIT``
(from the page cache, or not at all); the rest, and what was not cached, in a worker thread."""

_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def same_host(info: dict) -> bool:
    """Whether a node's ``host_info`` answer describes this host and a volumes directory this
    process sees as the node does."""
    host, path, ident = info.get("host"), info.get("volumes"), info.get("volumes_id")
    if not isinstance(host, list) or not host or not host[0] or host != P.host_identity():
        return False
    if not isinstance(path, str) or not isinstance(ident, list) or len(ident) != 2:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return [st.st_dev, st.st_ino] == ident and os.access(path, os.R_OK | os.X_OK)


class LocalVolumes:
    """One storage node's volume files, opened read-only by this client. Reads run in worker
    threads (and inline, non-blocking); the descriptor table is shared under a lock, and a
    descriptor in use by a read is never closed."""

    def __init__(self, directory: str):
        self.dir = directory
        self._lock = threading.Lock()
        self._fds: OrderedDict[int, list] = OrderedDict()  # vol -> [fd, reads using it, used]

    def read(self, places: Sequence[tuple[int, int, memoryview, int]], *, nowait: bool = False
             ) -> list[bool | None]:
        """Fill each view from ``(volume, offset, view, xxh)`` and check it: True when the
        bytes are all there and match ``xxh``, False when not (left to the socket), None when
        ``nowait`` and the bytes are not in the page cache (read them again without it)."""
        out: list[bool | None] = []
        for vol, offset, view, xxh in places:
            fd = self._pin(vol)
            if fd is None:
                out.append(False)
                continue
            try:
                n = os.preadv(fd, [view], offset, _NOWAIT) if nowait else \
                    os.preadv(fd, [view], offset)
            except OSError:
                # not cached (EAGAIN), or RWF_NOWAIT not supported here: the blocking read
                # in a worker thread decides
                out.append(None if nowait else False)
                continue
            finally:
                self._unpin(vol)
            if nowait and n < len(view):
                out.append(None)  # partly cached: a blocking read finishes it
                continue
            out.append(n == len(view) and xxhash.xxh3_64_intdigest(view) == xxh)
        return out

    def _pin(self, vol: int) -> int | None:
        with self._lock:
            slot = self._fds.get(vol)
            if slot is not None:
                slot[1] += 1
                slot[2] = time.monotonic()
                self._fds.move_to_end(vol)
                return slot[0]
        try:
            fd = os.open(os.path.join(self.dir, P.volume_file(vol)), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # compacted away since it was located, or not ours to read
        with self._lock:
            slot = self._fds.get(vol)
            if slot is not None:  # another thread opened it meanwhile
                os.close(fd)
                slot[1] += 1
                return slot[0]
            self._fds[vol] = [fd, 1, time.monotonic()]
            if len(self._fds) > KEEP:
                for old in [v for v, s in self._fds.items() if not s[1]]:
                    if len(self._fds) <= KEEP:
                        break
                    os.close(self._fds.pop(old)[0])
            return fd

    def _unpin(self, vol: int) -> None:
        with self._lock:
            self._fds[vol][1] -= 1

    def tend(self, idle_close: float | None = None) -> int:
        """Close the descriptors no read is using whose volume was unlinked or that no read
        used for ``idle_close`` seconds (default ``IDLE_CLOSE``); returns how many are still
        open."""
        idle_close = IDLE_CLOSE if idle_close is None else idle_close
        with self._lock:
            now = time.monotonic()
            for vol, (fd, pins, used) in list(self._fds.items()):
                if not pins and (now - used > idle_close or os.fstat(fd).st_nlink == 0):
                    os.close(fd)
                    del self._fds[vol]
            return len(self._fds)

    def close(self) -> None:
        """Close every volume file kept open."""
        with self._lock:
            for fd, *_ in self._fds.values():
                os.close(fd)
            self._fds.clear()
