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
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import trio

from .. import config
from .client import AsyncClient, aconnect

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Forwarded(Generic[_P, _R]):
    """How the type checker sees a method made by ``_forward``: ``AsyncClient``'s method of the
    same name with its arguments, blocking, returning what the coroutine returns. Only used in
    the ``TYPE_CHECKING`` declarations of ``Client``; at run time ``_forward`` makes a function."""

    def __init__(self, fn: Callable[Concatenate[AsyncClient, _P], Awaitable[_R]]) -> None:
        self.fn = fn

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Forwarded[_P, _R]: ...
    @overload
    def __get__(self, obj: Client, owner: type | None = None) -> Callable[_P, _R]: ...
    def __get__(self, obj: Client | None, owner: type | None = None) -> Any:
        raise NotImplementedError  # never called: the class attributes are functions (FORWARDED)


class Client:
    """A blocking handle on a JPFS cluster. Methods mirror ``AsyncClient``; see its docs."""

    _thread: threading.Thread  # set by _ensure before _pid says it is this process's
    _stop: trio.Event  # set by the loop thread before it signals ready

    if TYPE_CHECKING:  # the methods FORWARDED makes (setattr below), for callers' type checks
        stat = _Forwarded(AsyncClient.stat)
        lstat = _Forwarded(AsyncClient.lstat)
        exists = _Forwarded(AsyncClient.exists)
        isdir = _Forwarded(AsyncClient.isdir)
        isfile = _Forwarded(AsyncClient.isfile)
        stat_many = _Forwarded(AsyncClient.stat_many)
        scandir = _Forwarded(AsyncClient.scandir)
        listdir = _Forwarded(AsyncClient.listdir)
        readlink = _Forwarded(AsyncClient.readlink)
        statfs = _Forwarded(AsyncClient.statfs)
        getxattr = _Forwarded(AsyncClient.getxattr)
        listxattr = _Forwarded(AsyncClient.listxattr)
        mkdir = _Forwarded(AsyncClient.mkdir)
        makedirs = _Forwarded(AsyncClient.makedirs)
        remove = _Forwarded(AsyncClient.remove)
        unlink = _Forwarded(AsyncClient.unlink)
        rmdir = _Forwarded(AsyncClient.rmdir)
        rmtree = _Forwarded(AsyncClient.rmtree)
        rename = _Forwarded(AsyncClient.rename)
        replace = _Forwarded(AsyncClient.replace)
        symlink = _Forwarded(AsyncClient.symlink)
        link = _Forwarded(AsyncClient.link)
        chmod = _Forwarded(AsyncClient.chmod)
        chown = _Forwarded(AsyncClient.chown)
        utime = _Forwarded(AsyncClient.utime)
        truncate = _Forwarded(AsyncClient.truncate)
        setxattr = _Forwarded(AsyncClient.setxattr)
        removexattr = _Forwarded(AsyncClient.removexattr)
        create = _Forwarded(AsyncClient.create)
        read_bytes = _Forwarded(AsyncClient.read_bytes)
        read_many = _Forwarded(AsyncClient.read_many)
        read_ranges = _Forwarded(AsyncClient.read_ranges)
        prefetch = _Forwarded(AsyncClient.prefetch)
        write_bytes = _Forwarded(AsyncClient.write_bytes)
        put = _Forwarded(AsyncClient.put)
        get = _Forwarded(AsyncClient.get)
        layout = _Forwarded(AsyncClient.layout)
        sync = _Forwarded(AsyncClient.sync)

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
        """The ``AsyncClient`` this client drives, connected first if it is not yet; use it only on
        the client's loop (``run``), never from the calling thread."""
        self._ensure()
        assert self._async is not None  # _ensure returns once the loop thread has set it
        return self._async

    def close(self) -> None:
        """Stop the client's loop thread, closing the connections; a closed client connects again on
        its next call. After a fork, the child only forgets the parent's loop."""
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
