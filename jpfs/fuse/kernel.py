"""The kernel's side of a FUSE session: ``/dev/fuse``, the mount, INIT, clones of the descriptor.

A session is one descriptor the kernel hands requests on. Root mounts with mount(2) directly
(``fd=N`` in the options); anyone else through ``fusermount3``, which mounts and passes the
descriptor back over a socket (``_FUSE_COMMFD``), as libfuse does. The first request is INIT,
answered here before any worker starts. ``clone`` opens another descriptor on the same
connection (``FUSE_DEV_IOC_CLONE``): clones share the kernel's queue of requests, and an answer
must be written to the descriptor its request was read from.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
from dataclasses import dataclass

from ..errors import error
from . import protocol as p

log = logging.getLogger(__name__)

FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_SYNCHRONOUS = 1, 2, 4, 8, 16
MS_DIRSYNC, MS_NOATIME, MS_NODIRATIME, MS_STRICTATIME = 128, 1024, 2048, 1 << 24
MS_NOSYMFOLLOW = 256
MNT_DETACH = 2
FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
         "sync": MS_SYNCHRONOUS, "dirsync": MS_DIRSYNC, "noatime": MS_NOATIME,
         "nodiratime": MS_NODIRATIME, "strictatime": MS_STRICTATIME,
         "nosymfollow": MS_NOSYMFOLLOW}
"""Options that are mount(2) flags; ``suid``, ``dev``, ``exec`` and the like clear them."""
CLEARS = {"suid": MS_NOSUID, "dev": MS_NODEV, "exec": MS_NOEXEC, "async": MS_SYNCHRONOUS,
          "nostrictatime": MS_STRICTATIME, "symfollow": MS_NOSYMFOLLOW}

WANTED = (p.ASYNC_READ | p.BIG_WRITES | p.PARALLEL_DIROPS | p.MAX_PAGES_FLAG
          | p.DO_READDIRPLUS | p.ATOMIC_O_TRUNC | p.ASYNC_DIO | p.CACHE_SYMLINKS)
"""INIT flags JPFS asks for: parallel reads and lookups, 1 MiB requests, listings with the
attributes of every entry always (not READDIRPLUS_AUTO: the VFS counts a lookup per entry)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@dataclass
class Session:
    """A mounted FUSE connection: its first descriptor, where it is mounted, what INIT agreed."""

    fd: int
    mountpoint: str
    fsname: str
    flags: int = 0
    """The INIT flags in force."""
    minor: int = 0
    """The protocol minor the kernel speaks with us."""

    @classmethod
    def mount(cls, mountpoint: str, fsname: str, options: set[str]) -> Session:
        """Mount a FUSE filesystem of type ``fuse.<fsname>`` at ``mountpoint``; ``options`` are
        mount(8)'s (``ro``, ``allow_other``, ``default_permissions``, ``noatime``, ...)."""
        if os.geteuid() == 0:
            fd = _mount_syscall(mountpoint, fsname, options)
        else:
            fd = _mount_fusermount(mountpoint, fsname, options)
        return cls(fd, mountpoint, fsname)

    def init(self, wanted: int = WANTED) -> int:
        """Read the kernel's INIT and accept it (``wanted`` of the flags it offers); returns the
        flags in force. Blocks: call it before the descriptor is made non-blocking."""
        buf = bytearray(p.BUFSIZE)
        while True:
            try:
                n = os.readv(self.fd, [buf])
                break
            except InterruptedError:
                continue
        req = p.parse(buf, n)
        if req.opcode != p.INIT:
            raise p.ProtocolError(f"the first FUSE request was {req.name}, not init")
        major, minor, max_readahead, offered = p.INIT_IN.unpack_from(req.body)
        try:
            body, self.flags = p.init_out(major, minor, max_readahead, offered, wanted)
        except p.ProtocolError:
            os.writev(self.fd, [p.header(req.unique, 0, errno.EPROTO)])
            raise
        self.minor = minor
        os.writev(self.fd, [p.header(req.unique, len(body)), body])
        return self.flags

    def clone(self) -> int:
        """Another descriptor on this connection, non-blocking (it shares the request queue)."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", self.fd))
        except OSError:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        """Close the first descriptor (the connection ends with its last descriptor)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unmount(mountpoint: str, *, lazy: bool = True) -> None:
    """Detach the mount (umount2 as root, ``fusermount3 -u`` otherwise); failures are logged."""
    if os.geteuid() == 0:
        if _libc().umount2(mountpoint.encode(), MNT_DETACH if lazy else 0) != 0:
            e = ctypes.get_errno()
            if e not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not mounted any more
                log.warning("umount %s: %s", mountpoint, os.strerror(e))
        return
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        return
    res = subprocess.run([tool, "-uz" if lazy else "-u", mountpoint], capture_output=True,
                         text=True)
    if res.returncode != 0 and "not mounted" not in res.stderr:
        log.warning("%s -u %s: %s", tool, mountpoint, res.stderr.strip())


def _mount_syscall(mountpoint: str, fsname: str, options: set[str]) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    st = os.stat(mountpoint)
    flags = MS_NOSUID | MS_NODEV
    data = [f"fd={fd}", f"rootmode={stat.S_IFMT(st.st_mode):o}", f"user_id={os.getuid()}",
            f"group_id={os.getgid()}", f"max_read={p.MAX_PAGES * p.PAGE}"]
    for o in sorted(options):
        if o in FLAGS:
            flags |= FLAGS[o]
        elif o in CLEARS:
            flags &= ~CLEARS[o]
        elif o in ("rw", "relatime", "norelatime") or o.startswith(("fsname=", "subtype=")):
            continue
        else:
            data.append(o)
    if _libc().mount(fsname.encode(), mountpoint.encode(), f"fuse.{fsname}".encode(), flags,
                     ",".join(data).encode()) != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise error(e, f"mount(2) of a FUSE filesystem failed: {os.strerror(e)}", mountpoint)
    return fd


def _mount_fusermount(mountpoint: str, fsname: str, options: set[str]) -> int:
    tool = shutil.which("fusermount3")
    if tool is None:
        raise error(errno.EPERM, "mounting as a user needs fusermount3 (apt install fuse3)",
                    mountpoint)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    opts = sorted((options - {"fsname=" + fsname, "subtype=" + fsname})
                  | {f"fsname={fsname}", f"subtype={fsname}", "nosuid", "nodev"})
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        res = subprocess.run([tool, "-o", ",".join(opts), "--", mountpoint], env=env,
                             pass_fds=(theirs.fileno(),), capture_output=True, text=True)
        theirs.close()
        if res.returncode != 0:
            raise error(errno.EPERM, f"fusermount3 failed: {res.stderr.strip()}", mountpoint)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise error(errno.EIO, "fusermount3 mounted but passed no descriptor", mountpoint)
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        ours.close()
        theirs.close()


__all__ = ["Session", "WANTED", "unmount"]
