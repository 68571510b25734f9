"""The FUSE wire protocol's messages, byte for byte against <linux/fuse.h>'s layouts."""

from __future__ import annotations

import stat
import struct

import pytest

from jpfs.fuse import protocol as p


def _attrs(**kw) -> p.Attributes:
    base = dict(ino=42, mode=stat.S_IFREG | 0o644, nlink=1, uid=1000, gid=100, size=12345,
                blocks=32, blksize=1 << 20, atime_ns=1_700_000_000_123_456_789,
                mtime_ns=1_700_000_001_000_000_001, ctime_ns=1_700_000_002_999_999_999,
                entry_timeout=1.5, attr_timeout=3600.0)
    base.update(kw)
    return p.Attributes(**base)


def test_a_request_parses_and_its_names_split():
    body = struct.pack("<II", 0, 0) + b"user.x\0"
    raw = p.IN_HEADER.pack(p.IN_HEADER.size + len(body), p.GETXATTR, 7, 99, 1, 2, 3, 0) + body
    buf = bytearray(p.BUFSIZE)
    buf[:len(raw)] = raw
    req = p.parse(buf, len(raw))
    assert (req.opcode, req.unique, req.nodeid, req.uid, req.gid, req.pid) == \
        (p.GETXATTR, 7, 99, 1, 2, 3)
    assert req.name == "getxattr"
    assert req.names(p.GETXATTR_IN.size) == [b"user.x"]
    rename = p.Request(p.RENAME, 1, 1, 0, 0, 0, struct.pack("<Q", 5) + b"old\0new\0")
    assert rename.names(8) == [b"old", b"new"]


@pytest.mark.parametrize("n, length", [(10, 10), (60, 70), (60, 50)])
def test_a_request_that_does_not_add_up_is_refused(n, length):
    raw = p.IN_HEADER.pack(length, p.LOOKUP, 1, 1, 0, 0, 0, 0) + b"\0" * 40
    with pytest.raises(p.ProtocolError):
        p.parse(raw, n)


def test_an_entry_is_fuse_entry_out_with_fuse_attr():
    a = _attrs()
    out = p.entry_out(a)
    assert len(out) == 128
    nodeid, gen, ev, av, evn, avn = p.ENTRY_OUT.unpack_from(out)
    assert (nodeid, gen, ev, evn, av, avn) == (42, 0, 1, 500_000_000, 3600, 0)
    (ino, size, blocks, atime, mtime, ctime, atimens, mtimens, ctimens, mode, nlink, uid, gid,
     rdev, blksize, flags) = p.ATTR.unpack_from(out, p.ENTRY_OUT.size)
    assert (ino, size, blocks, mode, nlink, uid, gid, rdev, blksize, flags) == \
        (42, 12345, 32, a.mode, 1, 1000, 100, 0, 1 << 20, 0)
    assert (atime, atimens) == (1_700_000_000, 123_456_789)
    assert (mtime, mtimens) == (1_700_000_001, 1)
    assert (ctime, ctimens) == (1_700_000_002, 999_999_999)


def test_times_before_1970_keep_their_sign():
    out = p.attr_out(_attrs(mtime_ns=-1_500_000_000))
    fields = p.ATTR.unpack_from(out, p.ATTR_OUT.size)
    assert (fields[4], fields[7]) == (-2, 500_000_000)  # -2 s + 0.5 s = -1.5 s


def test_a_negative_entry_has_node_zero_and_its_timeout():
    out = p.entry_out(p.Attributes(ino=0, mode=0, entry_timeout=2.0))
    assert p.ENTRY_OUT.unpack_from(out)[:3] == (0, 0, 2)


def test_directory_entries_are_padded_to_eight_bytes():
    a = _attrs(mode=stat.S_IFDIR | 0o755)
    for name in (b"a", b"abcdefgh", b"x" * 255):
        rec = p.dirent(name, a, 9)
        assert len(rec) % 8 == 0 and len(rec) >= p.DIRENT.size + len(name)
        ino, off, namelen, kind = p.DIRENT.unpack_from(rec)
        assert (ino, off, namelen, kind) == (42, 9, len(name), stat.S_IFDIR >> 12)
        assert rec[p.DIRENT.size:p.DIRENT.size + namelen] == name
        plus = p.direntplus(name, a, 9)
        assert plus[:128] == p.entry_out(a) and plus[128:] == rec


def test_xattr_answers_give_the_size_or_the_value_or_erange():
    assert p.xattr_answer(b"value", 0) == p.GETXATTR_OUT.pack(5, 0)
    assert p.xattr_answer(b"value", 5) == b"value"
    with pytest.raises(OverflowError):
        p.xattr_answer(b"value", 4)


def test_init_takes_what_both_sides_want_and_refuses_old_kernels():
    body, flags = p.init_out(7, 40, 131072, p.ASYNC_READ | p.WRITEBACK_CACHE | p.MAX_PAGES_FLAG,
                             p.ASYNC_READ | p.MAX_PAGES_FLAG | p.DO_READDIRPLUS)
    assert flags == p.ASYNC_READ | p.MAX_PAGES_FLAG
    assert len(body) == 64
    major, minor, readahead, got, _, _, max_write, _, max_pages = \
        p.INIT_OUT.unpack_from(body)[:9]
    assert (major, minor, readahead, got) == (7, p.MINOR, 131072, flags)
    assert (max_write, max_pages) == (p.MAX_PAGES * p.PAGE, p.MAX_PAGES)
    assert p.INIT_OUT.unpack_from(p.init_out(7, 29, 0, 0, 0)[0])[1] == 29  # its minor if older
    for major, minor in ((6, 40), (8, 0), (7, 27)):
        with pytest.raises(p.ProtocolError):
            p.init_out(major, minor, 0, 0, 0)


def test_notifications_carry_unique_zero_and_their_code():
    msg = p.notify_store(42, 4096, 100)
    length, code, unique = p.OUT_HEADER.unpack_from(msg)
    assert (length, code, unique) == (p.OUT_HEADER.size + 24 + 100, p.NOTIFY_STORE, 0)
    assert p.NOTIFY_STORE_OUT.unpack_from(msg, p.OUT_HEADER.size) == (42, 4096, 100, 0)
    inval = p.notify_inval_inode(42, -1, 0)
    assert p.OUT_HEADER.unpack_from(inval) == (len(inval), p.NOTIFY_INVAL_INODE, 0)
    entry = p.notify_inval_entry(1, b"name")
    assert p.OUT_HEADER.unpack_from(entry)[:2] == (len(entry), p.NOTIFY_INVAL_ENTRY)
    assert entry.endswith(b"name\0")


def test_an_error_answer_is_a_negative_errno():
    assert p.OUT_HEADER.unpack(p.header(9, 0, 2)) == (16, -2, 9)
    assert p.OUT_HEADER.unpack(p.header(9, 100)) == (116, 0, 9)


def test_every_opcode_has_a_name():
    assert p.NAMES[p.READDIRPLUS] == "readdirplus" and p.NAMES[p.LOOKUP] == "lookup"
    assert p.Request(200, 1, 1, 0, 0, 0, b"").name == "opcode 200"
