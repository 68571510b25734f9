"""The small language of namespace changes that may span shards.

A rename, link, unlink, rmdir or mkdir is planned as a list of *ops*, each touching one shard.
Every op names what it expects to find (the entry it replaces, the inode it removes): checking
those expectations under locks is what makes the change safe against concurrent operations.

On one shard the ops are checked and applied in one LMDB transaction (``apply_local``). Across
shards the same ops go through two-phase commit: ``prepare`` checks them, allocates new inodes
and records locks plus the ops durably; ``commit`` applies them; ``abort`` forgets them. The
coordinator's own ops are not prepared: they are applied by ``apply_local`` in the transaction
that records the decision (``coordinator.py``).

Op forms (lists, so they travel over msgpack as they are)::

    ["mkdent", parent, name, ino, kind, replaces]   add parent/name -> ino; replaces is the ino it
                                                    must currently point to, or None (absent)
    ["rmdent", parent, name, ino]                   remove parent/name, which must point to ino
    ["nlink", ino, delta]                           adjust the link count; a file at 0 is deleted
    ["subdirs", ino, delta]                         a parent's link count as its subdirectories
                                                    come and go (commutes, so it takes no lock)
    ["setparent", ino, parent]                      a moved directory's new parent
    ["ctime", ino]                                  the inode changed (renamed): its ctime is
                                                    now (locked, so a reader of the renamed
                                                    inode waits for the commit)
    ["rmdir", ino]                                  delete an empty directory inode
    ["times", ino, time_ns]                         a directory's mtime and ctime are time_ns
                                                    (a lease holder's batch: as it answered)
    ["mkinode", mode, uid, gid, parent, target]     a new inode on this shard; "$new" in later ops
                                                    (on any shard) is replaced by its id
    ["mkinode", mode, uid, gid, parent, target, ino]  ... with an inode number reserved here
                                                    before (``reserve``: a mount's mkdirs
                                                    answered from its parent's lease)
"""

from __future__ import annotations

import errno
import stat

from jpfs.errors import JPFSError, error
from jpfs.placement import COUNTER_MASK, shard_of

from . import keys as K
from .keys import Inode
from .txn import Txn

NEW = "$new"


class Stale(JPFSError):
    """An expectation no longer holds: the namespace changed since the plan was made.

    It travels as ESTALE; the coordinator answers it by planning again.
    """

    def __init__(self, message: str):
        super().__init__(errno.ESTALE, message)


_SHAPES = {
    "mkdent": (int, bytes, (int, str), int, (int, type(None))),
    "rmdent": (int, bytes, int),
    "nlink": (int, int),
    "subdirs": (int, int),
    "setparent": (int, int),
    "ctime": (int,),
    "rmdir": (int,),
    "times": (int, int),
    "mkinode": (int, int, int, int, (bytes, type(None))),
}


def check_shapes(ops: object) -> list[list]:
    """EINVAL unless ``ops`` is a list of well-formed ops (they arrive from the network)."""
    if not isinstance(ops, list) or not ops:
        raise error(errno.EINVAL, "ops must be a non-empty list")
    for op in ops:
        shape = _SHAPES.get(op[0]) if isinstance(op, list) and op else None
        if shape is not None and op[0] == "mkinode" and len(op) == 7:
            shape = (*shape, int)  # with a reserved inode number
        if shape is None or len(op) - 1 != len(shape) or not all(
            isinstance(v, k) and not isinstance(v, bool) for v, k in zip(op[1:], shape, strict=True)
        ):
            raise error(errno.EINVAL, f"malformed op {op!r:.80}")
    return ops


def lock_keys(op: list) -> list[bytes]:
    """The lock keys ``op`` takes while prepared (none for ops that commute)."""
    kind = op[0]
    if kind in ("mkdent", "rmdent"):
        return [K.lock_dentry(op[1], op[2])]
    if kind in ("nlink", "setparent", "rmdir", "ctime"):
        return [K.lock_inode(op[1])]
    if kind == "mkinode" and len(op) == 7:
        # the new inode (once allocated): a reader that finds its entry on the coordinator's
        # shard (committed with the decision) waits for it here instead of missing it, and so
        # does a create in a directory just made
        return [K.lock_inode(op[6])]
    return []


