"""The prefetch-hint socket: ``.jpfs/prefetch``'s lines for mounts the kernel keeps read-only.

A ``--read-only`` mount is mounted ``ro``, so no file on it can be opened for writing, the
control file included. Readers that announce what they will read next (``jpfs.torch``) send the
same lines to a Unix socket instead, whose path ``.jpfs/socket`` gives. Each connection sends
lines of paths; complete lines are queued as they arrive. The protocol is one way: a bad line is
logged and shown by reading ``.jpfs/prefetch``, and the connection goes on.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable

import trio

from ..errors import JPFSError

log = logging.getLogger(__name__)

MAX_PATH = 100
"""Unix socket paths longer than this (the kernel takes 107 bytes) get no socket."""
MAX_PENDING = 16 << 20


def socket_path(state_dir: os.PathLike | str, mountpoint: str) -> str:
    """Where the socket of the mount at ``mountpoint`` lives (short: sun_path is small)."""
    digest = hashlib.sha1(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return os.path.join(os.fspath(state_dir), "mounts", f"{digest}.sock")


async def serve(path: str, submit: Callable[[bytes], Awaitable[None]], *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Take hint lines on a Unix socket at ``path`` until cancelled (use ``nursery.start``);
    ``submit`` queues the complete lines of one read. The socket is removed at the end."""
    if len(path) > MAX_PATH:
        log.info("no prefetch-hint socket: %s is too long for a Unix socket", path)
        task_status.started()
        return
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.exists(path):
                os.unlink(path)  # left by a daemon that died
            await sock.bind(path)
            os.chmod(path, 0o666)  # whoever reads the mount may hint (hints are bounded)
            sock.listen(64)
        except OSError as e:  # the mount serves on; hints reach it through the control file
            log.warning("no prefetch-hint socket at %s: %s", path, e.strerror or e)
            task_status.started()
            return
        task_status.started()

        async def one(stream: trio.SocketStream) -> None:
            pending = bytearray()
            try:
                async for data in stream:
                    pending += data
                    nl = pending.rfind(b"\n")
                    if nl >= 0:
                        text = bytes(pending[:nl + 1])
                        del pending[:nl + 1]
                        try:
                            await submit(text)
                        except JPFSError:
                            pass  # recorded and logged by submit
                    if len(pending) > MAX_PENDING:
                        log.warning("prefetch-hint socket: no newline in 16 MiB, closing")
                        return
            except (trio.BrokenResourceError, OSError) as e:
                if getattr(e, "errno", None) not in (None, errno.ECONNRESET):
                    log.debug("prefetch-hint connection: %s", e)
            except Exception:  # noqa: BLE001 - a hint connection must never end the mount
                log.exception("prefetch-hint connection failed; closing it")
            finally:
                await stream.aclose()

        await trio.serve_listeners(one, [trio.SocketListener(sock)])
    finally:
        sock.close()
        try:
            os.unlink(path)
        except OSError:
            pass  # never made, or already gone


__all__ = ["serve", "socket_path"]
