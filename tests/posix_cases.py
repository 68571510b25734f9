"""POSIX cases, run the same way on a local ext4 directory and on a JPFS mount.

Each case sets up a fresh directory, makes one system call, and records what a program would see:
the call's outcome (``ok`` and its result, or the errno's name), then the type, permission bits,
link count, size, owner and device number of every entry left in the directory, and whether the
directory's and the target's mtime/ctime moved. ``tests/test_fuse_conformance.py`` runs this file
as a script, once on ext4 and once on the mount (as root, and as an unprivileged user), and
requires the two records to be identical: the reference is Linux itself, measured in the same run,
not a table of expected answers.

Usage: ``python posix_cases.py ROOT UID`` prints one JSON object, case name -> record. With a
UID other than 0 the per-case ``as_root`` steps run first, then the process drops to UID (and its
group) for everything else.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import sys
import time

OTHER_UID = 65533
"""Owner of files set up by root for another user (sticky directories, chown)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check(rc: int) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return rc


def renameat2(a: str, b: str, flags: int) -> None:
    _check(_libc.renameat2(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), flags))


def utimensat(path: str, atime: tuple[int, int], mtime: tuple[int, int]) -> None:
    ts = (_Timespec * 2)(_Timespec(*atime), _Timespec(*mtime))
    _check(_libc.utimensat(AT_FDCWD, path.encode(), ts, 0))


def fallocate(path: str, mode: int, off: int, length: int) -> int:
    fd = os.open(path, os.O_RDWR)
    try:
        _check(_libc.fallocate(fd, mode, off, length))
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


# ---- building blocks ----------------------------------------------------------------------------

def make(kind: str, path: str, arg=None) -> None:
    """Create one entry of ``kind`` at ``path``."""
    if kind == "file":
        with open(path, "wb") as f:
            f.write(arg if arg is not None else b"")
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "full":  # a directory with an entry
        os.mkdir(path)
        make("file", os.path.join(path, "inside"), b"x")
    elif kind == "symlink":
        os.symlink(arg or "target", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "sock":
        os.mknod(path, stat.S_IFSOCK | 0o644)
    elif kind == "chr":
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 3))
    elif kind == "blk":
        os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    else:
        raise ValueError(kind)


