"""The metadata service: every method on the wire, with its request and response records.

A request is the request record's fields as a msgpack array, in order; names are ``bytes``,
inode ids, times (ns) and ids are ints, attributes travel as ``Attr.to_wire()`` lists. Reads and
the 2PC steps are idempotent (safe to retry after a lost connection); namespace changes are not,
so a client never repeats one that may have reached the server, except with a request id
(``rid``, replicated shards), which makes the retry answer the first attempt's result.
``inline`` methods are answered on the shard's request loop (reads, and single-shard writes
queued to the group commit); the others run in a task of their own (they may wait on other
shards).

Per-name and per-inode batch answers carry an errno *name* (``"ENOENT"``) in place of an item
that failed, so one bad name does not fail the batch.
"""

from __future__ import annotations

import errno
from typing import NamedTuple

from ..errors import error, from_name
from ..rpc import Method, method_table
from ..types import NAME_MAX, Attr, DirEntry, Layout
from .heal import HEAL_METHODS
from .meta_leases import CreateBatchReq, Lease, LeaseReq, LeaseWaitReq, ReserveReq
from .meta_status import Counts, Pending, ScanPage, ShardInfo
from .replica import METHODS as _REPLICA_METHODS

# ---- response records ------------------------------------------------------------------------


def _attr(w) -> Attr | None:
    return Attr.from_wire(w) if w is not None else None


class Entry(NamedTuple):
    """``lookup``: a directory entry; ``attr`` is None when the inode lives on another shard.

    Wire: ``[ino, kind, attr or None]``."""

    ino: int
    kind: int
    attr: Attr | None

    @classmethod
    def from_wire(cls, w: list) -> Entry:
        """The entry from its ``[ino, kind, attr or None]`` wire form."""
        ino, kind, attr = w
        return cls(ino, kind, Attr.from_wire(attr) if attr is not None else None)

    def to_wire(self) -> list:
        """``[ino, kind, attr or None]``: what ``from_wire`` reads (the shard's answer)."""
        return [self.ino, self.kind, self.attr.to_wire() if self.attr is not None else None]


class Created(NamedTuple):
    """``create``/``mknod``: the entry and whether this call made it (False: it existed and
    ``exclusive`` was off). Wire: ``[ino, kind, attr or None, created]``."""

    ino: int
    kind: int
    attr: Attr | None
    created: bool

    @classmethod
    def from_wire(cls, w: list) -> Created:
        """The answer from its ``[ino, kind, attr or None, created]`` wire form."""
        ino, kind, attr, created = w
        return cls(ino, kind, Attr.from_wire(attr) if attr is not None else None, created)

    def to_wire(self) -> list:
        """``[ino, kind, attr or None, created]``: what ``from_wire`` reads (the shard's
        answer)."""
        return [self.ino, self.kind, self.attr.to_wire() if self.attr is not None else None,
                self.created]


class Made(NamedTuple):
    """``mkdir``: the new directory's attributes and its parent's after the change (as NFS's
    wcc data), so a client need not ask again. Wire: ``[attr, parent attr]`` (a bare attr
    list from older shards)."""

    attr: Attr
    parent: Attr | None

    @classmethod
    def from_wire(cls, w: list) -> Made:
        """The answer from ``[attr, parent attr]``, or from an older shard's bare attr (no
        parent)."""
        if len(w) == 2 and isinstance(w[0], list):
            return cls(Attr.from_wire(w[0]), Attr.from_wire(w[1]) if w[1] is not None else None)
        return cls(Attr.from_wire(w), None)


class PostOp(NamedTuple):
    """``unlink``/``rmdir``: the directory's attributes after the change (as NFS's wcc data),
    so a client need not ask again. Wire: an attr list (None from older shards)."""

    parent: Attr | None

    @classmethod
    def from_wire(cls, w) -> PostOp:
        """The answer from an attr list, or None (an older shard's: no parent attributes)."""
        return cls(Attr.from_wire(w) if w is not None else None)


