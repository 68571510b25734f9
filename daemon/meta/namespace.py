"""Single-shard namespace operations: ``fn(txn, ...)`` functions run by the Store.

Reads run in a read view, writes in a group commit; either may raise ``Locked`` (wait and rerun)
or a JPFSError carrying the POSIX errno. Changes that may involve other shards (mkdir elsewhere,
link, unlink, rmdir, rename) are planned by ``planner`` and applied through ``ops``.
"""

from __future__ import annotations

import errno
import stat

from jpfs.errors import errno_name, error
from jpfs.placement import shard_of
from jpfs.proto.meta import XATTR_CREATE, XATTR_REPLACE, Counts, Created, DirPage, Entry, check_name
from jpfs.types import Attr, DirEntry

from . import keys as K
from .keys import Inode
from .txn import Txn

MAX_READDIR = 10_000
MAX_SYMLINK = 4096
MAX_XATTR_NAME = 255
MAX_XATTR_VALUE = 64 << 10
FILE_TYPES = (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK)
NODE_TYPES = (*FILE_TYPES, stat.S_IFBLK, stat.S_IFCHR)
"""What ``mknod`` makes: every non-directory, non-symlink type (device nodes are metadata only:
type, mode and rdev; their I/O is the kernel's, never ours)."""


def _local_attr_record(t: Txn, ino: int) -> Attr | None:
    if shard_of(ino) != t.store.shard:
        return None
    node = t.inode(ino)
    return node.attr() if node else None


# ---- reads -------------------------------------------------------------------------------------

def lookup(t: Txn, parent: int, name: bytes) -> list:
    """``Entry.to_wire()``: attr is None when the inode lives on another shard."""
    check_name(name)
    t.need_dir(parent)
    d = t.dentry(parent, name)
    if d is None:
        raise error(errno.ENOENT, f"no entry {name.decode(errors='replace')!r}")
    return Entry(d[0], d[1], _local_attr_record(t, d[0])).to_wire()


def lookup_absent(t: Txn, parent: int, name: bytes) -> None:
    """Check that ``name`` can be created in ``parent`` (EEXIST, ENOTDIR, ENOENT otherwise)."""
    _new_entry_checks(t, parent, name)


def each_name(t: Txn, parent: int, names: list, answer) -> list:
    """``answer(ino, kind)`` for each name found in ``parent``; an errno name for the others
    (a bad name, a missing entry, or whatever errno ``answer`` raised)."""
    t.need_dir(parent)
    out: list = []
    for name in names:
        try:
            check_name(name)
            d = t.dentry(parent, name)
            out.append(answer(*d) if d else "ENOENT")
        except OSError as e:
            out.append(errno_name(e.errno))
    return out


def batch_lookup(t: Txn, parent: int, names: list) -> list:
    """One answer per name: ``Entry.to_wire()``, or an errno name (``Entries``)."""
    return each_name(t, parent, names,
                     lambda ino, kind: Entry(ino, kind, _local_attr_record(t, ino)).to_wire())


def getattr_(t: Txn, ino: int) -> list:
    """GETATTR's answer: the inode's attributes (wire form); ENOENT if it does not exist."""
    return t.need_inode(ino).attr().to_wire()


def batch_getattr(t: Txn, inos: list) -> list:
    """Attributes for each inode of this shard, or None where it does not exist."""
    out = []
    for ino in inos:
        node = t.inode(ino)
        out.append(node.attr().to_wire() if node else None)
    return out


def readdir(t: Txn, parent: int, after: bytes, limit: int, plus: bool) -> list:
    """``DirPage.to_wire()``: entries after name ``after`` in name order, with attrs when
    ``plus`` (for inodes of this shard; the client fetches the rest in one batch per shard)."""
    t.need_dir(parent)
    t.check_dir_lock(parent)
    limit = max(1, min(limit, MAX_READDIR))
    prefix = K.dentry_prefix(parent)
    entries: list[DirEntry] = []
    more = False
    with t.t.cursor(db=t.db["dentry"]) as cur:
        ok = cur.set_range(K.dentry_key(parent, after))
        while ok:
            key = cur.key()
            if not bytes(key[:8]) == prefix:
                break
            name = bytes(key[8:])
            if name == after:
                ok = cur.next()
                continue
            if len(entries) >= limit:
                more = True
                break
            ino, kind = K.split_dentry_value(cur.value())
            entries.append(DirEntry(name, ino, kind, _local_attr_record(t, ino) if plus else None))
            ok = cur.next()
    return DirPage(entries, more).to_wire()


def readlink(t: Txn, ino: int) -> bytes:
    """READLINK's answer: the symlink's target; EINVAL if ``ino`` is not a symlink."""
    node = t.need_inode(ino)
    if not stat.S_ISLNK(node.mode):
        raise error(errno.EINVAL, "not a symbolic link")
    return node.target or b""


def getxattr(t: Txn, ino: int, name: bytes) -> bytes:
    """GETXATTR's answer: the attribute's value; ENODATA where it is not set."""
    t.need_inode(ino)
    v = t.t.get(K.xattr_key(ino, name), db=t.db["xattr"])
    if v is None:
        raise error(errno.ENODATA, "no such attribute")
    return bytes(v)


