"""Where a file's bytes are: its chunk records, read in batches and replaced in one transaction.

The write path stores data first (on the storage nodes) and only then calls ``write_chunks`` or
``bulk_create``, so a crash in between leaves unreferenced blobs for gc, never a file pointing at
missing bytes.
"""

from __future__ import annotations

import errno
import stat

from jpfs.errors import errno_name, error
from jpfs.placement import COUNTER_MASK, shard_of
from jpfs.proto.meta import check_name
from jpfs.types import Chunk

from . import keys as K
from .keys import Inode
from .namespace import each_name, touch
from .ops import apply
from .txn import Txn

MAX_BULK = 10_000


def chunks_of(t: Txn, ino: int) -> list[Chunk]:
    """Every chunk record of ``ino``, in index order."""
    prefix = K.ino_key(ino)
    out = []
    with t.t.cursor(db=t.db["chunk"]) as cur:
        ok = cur.set_range(prefix)
        while ok:
            key = cur.key()
            if bytes(key[:8]) != prefix:
                break
            out.append(K.decode_chunk(K.split_chunk_key(key), cur.value()))
            ok = cur.next()
    return out


def _layout(t: Txn, node: Inode, chunk_size: int) -> list:
    """A file's layout on the wire: [attr, chunk size, chunks]."""
    return [node.attr().to_wire(), chunk_size, [c.to_wire() for c in chunks_of(t, node.ino)]]


def get_layout(t: Txn, ino: int, chunk_size: int) -> list:
    """GET_LAYOUT's answer (wire form): ENOENT if ``ino`` does not exist, EISDIR for a directory."""
    node = t.need_inode(ino)
    if stat.S_ISDIR(node.mode):
        raise error(errno.EISDIR, "is a directory")
    return _layout(t, node, chunk_size)


def batch_layout(t: Txn, inos: list, chunk_size: int) -> list:
    """Layouts of many files in one read (None where an inode does not exist or is a dir)."""
    out: list[list | None] = []
    for ino in inos:
        node = t.inode(ino)
        if node is None or stat.S_ISDIR(node.mode):
            out.append(None)
        else:
            out.append(_layout(t, node, chunk_size))
    return out


def lookup_layouts(t: Txn, parent: int, names: list, chunk_size: int) -> list:
    """Look up names in ``parent`` and return their layouts in the same read (what a reader of
    many small files needs, in one round trip). Per name: a layout; an errno name; or
    ``[ino, kind]`` when the answer needs another call (a symlink to follow, or an inode that
    lives on another shard)."""

    def answer(ino: int, kind: int) -> list:
        if kind == stat.S_IFDIR:
            raise error(errno.EISDIR, "is a directory")
        if kind != stat.S_IFREG or shard_of(ino) != t.store.shard:
            return [ino, kind]
        return _layout(t, t.need_inode(ino), chunk_size)

    return each_name(t, parent, names, answer)


def _check_chunks(raw: list, chunk_size: int) -> list[Chunk]:
    chunks = []
    for w in raw:
        c = Chunk.from_wire(w)
        if (not isinstance(c.blob, bytes) or len(c.blob) != 16 or not c.nodes
                or not 0 <= c.length <= c.blob_len <= chunk_size or c.index < 0):
            raise error(errno.EINVAL, f"invalid chunk record {w!r:.80}")
        chunks.append(c)
    return chunks


def write_chunks(t: Txn, ino: int, raw_chunks: list, size: int, expect_version: int | None,
                 chunk_size: int) -> list:
    """Point chunks of ``ino`` at new blobs and set its size; returns the new attributes.

    ``expect_version`` guards a read-modify-write: if the file changed since the writer read it,
    ESTALE tells the writer to reread and retry.
    """
    node = t.need_inode(ino)
    if not stat.S_ISREG(node.mode):
        raise error(errno.EISDIR if stat.S_ISDIR(node.mode) else errno.EINVAL,
                    "not a regular file")
    if expect_version is not None and node.version != expect_version:
        raise error(errno.ESTALE, "the file changed while being written")
    if size < 0:
        raise error(errno.EINVAL, "negative size")
    chunks = _check_chunks(raw_chunks, chunk_size)
    if size < node.size:
        from .namespace import truncate_chunks
        truncate_chunks(t, ino, size, chunk_size)
    _put_chunks(t, ino, chunks)
    node.size = size
    node.version += 1
    node.mtime_ns = node.ctime_ns = t.now
    t.put_inode(node)
    return node.attr().to_wire()


def _put_chunks(t: Txn, ino: int, chunks: list[Chunk]) -> None:
    for c in chunks:
        t.t.put(K.chunk_key(ino, c.index), K.encode_chunk(c), db=t.db["chunk"])


