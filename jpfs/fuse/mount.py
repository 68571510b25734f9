"""A mount's life: serve in the foreground, start in the background, unmount.

``serve`` runs everything on one trio loop: the client's connections, the blob cache's disk
writer, the prefetcher and pyfuse3's request tasks. In the background (the default), the CLI
re-executes itself with ``--foreground`` in a new session, logging to a file, and returns only when
the child reports the mount live (or shows the child's log when it failed). SIGTERM, SIGINT and
SIGHUP commit buffered writes and unmount cleanly.

``unmount`` uses ``fusermount3 -u``, and ``-uz`` (lazy) when the mount's daemon is gone, so a
crashed daemon never leaves a mount point that cannot be cleared; ``force`` first aborts the
kernel connection (for a daemon that is alive but stuck).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from .. import config
from ..client.data.cache import BlobCache
from ..client.vfs.core import VFS, Notifier, VFSConfig
from ..errors import error
from . import hints
from .lowlevel import Fallocate, InodeReads, NoFlushOnRead
from .notifier import KernelNotifier
from .operations import FuseConfig, Operations
from .process import keep_freed_buffers, quiet_collector

log = logging.getLogger(__name__)

FSNAME = "jpfs"
READ_ONLY_TIMEOUT = 3600.0
READ_WRITE_TIMEOUT = 1.0
START_TIMEOUT = 60.0
KERNEL_OPTIONS = frozenset({
    "suid", "nosuid", "dev", "nodev", "exec", "noexec", "sync", "async", "dirsync", "noatime",
    "nodiratime", "strictatime", "nostrictatime", "norelatime", "symfollow", "nosymfollow"})
"""Generic mount flags libfuse hands to the kernel (``--kernel-options``; mount(8)'s ``-o``).
A FUSE mount is nosuid,nodev unless ``suid`` or ``dev`` is given."""


@dataclass
class MountOptions:
    """What ``jpfs mount`` takes (sizes in bytes, times in seconds)."""

    mountpoint: str
    cluster: str | None = None
    cache_dir: str | None = None
    cache_size: int = 20 << 30
    memory_cache: int = 2 << 30
    prefetch: bool = True
    read_only: bool = False
    open_requests: bool = False
    """With ``read_only``: answer OPEN as read-write mounts do, instead of ENOSYS."""
    allow_other: bool = False
    entry_timeout: float | None = None
    attr_timeout: float | None = None
    open_cache: float = 0.0
    read_ahead: int = 4 << 20
    small_file: int | None = None
    notify_store: bool = True
    short_circuit: bool = True
    """Read the volume files of storage nodes on this host directly."""
    kernel_ahead: int | None = None
    """None: ``default_kernel_ahead()``."""
    metrics: str | None = None
    log_file: str | None = None
    max_tasks: int = 256
    nonempty: bool = False
    cache_admit: str = "second"
    dir_leases: bool = True
    write_behind: bool = False
    kernel_options: tuple[str, ...] = ()
    """Members of ``KERNEL_OPTIONS``: flags of the kernel's mount (noexec, noatime, ...)."""
    engine: str = "pyfuse3"
    """Who speaks FUSE: ``pyfuse3`` (libfuse's loop, the reference) or ``jpfs`` (the engine of
    ``engine.py`` in worker processes: read-only mounts)."""
    workers: int = 1
    """``engine`` jpfs: worker processes (0: one per core, at most ``workers.MAX_WORKERS``)."""

    def child_argv(self) -> list[str]:
        """Arguments for ``jpfs`` that run this mount in the foreground."""
        a = ["--cluster", str(self.cluster), "mount", self.mountpoint, "--foreground",
             "--cache-size", str(self.cache_size), "--memory-cache", str(self.memory_cache),
             "--prefetch" if self.prefetch else "--no-prefetch",
             "--open-cache", str(self.open_cache), "--read-ahead", str(self.read_ahead),
             "--max-tasks", str(self.max_tasks), "--cache-admit", self.cache_admit]
        for flag, value in (("--cache-dir", self.cache_dir), ("--log-file", self.log_file),
                            ("--entry-timeout", self.entry_timeout),
                            ("--attr-timeout", self.attr_timeout),
                            ("--small-file", self.small_file), ("--metrics", self.metrics),
                            ("--kernel-ahead", self.kernel_ahead),
                            ("--kernel-options", ",".join(self.kernel_options) or None),
                            ("--engine", self.engine), ("--workers", self.workers)):
            if value is not None:
                a += [flag, str(value)]
        for flag, on in (("--read-only", self.read_only),
                         ("--open-requests", self.open_requests),
                         ("--allow-other", self.allow_other),
                         ("--no-notify-store", not self.notify_store),
                         ("--no-short-circuit", not self.short_circuit),
                         ("--nonempty", self.nonempty),
                         ("--no-dir-leases", not self.dir_leases),
                         ("--write-behind", self.write_behind)):
            if on:
                a.append(flag)
        return a


# ---- where things live -------------------------------------------------------------------------

def state_dir() -> Path:
    """Where mounts record their daemons and logs ($JPFS_STATE_DIR, default ~/.jpfs)."""
    return Path(os.environ.get("JPFS_STATE_DIR") or Path.home() / ".jpfs")


def _key(mountpoint: str) -> str:
    mp = os.path.abspath(mountpoint)
    slug = mp.strip("/").replace("/", "_")[-80:] or "root"
    return f"{slug}-{hashlib.sha1(mp.encode()).hexdigest()[:8]}"


def state_file(mountpoint: str) -> Path:
    return state_dir() / "mounts" / f"{_key(mountpoint)}.json"


def control_snapshots(mountpoint: str) -> Path:
    """Where the workers of a mount keep the ``.jpfs`` files' snapshots."""
    return state_dir() / "control" / _key(mountpoint)


def default_log_file(mountpoint: str) -> Path:
    return state_dir() / "logs" / f"mount-{_key(mountpoint)}.log"


def default_cache_dir(cluster: config.Cluster) -> Path:
    """One cache directory per cluster file: /var/cache/jpfs/... for root, else ~/.cache/jpfs."""
    ident = hashlib.sha1(str(cluster.path or cluster.meta[0].address).encode()).hexdigest()[:10]
    base = Path("/var/cache/jpfs") if os.geteuid() == 0 else Path.home() / ".cache" / "jpfs"
    return base / f"{cluster.name}-{ident}"


def mount_entry(mountpoint: str) -> dict | None:
    """The /proc/self/mountinfo entry of a mount point: fstype, source, device, options."""
    mp = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return None
    found = None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5:
            continue
        where = fields[4].encode().decode("unicode_escape")
        if where == mp:
            rest = right.split()
            found = {"device": fields[2], "fstype": rest[0] if rest else "",
                     "source": rest[1] if len(rest) > 1 else "", "options": fields[5]}
    return found  # the last one: what is mounted on top


def is_jpfs_mount(mountpoint: str) -> bool:
    """Whether a jpfs FUSE filesystem is mounted at ``mountpoint`` (the top mount)."""
    e = mount_entry(mountpoint)
    return e is not None and e["fstype"] == f"fuse.{FSNAME}"


def _read_state(mountpoint: str) -> dict | None:
    try:
        return json.loads(state_file(mountpoint).read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"jpfs" in f.read()
    except OSError:
        return False


def daemon_pid(mountpoint: str) -> int | None:
    """The pid of the live daemon serving ``mountpoint`` (None when there is none)."""
    st = _read_state(mountpoint)
    pid = st.get("pid") if st else None
    return pid if _alive(pid) else None


# ---- serving -----------------------------------------------------------------------------------

def _timeouts(opts: MountOptions) -> tuple[float, float, float]:
    default = READ_ONLY_TIMEOUT if opts.read_only else READ_WRITE_TIMEOUT
    entry = default if opts.entry_timeout is None else opts.entry_timeout
    attr = default if opts.attr_timeout is None else opts.attr_timeout
    return entry, attr, (entry if opts.read_only else 0.0)


def tune_readahead(mountpoint: str, nbytes: int) -> None:
    """Raise the FUSE bdi's read-ahead: the kernel then reads in 1 MiB requests, not 128 KiB."""
    e = mount_entry(mountpoint)
    if e is None or nbytes <= 0:
        return
    path = Path("/sys/class/bdi") / e["device"] / "read_ahead_kb"
    try:
        path.write_text(str(max(4, nbytes // 1024)))
    except OSError as err:
        log.info("cannot set %s (%s): reads stay at the kernel's default size", path,
                 err.strerror)


async def _tune_after_init(ops: Operations, mp: str, nbytes: int) -> None:
    """The kernel sets the mount's read-ahead from its INIT answer: change it after that."""
    await ops.initialized.wait()
    await trio.lowlevel.checkpoint()  # the answer was written before this task runs again
    tune_readahead(mp, nbytes)


async def serve(opts: MountOptions, ready: Callable[[], None] | None = None) -> None:
    """Mount and serve until unmounted or signalled; ``ready`` is called once the mount is live."""
    mp = os.path.abspath(opts.mountpoint)
    check_mountpoint(mp, opts.nonempty)
    # a read-only mount stops the kernel's OPENs where READs can be made to name their inode
    # (installed in the session once it exists)
    reads = InodeReads() if opts.read_only and not opts.open_requests else None
    async with trio.open_nursery() as nursery:
        async with mount_parts(opts, nursery, KernelNotifier(mp), reads) as (ops, cache_dir):
            await _serve_mounted(ops, mp, opts, fuse_options(opts), nursery, cache_dir, ready,
                                 reads)


@dataclass(frozen=True)
class Share:
    """A worker's part of a mount served by several processes: its own slice of the caches
    (a disk cache directory each); worker 0 alone fetches ahead and takes prefetch hints
    (sweeps of the same directories by every worker would fetch them once per worker), and
    hears what the others see (``relay.py``); every worker lists directories for its lookups
    and reads large files ahead."""

    index: int = 0
    count: int = 1


@asynccontextmanager
async def mount_parts(opts: MountOptions, nursery: trio.Nursery, notifier: Notifier,
                      reads, share: Share = Share()
                      ) -> AsyncIterator[tuple[Operations, Path]]:
    """The cache, the VFS and the adapter of a mount, built in ``nursery`` and closed after;
    yields the adapter and the disk cache directory."""
    cluster = config.load(opts.cluster)
    mp = os.path.abspath(opts.mountpoint)
    entry_t, attr_t, neg_t = _timeouts(opts)
    small = opts.small_file or cluster.chunk_size
    cache_dir = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir(cluster)
    if share.count > 1:
        cache_dir = cache_dir / f"worker-{share.index}"
    if not cluster.n_nodes:
        raise error(errno.ENODEV, "this cluster has no storage nodes: nothing to mount")
    cache = BlobCache(opts.memory_cache // share.count,
                      cache_dir if opts.cache_size > 0 else None,
                      opts.cache_size // share.count, admit=opts.cache_admit)
    vfs: VFS | None = None
    try:
        await cache.open(nursery)
        kernel_ahead = opts.kernel_ahead if opts.kernel_ahead is not None \
            else default_kernel_ahead(opts.memory_cache)
        vfs = await VFS.connect(nursery, cluster, cache, VFSConfig(
            read_only=opts.read_only, attr_timeout=attr_t, entry_timeout=entry_t,
            open_cache=opts.open_cache, small_file=small, notify_store=opts.notify_store,
            kernel_ahead=kernel_ahead if share.index == 0 else 0,
            dir_leases=opts.dir_leases, write_behind=opts.write_behind,
            short_circuit=opts.short_circuit),
            notifier, prefetch=opts.prefetch, ahead=share.index == 0)
        sock = hints.socket_path(state_dir(), mp) if share.index == 0 else ""
        if len(sock) > hints.MAX_PATH:
            sock = ""
        snapshots = control_snapshots(mp) if share.count > 1 else None
        if snapshots is not None:
            snapshots.mkdir(parents=True, exist_ok=True)
        yield Operations(vfs, FuseConfig(mountpoint=mp, cluster=str(cluster.path or ""),
                                         entry_timeout=entry_t, attr_timeout=attr_t,
                                         negative_timeout=neg_t),
                         hint_socket=sock, storage=vfs.client.storage, reads=reads,
                         shared_snapshots=snapshots), cache_dir
    finally:
        if vfs is not None:
            if vfs.client.storage is not None:  # before the connections close
                await vfs.client.storage.reports_answered()
            vfs.close()
        cache.close()
        nursery.cancel_scope.cancel()


def fuse_options(opts: MountOptions) -> set[str]:
    """The kernel mount's options (mount(8)'s ``-o``)."""
    options = {f"fsname={FSNAME}", f"subtype={FSNAME}", "default_permissions"}
    if opts.allow_other:
        options.add("allow_other")
    if opts.read_only:
        options.add("ro")  # hints still arrive, on the socket
    options.update(opts.kernel_options)
    return options


KERNEL_AHEAD_SHARE = 8
"""By default a read-only mount's sweeps run ahead of readers by up to this fraction of the
machine's memory (1/8) in the kernel's page cache."""


def default_kernel_ahead(memory_cache: int) -> int:
    """How far sweeps may run ahead in the page cache: an eighth of the machine's memory, and
    never less than the half of the memory cache that bounded them before they were handed
    to the kernel. Pages the kernel has to evict before they are read are fetched again by
    their READs: too large a bound costs work, never correctness."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    return max(ram // KERNEL_AHEAD_SHARE, memory_cache // 2)


def check_mountpoint(mp: str, nonempty: bool = False) -> None:
    """A mount point must be an existing directory, and empty unless ``nonempty`` (a mount
    hides what is under it)."""
    if not os.path.exists(mp):
        raise error(errno.ENOENT, "the mount point does not exist (create it with mkdir -p)",
                    mp)
    if not os.path.isdir(mp):
        raise error(errno.ENOTDIR, "the mount point is not a directory", mp)
    if not nonempty and not is_jpfs_mount(mp):
        try:
            with os.scandir(mp) as it:
                busy = next(it, None) is not None
        except OSError as e:
            raise error(e.errno or errno.EIO, f"cannot read the mount point: {e.strerror}",
                        mp) from None
        if busy:
            raise error(errno.ENOTEMPTY, "the mount point is not empty: mounting would hide "
                        "its files (pass --nonempty to mount over them anyway)", mp)


async def _serve_mounted(ops: Operations, mp: str, opts: MountOptions, fuse_options: set[str],
                         nursery: trio.Nursery, cache_dir: Path,
                         ready: Callable[[], None] | None, reads: InodeReads | None) -> None:
    pyfuse3.init(ops, mp, fuse_options)
    sf = state_file(mp)
    try:
        nursery.start_soon(_tune_after_init, ops, mp, opts.read_ahead)
        sf.parent.mkdir(parents=True, exist_ok=True)
        sf.write_text(json.dumps({"pid": os.getpid(), "mountpoint": mp,
                                  "cluster": str(ops.vfs.client.cluster.path),
                                  "log_file": opts.log_file, "cache_dir": str(cache_dir),
                                  "started": time.time()}))
        nursery.start_soon(_on_signals, ops)
        if ops.control.hint_socket:
            await nursery.start(hints.serve, ops.control.hint_socket, ops.control.submit_hints)
        if opts.metrics:
            _serve_metrics(ops, opts.metrics)
        log.info("mounted %s at %s (%s, prefetch %s)", ops.vfs.client.cluster.path, mp,
                 "read-only" if opts.read_only else "read-write",
                 "on" if opts.prefetch else "off")
        if ready is not None:
            ready()
        async with trio.open_nursery() as requests:  # ended before the session is closed
            fallocate = Fallocate(ops, requests)  # holds the callback libfuse calls
            fallocate.install()
            noflush = NoFlushOnRead()  # the same; a read-only mount stops FLUSH with ENOSYS
            if not opts.read_only:
                noflush.install()
            elif reads is not None:
                reads.install()  # then OPEN is answered ENOSYS: the kernel opens files itself
            await pyfuse3.main(min_tasks=1, max_tasks=opts.max_tasks)
            requests.cancel_scope.cancel()
        del fallocate, noflush
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await ops.vfs.commit_all()
            await ops.vfs.notifier.close()
        pyfuse3.close(unmount=True)
        try:
            st = json.loads(sf.read_text())
            if st.get("pid") == os.getpid():
                sf.unlink()
        except (OSError, ValueError):
            pass
        log.info("unmounted %s", mp)


async def _on_signals(ops: Operations) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %s: committing writes and unmounting",
                     signal.Signals(signum).name)
            await ops.vfs.commit_all()
            await ops.vfs.notifier.close()  # while READs its stores may wait for are answered
            pyfuse3.terminate()
            return


def _serve_metrics(ops: Operations, address: str) -> None:
    """Prometheus over HTTP; the collector takes its snapshot on the trio thread."""
    from prometheus_client import start_http_server

    from .stats import registry_for

    host, port = config.parse_address(address)
    token = trio.lowlevel.current_trio_token()

    def snapshot() -> dict:
        return trio.from_thread.run_sync(ops.snapshot, trio_token=token)

    start_http_server(port, addr=host, registry=registry_for(snapshot))
    log.info("Prometheus metrics at http://%s:%d/metrics", host, port)


def run_foreground(opts: MountOptions, ready_fd: int | None = None) -> int:
    """Serve in this process (``--foreground``); ``ready_fd`` gets "ok" once the mount is live."""
    prepare_daemon(opts)
    trio.run(serve, opts, ready_callback(ready_fd))
    return 0


def prepare_daemon(opts: MountOptions) -> None:
    """What a mount daemon does before it mounts: clear a dead mount at its mount point, keep
    freed buffers, quiet the garbage collector."""
    _clear_dead_mount(opts.mountpoint)
    if not keep_freed_buffers():
        log.info("freed buffers go back to the system (the C library is not glibc)")
    if not os.environ.get("JPFS_TMP_NOGC"):
        quiet_collector()


def ready_callback(ready_fd: int | None) -> Callable[[], None]:
    """What tells the starter the mount is live: "ok" written to ``ready_fd`` (if any)."""

    def ready() -> None:
        if ready_fd is not None:
            try:
                os.write(ready_fd, b"ok\n")
                os.close(ready_fd)
            except OSError:
                pass

    return ready


def _clear_dead_mount(mountpoint: str) -> None:
    """A jpfs mount left by a daemon that died: unmount it (lazily) before mounting again."""
    if is_jpfs_mount(mountpoint) and daemon_pid(mountpoint) is None:
        log.warning("%s is a jpfs mount whose daemon is gone: unmounting it first", mountpoint)
        unmount(mountpoint, lazy=True)


# ---- background start --------------------------------------------------------------------------

def start_background(opts: MountOptions, *, verbose: int = 0) -> int:
    """Start the mount in a new session and wait until it is live; returns the daemon's pid."""
    mp = os.path.abspath(opts.mountpoint)
    if is_jpfs_mount(mp):
        if daemon_pid(mp) is not None:
            raise error(errno.EBUSY, "already mounted (jpfs umount it first)", mp)
        _clear_dead_mount(mp)
    check_mountpoint(mp, opts.nonempty)
    log_file = Path(opts.log_file) if opts.log_file else default_log_file(mp)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    opts.log_file = str(log_file)
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "jpfs.cli.main", *(["-" + "v" * verbose] if verbose else []),
           *opts.child_argv(), "--ready-fd", str(w)]
    start = log_file.stat().st_size if log_file.exists() else 0
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                pass_fds=(w,), start_new_session=True, cwd="/")
    os.close(w)
    got = b""
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([r], [], [], 0.5)
            if readable:
                piece = os.read(r, 64)
                if not piece:
                    break
                got += piece
                if b"ok" in got:
                    break
            elif proc.poll() is not None:
                break
    finally:
        os.close(r)
    if b"ok" not in got:
        if proc.poll() is None:
            proc.terminate()
        raise error(errno.EIO, f"the mount did not start; its log ({log_file}) says:\n"
                    + _tail(log_file, start), mp)
    return proc.pid


def _tail(path: Path, start: int, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


# ---- unmount -----------------------------------------------------------------------------------

def unmount(mountpoint: str, *, lazy: bool = False, force: bool = False,
            timeout: float = 30.0) -> str:
    """Unmount a jpfs mount; returns what was done. Lazy when the daemon is gone (or asked)."""
    mp = os.path.abspath(mountpoint)
    entry = mount_entry(mp)
    pid = daemon_pid(mp)
    if entry is None or entry["fstype"] != f"fuse.{FSNAME}":
        state_file(mp).unlink(missing_ok=True)
        raise error(errno.EINVAL, "not a jpfs mount point", mp)
    how = "unmounted"
    if force:
        _abort_connection(entry["device"])
        lazy = True
        how = "aborted and lazily unmounted"
    elif pid is None:
        lazy = True
        how = "lazily unmounted (its daemon was gone)"
    elif lazy:
        how = "lazily unmounted"
    _fusermount(mp, lazy)
    if pid is not None:
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            how += "; its daemon did not exit and was sent SIGTERM"
    state_file(mp).unlink(missing_ok=True)
    return how


def _fusermount(mp: str, lazy: bool) -> None:
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is not None:
        cmd = [tool, "-uz" if lazy else "-u", mp]
    else:
        cmd = ["umount", "-l", mp] if lazy else ["umount", mp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode == 0 or not is_jpfs_mount(mp):
        return
    msg = (res.stderr or res.stdout).strip()
    if "busy" in msg.lower():
        raise error(errno.EBUSY, f"{msg}: close what uses it, or unmount with --lazy", mp)
    raise error(errno.EIO, f"{' '.join(cmd)} failed: {msg}", mp)


def _abort_connection(device: str) -> None:
    """Abort the kernel's FUSE connection (requests in flight fail with ENOTCONN)."""
    minor = device.split(":")[-1]
    path = Path("/sys/fs/fuse/connections") / minor / "abort"
    try:
        path.write_text("1")
    except OSError as e:
        log.warning("cannot abort the FUSE connection (%s): %s", path, e.strerror)


__all__ = ["MountOptions", "check_mountpoint", "daemon_pid", "default_cache_dir",
           "is_jpfs_mount", "mount_entry", "run_foreground", "serve", "start_background",
           "state_dir", "unmount"]
