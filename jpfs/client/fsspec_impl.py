"""fsspec for JPFS: ``jpfs://a/b`` names ``/a/b`` in the cluster named by ``$JPFS_CLUSTER`` at
the time of each call (or the ``cluster`` storage option), so pandas, pyarrow, datasets and
anything else that speaks fsspec reads JPFS directly, through the native client.

``cat`` of many paths maps to the client's batched ``read_many``.
"""

from __future__ import annotations

import errno
import os
import posixpath
import threading

from fsspec.spec import AbstractFileSystem

from .. import config, uri
from .blocking import Client

_clients: dict[tuple[str, int], tuple[tuple[int, int, int, int], Client]] = {}
_found: dict[tuple[str | None, str | None, str], str] = {}
_lock = threading.Lock()


def _cluster_file(cluster: str | None) -> tuple[str, os.stat_result]:
    """The cluster file ``cluster`` names now (default ``$JPFS_CLUSTER``) and its stat.

    Where a (cluster, $JPFS_CLUSTER, cwd) led last time is remembered, so a call costs one
    ``stat`` rather than a path search; a file gone from there is searched for again.
    """
    key = (cluster, os.environ.get(config.ENV_CLUSTER), os.getcwd())
    path = _found.get(key)
    if path is not None:
        try:
            return path, os.stat(path)
        except OSError:
            del _found[key]
    path = _found[key] = os.fspath(config.find_cluster_file(cluster).resolve())
    return path, os.stat(path)


def _client(cluster: str | None) -> Client:
    """One blocking client per cluster per process (DataLoader workers get their own).

    The cluster is resolved at every call, not when the filesystem object was made: fsspec
    hands back one cached ``JPFSFileSystem()`` for every ``jpfs://`` URL, so ``$JPFS_CLUSTER``
    may name another cluster by now, and a cluster file rewritten in place (a new cluster in
    the folder of one that is gone: new ports) may name other daemons. A client is reused for
    the same file while its contents say the same; one for an older version is closed.
    """
    path, st = _cluster_file(cluster)
    ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    key = (path, os.getpid())
    had = _clients.get(key)
    if had is not None and had[0] == ident:
        return had[1]
    parsed = config.load(path)
    with _lock:
        had = _clients.get(key)
        if had is not None and had[1].cluster == parsed:
            _clients[key] = (ident, had[1])  # rewritten, same cluster (a second `cluster up`)
            return had[1]
        c = Client(parsed)
        _clients[key] = (ident, c)
    if had is not None:
        had[1].close()  # it talks to daemons this cluster file no longer names
    return c