def _each_entry(entries: list, one) -> list:
    """``one(entry)`` for each entry of a batch: its answer, or the errno name of why it failed
    (one bad entry does not fail the batch)."""
    out: list = []
    for e in entries:
        try:
            out.append(one(e))
        except OSError as err:
            out.append(errno_name(err.errno))
        except (TypeError, ValueError):
            out.append("EINVAL")
    return out


def bulk_create(t: Txn, parent: int, entries: list, replace: bool, chunk_size: int) -> list:
    """Create many files with their content in one transaction (imports).

    Each entry is ``[name, mode, uid, gid, size, mtime_ns, chunks]``. Returns per entry the new
    attributes or an errno name. With ``replace``, an existing regular file takes the new content.
    """
    if len(entries) > MAX_BULK:
        raise error(errno.E2BIG, f"at most {MAX_BULK} entries per bulk_create")
    pdir = t.need_dir(parent)
    t.check_lease(parent)

    def one(e) -> list:
        name, mode, uid, gid, size, mtime_ns, raw = e
        check_name(name)
        chunks = _check_chunks(raw, chunk_size)
        d = t.dentry(parent, name)
        if d is not None:
            if not replace:
                raise error(errno.EEXIST, "exists")
            node = t.inode(d[0]) if d[1] == stat.S_IFREG else None
            if node is None:
                raise error(errno.EEXIST, "exists and is not a local regular file")
            t.delete_inode(node.ino)  # drop old chunks and xattrs; keep the inode id
            node.mode, node.uid, node.gid = stat.S_IFREG | (mode & 0o7777), uid, gid
            node.version += 1
        else:
            node = Inode(t.alloc_ino(), stat.S_IFREG | (mode & 0o7777), 1, uid, gid, 0,
                         t.now, t.now, t.now, parent=parent)
            t.put_dentry(parent, name, node.ino, stat.S_IFREG)
        node.size, node.mtime_ns, node.ctime_ns = size, mtime_ns, t.now
        t.put_inode(node)
        _put_chunks(t, node.ino, chunks)
        return node.attr().to_wire()

    out = _each_entry(entries, one)
    touch(t, pdir)
    return out


def create_batch(t: Txn, parent: int, session: bytes, entries: list, time_ns: int,
                 chunk_size: int) -> list:
    """Changes a mount holding ``parent``'s lease already answered (``leases.py``), in order:
    new regular files, each ``[name, ino, mode, uid, gid, time_ns]`` with an inode number the
    lease reserved, ``[..., time_ns, ctime_ns]`` (renamed before it was sent: its ctime moved),
    or ``[..., time_ns, size, chunks]`` (the file's first commit, made with it); new
    directories placed on this shard, the same six fields with a directory's mode, each
    leased to the session from birth (those placed elsewhere are
    ``crossshard.CrossShard.dir_batch``'s); removes,
    ``[name, ino]`` (an unlink of a file whose inode lives here, or the rmdir of an empty
    directory placed here, whose lease is the session's if anybody's); and renames within the
    directory, ``[old, new, ino, replaced]`` (``replaced``: the file ``new`` names, or 0). Per
    entry the file's attributes after it, or an errno name (EEXIST, ENOENT: the name changed
    while the lease was lost). A create or rename already made (a retry after a
    lost answer) answers its attributes. The directory's mtime and ctime become ``time_ns``
    (what the holder told its kernel; 0: now)."""
    pdir = t.need_dir(parent)
    t.check_lease(parent, session)
    top = t.next_counter()

    def one(e) -> list:
        if isinstance(e, list) and len(e) == 2:
            return _remove_entry(t, parent, e, pdir, session)
        if isinstance(e, list) and len(e) == 4:
            return _rename_entry(t, parent, e)
        if not isinstance(e, list) or len(e) not in (6, 7, 8) or not all(
                type(v) is int for v in e[1:7]):
            raise error(errno.EINVAL, "malformed entry")
        name, ino, mode, uid, gid, time_ns = e[:6]
        ctime_ns = e[6] if len(e) == 7 else time_ns
        check_name(name)
        chunks = _check_chunks(e[7], chunk_size) if len(e) == 8 else None
        if shard_of(ino) != t.store.shard or not 0 < ino & COUNTER_MASK < top:
            raise error(errno.EINVAL, f"inode {ino:#x} was not reserved on this shard")
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFREG, stat.S_IFDIR) or (kind == stat.S_IFDIR and len(e) != 6) \
                or not (0 <= uid < 1 << 32 and 0 <= gid < 1 << 32):
            raise error(errno.EINVAL, "a batched create makes a regular file or a directory")
        d = t.dentry(parent, name)
        if d is not None:
            node = t.inode(d[0], lock=False) if d[0] == ino else None
            if node is None:
                raise error(errno.EEXIST, f"{name.decode(errors='replace')!r} exists")
            return node.attr().to_wire()  # made by an earlier attempt
        if t.inode(ino, lock=False) is not None:
            raise error(errno.EEXIST, f"inode {ino:#x} is in use")
        if kind == stat.S_IFDIR:
            node = Inode(ino, mode, 2, uid, gid, 0, time_ns, time_ns, time_ns, parent=parent)
            t.put_inode(node)
            t.put_dentry(parent, name, ino, stat.S_IFDIR)
            pdir.nlink += 1
            t.lease_new_dir(ino, session)
            return node.attr().to_wire()
        node = Inode(ino, mode, 1, uid, gid, 0, time_ns, time_ns, ctime_ns, parent=parent)
        if chunks is not None:
            if e[6] < 0:
                raise error(errno.EINVAL, "negative size")
            node.size, node.version = e[6], 1
            node.mtime_ns = node.ctime_ns = t.now
            _put_chunks(t, ino, chunks)
        t.put_inode(node)
        t.put_dentry(parent, name, ino, stat.S_IFREG)
        return node.attr().to_wire()

    out = _each_entry(entries, one)
    if time_ns > 0:
        pdir.mtime_ns = pdir.ctime_ns = time_ns
        t.put_inode(pdir)
    else:
        touch(t, pdir)
    return out


