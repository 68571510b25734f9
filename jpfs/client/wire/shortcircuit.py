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

``LocalReads`` is the part of a ``StorageClient`` that does this: which nodes are on this host,
the local reads of a batch, and the task that tends the descriptors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import trio
import xxhash

from ...errors import DeadlineError, JPFSError, Unavailable
from ...proto import storage as P
from ...rpc import Pool
from ...types import Chunk

log = logging.getLogger(__name__)

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


def same_host(info: P.HostInfo) -> bool:
    """Whether a node's ``host_info`` answer describes this host and a volumes directory this
    process sees as the node does."""
    if not info.host[0] or info.host != P.host_identity():
        return False
    try:
        st = os.stat(info.volumes)
    except OSError:
        return False
    return [st.st_dev, st.st_ino] == info.volumes_id and os.access(info.volumes,
                                                                   os.R_OK | os.X_OK)


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


class LocalReads:
    """The storage nodes on this host and the reads of their volume files, for one client.

    Args:
        nursery: runs the task that tends the volume descriptors (started with the first
            local node found).
        pool: the client's connections to the storage nodes (``host_info``, ``locate_blobs``).
        retry_for: how long a call waits for an unreachable node when no other replica is left.
        read_retry_for: how long it waits when another replica could serve the read instead.
    """

    def __init__(self, nursery: trio.Nursery, pool: Pool, *, retry_for: float,
                 read_retry_for: float):
        self.nursery = nursery
        self.pool = pool
        self.retry_for = retry_for
        self.read_retry_for = read_retry_for
        self.nodes: dict[int, LocalVolumes | None] = {}
        """Per node asked: its volumes when it is on this host, else None."""
        self._asking: dict[int, trio.Event] = {}
        self._tending: trio.CancelScope | None = None
        """The task that tends the local volumes' descriptors, once there are any."""
        self.counters = dict.fromkeys(("local_blobs", "local_bytes", "local_fallbacks"), 0)
        """Blobs and bytes read from local volume files, and blobs a local read left to the
        socket (not there, not readable, bytes that did not check)."""

    def close(self) -> None:
        """Stop tending the descriptors and close every node's volume files."""
        if self._tending is not None:
            self._tending.cancel()
        for local in self.nodes.values():
            if local is not None:
                local.close()

    def forget(self, node: int) -> None:
        """Close ``node``'s volumes and ask it again next time (it moved: it may be elsewhere
        now)."""
        local = self.nodes.pop(node, None)
        if local is not None:
            local.close()

    def local_nodes(self) -> int:
        """How many nodes were found on this host."""
        return sum(v is not None for v in self.nodes.values())

    async def ask(self, node: int) -> LocalVolumes | None:
        """Whether ``node`` runs on this host with volumes this process can read (asked once
        per node; a node that cannot say, or is down, is read over the socket)."""
        while (asking := self._asking.get(node)) is not None:
            await asking.wait()
            if node in self.nodes:
                return self.nodes[node]
        if node in self.nodes:
            return self.nodes[node]
        self._asking[node] = done = trio.Event()
        try:
            info = P.HOST_INFO.decode(await self.pool.call(node, P.HOST_INFO, P.NoArgs(),
                                                           retry_for=self.read_retry_for))
            local = LocalVolumes(info.volumes) if same_host(info) else None
            if local is not None:
                log.info("%s runs on this host: reading its volumes in %s directly",
                         self.pool.name(node), local.dir)
                if self._tending is None:
                    self._tending = trio.CancelScope()
                    self.nursery.start_soon(self._tend, self._tending)
            self.nodes[node] = local
            return local
        except JPFSError as e:
            if isinstance(e, Unavailable | DeadlineError):
                return None  # ask again once it is back
            self.nodes[node] = None  # an older node without host_info, or a malformed answer
            return None
        finally:
            del self._asking[node]
            done.set()

    async def _tend(self, scope: trio.CancelScope) -> None:
        """Every ``CHECK_EVERY`` seconds, read or not, let go of the volume files that a
        compaction unlinked or that no read used lately, so an idle client pins no space."""
        with scope:
            while True:
                await trio.sleep(CHECK_EVERY)
                for local in list(self.nodes.values()):
                    if local is None:
                        continue
                    try:
                        local.tend()
                    except OSError as e:  # a task of the client's own: log, never end it
                        log.warning("tending the volume files in %s: %s", local.dir, e)

    async def read(self, local: LocalVolumes, node: int, batch: list[int],
                   chunks: Sequence[Chunk], into: list[memoryview], out: list,
                   last: bool) -> set[int]:
        """Read what ``local`` can of ``batch`` into ``into`` (filling ``out``); returns the
        chunk indexes left to the socket. Raises what says the node is unreachable."""
        try:
            places = P.LOCATE_BLOBS.decode(await self.pool.call(
                node, P.LOCATE_BLOBS, P.IdsReq([chunks[i].blob for i in batch]),
                retry_for=self.retry_for if last else self.read_retry_for))
        except (Unavailable, DeadlineError):
            raise
        except JPFSError:
            return set(batch)  # the socket read meets the same trouble and reports it
        found = P.BlobPlaces.found
        jobs = [k for k, p in enumerate(places)
                if found(p) and p[2] == chunks[batch[k]].blob_len] \
            if len(places) == len(batch) else []
        work = [(places[k][0], places[k][1], into[k], chunks[batch[k]].xxh) for k in jobs]
        oks: list[bool | None] = [None] * len(work)
        if sum(len(w[2]) for w in work) <= INLINE_MAX:
            oks = local.read(work, nowait=True)
        later = [j for j, ok in enumerate(oks) if ok is None]
        if later:
            got = await trio.to_thread.run_sync(local.read, [work[j] for j in later])
            for j, ok in zip(later, got, strict=True):
                oks[j] = ok
        left = set(batch)
        c = self.counters
        for k, ok in zip(jobs, oks, strict=True):
            if ok:
                i = batch[k]
                out[i] = into[k]
                left.discard(i)
                c["local_blobs"] += 1
                c["local_bytes"] += len(into[k])
        c["local_fallbacks"] += len(left)
        return left