def listxattr(t: Txn, ino: int) -> list[bytes]:
    """LISTXATTR's answer: the names of the inode's attributes, in name order."""
    t.need_inode(ino)
    prefix = K.ino_key(ino)
    names = []
    with t.t.cursor(db=t.db["xattr"]) as cur:
        ok = cur.set_range(prefix)
        while ok and bytes(cur.key()).startswith(prefix):
            names.append(bytes(cur.key()[8:]))
            ok = cur.next()
    return names


def statfs(t: Txn) -> Counts:
    """This shard's record counts: ``inodes``, ``dentries`` and ``chunks``."""
    return Counts(t.t.stat(t.db["inode"])["entries"], t.t.stat(t.db["dentry"])["entries"],
                  t.t.stat(t.db["chunk"])["entries"])


# ---- writes that never leave this shard ---------------------------------------------------------

def _new_entry_checks(t: Txn, parent: int, name: bytes) -> Inode:
    check_name(name)
    pdir = t.need_dir(parent)
    if t.dentry(parent, name) is not None:
        raise error(errno.EEXIST, f"{name.decode(errors='replace')!r} exists")
    t.check_lease(parent)
    return pdir


def touch(t: Txn, node: Inode) -> None:
    """A directory changed: its mtime and ctime are now (stored by the caller's transaction)."""
    node.mtime_ns = node.ctime_ns = t.now
    t.put_inode(node)


def create(t: Txn, parent: int, name: bytes, mode: int, uid: int, gid: int,
           exclusive: bool, rdev: int = 0) -> list:
    """``Created.to_wire()``: a new file, or the existing one unless exclusive."""
    check_name(name)
    if stat.S_IFMT(mode) == 0:
        mode |= stat.S_IFREG
    if stat.S_IFMT(mode) not in FILE_TYPES:
        raise error(errno.EINVAL, "create makes regular files, fifos and sockets only")
    return _make(t, parent, name, mode, uid, gid, exclusive, rdev)


def mknod(t: Txn, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int) -> list:
    """Like an exclusive ``create``, for any node type but directories and symlinks; ``rdev``
    (the device number of a block or character device) is kept with the inode."""
    check_name(name)
    if stat.S_IFMT(mode) == 0:
        mode |= stat.S_IFREG
    if stat.S_IFMT(mode) not in NODE_TYPES:
        raise error(errno.EINVAL, "mknod makes regular files, fifos, sockets and devices")
    if not 0 <= rdev < 1 << 64:
        raise error(errno.EINVAL, "a device number is an unsigned 64-bit integer")
    if stat.S_IFMT(mode) not in (stat.S_IFBLK, stat.S_IFCHR):
        rdev = 0
    return _make(t, parent, name, mode, uid, gid, True, rdev)


def _make(t: Txn, parent: int, name: bytes, mode: int, uid: int, gid: int, exclusive: bool,
          rdev: int) -> list:
    pdir = t.need_dir(parent)
    d = t.dentry(parent, name)
    if d is not None:
        if exclusive:
            raise error(errno.EEXIST, f"{name.decode(errors='replace')!r} exists")
        if d[1] == stat.S_IFDIR:
            raise error(errno.EISDIR, f"{name.decode(errors='replace')!r} is a directory")
        return Created(d[0], d[1], _local_attr_record(t, d[0]), False).to_wire()
    t.check_lease(parent)
    ino = t.alloc_ino()
    node = Inode(ino, mode, 1, uid, gid, 0, t.now, t.now, t.now, rdev=rdev, parent=parent)
    t.put_inode(node)
    t.put_dentry(parent, name, ino, stat.S_IFMT(mode))
    touch(t, pdir)
    return Created(ino, stat.S_IFMT(mode), node.attr(), True).to_wire()


def mkdir_local(t: Txn, parent: int, name: bytes, mode: int, uid: int, gid: int) -> list:
    """Make a directory whose inode lives on the parent's shard, in one transaction; its
    attributes (wire form). EEXIST if the name is taken."""
    pdir = _new_entry_checks(t, parent, name)
    ino = t.alloc_ino()
    node = Inode(ino, stat.S_IFDIR | (mode & 0o7777), 2, uid, gid, 0, t.now, t.now, t.now,
                 parent=parent)
    t.put_inode(node)
    t.put_dentry(parent, name, ino, stat.S_IFDIR)
    pdir.nlink += 1
    touch(t, pdir)
    return node.attr().to_wire()


