"""Scans and repairs for ``jpfs fsck`` and ``jpfs gc``: page through a shard's records, and apply
the few precise fixes fsck decides on. Each fix states what it expects, so a fix computed from a
stale scan does nothing rather than damage."""

from __future__ import annotations

import errno
import stat

from jpfs.errors import error
from jpfs.proto.meta import Pending, ScanPage, check_name

from . import keys as K
from . import ops
from .keys import Inode
from .txn import Txn

MAX_SCAN = 5000


def scan(t: Txn, kind: str, after: bytes, limit: int) -> ScanPage:
    """A page of records of kind "dentry", "inode" or "chunk", and the next cursor."""
    limit = max(1, min(limit, MAX_SCAN))
    if kind not in ("dentry", "inode", "chunk"):
        raise error(errno.EINVAL, f"cannot scan {kind!r}")
    out: list = []
    last = None
    with t.t.cursor(db=t.db[kind]) as cur:
        ok = cur.set_range(after) if after else cur.first()
        if ok and after and bytes(cur.key()) == after:
            ok = cur.next()
        while ok and len(out) < limit:
            key, value = bytes(cur.key()), cur.value()
            if kind == "dentry":
                parent, name = K.split_dentry_key(key)
                ino, dkind = K.split_dentry_value(value)
                out.append([parent, name, ino, dkind])
            elif kind == "inode":
                node = Inode.decode(K.U64.unpack(key)[0], value)
                out.append([node.ino, node.mode, node.nlink, node.parent, node.size])
            else:
                ino, index = K.split_chunk_key(key)
                c = K.decode_chunk((ino, index), value)
                out.append([ino, index, c.blob, list(c.nodes)])
            last = key
            ok = cur.next()
    return ScanPage(out, last if ok else None)


def pending(t: Txn) -> Pending:
    """Cross-shard transactions in flight here: intents we coordinate, records we prepared."""
    with t.t.cursor(db=t.db["intent"]) as cur:
        intents = [[bytes(k), K.unpack(v)["state"]] for k, v in cur]
    with t.t.cursor(db=t.db["prepared"]) as cur:
        prepared = [[bytes(k), K.unpack(v)["coordinator"]] for k, v in cur]
    return Pending(intents, prepared)


def repair(t: Txn, kind: str, args: list) -> bool | int:
    """Apply one fsck fix; False when the state is no longer what fsck saw. ``make_dir``
    answers the directory's ino instead (the one it made, or the one already there)."""
    if kind == "drop_dentry":
        parent, name, ino = args
        d = t.dentry(parent, name, lock=False)
        if d is None or d[0] != ino:
            return False
        t.delete_dentry(parent, name)
        return True
    if kind == "set_dentry_kind":
        parent, name, ino, dkind = args
        d = t.dentry(parent, name, lock=False)
        if d is None or d[0] != ino:
            return False
        t.put_dentry(parent, name, ino, dkind)
        return True
    if kind == "add_dentry":
        parent, name, ino, dkind = args
        check_name(name)
        t.need_dir(parent)
        if t.dentry(parent, name, lock=False) is not None:
            return False
        t.put_dentry(parent, name, ino, dkind)
        return True
    if kind in ("set_nlink", "set_parent"):
        ino, value = args
        node = t.inode(ino, lock=False)
        if node is None:
            return False
        if kind == "set_nlink":
            node.nlink = value
        else:
            node.parent = value
        t.put_inode(node)
        return True
    if kind == "drop_inode":
        (ino,) = args
        if t.inode(ino, lock=False) is None:
            return False
        t.delete_inode(ino)
        return True
    if kind == "drop_chunks":
        (ino,) = args
        if t.inode(ino, lock=False) is not None:
            return False
        prefix = K.ino_key(ino)
        with t.t.cursor(db=t.db["chunk"]) as cur:
            ok = cur.set_range(prefix)
            while ok and bytes(cur.key()[:8]) == prefix:
                ok = cur.delete()
        return True
    if kind == "abort_tx":
        (txid,) = args
        return ops.abort(t, txid)
    if kind == "make_dir":
        # lost+found: a directory made by fsck under ``parent`` (on this shard)
        parent, name = args
        check_name(name)
        pdir = t.need_dir(parent)
        d = t.dentry(parent, name, lock=False)
        if d is not None:
            return d[0]
        ino = t.alloc_ino()
        t.put_inode(Inode(ino, stat.S_IFDIR | 0o700, 2, 0, 0, 0, t.now, t.now, t.now,
                          parent=parent))
        t.put_dentry(parent, name, ino, stat.S_IFDIR)
        pdir.nlink += 1
        t.put_inode(pdir)
        return ino
    raise error(errno.EINVAL, f"unknown repair {kind!r}")
