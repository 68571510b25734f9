"""Namespace commands: ``jpfs ls``, ``stat``, ``mkdir``, ``rm``, ``mv``, ``fsck``.

These only work inside JPFS: their paths are written ``jpfs:/a/b``. A plain path is a local one
(the rule of every ``jpfs`` command), so it is refused with the spelling that would work.
"""

from __future__ import annotations

import argparse
import errno
import posixpath
import sys

from ..config import format_size
from ..errors import JPFSError
from .common import (
    PATH_RULE,
    add_json,
    connect,
    jpfs_path,
    mode_string,
    print_json,
    report,
    shown,
    time_string,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ls", help="list a directory",
                       description="List directory entries in name order (readdirplus: one "
                       "call per page of entries). " + PATH_RULE)
    p.add_argument("paths", nargs="*", default=["jpfs:/"], metavar="jpfs:/PATH",
                   help="directories or files (default jpfs:/)")
    p.add_argument("-l", "--long", action="store_true", help="mode, links, owner, size, time")
    p.add_argument("-R", "--recursive", action="store_true", help="list subdirectories too")
    p.add_argument("-H", "--human", action="store_true", help="sizes as 1.5 MiB")
    add_json(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stat", help="show attributes of paths", description="Show the "
                       "attributes of JPFS paths (inode, size, mode, version, times). " + PATH_RULE)
    p.add_argument("paths", nargs="+", metavar="jpfs:/PATH")
    p.add_argument("-L", "--dereference", action="store_true", help="follow a final symlink")
    add_json(p)
    p.set_defaults(func=cmd_stat)

    p = sub.add_parser("mkdir", help="make directories",
                       description="Make directories inside JPFS. " + PATH_RULE)
    p.add_argument("paths", nargs="+", metavar="jpfs:/PATH")
    p.add_argument("-p", "--parents", action="store_true",
                   help="make parents as needed; no error if it exists")
    p.add_argument("-m", "--mode", type=lambda s: int(s, 8), default=0o777,
                   help="permission bits in octal (default 777, less the umask)")
    p.set_defaults(func=cmd_mkdir)

    p = sub.add_parser("rm", help="remove files (and directories with -r)",
                       description="Remove files inside JPFS (directories and their contents "
                       "with -r). " + PATH_RULE)
    p.add_argument("paths", nargs="+", metavar="jpfs:/PATH")
    p.add_argument("-r", "--recursive", action="store_true", help="remove directories and "
                   "their contents")
    p.add_argument("-f", "--force", action="store_true", help="ignore missing paths")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("mv", help="rename or move",
                       description="Rename SRC to DST (replacing DST as rename(2) does); with an "
                       "existing directory as DST, or several sources, move into it. " + PATH_RULE)
    p.add_argument("paths", nargs="+", metavar="jpfs:/SRC... jpfs:/DST")
    p.add_argument("-n", "--no-clobber", action="store_true", help="never replace DST")
    p.set_defaults(func=cmd_mv)

    p = sub.add_parser("fsck", help="check (and repair) the namespace",
                       description="Check every shard's inodes and entries against each other: "
                       "dangling entries, wrong link counts, orphans, stray chunk records, "
                       "unfinished cross-shard transactions. With --repair, fix them (orphans go "
                       "to /lost+found). Run it on a quiet cluster.")
    p.add_argument("--repair", action="store_true", help="fix what is found")
    add_json(p)
    p.set_defaults(func=cmd_fsck)


def _size(n: int, human: bool) -> str:
    return format_size(n) if human else str(n)


def cmd_ls(args: argparse.Namespace) -> int:
    client = connect(args)
    out: dict = {}
    status = 0
    try:
        stack = list(args.paths)  # the user's text for arguments, jpfs:/... below them
        first = True
        while stack:
            given = stack.pop(0)
            try:
                path = jpfs_path(given)
                attr = client.stat(path)
                entries = client.scandir(path) if attr.is_dir else None
            except OSError as e:
                report("jpfs ls", given, e)
                status = 1
                continue
            if args.json:
                out[path] = [{"name": x.name, "ino": x.attr.ino, "mode": x.attr.mode,
                              "size": x.attr.size, "mtime_ns": x.attr.mtime_ns}
                             for x in entries] if entries is not None else attr.size
            else:
                if len(args.paths) > 1 or args.recursive:
                    print(("" if first else "\n") + f"{given}:")
                first = False
                for ent in entries if entries is not None else []:
                    if args.long:
                        a = ent.attr
                        print(f"{mode_string(a.mode)} {a.nlink:>3} {a.uid:>5} {a.gid:>5} "
                              f"{_size(a.size, args.human):>10} {time_string(a.mtime_ns)} "
                              f"{ent.name}")
                    else:
                        print(ent.name)
                if entries is None:
                    print(given)
            if args.recursive and entries:
                stack[0:0] = [shown(x.path) for x in entries if x.is_dir()]
    finally:
        client.close()
    if args.json:
        print_json(out)
    return status