class RenamePostOp(NamedTuple):
    """``rename``: both directories' attributes after it, each None where the coordinating
    shard does not hold it. Wire: ``[src attr or None, dst attr or None]`` (None from older
    shards)."""

    src: Attr | None
    dst: Attr | None

    @classmethod
    def from_wire(cls, w) -> RenamePostOp:
        """The answer from ``[src, dst]`` attrs, or None from an older shard (both unknown)."""
        if w is None:
            return cls(None, None)
        a, b = w
        return cls(_attr(a), _attr(b))


class DirPage(NamedTuple):
    """``readdir``: entries in name order (``attr`` set for inodes of this shard when ``plus``)
    and whether more follow. Wire: ``[[DirEntry.to_wire(), ...], more]``."""

    entries: list[DirEntry]
    more: bool

    @classmethod
    def from_wire(cls, w: list) -> DirPage:
        """The page from ``[[entry, ...], more]``."""
        entries, more = w
        return cls([DirEntry.from_wire(e) for e in entries], more)

    def to_wire(self) -> list:
        """``[[DirEntry.to_wire(), ...], more]``: what ``from_wire`` reads (the shard's
        answer)."""
        return [[e.to_wire() for e in self.entries], self.more]


class Entries:
    """``batch_lookup``: per name an ``Entry``, or the OSError its errno name stands for."""

    @staticmethod
    def from_wire(w: list) -> list[Entry | OSError]:
        """Each result: an ``Entry``, or the OSError of the errno name sent in its place."""
        return [from_name(r) if type(r) is str else Entry.from_wire(r) for r in w]


class Attrs:
    """``batch_getattr``: per inode its ``Attr``, or None where it does not exist."""

    @staticmethod
    def from_wire(w: list) -> list[Attr | None]:
        """Each result: an ``Attr``, or None where the inode does not exist."""
        return [Attr.from_wire(r) if r is not None else None for r in w]


class AttrsOrErrors:
    """``bulk_create``: per entry the new file's ``Attr``, or the OSError of why it failed."""

    @staticmethod
    def from_wire(w: list) -> list[Attr | OSError]:
        """Each result: the new file's ``Attr``, or the OSError of the errno name sent in its
        place."""
        return [from_name(r) if type(r) is str else Attr.from_wire(r) for r in w]


class Layouts:
    """``batch_layout``: per inode its ``Layout``, or None (no such inode, or a directory)."""

    @staticmethod
    def from_wire(w: list) -> list[Layout | None]:
        """Each result: a ``Layout``, or None (no such inode, or a directory)."""
        return [Layout.from_wire(r) if r is not None else None for r in w]


class NamedLayouts:
    """``lookup_layouts``: per name a ``Layout``; an ``(ino, kind)`` tuple where another call
    is needed (not a regular file, or an inode on another shard); or the OSError of its errno
    name. Wire: ``Layout.to_wire()``, ``[ino, kind]`` or an errno name."""

    @staticmethod
    def from_wire(w: list) -> list[Layout | OSError | tuple[int, int]]:
        """Each result: a ``Layout``, an ``(ino, kind)`` tuple or the OSError of an errno name."""
        out: list = []
        for r in w:
            if type(r) is str:
                out.append(from_name(r))
            elif len(r) == 2:
                out.append((r[0], r[1]))
            else:
                out.append(Layout.from_wire(r))
        return out


# ---- request records -------------------------------------------------------------------------
# Names are not checked here (their errors differ per method: see check_name); inode ids are
# checked to belong to the shard asked.

class InoReq(NamedTuple):
    """One inode: getattr, readlink, get_layout, getparent, listxattr."""

    ino: int


class InosReq(NamedTuple):
    """Inodes of this shard: batch_getattr, batch_layout."""

    inos: list[int]


class NameReq(NamedTuple):
    """A name in a directory: lookup."""

    parent: int
    name: bytes


class NamesReq(NamedTuple):
    """Names in one directory: batch_lookup, lookup_layouts."""

    parent: int
    names: list
    """bytes each; a bad name gets its own errno in the answer."""


