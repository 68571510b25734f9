"""The blocking client: ``jpfs.connect()`` for scripts, the CLI and DataLoader workers.

It runs an AsyncClient on a trio loop in a background thread and forwards each call there. After
a ``fork`` (DataLoader workers) the thread does not exist in the child, so the first call in a new
process starts a fresh loop and fresh connections.
"""

from __future__ import annotations

import functools
import io
import os
import threading
from collections.abc import Iterator

import trio

from .. import config
from .client import AsyncClient, aconnect


class Client:
    """A blocking handle on a JPFS cluster. Methods mirror ``AsyncClient``; see its docs."""

    def __init__(self, cluster: str | os.PathLike | config.Cluster | None = None, **options):
        self.cluster = cluster if isinstance(cluster, config.Cluster) else config.load(cluster)
        self._options = options
        self._lock = threading.Lock()
        self._pid = -1
        self._token: trio.lowlevel.TrioToken | None = None
        self._async: AsyncClient | None = None

    def _ensure(self) -> None:
        if self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._lock:
            if self._pid == os.getpid() and self._thread.is_alive():
                return
            ready = threading.Event()
            failure: list[BaseException] = []

            async def main() -> None:
                try:
                    async with aconnect(self.cluster, **self._options) as client:
                        self._async = client
                        self._token = trio.lowlevel.current_trio_token()
                        self._stop = trio.Event()
                        ready.set()
                        await self._stop.wait()
                except BaseException as e:  # noqa: BLE001 - reported to the starting thread
                    failure.append(e)
                    ready.set()

            self._thread = threading.Thread(target=trio.run, args=(main,), daemon=True,
                                            name="jpfs-client")
            self._thread.start()
            ready.wait()
            if failure:
                raise failure[0]
            self._pid = os.getpid()

    def _call(self, name: str, *args, **kwargs):
        self._ensure()
        fn = getattr(self._async, name)
        return trio.from_thread.run(functools.partial(fn, *args, **kwargs),
                                    trio_token=self._token)

    def run(self, afn, *args, **kwargs):
        """Run ``await afn(async_client, *args)`` on the client's loop and return its result."""
        self._ensure()
        return trio.from_thread.run(functools.partial(afn, self._async, *args, **kwargs),
                                    trio_token=self._token)

    @property
    def aclient(self) -> AsyncClient:
        self._ensure()
        return self._async

    def close(self) -> None:
        if self._pid == os.getpid() and self._token is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()
        self._pid = -1

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self, path: str, mode: str = "rb", buffering: int = -1, **options):
        """Open a JPFS file like ``open()`` (binary modes only). ``buffering=0`` gives the raw
        file; otherwise reads and writes go through an ``io`` buffer of ``buffering`` bytes
        (default 1 MiB)."""
        from .files import BufferedRandom, BufferedWriter, RawFile

        afile = self._call("open", path, mode, **options)
        raw = RawFile(afile, lambda fn, *a: trio.from_thread.run(fn, *a, trio_token=self._token))
        if buffering == 0:
            return raw
        size = buffering if buffering > 1 else 1 << 20
        if raw.readable() and raw.writable():
            return BufferedRandom(raw, size)
        return io.BufferedReader(raw, size) if raw.readable() else BufferedWriter(raw, size)

    def walk(self, top: str = "/") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk``: top-down, one scandir per directory."""
        stack = [top]
        while stack:
            d = stack.pop()
            try:
                entries = self.scandir(d)
            except FileNotFoundError:
                continue
            dirs = [e.name for e in entries if e.is_dir()]
            yield d, dirs, [e.name for e in entries if not e.is_dir()]
            stack.extend(reversed([f"{d.rstrip('/')}/{n}" for n in dirs]))


def _forward(name: str):
    target = getattr(AsyncClient, name)

    def method(self, *args, **kwargs):
        return self._call(name, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"Client.{name}"
    method.__doc__ = target.__doc__
    return method


FORWARDED = (
    "stat", "lstat", "exists", "isdir", "isfile", "stat_many", "scandir", "listdir", "readlink",
    "statfs", "getxattr", "listxattr", "mkdir", "makedirs", "remove", "unlink", "rmdir",
    "rmtree", "rename", "replace", "symlink", "link", "chmod", "chown", "utime", "truncate",
    "setxattr", "removexattr", "create", "read_bytes", "read_many", "read_ranges", "prefetch",
    "write_bytes", "put", "get", "layout", "sync",
)

for _name in FORWARDED:
    setattr(Client, _name, _forward(_name))


def connect(cluster: str | os.PathLike | config.Cluster | None = None, **options) -> Client:
    """A blocking Client for ``cluster`` (a cluster file or directory; default $JPFS_CLUSTER)."""
    client = Client(cluster, **options)
    client._ensure()
    return client