def _ftruncate(path: str, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _open(path: str, flags: int, mode: int = 0o644) -> int | str:
    fd = os.open(path, flags, mode)
    try:
        st = os.fstat(fd)
        return st.st_size if stat.S_ISREG(st.st_mode) else "not a file"
    finally:
        os.close(fd)


def _write_at(path: str, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)


def _unlink_open_fstat(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        return os.fstat(fd).st_nlink
    finally:
        os.close(fd)


OPS = {
    "open": _open,
    "mkdir": os.mkdir,
    "mknod": os.mknod,
    "mkfifo": os.mkfifo,
    "link": os.link,
    "symlink": os.symlink,
    "unlink": os.unlink,
    "rmdir": os.rmdir,
    "rename": os.rename,
    "renameat2": renameat2,
    "chmod": os.chmod,
    "chown": lambda p, u, g: os.chown(p, u, g, follow_symlinks=False),
    "truncate": os.truncate,
    "ftruncate": _ftruncate,
    "utimensat": utimensat,
    "stat": lambda p: stat.S_IFMT(os.stat(p).st_mode),
    "lstat": lambda p: stat.S_IFMT(os.lstat(p).st_mode),
    "readlink": os.readlink,
    "write": _write_at,
    "fallocate": fallocate,
    "unlink_open_fstat": _unlink_open_fstat,
    "listdir": lambda p: sorted(os.listdir(p)),
}


# ---- the table ----------------------------------------------------------------------------------
# (name, setup steps, operation, arguments); paths are relative to the case directory. A setup
# step is (kind, name[, arg]) or ("as_root", kind, name[, arg]) or ("chmod"/"chown", name, ...).

TYPES = ("file", "dir", "symlink", "fifo", "sock", "chr", "blk")
DEST = (None, "file", "dir", "full", "symlink")
CREAT = os.O_CREAT | os.O_WRONLY
NOW = (0, UTIME_NOW)
OMIT = (0, UTIME_OMIT)
LONG = "n" * 255


def mk(kind: str, name: str) -> tuple:
    """A setup step making ``kind``: devices are made by root (mknod of a device needs
    CAP_MKNOD; what is tested is what others can then do with them)."""
    return ("as_root", kind, name) if kind in ("chr", "blk") else (kind, name)


def cases() -> list[tuple]:
    out: list[tuple] = []
    add = out.append
    # open / creat
    add(("creat new", [], "open", ("f", CREAT, 0o640)))
    add(("creat excl existing", [("file", "f")], "open", ("f", CREAT | os.O_EXCL)))
    add(("creat existing trunc", [("file", "f", b"abc")], "open", ("f", CREAT | os.O_TRUNC)))
    add(("open missing", [], "open", ("f", os.O_RDONLY)))
    add(("open dir for write", [("dir", "d")], "open", ("d", os.O_WRONLY)))
    add(("open dir rdonly", [("dir", "d")], "open", ("d", os.O_RDONLY)))
    add(("open file as dir", [("file", "f")], "open", ("f/x", CREAT)))
    add(("open O_DIRECTORY on file", [("file", "f")], "open", ("f", os.O_DIRECTORY)))
    add(("creat through dangling symlink", [("symlink", "l", "gone")], "open", ("l", CREAT)))
    add(("open O_NOFOLLOW symlink", [("file", "t"), ("symlink", "l", "t")],
         "open", ("l", os.O_RDONLY | os.O_NOFOLLOW)))
    add(("creat no perm", [("dir", "d"), ("chmod", "d", 0o555)], "open", ("d/f", CREAT)))
    add(("open no read perm", [("file", "f"), ("chmod", "f", 0o200)], "open",
         ("f", os.O_RDONLY)))
    # mkdir / mknod / mkfifo
    add(("mkdir", [], "mkdir", ("d", 0o750)))
    add(("mkdir existing", [("file", "d")], "mkdir", ("d",)))
    add(("mkdir in missing", [], "mkdir", ("x/d",)))
    add(("mkdir setgid parent", [("dir", "p"), ("chmod", "p", 0o2775)], "mkdir", ("p/d",)))
    add(("mkfifo", [], "mkfifo", ("p", 0o600)))
    add(("mknod sock", [], "mknod", ("s", stat.S_IFSOCK | 0o644)))
    add(("mknod chr", [], "mknod", ("c", stat.S_IFCHR | 0o600, os.makedev(1, 5))))
    add(("mknod blk", [], "mknod", ("b", stat.S_IFBLK | 0o600, os.makedev(7, 1))))
    add(("mknod reg", [], "mknod", ("r", stat.S_IFREG | 0o644)))
    add(("mknod existing", [("fifo", "p")], "mknod", ("p", stat.S_IFIFO | 0o644)))
    # links
    add(("link", [("file", "f")], "link", ("f", "g")))
    add(("link to existing", [("file", "f"), ("file", "g")], "link", ("f", "g")))
    add(("link a dir", [("dir", "d")], "link", ("d", "e")))
    add(("link missing", [], "link", ("f", "g")))
    add(("link fifo", [("fifo", "p")], "link", ("p", "q")))
    add(("symlink", [], "symlink", ("some/target", "l")))
    add(("symlink existing", [("file", "l")], "symlink", ("t", "l")))
    add(("unlink one of three links", [("file", "f"), ("link", "f", "g"), ("link", "f", "h")],
         "unlink", ("g",)))
    add(("unlink while open", [("file", "f"), ("link", "f", "g")], "unlink_open_fstat",
         ("g",)))
    add(("unlink last while open", [("file", "f")], "unlink_open_fstat", ("f",)))
    add(("unlink dir", [("dir", "d")], "unlink", ("d",)))
    add(("unlink missing", [], "unlink", ("f",)))
    add(("readlink", [("symlink", "l", "a/b")], "readlink", ("l",)))
    add(("readlink on file", [("file", "f")], "readlink", ("f",)))
    add(("stat loop", [("symlink", "a", "b"), ("symlink", "b", "a")], "stat", ("a",)))
    for kind in TYPES:
        add((f"unlink {kind}", [mk(kind, "x")], "unlink", ("x",)))
        add((f"lstat {kind}", [mk(kind, "x")], "lstat", ("x",)))
    # rmdir
    add(("rmdir", [("dir", "d")], "rmdir", ("d",)))
    add(("rmdir nonempty", [("full", "d")], "rmdir", ("d",)))
    add(("rmdir file", [("file", "d")], "rmdir", ("d",)))
    add(("rmdir dot", [("dir", "d")], "rmdir", ("d/.",)))
    # rename: every type onto every kind of destination
    for src in TYPES:
        for dst in DEST:
            setup = [mk(src, "a")] + ([mk(dst, "b")] if dst else [])
            add((f"rename {src} over {dst or 'nothing'}", setup, "rename", ("a", "b")))
    add(("rename dir into itself", [("dir", "d")], "rename", ("d", "d/e")))
    add(("rename to same link", [("file", "f"), ("link", "f", "g")], "rename", ("f", "g")))
    add(("rename missing", [], "rename", ("a", "b")))
    add(("rename across dirs", [("dir", "p"), ("dir", "q"), ("file", "p/f")], "rename",
         ("p/f", "q/f")))
    add(("rename dir across dirs", [("dir", "p"), ("dir", "q"), ("full", "p/d")], "rename",
         ("p/d", "q/d")))
    add(("noreplace onto existing", [("file", "a"), ("file", "b")], "renameat2",
         ("a", "b", RENAME_NOREPLACE)))
    add(("noreplace onto nothing", [("file", "a")], "renameat2", ("a", "b", RENAME_NOREPLACE)))
    add(("exchange file dir", [("file", "a"), ("full", "b")], "renameat2",
         ("a", "b", RENAME_EXCHANGE)))
    add(("exchange with nothing", [("file", "a")], "renameat2", ("a", "b", RENAME_EXCHANGE)))
    add(("exchange across dirs", [("dir", "p"), ("file", "p/a"), ("dir", "b")], "renameat2",
         ("p/a", "b", RENAME_EXCHANGE)))
    # chmod / chown
    add(("chmod", [("file", "f")], "chmod", ("f", 0o4711)))
    add(("chmod dir", [("dir", "d")], "chmod", ("d", 0o1777)))
    add(("chmod not owner", [("as_root", "file", "f")], "chmod", ("f", 0o777)))
    add(("chown to other", [("file", "f")], "chown", ("f", OTHER_UID, -1)))
    add(("chown to self", [("file", "f")], "chown", ("f", -1, -1)))
    add(("chown clears setuid", [("file", "f"), ("chmod", "f", 0o6755)], "chown",
         ("f", -1, -1)))
    add(("chown clears setgid", [("file", "f"), ("chmod", "f", 0o2775)], "chown",
         ("f", -1, -1)))
    add(("write clears setuid", [("file", "f", b"abc"), ("chmod", "f", 0o4755)], "write",
         ("f", b"x")))
    # truncate
    add(("truncate grow", [("file", "f", b"abc")], "truncate", ("f", 100)))
    add(("truncate shrink", [("file", "f", b"abcdef")], "truncate", ("f", 2)))
    add(("truncate dir", [("dir", "d")], "truncate", ("d", 0)))
    add(("truncate negative", [("file", "f")], "truncate", ("f", -1)))
    add(("truncate no perm", [("file", "f"), ("chmod", "f", 0o444)], "truncate", ("f", 0)))
    add(("ftruncate", [("file", "f", b"abcdef")], "ftruncate", ("f", 3)))
    # utimensat
    add(("utime now", [("file", "f")], "utimensat", ("f", NOW, NOW)))
    add(("utime omit atime", [("file", "f")], "utimensat", ("f", OMIT, (1000, 5))))
    add(("utime omit both", [("file", "f")], "utimensat", ("f", OMIT, OMIT)))
    add(("utime set", [("file", "f")], "utimensat", ("f", (10, 1), (20, 2))))
    add(("utime not owner", [("as_root", "file", "f")], "utimensat", ("f", (10, 1), (20, 2))))
    add(("utime now not owner writable", [("as_root", "file", "f"), ("as_root", "chmod", "f",
                                                                       0o666)],
         "utimensat", ("f", NOW, NOW)))
    # names and paths
    add(("name 255", [], "open", (LONG, CREAT)))
    add(("name 256", [], "open", (LONG + "n", CREAT)))
    add(("mkdir name 256", [], "mkdir", (LONG + "n",)))
    add(("path too long", [], "open", ("/".join(["d" * 200] * 21), CREAT)))
    # sticky directories
    sticky = [("as_root", "dir", "t"), ("as_root", "chmod", "t", 0o1777),
              ("as_root", "file", "t/theirs"), ("file", "t/mine")]
    add(("sticky unlink theirs", sticky, "unlink", ("t/theirs",)))
    add(("sticky unlink mine", sticky, "unlink", ("t/mine",)))
    add(("sticky rename theirs", sticky, "rename", ("t/theirs", "t/moved")))
    add(("sticky replace theirs", sticky, "rename", ("t/mine", "t/theirs")))
    # fallocate
    add(("fallocate grow", [("file", "f", b"abc")], "fallocate", ("f", 0, 0, 5000)))
    add(("fallocate keep size", [("file", "f", b"abc")], "fallocate",
         ("f", FALLOC_FL_KEEP_SIZE, 0, 5000)))
    add(("fallocate inside", [("file", "f", b"abcdef")], "fallocate", ("f", 0, 1, 2)))
    add(("fallocate zero length", [("file", "f")], "fallocate", ("f", 0, 0, 0)))
    add(("listdir after changes", [("file", "a"), ("dir", "b"), ("symlink", "c"),
                                   ("fifo", "d")], "listdir", (".",)))
    return out


# ---- running and recording -----------------------------------------------------------------------

def _entry(st: os.stat_result) -> dict:
    kind = stat.S_IFMT(st.st_mode)
    d = {"type": kind, "mode": oct(stat.S_IMODE(st.st_mode)), "nlink": st.st_nlink,
         "uid": st.st_uid, "gid": st.st_gid}
    if stat.S_ISREG(kind) or stat.S_ISLNK(kind):
        d["size"] = st.st_size
    if stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
        d["rdev"] = st.st_rdev
    return d


def _snapshot(top: str) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = {**_entry(st), "ino": st.st_ino,
                                            "mtime": st.st_mtime_ns, "ctime": st.st_ctime_ns}
    st = os.lstat(top)
    out["."] = {**_entry(st), "ino": st.st_ino, "mtime": st.st_mtime_ns,
                "ctime": st.st_ctime_ns}
    return out


def _result(value) -> object:
    if isinstance(value, bytes | str):
        return value if isinstance(value, str) else value.decode()
    if isinstance(value, int | list | type(None)):
        return value
    return repr(value)


def run_op(op: str, args: tuple) -> dict:
    try:
        return {"ok": _result(OPS[op](*args))}
    except OSError as e:
        return {"error": errno.errorcode.get(e.errno, str(e.errno))}
    except (ValueError, OverflowError) as e:  # Python refuses before the kernel (negative size)
        return {"error": type(e).__name__}


def _setup(step: tuple) -> None:
    kind, name, *rest = step
    if kind == "chmod":
        os.chmod(name, rest[0])
    elif kind == "chown":
        os.chown(name, *rest, follow_symlinks=False)
    elif kind == "link":
        os.link(name, rest[0])
    else:
        make(kind, name, rest[0] if rest else None)


def record(before: dict, after: dict, outcome: dict) -> dict:
    """What a program sees: the outcome, the entries and which of their times moved (each
    inode compared with itself: a renamed entry keeps its times)."""
    by_ino = {e["ino"]: e for e in before.values()}
    entries = {}
    for name, e in sorted(after.items()):
        old = by_ino.get(e["ino"])
        moved = {k: e[k] != old[k] for k in ("mtime", "ctime")} if old else "new"
        entries[name] = {**{k: v for k, v in e.items() if k not in ("ino", "mtime", "ctime")},
                         "times_moved": moved}
    return {**outcome, "gone": sorted(set(before) - set(after)), "entries": entries}


def main(root: str, uid: int) -> dict:
    os.umask(0o022)
    table = cases()
    dirs = {}
    for i, (name, steps, _op, _args) in enumerate(table):  # as root: directories, root steps
        d = os.path.join(root, f"c{i:03d}")
        os.mkdir(d)
        os.chmod(d, 0o755)
        for step in steps:
            if step[0] == "as_root":
                os.chdir(d)
                _setup(step[1:])
        if uid:
            os.chown(d, uid, uid)
        dirs[name] = d
    if uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    out = {}
    for name, steps, op, args in table:
        d = dirs[name]
        os.chdir(d)
        for step in steps:
            if step[0] != "as_root":
                _setup(step)
        time.sleep(0.012)  # ext4 stamps times from a coarse clock: let it tick
        before = _snapshot(".")
        outcome = run_op(op, args)
        after = _snapshot(".")
        out[name] = record(before, after, outcome)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