class NoArgs(NamedTuple):
    """Methods without arguments: statfs, pending, shard_info, sync."""


class ReaddirReq(NamedTuple):
    """``readdir``: one page of a directory, in name order."""

    parent: int
    after: bytes
    """Entries after this name (b"" from the start)."""
    limit: int
    plus: bool
    """With attributes (readdirplus)."""


class XattrReq(NamedTuple):
    """One extended attribute: getxattr."""

    ino: int
    name: bytes


class RemoveXattrReq(NamedTuple):
    """``removexattr``."""

    ino: int
    name: bytes
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class RemoveReq(NamedTuple):
    """A name to remove: unlink, rmdir."""

    parent: int
    name: bytes
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class RmdirReq(NamedTuple):
    """``rmdir``: the empty directory ``name`` to remove."""

    parent: int
    name: bytes
    rid: bytes | None = None
    session: bytes | None = None
    """A mount's lease session: its leases (on the parent, on the directory) do not stop the
    change."""


class CreateReq(NamedTuple):
    """``create``: a regular file (``exclusive``: EEXIST if the name is taken)."""

    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    exclusive: bool
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class MknodReq(NamedTuple):
    """``mknod``: a device, fifo or socket node."""

    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    rdev: int
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class MkdirReq(NamedTuple):
    """``mkdir`` (the directory's inode may go to another shard)."""

    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class SymlinkReq(NamedTuple):
    """``symlink``."""

    parent: int
    name: bytes
    target: bytes
    uid: int
    gid: int
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class LinkReq(NamedTuple):
    """``link``: a new name for ``ino`` in ``parent``."""

    ino: int
    parent: int
    name: bytes
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class RenameReq(NamedTuple):
    """``rename``, sent to the source directory's shard (which coordinates)."""

    src_parent: int
    src_name: bytes
    dst_parent: int
    dst_name: bytes
    flags: int
    """RENAME_NOREPLACE, RENAME_EXCHANGE."""
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""
    session: bytes | None = None
    """The mount's lease session: its own leases do not stop the rename (no recall)."""


class SetattrReq(NamedTuple):
    """``setattr``: mode, owner, size, times."""

    ino: int
    fields: dict
    """Some of SETATTR_FIELDS, each an int."""
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class SetxattrReq(NamedTuple):
    """``setxattr``."""

    ino: int
    name: bytes
    value: bytes
    flags: int
    """XATTR_CREATE, XATTR_REPLACE."""
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class WriteChunksReq(NamedTuple):
    """``write_chunks``: point a file at stored blobs (the commit of a write)."""

    ino: int
    chunks: list[list]
    """``Chunk.to_wire()`` each."""
    size: int
    expect_version: int | None
    """ESTALE unless the file is still at this version (None: any)."""
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class BulkCreateReq(NamedTuple):
    """``bulk_create``: many files of one directory with their content (imports)."""

    parent: int
    entries: list
    """``[name, mode, uid, gid, mtime_ns, size, [Chunk.to_wire(), ...]]`` each."""
    replace: bool
    rid: bytes | None = None
    """Request id (replicated shards): a retry after a failover answers the first result."""


class TxPrepareReq(NamedTuple):
    """``tx_prepare``: a participant's ops of a cross-shard transaction."""

    txid: bytes
    coordinator: int
    ops: list[list]
    holder: bytes | None = None
    """The lease session the change is made for: its own leases on this shard's directories
    let the ops pass (a lease holder's ``dir_batch``)."""


class TxReq(NamedTuple):
    """One cross-shard transaction: tx_abort, tx_status."""

    txid: bytes


class TxCommitReq(NamedTuple):
    """``tx_commit``: answered once the commit is durable; ``hurry=False`` lets the shard's
    next delayed fsync cover it rather than start one (a commit nobody waits for)."""

    txid: bytes
    hurry: bool = True


class RenameLockReq(NamedTuple):
    """``rename_lock``: the directory-move lease on shard 0."""

    owner: bytes
    ttl: float


class OwnerReq(NamedTuple):
    """``rename_unlock``: the lease's holder."""

    owner: bytes