class JPFSFileSystem(AbstractFileSystem):
    """fsspec's view of a JPFS cluster."""

    protocol = "jpfs"
    root_marker = "/"

    def __init__(self, cluster: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.cluster = os.fspath(cluster) if cluster else None

    @property
    def client(self) -> Client:
        """The blocking client of this filesystem's cluster file, shared by every instance for
        it."""
        return _client(self.cluster)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = os.fspath(path)
        return uri.to_path(path) if uri.is_jpfs(path) else uri.normalize(path)

    def unstrip_protocol(self, name: str) -> str:
        """``jpfs://`` URL of the path ``name``."""
        return uri.to_url(name)

    @staticmethod
    def _info(path: str, attr) -> dict:
        kind = "directory" if attr.is_dir else "link" if attr.is_link else "file"
        return {"name": path, "size": attr.size, "type": kind, "ino": attr.ino,
                "mode": attr.mode, "nlink": attr.nlink, "uid": attr.uid, "gid": attr.gid,
                "mtime": attr.mtime_ns / 1e9, "created": attr.ctime_ns / 1e9}

    def info(self, path, **kwargs):
        """The fsspec info dict of ``path`` (its symlink is followed): name, size, type, inode,
        mode, owner, ``mtime`` and ``created`` (the ctime), in seconds."""
        p = self._strip_protocol(path)
        return self._info(p, self.client.stat(p))

    def ls(self, path, detail=True, **kwargs):
        """The entries of directory ``path`` (one listing, with attributes), or the file itself;
        info dicts, or names when not ``detail``."""
        p = self._strip_protocol(path)
        attr = self.client.stat(p)
        if not attr.is_dir:
            entries = [self._info(p, attr)]
        else:
            entries = [self._info(e.path, e.attr) for e in self.client.scandir(p)]
        return entries if detail else [e["name"] for e in entries]

    def exists(self, path, **kwargs) -> bool:
        """Whether ``path`` exists."""
        return self.client.exists(self._strip_protocol(path))

    def cat_file(self, path, start=None, end=None, **kwargs) -> bytes:
        """The bytes of ``path`` from ``start`` to ``end`` (negative: from the end), all of it by
        default."""
        p = self._strip_protocol(path)
        if start is None and end is None:
            return self.client.read_bytes(p)
        with self.client.open(p, "rb") as f:
            size = f.raw.size if hasattr(f, "raw") else f.size
            s = 0 if start is None else (start if start >= 0 else max(0, size + start))
            e = size if end is None else (end if end >= 0 else max(0, size + end))
            f.seek(s)
            return f.read(max(0, e - s))

    def cat(self, path, recursive=False, on_error="raise", **kwargs):
        """Whole files in one batched ``read_many``: one call per directory, no stat per path.

        A single path (not a list, no glob) gives its bytes, anything else ``{path: bytes}``
        (bytes, as fsspec promises: one copy of the client's views; ``Client.read_many`` hands
        out the views themselves). A directory named is an IsADirectoryError, as in fsspec;
        ``recursive`` reads the files below the paths given, found by listing them.
        """
        paths = self.expand_path(path, recursive=False)
        if recursive:
            paths = sorted({f for p in paths for f in self.find(p, withdirs=False)})
        if len(paths) == 1 and paths[0] == self._strip_protocol(path) and not isinstance(
                path, list):
            return self.cat_file(paths[0])
        try:
            views = self.client.read_many(paths)
        except OSError:
            if on_error == "raise":
                raise
            out: dict[str, bytes | OSError] = {}
            for p in paths:
                try:
                    out[p] = self.cat_file(p)
                except OSError as e:
                    if on_error == "return":
                        out[p] = e
            return out
        return {p: bytes(v) for p, v in zip(paths, views, strict=True)}

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Many byte ranges in one batched read (each chunk fetched once), as bytes."""
        if not isinstance(starts, list):
            starts = [starts] * len(paths)
        if not isinstance(ends, list):
            ends = [ends] * len(paths)
        items = [(self._strip_protocol(p), 0 if s is None else s, (1 << 62) if e is None else e)
                 for p, s, e in zip(paths, starts, ends, strict=True)]
        try:
            return [bytes(v) for v in self.client.read_ranges(items)]
        except OSError as err:
            if on_error == "raise":
                raise
            got: list[bytes | OSError] = []
            for p, s, e in items:
                try:
                    got.append(bytes(self.client.read_ranges([(p, s, e)])[0]))
                except OSError as one:
                    got.append(one)
            return got if got else [err]

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        """Write ``value`` as the whole file ``path``; FileExistsError where ``mode`` is ``create``
        and it exists."""
        p = self._strip_protocol(path)
        if mode == "create" and self.client.exists(p):
            raise FileExistsError(errno.EEXIST, "exists", p)
        self.client.write_bytes(p, value)

    def put_file(self, lpath, rpath, callback=None, **kwargs):
        """Copy local file ``lpath`` to ``rpath`` (a local directory: make the remote one)."""
        rp = self._strip_protocol(rpath)
        if os.path.isdir(lpath):
            self.client.makedirs(rp, exist_ok=True)
        else:
            self.client.put(lpath, rp)

    def get_file(self, rpath, lpath, callback=None, outfile=None, **kwargs):
        """Copy ``rpath`` to local file ``lpath``, or into ``outfile``; a directory is made
        locally."""
        rp = self._strip_protocol(rpath)
        if self.isdir(rp):
            os.makedirs(lpath, exist_ok=True)
        elif outfile is not None:
            outfile.write(self.client.read_bytes(rp))
        else:
            self.client.get(rp, lpath)

    def mkdir(self, path, create_parents=True, **kwargs):
        """Make directory ``path``, and its parents if ``create_parents``; FileExistsError if it
        exists."""
        p = self._strip_protocol(path)
        if create_parents:
            self.client.makedirs(p, exist_ok=False)
        else:
            self.client.mkdir(p)

    def makedirs(self, path, exist_ok=False):
        """Make directory ``path`` and its parents; FileExistsError if it exists, unless
        ``exist_ok``."""
        self.client.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rmdir(self, path):
        """Remove the empty directory ``path``."""
        self.client.rmdir(self._strip_protocol(path))

    def rm_file(self, path):
        """Remove the file ``path``."""
        self.client.remove(self._strip_protocol(path))

    def _rm(self, path):
        p = self._strip_protocol(path)
        if self.client.lstat(p).is_dir:
            self.client.rmdir(p)
        else:
            self.client.remove(p)

    def rm(self, path, recursive=False, maxdepth=None):
        """Remove each path (a directory must be empty unless ``recursive``: then its whole
        tree)."""
        paths = [path] if isinstance(path, str) else path
        for p in paths:
            p = self._strip_protocol(p)
            if recursive and self.client.lstat(p).is_dir:
                self.client.rmtree(p)
            else:
                self._rm(p)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        """Rename ``path1`` to ``path2`` (one metadata operation, whole directories included)."""
        self.client.rename(self._strip_protocol(path1), self._strip_protocol(path2))

    def touch(self, path, truncate=True, **kwargs):
        """Make ``path`` an empty file if ``truncate`` or if it is missing; else set its times to
        now."""
        p = self._strip_protocol(path)
        if truncate or not self.client.exists(p):
            self.client.write_bytes(p, b"")
        else:
            self.client.utime(p)

    def created(self, path):
        """The ctime of ``path`` (JPFS keeps no birth time), as an aware UTC datetime."""
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["created"], datetime.UTC)

    def modified(self, path):
        """The mtime of ``path``, as an aware UTC datetime."""
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], datetime.UTC)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
              **kwargs):
        p = self._strip_protocol(path)
        if "w" in mode or "a" in mode or "x" in mode:
            parent = posixpath.dirname(p)
            if parent and parent != "/" and not self.client.exists(parent):
                raise FileNotFoundError(errno.ENOENT, "no such directory", parent)
        return self.client.open(p, mode, buffering=block_size or -1)
