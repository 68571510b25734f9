"""Where a ShardDataset's bytes come from: the native client for ``jpfs://``, fsspec otherwise.

The hot path (shard bytes, ranged reads, video files) goes through a ``Store``. ``jpfs://`` is
served by ``ClientStore``, which imports the client explicitly (no fsspec registry lookup) and
calls its batched reads directly: one ``lookup_layouts`` per directory and one blob read per
storage node per batch, no per-path stat, and the client's read-only views handed on uncopied.
Every other URL (local and mounted paths, ``s3://``, ...) is ``FsspecStore``. Opening a dataset
(``meta/``, listings, footers) still uses an fsspec filesystem, once, in the main process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from jpfs.client import Client
from jpfs.client.fsspec_impl import JPFSFileSystem
from jpfs.uri import is_jpfs, to_path

BytesLike = bytes | memoryview
"""What reads return: bytes from fsspec, read-only views of the received blobs from JPFS."""

DIR_CACHE_TTL = 60.0
"""How long ``ClientStore`` trusts a resolved directory: a dataset being trained on does not
move, so its directories are resolved once a minute, not once a batch."""


class Store:
    """Batched reads of whole files and byte ranges, and open files, on one filesystem."""

    local = False
    """True where paths are local files (read natively: memory maps, ``av.open(path)``)."""

    def read_many(self, paths: Sequence[str]) -> list[BytesLike]:
        """The whole contents of ``paths``, in order, in as few round trips as the store allows."""
        raise NotImplementedError

    def read_ranges(self, paths: Sequence[str], starts: Sequence[int],
                    stops: Sequence[int]) -> list[BytesLike]:
        """Bytes ``[start, stop)`` of each path, in order."""
        raise NotImplementedError

    def open(self, path: str) -> Any:
        """A binary file object for reading ``path``."""
        raise NotImplementedError

    def session(self) -> Store:
        """A store for one reader thread: shares the connection, not the open files."""
        return self

    def close(self) -> None:
        """Release the open files of this session (the store stays usable)."""


class ClientStore(Store):
    """``jpfs://`` through the native client: one client per process (DataLoader workers make
    their own on first use, as the blocking client does after a fork)."""

    def __init__(self, cluster: str | None):
        self.cluster = cluster
        self._client: Client | None = None
        self._pid = -1

    def __getstate__(self) -> dict:
        return {"cluster": self.cluster}

    def __setstate__(self, state: dict) -> None:
        self.cluster, self._client, self._pid = state["cluster"], None, -1

    @property
    def client(self) -> Client:
        """This process's client (made on first use)."""
        if self._client is None or self._pid != os.getpid():
            self._client = Client(self.cluster, dir_cache_ttl=DIR_CACHE_TTL)
            self._pid = os.getpid()
        return self._client

    def read_many(self, paths: Sequence[str]) -> list[BytesLike]:
        """One ``read_many``: a lookup_layouts per directory, a blob read per storage node."""
        return list(self.client.read_many(list(paths)))

    def read_ranges(self, paths: Sequence[str], starts: Sequence[int],
                    stops: Sequence[int]) -> list[BytesLike]:
        """One ``read_ranges``: each chunk fetched once however many ranges touch it."""
        return list(self.client.read_ranges(list(zip(paths, starts, stops, strict=True))))

    def open(self, path: str) -> Any:
        """A buffered native file (video decoding seeks in it)."""
        return self.client.open(path, "rb")


class FsspecStore(Store):
    """Any other fsspec filesystem: ``cat`` for whole files (concurrent on async stores), its
    ``cat_ranges`` where it has its own, else ranged reads on kept-open handles."""

    def __init__(self, fs: AbstractFileSystem, max_handles: int = 16):
        self.fs = fs
        self.local = isinstance(fs, LocalFileSystem)
        self.max_handles = max_handles
        self._handles: dict[str, Any] = {}  # open files for ranged reads (one reader thread)

    def __getstate__(self) -> dict:
        return {"fs": self.fs, "max_handles": self.max_handles}

    def __setstate__(self, state: dict) -> None:
        self.fs, self.max_handles, self._handles = state["fs"], state["max_handles"], {}
        self.local = isinstance(self.fs, LocalFileSystem)

    def read_many(self, paths: Sequence[str]) -> list[BytesLike]:
        """One ``cat`` (a single path: ``cat_file``), as bytes."""
        if len(paths) == 1:
            return [self.fs.cat_file(paths[0])]
        got = self.fs.cat(list(paths), on_error="raise")
        return [got[p] if p in got else got[self.fs._strip_protocol(p)] for p in paths]

    def read_ranges(self, paths: Sequence[str], starts: Sequence[int],
                    stops: Sequence[int]) -> list[BytesLike]:
        """The filesystem's own ``cat_ranges`` where it has one, else kept-open handles."""
        if type(self.fs).cat_ranges is not AbstractFileSystem.cat_ranges:
            return self.fs.cat_ranges(list(paths), list(starts), list(stops), on_error="raise")
        # fsspec's default opens the file per range: keep handles open instead
        return [self._read_range(p, a, b) for p, a, b in zip(paths, starts, stops, strict=True)]

    def _read_range(self, path: str, start: int, stop: int) -> bytes:
        f = self._handles.get(path)
        if f is None:
            while len(self._handles) >= self.max_handles:
                self._handles.pop(next(iter(self._handles))).close()
            f = self._handles[path] = self.fs.open(path, "rb", block_size=0, cache_type="none")
        f.seek(start)
        return f.read(stop - start)

    def open(self, path: str) -> Any:
        """The filesystem's file object."""
        return self.fs.open(path, "rb")

    def session(self) -> FsspecStore:
        """A store with handles of its own, for one reader thread."""
        return FsspecStore(self.fs, self.max_handles)

    def close(self) -> None:
        """Close the kept-open handles."""
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def open_store(root: str, storage_options: dict | None = None
               ) -> tuple[AbstractFileSystem, str, Store]:
    """The filesystem that opens ``root``, the path on it, and the store that reads its shards.

    ``jpfs://`` (and ``jpfs:/``) names the cluster in ``storage_options["cluster"]``, default
    ``$JPFS_CLUSTER``; other storage options are for fsspec.
    """
    options = dict(storage_options or {})
    if is_jpfs(root):
        cluster = options.pop("cluster", None)
        cluster = os.fspath(cluster) if cluster else None
        return JPFSFileSystem(cluster=cluster, **options), to_path(root), ClientStore(cluster)
    fs, path = fsspec.core.url_to_fs(str(root), **options)
    return fs, path, FsspecStore(fs)