class ScanReq(NamedTuple):
    """``scan``: a page of one database (fsck, gc)."""

    kind: str
    after: bytes
    limit: int


class RepairReq(NamedTuple):
    """``repair``: one fsck repair, stating what it expects to find."""

    kind: str
    args: list


# ---- the methods (ids are stable: never reuse one) --------------------------------------------

def _read(id_: int, name: str, req: type, rsp: object) -> Method:
    return Method(id_, name, req, rsp, idempotent=True, inline=True)


# namespace reads (one shard each)
LOOKUP = _read(1, "lookup", NameReq, Entry)
BATCH_LOOKUP = _read(2, "batch_lookup", NamesReq, Entries)
GETATTR = _read(3, "getattr", InoReq, Attr)
BATCH_GETATTR = _read(4, "batch_getattr", InosReq, Attrs)
READDIR = _read(5, "readdir", ReaddirReq, DirPage)
READLINK = _read(6, "readlink", InoReq, bytes)
GETPARENT = Method(7, "getparent", InoReq, int, idempotent=True)
STATFS = Method(8, "statfs", NoArgs, Counts, idempotent=True)
"""Counts of this shard; the client sums them over shards."""
GETXATTR = Method(9, "getxattr", XattrReq, bytes, idempotent=True)
LISTXATTR = Method(10, "listxattr", InoReq, list[bytes], idempotent=True)
"""The names, in name order (a list of names: no record needed; every one checked bytes)."""
# namespace changes (coordinated by the parent directory's shard); the inline ones are one
# local transaction, queued to the next group commit and answered once it is committed
# (durable within one fsync of the shard's; SYNC waits for that)
CREATE = Method(11, "create", CreateReq, Created, inline=True)
MKNOD = Method(12, "mknod", MknodReq, Created, inline=True)
MKDIR = Method(13, "mkdir", MkdirReq, Made)
SYMLINK = Method(14, "symlink", SymlinkReq, Attr, inline=True)
LINK = Method(15, "link", LinkReq, Attr)
UNLINK = Method(16, "unlink", RemoveReq, PostOp, inline=True)
"""Inline when the file's inode is on the directory's shard; deferred to 2PC otherwise."""
RMDIR = Method(17, "rmdir", RmdirReq, PostOp)
RENAME = Method(18, "rename", RenameReq, RenamePostOp)
SETATTR = Method(19, "setattr", SetattrReq, Attr, inline=True)
SETXATTR = Method(20, "setxattr", SetxattrReq, None, inline=True)
REMOVEXATTR = Method(21, "removexattr", RemoveXattrReq, None, inline=True)
# file data layout
GET_LAYOUT = _read(22, "get_layout", InoReq, Layout)
BATCH_LAYOUT = _read(23, "batch_layout", InosReq, Layouts)
LOOKUP_LAYOUTS = _read(24, "lookup_layouts", NamesReq, NamedLayouts)
WRITE_CHUNKS = Method(25, "write_chunks", WriteChunksReq, Attr, inline=True)
BULK_CREATE = Method(26, "bulk_create", BulkCreateReq, AttrsOrErrors, inline=True)
# cross-shard transactions (shard to shard)
TX_PREPARE = Method(27, "tx_prepare", TxPrepareReq, list[list], idempotent=True)
"""Answers the attributes (``Attr.to_wire()`` each) of the inodes the commit will make, their
times the prepare's: shard to shard only, kept in wire form because the coordinator passes
them on as they are (a cross-shard mkdir's answer)."""
TX_COMMIT = Method(28, "tx_commit", TxCommitReq, bool, idempotent=True)
TX_ABORT = Method(29, "tx_abort", TxReq, bool, idempotent=True)
TX_STATUS = Method(30, "tx_status", TxReq, str, idempotent=True)
RENAME_LOCK = Method(31, "rename_lock", RenameLockReq, bool, idempotent=True)
RENAME_UNLOCK = Method(32, "rename_unlock", OwnerReq, bool, idempotent=True)
# maintenance: fsck, gc, status
SCAN = Method(33, "scan", ScanReq, ScanPage, idempotent=True)
PENDING = Method(34, "pending", NoArgs, Pending, idempotent=True)
REPAIR = Method(35, "repair", RepairReq, bool | int)
"""False when the state is no longer what fsck saw; ``make_dir`` answers the directory's ino
(a bool or an int: no record needed)."""
SHARD_INFO = Method(36, "shard_info", NoArgs, ShardInfo, idempotent=True)
SYNC = Method(37, "sync", NoArgs, int, idempotent=True)
"""Answered once every change this shard answered before is durable (fsync(2), unmount)."""
# directory write leases (daemon/meta/leases.py)
LEASE = Method(38, "lease", LeaseReq, Lease)
LEASE_RETURN = Method(39, "lease_return", LeaseReq, bool, idempotent=True)
LEASE_WAIT = Method(40, "lease_wait", LeaseWaitReq, list[int], idempotent=True)
"""The directories recalled from the session (empty after ``seconds`` with none): a list of
inodes, every one checked an int (a record would add nothing)."""
CREATE_BATCH = Method(41, "create_batch", CreateBatchReq, AttrsOrErrors, idempotent=True,
                      inline=True)
