"""The metadata service's methods: names, argument types, retry safety.

Names are ``bytes``; inode ids, times (ns) and ids are ints; attributes travel as
``Attr.to_wire()`` lists. Reads and the 2PC steps are idempotent (safe to retry after a lost
connection); namespace changes are not, so a client never repeats one that may have reached the
server.
"""

from __future__ import annotations

import errno

from ..errors import error
from ..rpc import Method, method_table
from ..types import NAME_MAX

B = bytes
L = list
N = type(None)

METHODS = method_table(
    # ---- namespace reads (one shard each)
    Method("lookup", (int, B), idempotent=True),
    Method("batch_lookup", (int, L), idempotent=True),
    Method("getattr", (int,), idempotent=True),
    Method("batch_getattr", (L,), idempotent=True),
    Method("readdir", (int, B, int, bool), idempotent=True),
    Method("readlink", (int,), idempotent=True),
    Method("getparent", (int,), idempotent=True),
    Method("statfs", (), idempotent=True),
    Method("getxattr", (int, B), idempotent=True),
    Method("listxattr", (int,), idempotent=True),
    # ---- namespace changes (coordinated by the parent directory's shard)
    Method("create", (int, B, int, int, int, bool)),
    Method("mknod", (int, B, int, int, int, int)),
    Method("mkdir", (int, B, int, int, int)),
    Method("symlink", (int, B, B, int, int)),
    Method("link", (int, int, B)),
    Method("unlink", (int, B)),
    Method("rmdir", (int, B)),
    Method("rename", (int, B, int, B, int)),
    Method("setattr", (int, dict)),
    Method("setxattr", (int, B, B, int)),
    Method("removexattr", (int, B)),
    # ---- file data layout
    Method("get_layout", (int,), idempotent=True),
    Method("batch_layout", (L,), idempotent=True),
    Method("lookup_layouts", (int, L), idempotent=True),
    Method("write_chunks", (int, L, int, (int, N))),
    Method("bulk_create", (int, L, bool)),
    # ---- cross-shard transactions (shard to shard)
    Method("tx_prepare", (B, int, L), idempotent=True),
    Method("tx_commit", (B,), idempotent=True),
    Method("tx_abort", (B,), idempotent=True),
    Method("tx_status", (B,), idempotent=True),
    Method("rename_lock", (B, (int, float)), idempotent=True),
    Method("rename_unlock", (B,), idempotent=True),
    # ---- maintenance: fsck, gc, status
    Method("scan", (str, B, int), idempotent=True),
    Method("pending", (), idempotent=True),
    Method("repair", (str, L)),
    Method("shard_info", (), idempotent=True),
)

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
