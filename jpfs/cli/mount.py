"""``jpfs mount`` and ``jpfs umount``: the per-node FUSE mount."""

from __future__ import annotations

import argparse
import logging
import os

from ..config import parse_size

MOUNT_DESCRIPTION = """\
Mount a JPFS cluster at MOUNTPOINT with FUSE, so unchanged programs read it as a local tree.

Runs in the background by default (logging to ~/.jpfs/logs/, or --log-file) and returns once the
mount is live; SIGTERM or SIGINT to the daemon, or `jpfs umount`, unmounts cleanly.

Caching: the kernel caches entries, attributes and file pages (--read-only makes the timeouts
long: a dataset that does not change while mounted); the mount keeps a memory cache and a disk
cache of file bytes, both bounded, checksummed, the disk cache reused after a remount.
Prefetch (on unless --no-prefetch) fetches ahead of readers: small files whole on open, the next
files of a directory being read in order, files learned to be read together, hinted paths, and
large sequential reads. MOUNTPOINT/.jpfs/stats shows the counters (JSON), .jpfs/metrics the same
for Prometheus, and paths written to .jpfs/prefetch (one per line) are fetched ahead.

Writes are buffered per file and become visible to other nodes when the file is closed (or
fsync'd): close-to-open consistency."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mount", help="mount JPFS with FUSE", description=MOUNT_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", metavar="[CLUSTER] MOUNTPOINT",
                   help="cluster file or directory (default: --cluster, $JPFS_CLUSTER, ...) "
                   "and the directory to mount on")
    p.add_argument("--cache-dir", help="disk cache directory (default: /var/cache/jpfs/<cluster> "
                   "for root, ~/.cache/jpfs/<cluster> otherwise)")
    p.add_argument("--cache-size", type=parse_size, default="20G",
                   help="disk cache bound (default 20G; 0 turns the disk cache off)")
    p.add_argument("--memory-cache", type=parse_size, default="2G",
                   help="memory cache bound (default 2G)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="fetch ahead of readers (default on)")
    p.add_argument("--read-only", action="store_true",
                   help="dataset mode: no writes, long kernel cache timeouts (1 h)")
    p.add_argument("--open-requests", action="store_true",
                   help="--read-only: keep the kernel asking the mount at every open and close "
                   "(by default it opens files itself, so a file it caches costs no request; "
                   "this keeps per-open counters exact, at 2 requests per open)")
    p.add_argument("-f", "--foreground", action="store_true", help="do not go to the background")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users use the mount (needs user_allow_other for non-root)")
    p.add_argument("--log-file", help="where the background daemon logs")
    p.add_argument("--entry-timeout", type=float,
                   help="seconds the kernel keeps names (default 1, 3600 with --read-only)")
    p.add_argument("--attr-timeout", type=float,
                   help="seconds the kernel keeps attributes (default 1, 3600 with --read-only)")
    p.add_argument("--open-cache", type=float, default=0.0,
                   help="read-write mounts: seconds an open trusts a known layout instead of "
                   "checking for a newer version (default 0: always check)")
    p.add_argument("--read-ahead", type=parse_size, default="4M",
                   help="kernel read-ahead for the mount (default 4M: reads arrive as 1 MiB "
                   "requests)")
    p.add_argument("--small-file", type=parse_size,
                   help="files up to this size are fetched whole on open (default: chunk size)")
    p.add_argument("--no-notify-store", dest="notify_store", action="store_false",
                   help="never put file contents into the kernel's page cache ahead of its "
                   "READs (a --read-only mount gives it directories swept for a shuffled "
                   "epoch; with --open-requests, small files at open)")
    p.add_argument("--no-short-circuit", dest="short_circuit", action="store_false",
                   help="read the volumes of storage nodes on this host over their sockets "
                   "too (by default the mount reads those files itself: one copy, no "
                   "loopback)")
    p.add_argument("--kernel-ahead", type=parse_size, metavar="SIZE",
                   help="--read-only: how far the directories swept for a shuffled epoch may "
                   "run ahead of the readers in the kernel's page cache (default: an eighth of "
                   "this machine's memory, at least half of --memory-cache)")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="also serve Prometheus metrics over HTTP there")
    p.add_argument("--cache-admit", choices=("second", "all"), default="second",
                   help="what the disk cache keeps: blobs fetched a second time or pushed out "
                   "of memory unread (second, the default), or every blob fetched (all)")
    p.add_argument("--dir-leases", action=argparse.BooleanOptionalAction, default=True,
                   help="read-write mounts: take a lease on a directory this mount is filling "
                   "or emptying and answer its creates and unlinks at once, committing them in "
                   "batches behind, its lookups from memory, and its file renames without giving "
                   "the lease back (default on; other nodes see the changes once their batch "
                   "commits, within milliseconds; a killed mount loses the changes it had not "
                   "sent)")
    p.add_argument("--write-behind", action="store_true",
                   help="read-write mounts with directory leases: answer the close of a file "
                   "made in a leased directory before its bytes are stored, and store and "
                   "commit them behind it (about twice the files/s of cp -r or tar x of "
                   "small files here). Other nodes still never see such a file without its "
                   "bytes, and fsync and unmount still wait for them, but a killed mount "
                   "loses the files it had not committed yet, closed or not, and an error "
                   "storing them is logged and returned by the next fsync of the file or its "
                   "directory, not by close (default off: a closed file is committed)")
    p.add_argument("--nonempty", action="store_true",
                   help="mount over a directory that has files (they are hidden while mounted)")
    p.add_argument("--kernel-options", metavar="LIST", default="",
                   help="generic mount flags for the kernel, comma-separated: noexec, noatime, "
                   "sync, ... (a FUSE mount is nosuid,nodev unless suid or dev is given)")
    p.add_argument("--engine", choices=("pyfuse3", "jpfs"), default="pyfuse3",
                   help="who speaks FUSE to the kernel: pyfuse3 (libfuse's loop, the default) "
                   "or jpfs (JPFS's own protocol engine, served by --workers processes; "
                   "read-only mounts only)")
    p.add_argument("--workers", type=int, default=1,
                   help="--engine jpfs: worker processes, each with its own connection to the "
                   "cluster and a share of the caches (default 1; 0: one per core, at most "
                   "16). Requests then run on several cores; worker 0 prefetches for all, told "
                   "by the others what they serve. Each worker costs CPU of its own: where the "
                   "training job needs every core, 1 is faster (docs/perf.md)")
    p.add_argument("--max-tasks", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount a JPFS mount",
                       description="Unmount MOUNTPOINT (fusermount3 -u). When the mount's "
                       "daemon is gone (crashed, killed) the unmount is lazy, so the mount "
                       "point is always cleared.")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("-z", "--lazy", action="store_true",
                   help="detach now even if busy (cleaned up when no longer used)")
    u.add_argument("--force", action="store_true",
                   help="abort the kernel connection first (a daemon that hangs)")
    u.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the daemon to exit (default 30)")
    u.set_defaults(func=cmd_umount)


def _options(args: argparse.Namespace):
    from .. import config
    from ..fuse.mount import KERNEL_OPTIONS, MountOptions

    if len(args.paths) > 2:
        raise ValueError("usage: jpfs mount [CLUSTER] MOUNTPOINT")
    kernel = tuple(o for o in args.kernel_options.split(",") if o)
    unknown = sorted(set(kernel) - KERNEL_OPTIONS)
    if unknown:
        raise ValueError(f"--kernel-options: unknown {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(KERNEL_OPTIONS))})")
    if args.engine == "jpfs" and not args.read_only:
        raise ValueError("--engine jpfs serves read-only mounts: add --read-only (read-write "
                         "mounts use the pyfuse3 engine)")
    if args.workers < 0:
        raise ValueError("--workers must be 0 (one per core) or more")
    cluster_arg = args.paths[0] if len(args.paths) == 2 else args.cluster
    cluster = config.load(cluster_arg)
    return MountOptions(
        mountpoint=os.path.abspath(args.paths[-1]), cluster=str(cluster.path),
        cache_dir=os.path.abspath(args.cache_dir) if args.cache_dir else None,
        cache_size=args.cache_size, memory_cache=args.memory_cache, prefetch=args.prefetch,
        read_only=args.read_only, open_requests=args.open_requests, allow_other=args.allow_other,
        entry_timeout=args.entry_timeout, attr_timeout=args.attr_timeout,
        open_cache=args.open_cache, read_ahead=args.read_ahead, small_file=args.small_file,
        notify_store=args.notify_store, kernel_ahead=args.kernel_ahead, metrics=args.metrics,
        log_file=os.path.abspath(args.log_file) if args.log_file else None,
        max_tasks=args.max_tasks, nonempty=args.nonempty, cache_admit=args.cache_admit,
        dir_leases=args.dir_leases, write_behind=args.write_behind,
        short_circuit=args.short_circuit, kernel_options=kernel, engine=args.engine,
        workers=args.workers)


def cmd_mount(args: argparse.Namespace) -> int:
    from ..fuse import mount as m

    opts = _options(args)
    if not args.foreground:
        pid = m.start_background(opts, verbose=args.verbose)
        print(f"mounted {opts.cluster} at {opts.mountpoint} (daemon pid {pid}, log "
              f"{opts.log_file})")
        return 0
    root = logging.getLogger()
    root.setLevel(min(root.level, logging.INFO) if args.verbose < 2 else logging.DEBUG)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for h in root.handlers:
        h.setFormatter(fmt)
    if args.log_file and args.ready_fd is None:
        fh = logging.FileHandler(args.log_file)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    if opts.engine == "jpfs":
        from ..fuse import workers

        return workers.run_foreground(opts, args.ready_fd)
    return m.run_foreground(opts, args.ready_fd)


def cmd_umount(args: argparse.Namespace) -> int:
    from ..fuse.mount import unmount

    how = unmount(args.mountpoint, lazy=args.lazy, force=args.force, timeout=args.timeout)
    print(f"{os.path.abspath(args.mountpoint)}: {how}")
    return 0