def _remove_entry(t: Txn, parent: int, e: list, pdir: Inode, session: bytes) -> list:
    """One remove of a ``create_batch``: ``[name, ino]``, the entry must still name ``ino``: a
    file, or an empty directory (its lease, if any, the session's); the file's attributes
    after, or the parent's for a directory."""
    name, ino = e
    check_name(name)
    if type(ino) is not int:
        raise error(errno.EINVAL, "malformed entry")
    d = t.dentry(parent, name)
    if d is None or d[0] != ino:
        raise error(errno.ENOENT, f"{name.decode(errors='replace')!r} is not that file")
    node = t.inode(ino)
    if node is None:
        raise error(errno.EXDEV, "a batched remove takes an inode that lives here")
    if d[1] == stat.S_IFDIR:
        t.check_lease(ino, session)
        t.check_dir_lock(ino)
        if not t.dir_is_empty(ino):
            raise error(errno.ENOTEMPTY, f"{name.decode(errors='replace')!r} is not empty")
        t.delete_dentry(parent, name)
        t.delete_inode(ino)
        t.end_lease(ino, session)
        pdir.nlink -= 1
        return pdir.attr().to_wire()
    t.delete_dentry(parent, name)
    node.nlink -= 1
    node.ctime_ns = t.now
    if node.nlink <= 0:
        t.delete_inode(ino)
    else:
        t.put_inode(node)
    return node.attr().to_wire()


def _rename_entry(t: Txn, parent: int, e: list) -> list:
    """One rename of a ``create_batch``: ``[old, new, ino, replaced]``. ``old`` must still name
    the file ``ino`` and ``new`` the file ``replaced`` (0: nothing), both regular files whose
    inodes live here; the replaced file loses a link, as ``rename(2)``'s."""
    old, new, ino, replaced = e
    check_name(old)
    check_name(new)
    if type(ino) is not int or type(replaced) is not int or old == new or ino == replaced:
        raise error(errno.EINVAL, "malformed entry")
    d = t.dentry(parent, old)
    if d is None or d[0] != ino:
        done = t.dentry(parent, new)
        if d is None and done is not None and done[0] == ino:  # made by an earlier attempt
            node = t.inode(ino, lock=False)
            if node is not None:
                return node.attr().to_wire()
        raise error(errno.ENOENT, f"{old.decode(errors='replace')!r} is not that file")
    if d[1] != stat.S_IFREG:
        raise error(errno.EINVAL, "a batched rename moves a regular file")
    was = t.dentry(parent, new)
    if (was[0] if was is not None else 0) != replaced:
        raise error(errno.EEXIST if was is not None else errno.ENOENT,
                    f"{new.decode(errors='replace')!r} is not the file expected there")
    if was is not None and was[1] != stat.S_IFREG:
        raise error(errno.EISDIR, f"{new.decode(errors='replace')!r} is not a regular file")
    node = t.inode(ino)
    victim = t.inode(replaced) if was is not None else None
    if node is None or (was is not None and victim is None):
        raise error(errno.EXDEV, "a batched rename takes files whose inodes live here")
    if victim is not None:
        apply(t, ["nlink", replaced, -1])  # gone at no link left, as rename(2)'s target
    t.delete_dentry(parent, old)
    t.put_dentry(parent, new, ino, stat.S_IFREG)
    node.ctime_ns = t.now
    t.put_inode(node)
    return node.attr().to_wire()