"""Idempotent: an entry already made answers its attributes."""
RESERVE = Method(42, "reserve", ReserveReq, int)
"""The first counter of the range reserved (durable before the answer)."""
DIR_BATCH = Method(43, "dir_batch", CreateBatchReq, AttrsOrErrors, idempotent=True)
"""Directories a lease holder answered, placed on other shards (``CreateBatchReq.entries``:
creates with a directory's mode and an inode number ``reserve`` gave); idempotent as
``create_batch``."""

METHODS = method_table(
    LOOKUP, BATCH_LOOKUP, GETATTR, BATCH_GETATTR, READDIR, READLINK, GETPARENT, STATFS, GETXATTR,
    LISTXATTR, CREATE, MKNOD, MKDIR, SYMLINK, LINK, UNLINK, RMDIR, RENAME, SETATTR, SETXATTR,
    REMOVEXATTR, GET_LAYOUT, BATCH_LAYOUT, LOOKUP_LAYOUTS, WRITE_CHUNKS, BULK_CREATE, TX_PREPARE,
    TX_COMMIT, TX_ABORT, TX_STATUS, RENAME_LOCK, RENAME_UNLOCK, SCAN, PENDING, REPAIR, SHARD_INFO,
    SYNC, LEASE, LEASE_RETURN, LEASE_WAIT, CREATE_BATCH, RESERVE, DIR_BATCH,
)
"""Every metadata method by name (the replication methods of ``replica.py`` included)."""
METHODS.update(_REPLICA_METHODS)
METHODS.update(method_table(*HEAL_METHODS))  # the healer's (jpfs/proto/heal.py, ids 80-99)

CHANGES = frozenset({CREATE, MKNOD, MKDIR, SYMLINK, LINK, UNLINK, RMDIR, RENAME, SETATTR,
                     SETXATTR, REMOVEXATTR, WRITE_CHUNKS, BULK_CREATE, CREATE_BATCH,
                     DIR_BATCH})
"""Namespace changes: their request records end with ``rid`` (see ``CreateReq.rid``)."""

# rename flags (as renameat2)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

# setxattr flags (as setxattr(2))
XATTR_CREATE = 1
XATTR_REPLACE = 2

# setattr fields
SETATTR_FIELDS = frozenset({"mode", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns"})


def check_name(name: object) -> bytes:
    """Raise EINVAL/ENAMETOOLONG unless ``name`` is a valid directory entry name."""
    if not isinstance(name, bytes) or not name:
        raise error(errno.EINVAL, "a name must be non-empty bytes")
    if len(name) > NAME_MAX:
        raise error(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
    if b"/" in name or b"\0" in name:
        raise error(errno.EINVAL, f"invalid name {name!r}: contains '/' or NUL")
    if name in (b".", b".."):
        raise error(errno.EINVAL, f"invalid name {name!r}")
    return name