def check(t: Txn, op: list) -> None:
    """Raise Stale/JPFSError unless ``op`` can be applied now (locks are checked too)."""
    kind = op[0]
    for key in lock_keys(op):
        t.check_lock(key)
    if kind in ("mkdent", "rmdent", "rmdir"):
        t.check_lease(op[1])  # a mount that holds the directory's lease gives it back first
    if kind == "mkdent":
        _, parent, name, ino, _kind, replaces = op
        t.need_dir(parent)
        cur = t.dentry(parent, name)
        if (cur[0] if cur else None) != replaces:
            raise Stale(f"entry {name!r} changed")
    elif kind == "rmdent":
        _, parent, name, ino = op
        cur = t.dentry(parent, name)
        if cur is None or cur[0] != ino:
            raise Stale(f"entry {name!r} changed")
    elif kind in ("nlink", "setparent"):
        if t.inode(op[1]) is None:
            raise Stale(f"inode {op[1]:#x} vanished")
    elif kind in ("subdirs", "ctime", "times"):
        if kind != "ctime":
            t.need_dir(op[1])
    elif kind == "rmdir":
        node = t.inode(op[1])
        if node is None:
            raise Stale(f"directory {op[1]:#x} vanished")
        t.check_dir_lock(op[1])  # an entry being added by a prepared transaction
        if not t.dir_is_empty(op[1]):
            raise error(errno.ENOTEMPTY, "directory not empty")
    elif kind == "mkinode":
        ino = op[6]
        if shard_of(ino) != t.store.shard or not 0 < ino & COUNTER_MASK < t.next_counter():
            raise error(errno.EINVAL, f"inode {ino:#x} was not reserved on this shard")
        if t.inode(ino, lock=False) is not None:
            raise error(errno.EEXIST, f"inode {ino:#x} is in use")
    else:
        raise error(errno.EINVAL, f"unknown op {kind!r}")


def apply(t: Txn, op: list) -> None:
    """Apply a checked op."""
    kind = op[0]
    if kind == "mkdent":
        _, parent, name, ino, dkind, _ = op
        t.put_dentry(parent, name, ino, dkind)
        _touch(t, parent)
    elif kind == "rmdent":
        _, parent, name, _ = op
        t.delete_dentry(parent, name)
        _touch(t, parent)
    elif kind in ("nlink", "subdirs"):
        node = t.inode(op[1], lock=False)
        if node is None:
            return
        node.nlink += op[2]
        node.ctime_ns = t.now
        if node.nlink <= 0 and not stat.S_ISDIR(node.mode):
            t.delete_inode(node.ino)
        else:
            t.put_inode(node)
    elif kind == "setparent":
        node = t.inode(op[1], lock=False)
        if node is not None:
            node.parent = op[2]
            node.ctime_ns = t.now
            t.put_inode(node)
    elif kind == "ctime":
        node = t.inode(op[1], lock=False)
        if node is not None:
            node.ctime_ns = t.now
            t.put_inode(node)
    elif kind == "times":
        node = t.inode(op[1], lock=False)
        if node is not None:
            node.mtime_ns = node.ctime_ns = op[2]
            t.put_inode(node)
    elif kind == "rmdir":
        t.delete_inode(op[1])
    elif kind == "mkinode":
        t.put_inode(new_inode(op, t.now))


def new_inode(op: list, now: int) -> Inode:
    """The inode an allocated mkinode op makes, with its times at ``now``."""
    _, mode, uid, gid, parent, target, ino = op
    return Inode(ino, mode, 2 if stat.S_ISDIR(mode) else 1, uid, gid,
                 len(target) if target else 0, now, now, now, parent=parent, target=target)


def _touch(t: Txn, ino: int) -> None:
    node = t.inode(ino, lock=False)
    if node is not None:
        node.mtime_ns = node.ctime_ns = t.now
        t.put_inode(node)