def cmd_stat(args: argparse.Namespace) -> int:
    client = connect(args)
    rows, status = [], 0
    try:
        for p in args.paths:
            try:
                path = jpfs_path(p)
                a = client.stat(path, follow_symlinks=args.dereference)
            except OSError as e:
                report("jpfs stat", p, e)
                status = 1
                continue
            row = {"path": path, **{k: getattr(a, k) for k in a.__slots__}}
            if a.is_link:
                row["target"] = client.readlink(path)
            rows.append(row)
            if not args.json:
                link = f" -> {row['target']}" if a.is_link else ""
                print(f"  File: {p}{link}\n  Size: {a.size:<12} Blocks: {a.blocks:<8} "
                      f"Inode: {a.ino:#x}  Links: {a.nlink}\n  Mode: {mode_string(a.mode)} "
                      f"({a.mode & 0o7777:04o})  Uid: {a.uid}  Gid: {a.gid}  "
                      f"Version: {a.version}\nAccess: {time_string(a.atime_ns)}  "
                      f"Modify: {time_string(a.mtime_ns)}  Change: {time_string(a.ctime_ns)}")
    finally:
        client.close()
    if args.json:
        print_json(rows)
    return status


def cmd_mkdir(args: argparse.Namespace) -> int:
    client = connect(args)
    status = 0
    try:
        for p in args.paths:
            try:
                if args.parents:
                    client.makedirs(jpfs_path(p), args.mode, exist_ok=True)
                else:
                    client.mkdir(jpfs_path(p), args.mode)
            except OSError as e:
                report("jpfs mkdir", p, e)
                status = 1
    finally:
        client.close()
    return status


def cmd_rm(args: argparse.Namespace) -> int:
    client = connect(args)
    status = 0
    try:
        for p in args.paths:
            try:
                path = jpfs_path(p)
                attr = client.lstat(path)
                if attr.is_dir:
                    if not args.recursive:
                        raise JPFSError(errno.EISDIR, "is a directory (use -r)")
                    client.rmtree(path)
                else:
                    client.remove(path)
            except OSError as e:
                if args.force and e.errno == errno.ENOENT:
                    continue
                report("jpfs rm", p, e)
                status = 1
    finally:
        client.close()
    return status


def cmd_mv(args: argparse.Namespace) -> int:
    if len(args.paths) < 2:
        print("jpfs mv: need a source and a destination (jpfs mv jpfs:/SRC jpfs:/DST)",
              file=sys.stderr)
        return 2
    for p in args.paths:  # nothing moves unless every path is a JPFS path
        try:
            jpfs_path(p)
        except OSError as e:
            print(f"jpfs mv: {p}: {e.strerror}", file=sys.stderr)
            return 2
    *srcs, dst = args.paths
    client = connect(args)
    status = 0
    try:
        into = client.isdir(jpfs_path(dst))
        if len(srcs) > 1 and not into:
            print(f"jpfs mv: {dst}: not a directory (several sources move into a directory)",
                  file=sys.stderr)
            return 1
        for src in srcs:
            target = (posixpath.join(jpfs_path(dst), posixpath.basename(jpfs_path(src))) if into
                      else jpfs_path(dst))
            try:
                client.rename(jpfs_path(src), target, flags=1 if args.no_clobber else 0)
            except OSError as e:
                report("jpfs mv", f"{src} -> {shown(target)}", e)
                status = 1
    finally:
        client.close()
    return status


def cmd_fsck(args: argparse.Namespace) -> int:
    from ..client.tools.fsck import fsck

    client = connect(args)
    try:
        report = client.run(lambda ac: fsck(ac.meta, repair=args.repair))
    finally:
        client.close()
    if args.json:
        print_json(report.as_dict())
    else:
        print(f"checked {report.inodes:,} inodes, {report.entries:,} entries, "
              f"{report.chunks:,} chunk records")
        for line in report.problems[:50]:
            print(f"  {line}")
        if len(report.problems) > 50:
            print(f"  ... and {len(report.problems) - 50} more")
        for line in report.notes:  # not problems: what could not be checked, and why
            print(f"  note: {line}")
        if report.clean:
            print("clean")
        elif args.repair:
            print(f"repaired {report.repaired} of {len(report.problems)} problems "
                  "(run fsck again to confirm)")
        else:
            print(f"{len(report.problems)} problems (run with --repair to fix)")
    return 0 if report.clean or args.repair else 1
