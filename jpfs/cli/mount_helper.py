"""``mount.fuse.jpfs``: what mount(8) runs for ``mount -t fuse.jpfs`` and fstab lines.

mount(8) runs ``/sbin/mount.fuse.jpfs CLUSTER MOUNTPOINT [-sfnv] [-o OPTIONS]`` and takes the
filesystem to be mounted once the helper exits 0. The helper turns the options into ``jpfs mount``
flags and runs ``jpfs mount``, whose background mode already returns only once the mount is live
and leaves its daemon running. Options are those of ``jpfs mount`` spelled ``name=value`` or
``name`` (``cache_size=20G``, ``no_prefetch``), plus ``ro`` (``--read-only``), ``allow_other``
and the kernel's generic flags (``noexec``, ``noatime``, ...); the ones mount(8) and systemd act
on themselves (``_netdev``, ``noauto``, ``nofail``, ``user``, ``x-systemd.*``, ...) are dropped.

Exit statuses are mount(8)'s: 1 for a wrong invocation or option, 32 for a mount that failed.
``jpfs install-mount-helper`` (``mount_install``) writes ``/sbin/mount.fuse.jpfs``, where
mount(8) looks for it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from typing import NoReturn

from .mount_install import PROG

EXIT_USAGE = 1
EXIT_FAILURE = 32

DROPPED = frozenset({
    "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group", "_netdev",
    "nofail", "rw", "atime", "relatime", "diratime", "silent", "loud"})
"""Options mount(8) or systemd act on (or the kernel's defaults): nothing for ``jpfs mount``."""
DROPPED_PREFIXES = ("x-", "comment=")
RENAMED = {"ro": "--read-only", "allow_other": "--allow-other"}
INTERNAL = frozenset({"foreground", "ready_fd", "max_tasks", "help", "kernel_options"})
"""``jpfs mount`` flags that are not options of a mount made by mount(8)."""


class UsageError(Exception):
    """A wrong invocation of the helper or an option it does not know (exit status 1)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _mount_parser() -> argparse.ArgumentParser:
    """``jpfs mount``'s own parser, raising UsageError instead of exiting."""
    from . import mount

    sub = _Parser(prog="jpfs").add_subparsers()
    mount.register(sub)
    return sub.choices["mount"]


def _jpfs_mount_flags() -> dict[str, tuple[str, bool]]:
    """``jpfs mount``'s long options: ``cache_size`` -> (``--cache-size``, takes a value)."""
    table: dict[str, tuple[str, bool]] = {}
    for action in _mount_parser()._actions:
        for flag in action.option_strings:
            key = flag.lstrip("-").replace("-", "_")
            if flag.startswith("--") and key not in INTERNAL:
                table[key] = (flag, action.nargs != 0)
    return table


def mount_flags(options: list[str], *, sloppy: bool = False) -> list[str]:
    """The ``jpfs mount`` flags for mount(8)'s ``-o`` options (``sloppy``: skip unknown ones)."""
    from ..fuse.mount import KERNEL_OPTIONS

    table = _jpfs_mount_flags()
    flags: list[str] = []
    kernel: list[str] = []
    for opt in options:
        name, eq, value = opt.partition("=")
        key = name.replace("-", "_")
        if (name in DROPPED and not eq) or opt.startswith(DROPPED_PREFIXES):
            continue
        if key in RENAMED and not eq:
            flags.append(RENAMED[key])
        elif name in KERNEL_OPTIONS and not eq:
            kernel.append(name)
        elif key in table and table[key][1] == bool(eq):
            flags += [table[key][0], value] if eq else [table[key][0]]
        elif not sloppy:
            if key in table:
                how = "takes a value (NAME=VALUE)" if table[key][1] else "takes no value"
                raise UsageError(f"option {name} {how}")
            raise UsageError(f"unknown option {opt!r} (the options are jpfs mount's, as "
                             "cache_size=20G or no_prefetch, ro, allow_other and the generic "
                             "mount flags; see jpfs mount --help)")
    if kernel:
        flags += ["--kernel-options", ",".join(kernel)]
    return flags


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, add_help=False,
                usage=f"{PROG} CLUSTER MOUNTPOINT [-sfnv] [-o OPTIONS] (run by mount(8))")
    p.add_argument("spec")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[])
    p.add_argument("-s", dest="sloppy", action="store_true")
    p.add_argument("-f", dest="fake", action="store_true")
    p.add_argument("-n", dest="no_mtab", action="store_true")
    p.add_argument("-v", dest="verbose", action="store_true")
    p.add_argument("-t", dest="type")
    p.add_argument("-N", dest="namespace")
    args = p.parse_args(argv)
    if args.namespace is not None:
        raise UsageError("-N (another mount namespace) is not supported")
    if args.type not in (None, "fuse.jpfs", "jpfs"):
        raise UsageError(f"-t {args.type}: this helper mounts fuse.jpfs")
    args.options = [o for group in args.options for o in group.split(",") if o]
    return args


def main(argv: list[str] | None = None) -> int:
    """Mount as mount(8) asked; the status tells it whether the filesystem is mounted."""
    from . import main as cli

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        flags = mount_flags(args.options, sloppy=args.sloppy)
        _mount_parser().parse_args([args.mountpoint, *flags])  # the values: cache_size=abc
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_USAGE
    cluster = os.path.abspath(args.spec)
    if not os.path.exists(cluster):
        print(f"{PROG}: {args.spec}: no such cluster file", file=sys.stderr)
        return EXIT_FAILURE
    jpfs_argv = ["--cluster", cluster, "mount", args.mountpoint, *flags]
    if args.verbose:
        print(f"{PROG}: jpfs {' '.join(jpfs_argv)}", file=sys.stderr)
    if args.fake:
        return _check_only(jpfs_argv)
    with contextlib.redirect_stdout(sys.stdout if args.verbose else io.StringIO()):
        rc = cli.main(jpfs_argv)  # errors are on stderr: "jpfs mount: PATH: reason"
    return 0 if rc == 0 else EXIT_FAILURE


def _check_only(jpfs_argv: list[str]) -> int:
    """``-f``: check the cluster file, the options and the mount point, mount nothing."""
    from ..errors import JPFSError
    from ..fuse.mount import check_mountpoint
    from . import main as cli
    from . import mount

    try:
        opts = mount._options(cli.build_parser().parse_args(jpfs_argv))
        check_mountpoint(opts.mountpoint, opts.nonempty)
    except (JPFSError, OSError, ValueError) as e:
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"{PROG}: {where}{reason}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


__all__ = ["main", "mount_flags", "parse_args"]