def symlink(t: Txn, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> list:
    """Make a symlink to ``target`` in ``parent``; its attributes (wire form). EINVAL for an empty
    target or one with a NUL, ENAMETOOLONG past ``MAX_SYMLINK``, EEXIST if the name is taken."""
    if not target or len(target) > MAX_SYMLINK or b"\0" in target:
        raise error(errno.ENAMETOOLONG if len(target) > MAX_SYMLINK else errno.EINVAL,
                    "invalid symlink target")
    pdir = _new_entry_checks(t, parent, name)
    ino = t.alloc_ino()
    node = Inode(ino, stat.S_IFLNK | 0o777, 1, uid, gid, len(target), t.now, t.now, t.now,
                 parent=parent, target=target)
    t.put_inode(node)
    t.put_dentry(parent, name, ino, stat.S_IFLNK)
    touch(t, pdir)
    return node.attr().to_wire()


def lease_grant(t: Txn, parent: int, limit: int) -> tuple[list[bytes], list[int]] | None:
    """A directory's names and their inodes for a lease's grant (None: more than ``limit``);
    raises ``Locked`` while a cross-shard change holds one of its entries."""
    t.need_dir(parent)
    t.check_dir_lock(parent)
    prefix = K.dentry_prefix(parent)
    names: list[bytes] = []
    inos: list[int] = []
    with t.t.cursor(db=t.db["dentry"]) as cur:
        if cur.set_range(prefix):
            for key, value in cur:
                key = bytes(key)
                if not key.startswith(prefix):
                    break
                if len(names) >= limit:
                    return None
                names.append(key[len(prefix):])
                inos.append(K.split_dentry_value(value)[0])
    return names, inos


def setattr_(t: Txn, ino: int, fields: dict, chunk_size: int) -> list:
    """Change mode/uid/gid/size/times; a size change truncates or extends the file."""
    node = t.need_inode(ino)
    changed = False
    for key, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise error(errno.EINVAL, f"setattr: bad value for {key}")
        if key == "mode":
            node.mode = stat.S_IFMT(node.mode) | (value & 0o7777)
        elif key in ("uid", "gid", "atime_ns", "mtime_ns", "ctime_ns"):
            setattr(node, key, value)
        elif key == "size":
            if stat.S_ISDIR(node.mode):
                raise error(errno.EISDIR, "cannot truncate a directory")
            if not stat.S_ISREG(node.mode):
                raise error(errno.EINVAL, "can only truncate regular files")
            if value != node.size:
                truncate_chunks(t, ino, value, chunk_size)
                node.size = value
                node.version += 1
            if "mtime_ns" not in fields:  # as truncate(2) on Linux, even to the same size
                node.mtime_ns = t.now
        else:
            raise error(errno.EINVAL, f"setattr: unknown field {key!r}")
        changed = True
    if changed and "ctime_ns" not in fields:
        node.ctime_ns = t.now
    t.put_inode(node)
    return node.attr().to_wire()


def truncate_chunks(t: Txn, ino: int, size: int, chunk_size: int) -> None:
    """Drop chunks past ``size`` and shorten the one it ends in (bytes past the end read as 0)."""
    keep = (size + chunk_size - 1) // chunk_size
    with t.t.cursor(db=t.db["chunk"]) as cur:
        ok = cur.set_range(K.chunk_key(ino, keep))
        while ok and bytes(cur.key()[:8]) == K.ino_key(ino):
            ok = cur.delete()
    if size % chunk_size:
        last = keep - 1
        raw = t.t.get(K.chunk_key(ino, last), db=t.db["chunk"])
        if raw is not None:
            c = K.decode_chunk((ino, last), raw)
            want = size - last * chunk_size
            if c.length > want:
                t.t.put(K.chunk_key(ino, last),
                        K.encode_chunk(type(c)(c.index, c.blob, c.nodes, want, c.blob_len, c.xxh)),
                        db=t.db["chunk"])


def setxattr(t: Txn, ino: int, name: bytes, value: bytes, flags: int) -> None:
    """Set an extended attribute (``flags``: XATTR_CREATE gives EEXIST if it exists, XATTR_REPLACE
    ENODATA if not); EINVAL/ERANGE for a bad name, E2BIG past ``MAX_XATTR_VALUE``."""
    node = t.need_inode(ino)
    if not name or len(name) > MAX_XATTR_NAME or b"\0" in name:
        raise error(errno.ERANGE if len(name) > MAX_XATTR_NAME else errno.EINVAL,
                    "invalid attribute name")
    if len(value) > MAX_XATTR_VALUE:
        raise error(errno.E2BIG, f"attribute values are limited to {MAX_XATTR_VALUE} bytes")
    key = K.xattr_key(ino, name)
    exists = t.t.get(key, db=t.db["xattr"]) is not None
    if flags & XATTR_CREATE and exists:
        raise error(errno.EEXIST, "attribute exists")
    if flags & XATTR_REPLACE and not exists:
        raise error(errno.ENODATA, "no such attribute")
    t.t.put(key, value, db=t.db["xattr"])
    node.ctime_ns = t.now
    t.put_inode(node)


def removexattr(t: Txn, ino: int, name: bytes) -> None:
    """Remove an extended attribute; ENODATA where it is not set."""
    node = t.need_inode(ino)
    if not t.t.delete(K.xattr_key(ino, name), db=t.db["xattr"]):
        raise error(errno.ENODATA, "no such attribute")
    node.ctime_ns = t.now
    t.put_inode(node)