def allocate(t: Txn, ops: list[list]) -> list[list]:
    """Give every mkinode op its inode id (appended as the op's last element)."""
    out = []
    for op in ops:
        if op[0] == "mkinode" and len(op) == 6:
            op = [*op, t.alloc_ino()]
        out.append(op)
    return out


def new_inos(ops: list[list]) -> list[int]:
    """The inode ids ``allocate`` gave the mkinode ops."""
    return [op[-1] for op in ops if op[0] == "mkinode"]


def substitute(ops: list[list], ino: int | None) -> list[list]:
    """Replace the ``$new`` placeholder by the allocated inode id."""
    if ino is None:
        return ops
    return [[ino if x == NEW else x for x in op] for op in ops]


def apply_local(t: Txn, ops: list[list], holder: bytes | None = None) -> list[int]:
    """Check and apply ops that all live on this shard, in one transaction; ``holder``: the
    lease session asking (a change in a directory it holds the lease of goes ahead)."""
    t.holder = holder
    ops = allocate(t, ops)
    created = new_inos(ops)
    if created:
        ops = substitute(ops, created[0])
    for op in ops:
        check(t, op)
    for op in ops:
        apply(t, op)
    return created


# ---- two-phase commit, participant side -------------------------------------------------------

def prepare(t: Txn, txid: bytes, coordinator: int, ops: list[list],
            holder: bytes | None = None) -> list[list]:
    """Check ``ops``, allocate inodes, hold locks and record everything durably. Returns
    the attributes (wire form) of the inodes the commit will make: their times are the
    prepare's, so the coordinator can answer with them before the commit. ``holder``: the
    lease session the change is made for (its leases here let the ops pass, and the
    directories it makes are leased to it).

    Idempotent: preparing a transaction again returns what the first prepare allocated.
    """
    prev = t.t.get(txid, db=t.db["prepared"])
    if prev is not None:
        rec = K.unpack(prev)
        return _made(rec["ops"], rec.get("at", t.now))
    t.holder = holder
    ops = allocate(t, ops)
    for op in ops:
        check(t, op)
    for op in ops:
        for key in lock_keys(op):
            t.t.put(key, txid, db=t.db["lock"])
    t.t.put(txid, K.pack({"coordinator": coordinator, "ops": ops, "at": t.now}),
            db=t.db["prepared"])
    if holder is not None:  # a lease holder's new directories: leased to it from birth
        for op in ops:  # (and those it removes no longer)
            if op[0] == "mkinode" and stat.S_ISDIR(op[1]):
                t.lease_new_dir(op[6], holder)
            elif op[0] == "rmdir":
                t.end_lease(op[1], holder)
    return _made(ops, t.now)


def _made(ops: list[list], at: int) -> list[list]:
    return [new_inode(op, at).attr().to_wire() for op in ops if op[0] == "mkinode"]


def commit(t: Txn, txid: bytes) -> bool:
    """Apply a prepared transaction and release its locks; False if there was none (done)."""
    rec = t.t.get(txid, db=t.db["prepared"])
    if rec is None:
        return False
    prepared = K.unpack(rec)
    ops = prepared["ops"]
    _release(t, txid, ops)
    for op in ops:
        if op[0] == "mkinode":  # as its prepare answered the coordinator
            t.put_inode(new_inode(op, prepared.get("at", t.now)))
        else:
            apply(t, op)
    return True


def abort(t: Txn, txid: bytes) -> bool:
    """Forget prepared transaction ``txid`` and release its locks; False if there was none
    (done)."""
    rec = t.t.get(txid, db=t.db["prepared"])
    if rec is None:
        return False
    _release(t, txid, K.unpack(rec)["ops"])
    return True


def _release(t: Txn, txid: bytes, ops: list[list]) -> None:
    for op in ops:
        for key in lock_keys(op):
            if t.t.get(key, db=t.db["lock"]) == txid:
                t.t.delete(key, db=t.db["lock"])
    t.t.delete(txid, db=t.db["prepared"])
